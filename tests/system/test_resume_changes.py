"""A resume whose settings change the trajectory is refused, or carried over when asked for.

Before ``RunSettings``, ``--kl.target=3`` on a resume kept beta under the new target while the
drift monitor's state was dropped (its state key held the target), and a changed batch size or
horizon was accepted without a word.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from helpers.cli_runs import cli_error, tiny_cli_config

from rlkl_lightning import KLControllerCallback, KLDriftMonitor
from rlkl_lightning.cli import main
from rlkl_lightning.cli.run_settings import RunSettings


@pytest.fixture(scope="module")
def finished(tiny_lm_dir, tmp_path_factory):
    """A CLI run of 2 batches with `last.ckpt`, and its config."""
    tmp = tmp_path_factory.mktemp("finished")
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp / "ckpt"), "save_last": True},
    }
    config = tiny_cli_config(
        tiny_lm_dir, tmp, trainer={"callbacks": [checkpoint]}, kl={"window": 4}
    )
    main(["fit", "--config", str(config)])
    return config, tmp / "ckpt" / "last.ckpt"


def resume(config, *args) -> list[str]:
    return ["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps=3", *args]


@pytest.mark.parametrize(
    ("args", "listed"),
    [
        (["--kl.target=3"], ["kl.target: 1.0 -> 3.0"]),
        (["--kl.horizon=50"], ["kl.horizon: 100.0 -> 50.0"]),
        (["--kl.controller=fixed"], ["kl.controller: 'adaptive' -> 'fixed'"]),
        (["--data.init_args.batch_size=2"], ["data.init_args.batch_size: 4 -> 2"]),
        (
            ["--kl.target=2", "--model.init_args.sampling.max_new_tokens=3"],
            ["kl.target: 1.0 -> 2.0", "model.init_args.sampling.max_new_tokens: 4 -> 3"],
        ),
    ],
)
def test_a_resume_with_other_settings_is_refused_listing_them(finished, args, listed, capfd):
    config, last = finished
    saved_config = last.parent.parent / "config.yaml"  # the run's, written by the CLI
    before = (saved_config.read_text(), last.read_bytes())
    message = cli_error(resume(config, *args), capfd)
    assert (saved_config.read_text(), last.read_bytes()) == before  # refused before fit
    assert message.startswith("`ckpt_path`: this run's settings differ from the checkpoint's")
    lines = message.splitlines()
    assert [line.strip() for line in lines[1:-1]] == listed  # exactly the changed options
    assert "`--resume_with_changes true`" in lines[-1]


def test_another_model_with_the_same_shapes_is_refused(finished, tiny_lm_dir, tmp_path, capfd):
    config, _ = finished
    other = shutil.copytree(tiny_lm_dir, tmp_path / "other_model")
    message = cli_error(resume(config, f"--model.init_args.policy={other}"), capfd)
    assert f"model.init_args.policy: '{tiny_lm_dir}' -> '{other}'" in message


def test_resume_with_changes_carries_the_states_over_and_says_so(finished, caplog):
    config, last = finished
    saved = torch.load(last, weights_only=True)["callbacks"]
    carried = r"KLDriftMonitor: the checkpoint's target was 1, this monitor's is 3: its window"
    with caplog.at_level(logging.INFO), pytest.warns(RuntimeWarning, match=carried):
        run = main(
            ["fit", "--config", str(config), "--ckpt_path", str(last), "--trainer.max_steps=3"]
            + ["--kl.target=3", "--resume_with_changes=true"]
            + ["--trainer.enable_checkpointing=false"]  # last.ckpt stays the fixture's
        )
    assert "Resuming with changed settings (--resume_with_changes):\n  kl.target: 1.0 -> 3.0" in (
        caplog.text
    )
    guard = next(c for c in run.trainer.callbacks if isinstance(c, RunSettings))
    assert guard.changes == ["kl.target: 1.0 -> 3.0"]
    controller = next(c for c in run.trainer.callbacks if isinstance(c, KLControllerCallback))
    monitor = next(c for c in run.trainer.callbacks if isinstance(c, KLDriftMonitor))
    saved_controller = saved[controller.state_key]
    saved_monitor = saved[monitor.state_key]  # the key no longer holds the target
    assert saved_monitor["target"] == 1.0 and monitor.target == 3.0
    assert controller.controller.target == 3.0
    # One more batch on top of the carried states: the counters and the window continue.
    assert controller.n_batches == saved_controller["n_batches"] + 1 == 3
    assert monitor.n_batches == saved_monitor["n_batches"] + 1 == 3
    assert list(monitor.values)[:-1] == saved_monitor["values"]
    assert len(monitor.values) == 3
    assert run.model.batches_seen == 3


def test_a_monitor_state_under_the_old_key_still_loads(finished):
    _, last = finished
    checkpoint = torch.load(last, weights_only=True)
    monitor = KLDriftMonitor(target=1.0, window=4)
    state = checkpoint["callbacks"].pop(monitor.state_key)
    old_key = "KLDriftMonitor{'monitor': 'objective/kl', 'target': 1.0}"  # before this change
    checkpoint["callbacks"][old_key] = state
    monitor.on_load_checkpoint(None, None, checkpoint)
    monitor.load_state_dict(checkpoint["callbacks"][monitor.state_key])
    assert list(monitor.values) == state["values"] and len(state["values"]) == 2
    assert monitor.n_batches == state["n_batches"] == 2
