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
        (
            ["--kl.controller.init_args.horizon=50"],
            ["kl.controller.init_args.horizon: 100.0 -> 50.0"],
        ),
        (
            ["--kl.controller=fixed"],  # a law's arguments go with it
            [
                "kl.controller.class_path: 'rlkl_lightning.kl.controllers.AdaptiveKLController' "
                "-> 'rlkl_lightning.kl.controllers.FixedKLController'",
                "kl.controller.init_args.horizon: 100.0 -> (unset)",
            ],
        ),
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


def test_a_new_lr_and_weight_decay_are_applied_and_the_schedule_continues(
    tiny_lm_dir, tmp_path, caplog
):
    """``--resume_with_changes`` with a new ``optimization.lr`` printed it and kept the old one.

    The restored optimizer and scheduler carried the checkpoint's lr (1e-5), so ``policy/lr``
    stayed there while the new checkpoint recorded the new value. A warm-up of 8 batches, 2 of
    them done: the third batch steps at 3e-4 x 3/8 and logs the lr of the next, 3e-4 x 4/8.
    """
    ckpt = tmp_path / "ckpt"
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(ckpt), "save_last": True},
    }
    optimization = {"ppo_epochs": 1, "num_minibatches": 1, "lr": 1e-5, "warmup_batches": 8}
    config = tiny_cli_config(
        tiny_lm_dir,
        tmp_path,
        trainer={"callbacks": [checkpoint]},
        model={"optimization": optimization},
    )
    main(["fit", "--config", str(config)])
    with caplog.at_level(logging.INFO):
        run = main(
            ["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps=3"]
            + ["--model.init_args.optimization.lr=3e-4"]
            + ["--model.init_args.optimization.weight_decay=0.1", "--resume_with_changes=true"]
        )
    assert "model.init_args.optimization.lr: 1e-05 -> 0.0003" in caplog.text
    assert "applied: lr: 1e-05 -> 0.0003" in caplog.text
    assert "applied: weight_decay: 0.0 -> 0.1" in caplog.text
    (group,) = run.trainer.optimizers[0].param_groups
    (scheduler,) = [config.scheduler for config in run.trainer.lr_scheduler_configs]
    assert scheduler.base_lrs == [3e-4] and group["initial_lr"] == 3e-4
    assert group["lr"] == pytest.approx(3e-4 * 4 / 8) and group["weight_decay"] == 0.1
    assert run.trainer.callback_metrics["policy/lr"].item() == pytest.approx(3e-4 * 4 / 8)
    saved = torch.load(ckpt / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3
    (saved_group,) = saved["optimizer_states"][0]["param_groups"]
    assert saved_group["lr"] == pytest.approx(3e-4 * 4 / 8) and saved_group["initial_lr"] == 3e-4
    assert saved_group["weight_decay"] == 0.1
    assert saved["lr_schedulers"][0]["base_lrs"] == [3e-4]
    settings = saved["callbacks"]["RunSettings"]["settings"]
    assert settings["model.init_args.optimization.lr"] == "0.0003"


@pytest.mark.parametrize("law", ["exponential", "pi", "fixed"])
def test_a_new_law_starts_from_the_checkpoints_beta(finished, law, caplog):
    """The message suggested ``--resume_with_changes`` for a law change, which then failed in
    the controller's ``load_state_dict`` (a state of another law). The beta carries over."""
    config, last = finished
    saved = torch.load(last, weights_only=True)["callbacks"]
    with caplog.at_level(logging.INFO):
        run = main(
            ["fit", "--config", str(config), "--ckpt_path", str(last), "--trainer.max_steps=2"]
            + [f"--kl.controller={law}", "--resume_with_changes=true"]
            + ["--trainer.enable_checkpointing=false"]  # last.ckpt stays the fixture's
        )
    controller = next(c for c in run.trainer.callbacks if isinstance(c, KLControllerCallback))
    beta = saved[controller.state_key]["controller"]["value"]
    assert saved[controller.state_key]["controller"]["law"] == "adaptive"
    assert controller.controller.law == law
    assert controller.value == beta != 0.2  # the checkpoint's, not the config's init_coef
    assert controller.n_batches == saved[controller.state_key]["n_batches"] == 2
    assert f"the law changed ('adaptive' -> '{law}'): beta {beta:.6g} carries over" in caplog.text


@pytest.mark.slow  # a resume case: make test-slow
def test_a_changed_or_added_reference_refresh_is_refused(tiny_lm_dir, tmp_path, capfd):
    """A ``ReferenceRefresh`` changes the trajectory as the KL group does; it resumed unchecked."""
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True},
    }

    def config(name, *refresh):
        callbacks = [
            {"class_path": "rlkl_lightning.ReferenceRefresh", "init_args": args} for args in refresh
        ]
        return tiny_cli_config(
            tiny_lm_dir, tmp_path, name, trainer={"callbacks": [*callbacks, checkpoint]}
        )

    main(["fit", "--config", str(config("run.yaml", {"every": 5}))])
    last = str(tmp_path / "ckpt" / "last.ckpt")
    for resumed, listed in [
        (
            config("every.yaml", {"every": 3, "reset_optimizer": True}),
            [
                "trainer.callbacks.ReferenceRefresh.init_args.every: 5 -> 3",
                "trainer.callbacks.ReferenceRefresh.init_args.reset_optimizer: False -> True",
            ],
        ),
        (
            config("none.yaml"),
            [
                "trainer.callbacks: ['ReferenceRefresh'] -> []",
                "trainer.callbacks.ReferenceRefresh.init_args.alpha: None -> (unset)",
                "trainer.callbacks.ReferenceRefresh.init_args.every: 5 -> (unset)",
                "trainer.callbacks.ReferenceRefresh.init_args.mode: 'hard' -> (unset)",
                "trainer.callbacks.ReferenceRefresh.init_args.reset_optimizer: False -> (unset)",
            ],
        ),
    ]:
        args = ["fit", "--config", str(resumed), "--ckpt_path", last, "--trainer.max_steps=3"]
        message = cli_error(args, capfd)
        assert [line.strip() for line in message.splitlines()[1:-1]] == listed, message


