"""A ``train.py`` run killed with SIGKILL resumes with the README's command, bit for bit.

Each test starts ``python train.py fit --config RUN.yaml`` as a process, kills it with
``SIGKILL`` at a known point (a helper from ``helpers/kill_helpers.py`` named in the config stalls
the process there and writes a marker file), and then runs the command the README gives, the same
command plus ``--ckpt_path last``, in the same directory. The config is like
``configs/ppo_adaptive.yaml`` (TensorBoardLogger with ``save_dir``/``name``, a
``ModelCheckpoint`` without ``dirpath``, ``save_last``) with a tiny model made in the test:
6 batches over 2 epochs, a checkpoint every 2 batches. Every scalar the resumed run's
TensorBoard directory holds (beta, KL, score, losses, ...; timings excepted) must equal the
uninterrupted run's, bit for bit, and so must the final weights and optimizer state.

* one process, killed twice: first half-way through writing ``last.ckpt`` after batch 4 (the
  previous ``last.ckpt``, after batch 2, stays complete and loadable; the half-written bytes
  sit in ``.last.ckpt.partial``), then, resumed from batch 2, when batch 6 starts (the last
  checkpoint is after batch 4 and batch 5 was trained and logged after it). Each resume
  continues in the same ``version_0`` directory, and TensorBoard drops what a killed run logged
  after the checkpoint that was resumed;
* one process with a hard reset of the reference after batch 3, killed when batch 6 starts
  (its last checkpoint, after batch 4, holds the reset reference), resumed: the same numbers;
* under DDP with 2 processes (gloo): the whole process group killed when batch 4 starts,
  resumed, and compared with an uninterrupted 2-process run; the same under FSDPStrategy (2 CPU
  processes, gloo), whose checkpoint holds the gathered weights;
* one process and two, killed right after a checkpoint file is renamed in place (a helper
  inside the write, which flushes nothing): after batch 2, and after batch 3, the end of an
  epoch with a validation due (under DDP an epoch is 2 batches: batch 2 ends one). The
  checkpoint is written after that batch's logging and validation, with the loggers flushed
  first, so nothing logged is lost (``AfterLoggingCheckpoint``); Lightning's
  ``ModelCheckpoint`` wrote it before both;
* a reward model that cannot be reached (``ConnectionError`` at batch 2): the run stops with one
  line naming the batch, the checkpoint of batch 1 is intact, and ``--ckpt_path last``
  continues to the same weights as a run the reward never failed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli_runs import cli_error, tiny_cli_config
from helpers.ddp_runs import free_port
from helpers.kill_runs import BATCHES, write_config

from rlkl_lightning.checkpoints import check_checkpoint, partial_path

pytestmark = pytest.mark.slow  # killed and resumed runs: make test-slow

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


#: FSDP on 2 CPU processes (gloo): Lightning's FSDPStrategy through the tests' helper.
CPU_FSDP = '{"class_path": "helpers.cpu_fsdp.CPUFSDPStrategy"}'


def command(config: Path, ddp: bool | str, *extra: str) -> list[str]:
    """``python train.py fit --config RUN.yaml [...]``, as the README gives it.

    ``ddp``: True for 2-process DDP, ``"fsdp"`` for 2-process FSDP on the CPU.
    """
    args = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(config), *extra]
    if ddp:
        strategy = CPU_FSDP if ddp == "fsdp" else "ddp"
        args += ["--trainer.strategy", strategy, "--trainer.devices", "2"]
    return args


def start(config: Path, ddp: bool | str = False, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    if ddp:
        env["MASTER_PORT"] = str(free_port())
    log = open(config.parent / "log.txt", "a")  # noqa: SIM115
    return subprocess.Popen(
        command(config, ddp, *extra),
        cwd=config.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a DDP job is killed whole
    )


def finish(proc: subprocess.Popen, config: Path) -> None:
    assert proc.wait(timeout=300) == 0, (config.parent / "log.txt").read_text()[-4000:]


def kill_at_marker(proc: subprocess.Popen, config: Path, marker: str) -> None:
    """SIGKILL the process group once the helper wrote its marker."""
    deadline = time.monotonic() + 300
    while not (config.parent / marker).exists():
        assert proc.poll() is None, (config.parent / "log.txt").read_text()[-4000:]
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def scalars(config: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the run's one TensorBoard directory, as TensorBoard shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = (config.parent / "runs" / "tiny").glob("version_*")
    events = EventAccumulator(str(version), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: {e.step: e.value for e in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
        if not tag.startswith("perf/")
    }


def last_checkpoint(config: Path) -> dict:
    (path,) = (config.parent / "runs" / "tiny").glob("version_*/checkpoints/last.ckpt")
    return torch.load(path, weights_only=False)


def assert_same_run(resumed: Path, full: Path, batches: int = BATCHES) -> None:
    """Every scalar but ``perf/*`` (timings, memory peaks), the weights, optimizer, KL state."""
    got, want = scalars(resumed), scalars(full)
    assert got.keys() == want.keys()
    for key in ("objective/kl_coef", "objective/kl", "objective/score", "loss/policy"):
        assert sorted(want[key]) == list(range(batches)), key
    for key in want:
        assert got[key] == want[key], key
    a, b = last_checkpoint(resumed), last_checkpoint(full)
    assert a["rlkl_counters"] == b["rlkl_counters"]
    assert a["rlkl_counters"]["batches_seen"] == batches
    for key in b["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for x, y in zip(
        a["optimizer_states"][0]["state"].values(),
        b["optimizer_states"][0]["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(x[k], y[k]) for k in x)
    kl_states = [k for k in b["callbacks"] if k.startswith(("KLController", "KLDrift"))]
    assert len(kl_states) == 2
    for key in kl_states:
        assert a["callbacks"][key] == b["callbacks"][key]


def test_a_run_killed_while_writing_and_after_a_checkpoint_resumes_each_time(tiny_lm_dir, tmp_path):
    full = write_config(tmp_path, tiny_lm_dir, "full")
    cut = write_config(tmp_path, tiny_lm_dir, "cut", stall_write=True, stall_at=6)
    version = cut.parent / "runs" / "tiny" / "version_0"
    last = version / "checkpoints" / "last.ckpt"
    full_proc = start(full)

    # 1. Killed half-way through writing last.ckpt after batch 4: the one after batch 2 stays.
    kill_at_marker(start(cut), cut, "killed_in_write")
    partial = partial_path(last)
    assert 0 < partial.stat().st_size == int((cut.parent / "killed_in_write").read_text()) // 2
    with pytest.raises(Exception):  # noqa: B017 (a torch RuntimeError or a pickle error)
        torch.load(partial, weights_only=False)
    assert check_checkpoint(last)["rlkl_counters"]["batches_seen"] == 2

    # 2. Resumed from batch 2; killed again when batch 6 starts (last.ckpt after batch 4 and
    # batch 5 logged after it).
    kill_at_marker(start(cut, False, "--ckpt_path", "last"), cut, "killed_before_batch")
    assert not partial.exists()  # the resumed run wrote last.ckpt again, through it
    assert check_checkpoint(last)["rlkl_counters"]["batches_seen"] == 4
    assert 4 in scalars(cut)["objective/kl"]  # batch 5 was logged after the last checkpoint

    # 3. Resumed from batch 4, to the end.
    finish(start(cut, False, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert [p.name for p in (cut.parent / "runs" / "tiny").iterdir()] == ["version_0"]
    assert len(list(version.glob("events.out.tfevents.*"))) == 3  # one per process
    assert_same_run(cut, full)
    log = (cut.parent / "log.txt").read_text()
    assert log.count(f"Restored all states from the checkpoint at {last}") == 2
    # The uninterrupted run's console: no warning, no tips, a bar over the run's 6 batches.
    console = (full.parent / "log.txt").read_text()
    assert not re.findall(r"^.*\.py:\d+: .*$", console, flags=re.MULTILINE)
    assert "Tip" not in console and "Epoch" not in console
    assert re.search(r"Training +\S+ 6/6 ", console)


def test_a_ddp_run_killed_after_a_checkpoint_resumes_with_the_readme_command(tiny_lm_dir, tmp_path):
    full = write_config(tmp_path, tiny_lm_dir, "full")
    cut = write_config(tmp_path, tiny_lm_dir, "cut", stall_at=4)
    full_proc, cut_proc = start(full, True), start(cut, True)
    kill_at_marker(cut_proc, cut, "killed_before_batch")
    assert last_checkpoint(cut)["rlkl_counters"]["batches_seen"] == 2
    assert 2 in scalars(cut)["objective/kl"]  # batch 3 was logged after the last checkpoint
    finish(start(cut, True, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    assert len(last_checkpoint(cut)["rlkl_rng"]["cpu"]) == 2  # both ranks' random streams
    assert (cut.parent / "log.txt").read_text().count("Restored all states") == 1


def test_an_fsdp_run_killed_after_a_checkpoint_resumes_bit_for_bit(tiny_lm_dir, tmp_path):
    # FSDPStrategy's checkpoint holds the gathered weights under one process's names; the
    # resume shards them again, and goes on as the run that was never killed.
    full = write_config(tmp_path, tiny_lm_dir, "full")
    cut = write_config(tmp_path, tiny_lm_dir, "cut", stall_at=4)
    full_proc, cut_proc = start(full, "fsdp"), start(cut, "fsdp")
    kill_at_marker(cut_proc, cut, "killed_before_batch")
    assert last_checkpoint(cut)["rlkl_counters"]["batches_seen"] == 2
    finish(start(cut, "fsdp", "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    assert len(last_checkpoint(cut)["rlkl_rng"]["cpu"]) == 2  # both ranks' random streams
    assert (cut.parent / "log.txt").read_text().count("Restored all states") == 1


def test_a_run_killed_after_a_reference_reset_resumes_with_the_reset_reference(
    tiny_lm_dir, tmp_path
):
    full = write_config(tmp_path, tiny_lm_dir, "full", refresh_every=3)
    cut = write_config(tmp_path, tiny_lm_dir, "cut", refresh_every=3, stall_at=6)
    full_proc = start(full)
    kill_at_marker(start(cut), cut, "killed_before_batch")
    saved = check_checkpoint(
        cut.parent / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    )
    assert saved["rlkl_counters"]["reference_refreshes"] == 1  # after batch 3, before batch 4
    assert saved["rlkl_reference"]
    finish(start(cut, False, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    kl = scalars(full)["objective/kl"]
    assert abs(kl[3]) < 1e-4 < abs(kl[2])  # batch 4, the first against the reset reference
    assert scalars(full)["reference/refreshes"] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}


def test_a_run_killed_mid_cascade_continues_the_capability_budget_bit_for_bit(
    tiny_lm_dir, tmp_path
):
    full = write_config(tmp_path, tiny_lm_dir, "full", budget=1.02)
    cut = write_config(tmp_path, tiny_lm_dir, "cut", budget=1.02, stall_at=6)
    full_proc = start(full)
    kill_at_marker(start(cut), cut, "killed_before_batch")
    saved = last_checkpoint(cut)
    (budget_state,) = [v for k, v in saved["callbacks"].items() if k.startswith("Capability")]
    assert budget_state["n_evaluations"] == 4  # the checkpoint after batch 4 and its validation
    finish(start(cut, False, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    targets = scalars(full)["objective/kl_target"]
    assert sorted(targets) == list(range(BATCHES)) and len(set(targets.values())) > 2  # moved
    assert sorted(scalars(full)["test/perplexity"]) == list(range(BATCHES))
    states = [last_checkpoint(c)["callbacks"] for c in (cut, full)]
    keys = [k for k in states[1] if k.startswith("Capability")]
    assert keys and all(states[0][k] == states[1][k] for k in keys)


@pytest.mark.parametrize(
    ("ddp", "every"), [(False, 2), (False, 3), (True, 2)], ids=["batch2", "batch3_val", "ddp"]
)
def test_a_run_killed_right_after_a_checkpoint_write_loses_no_logged_number(
    tiny_lm_dir, tmp_path, ddp, every
):
    full = write_config(tmp_path, tiny_lm_dir, "full", every=every)
    cut = write_config(tmp_path, tiny_lm_dir, "cut", every=every, stall_after_write=1)
    full_proc = start(full, ddp)
    kill_at_marker(start(cut, ddp), cut, "killed_after_write")
    assert last_checkpoint(cut)["rlkl_counters"]["batches_seen"] == every
    logged = scalars(cut)
    assert sorted(logged["objective/kl"]) == list(range(every))  # the batch's own numbers
    epoch = 2 if ddp else 3  # batches per epoch; the validation runs at the end of each
    assert sorted(logged.get("val/perplexity", {})) == list(range(epoch - 1, every, epoch))
    finish(start(cut, ddp, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    assert len(scalars(cut)["val/perplexity"]) == BATCHES // epoch


def test_an_unreachable_reward_stops_the_run_and_last_continues(tiny_lm_dir, tmp_path, capfd):
    from rlkl_lightning.cli import main

    def run_config(name: str, fail_at: int) -> tuple[Path, Path]:
        root = tmp_path / name
        root.mkdir()
        reward = {
            "class_path": "helpers.kill_helpers.UnreachableReward",
            "init_args": {"marker": str(root / "reward_failed"), "at": fail_at},
        }
        checkpoint = {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": 1, "save_last": True},
        }
        trainer = {"default_root_dir": str(root), "max_steps": 3, "callbacks": [checkpoint]}
        config = tiny_cli_config(
            tiny_lm_dir, root, seed_everything=0, trainer=trainer, model={"reward": reward}
        )
        return config, root / "checkpoints" / "last.ckpt"

    cut, cut_last = run_config("cut", fail_at=2)
    message = cli_error(["fit", "--config", str(cut)], capfd)
    assert "\n" not in message
    assert "reward model could not be reached at batch 2 (ConnectionError" in message
    assert "--ckpt_path last" in message
    saved = check_checkpoint(cut_last)  # complete, loadable: the checkpoint of batch 1
    assert saved["rlkl_counters"]["batches_seen"] == 1
    assert not partial_path(cut_last).exists()

    main(["fit", "--config", str(cut), "--ckpt_path", "last"])  # the reward answers again
    calls = (cut_last.parents[1] / "reward_calls").read_text().splitlines()
    assert len(calls) == 2 + 2  # batches 1 and 2 (refused), then 2 and 3: not a new start
    full, full_last = run_config("full", fail_at=0)
    main(["fit", "--config", str(full)])
    a, b = check_checkpoint(cut_last), check_checkpoint(full_last)
    assert a["rlkl_counters"] == b["rlkl_counters"]
    assert a["rlkl_counters"]["batches_seen"] == 3
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in b["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