@pytest.mark.slow  # a resume case: make test-slow
def test_a_changed_budget_or_steering_text_is_refused_and_the_same_run_resumes(
    tiny_lm_dir, tmp_path, capfd
):
    """With a ``CapabilityBudget`` its options and the held-out text it steers on shape the run."""
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True},
    }
    prompts = str(tmp_path / "prompts.txt")

    def config(name, budget, num_heldout):
        callback = {"class_path": "rlkl_lightning.CapabilityBudget", "init_args": budget}
        return tiny_cli_config(
            tiny_lm_dir,
            tmp_path,
            name,
            trainer={"callbacks": [callback, checkpoint], "val_check_interval": 1},
            data={"heldout": prompts, "num_heldout": num_heldout, "test_heldout": prompts},
        )

    main(["fit", "--config", str(config("run.yaml", {"budget": 1.2}, 8))])
    last = str(tmp_path / "ckpt" / "last.ckpt")
    for resumed, listed, *extra in [
        (
            config("budget.yaml", {"budget": 1.3}, 8),
            ["trainer.callbacks.CapabilityBudget.init_args.budget: 1.2 -> 1.3"],
        ),
        (config("steer.yaml", {"budget": 1.2}, 6), ["data.init_args.num_heldout: 8 -> 6"]),
        # Each validation is a step of the budget's loop: it resumed with a validation every
        # 2 batches, or on half the held-out text, without a word.
        (
            config("run.yaml", {"budget": 1.2}, 8),
            ["trainer.val_check_interval: 1 -> 2"],
            "--trainer.val_check_interval=2",
        ),
        (
            config("run.yaml", {"budget": 1.2}, 8),
            ["trainer.limit_val_batches: None -> 0.5"],
            "--trainer.limit_val_batches=0.5",
        ),
    ]:
        args = ["fit", "--config", str(resumed), "--ckpt_path", last, "--trainer.max_steps=3"]
        args += extra
        message = cli_error(args, capfd)
        assert [line.strip() for line in message.splitlines()[1:-1]] == listed, message
    # The test text is reported, never steered on: another amount of it resumes.
    run = main(
        [
            "fit",
            "--config",
            str(config("run.yaml", {"budget": 1.2}, 8)),
            "--ckpt_path",
            last,
            "--trainer.max_steps=3",
            "--data.init_args.num_test=4",
        ]
    )
    assert run.trainer.global_step == 3


def test_an_option_added_to_a_group_since_the_checkpoint_was_written_is_its_default():
    """A 0.4.0 PPO checkpoint has no ``ppo.advantage``: its run shaped with ``gae``, the default,
    so a resume compares ``'gae'`` with ``'gae'`` instead of refusing ``(unset) -> 'gae'``."""
    from rlkl_lightning.cli.run_settings import differences, nested_settings

    prefix = "model.init_args."
    saved = {
        f"{prefix}ppo.vf_coef": "0.1",
        f"{prefix}ppo.value_model": "None",
        f"{prefix}models.peft.r": "8",  # a group option holding a mapping
    }
    out = nested_settings(saved)
    assert out[f"{prefix}ppo.advantage"] == "'gae'"
    assert out[f"{prefix}ppo.vf_coef"] == "0.1"  # what the checkpoint has is kept
    assert f"{prefix}models.peft" not in out and out[f"{prefix}models.peft.r"] == "8"
    assert not any(key.startswith(f"{prefix}group.") for key in out)  # RLOO's, not this run's
    current = {**out, f"{prefix}ppo.advantage": "'sign'"}
    assert differences(out, current) == [f"{prefix}ppo.advantage: 'gae' -> 'sign'"]


def test_under_a_budget_a_changed_kl_target_is_said_not_applied_and_changes_are_listed_once(
    caplog,
):
    """Under a ``CapabilityBudget`` ``kl.target`` only starts a run: a resume takes the budget's
    target, so a new one is neither refused nor listed as applied; the CLI's comparison and
    Lightning's load of the same checkpoint print the list once."""
    from rlkl_lightning.cli.run_settings import CALLBACKS_KEY, RunSettings, nested_settings

    def settings(target, lr, callbacks="['CapabilityBudget']"):
        prefix = "model.init_args.optimization."
        mine = {"kl.target": target, f"{prefix}lr": lr, CALLBACKS_KEY: callbacks}
        return nested_settings(mine)  # with the defaults a checkpoint's settings are filled with

    def checkpoint(target, lr, callbacks="['CapabilityBudget']"):
        return {"callbacks": {"RunSettings": {"settings": settings(target, lr, callbacks)}}}

    guard = RunSettings(settings("1.0", "0.001"), allow_changes=False)
    with caplog.at_level("INFO"):
        guard.compare(checkpoint("1.5", "0.001"))  # the CLI, before fit
        guard.compare(checkpoint("1.5", "0.001"))  # Lightning's load: another dict, same run
    assert guard.changes == []
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Not applied on resume: kl.target: 1.5 -> 1.0 (a CapabilityBudget sets the target; "
        "its own, from the checkpoint, is in force)"
    ]
    caplog.clear()
    guard = RunSettings(settings("1.0", "0.002"), allow_changes=True)
    with caplog.at_level("INFO"):
        guard.compare(checkpoint("1.5", "0.001"))
        guard.compare(checkpoint("1.5", "0.001"))
    assert guard.changes == ["model.init_args.optimization.lr: 0.001 -> 0.002"]
    listed = [r.getMessage() for r in caplog.records if "Resuming with changed" in r.getMessage()]
    assert len(listed) == 1 and "kl.target" not in listed[0]
    # Without a budget a changed target is a change of the trajectory: refused.
    guard = RunSettings(settings("1.0", "0.001", "[]"), allow_changes=False)
    with pytest.raises(ValueError, match=r"kl.target: 1.5 -> 1.0"):
        guard.compare(checkpoint("1.5", "0.001", "[]"))
