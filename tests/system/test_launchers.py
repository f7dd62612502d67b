"""Across nodes: the rank variables under srun and torchrun, and a hung rank that times out.

The launchers are simulated by their environment variables (no srun, no second machine here):
Lightning picks ``SLURMEnvironment`` or ``TorchElasticEnvironment`` from them, and the vLLM
engine's rank variables must be the launcher's ranks, not a variable left from another launch.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")

# srun's variables for the task of global rank 3 of 4, on the second of two nodes of 2 tasks.
SLURM = {
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NAME": "rlkl",
    "SLURM_NODELIST": "node[07-08]",
    "SLURM_JOB_ID": "4321",
}
# torchrun's for rank 2 of 4, the first process of the second node.
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "rlkl",
    "RANK": "2",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29511",
}


def _trainer(monkeypatch, launched: dict[str, str], left_over: dict[str, str]):
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch import Trainer

    # The Trainer sets the process-wide rank (3 of 4 here): undone after the test.
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0))

    for name in (*LAUNCH_VARIABLES, *SLURM, *TORCHRUN):
        monkeypatch.setenv(name, "")  # recorded, so that what Lightning sets is undone too
        monkeypatch.delenv(name)
    for name, value in {**left_over, **launched}.items():
        monkeypatch.setenv(name, value)
    return Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        num_nodes=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )


def test_under_srun_the_engine_gets_slurms_ranks_not_a_left_over_rank(monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from rlkl_lightning.algorithms.engines.vllm import rank_variables

    trainer = _trainer(monkeypatch, SLURM, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert type(trainer.strategy.cluster_environment) is SLURMEnvironment
    assert rank_variables(trainer) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "node07",  # the first node of the job
        "MASTER_PORT": "19321",  # Lightning's for SLURM: 15000 + the job id's last 4 digits
    }


def test_under_torchrun_the_engine_gets_torchruns_ranks_and_address(monkeypatch):
    from lightning.pytorch.plugins.environments import TorchElasticEnvironment

    from rlkl_lightning.algorithms.engines.vllm import rank_variables, set_rank_variables

    trainer = _trainer(monkeypatch, TORCHRUN, {})
    assert type(trainer.strategy.cluster_environment) is TorchElasticEnvironment
    expected = {k: TORCHRUN[k] for k in LAUNCH_VARIABLES if k in TORCHRUN}
    assert rank_variables(trainer) == expected
    set_rank_variables(trainer)
    assert {k: os.environ[k] for k in expected} == expected


def test_the_run_timeout_reaches_the_strategy_unless_it_has_its_own(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from rlkl_lightning.cli.collective_timeout import apply_collective_timeout

    strategy = DDPStrategy()
    apply_collective_timeout(strategy, 7.5)
    assert strategy._timeout == timedelta(seconds=7.5)
    own = DDPStrategy(timeout=timedelta(seconds=99))
    apply_collective_timeout(own, 7.5)
    assert own._timeout == timedelta(seconds=99)
    one = SingleDeviceStrategy("cpu")
    apply_collective_timeout(one, 7.5)  # no process group: nothing to set
    assert not hasattr(one, "_timeout")
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="`collective_timeout` must be a positive number"):
            apply_collective_timeout(DDPStrategy(), bad)


@pytest.mark.dist  # two processes: make test-dist
def test_a_rank_waiting_for_a_peer_that_never_comes_stops_within_the_timeout(tmp_path, tiny_lm_dir):
    import subprocess
    import sys
    import time

    import yaml
    from helpers.ddp_runs import PROMPTS, ROOT, TESTS, config, free_port
    from helpers.tiny_models import make_tiny_lm

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    path = config(tmp_path, lms, prompts, "stall", "", 2)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["callbacks"].append(
        {"class_path": "helpers.stall.StallRank", "init_args": {"rank": 1, "batch": 1}}
    )
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    env["MASTER_PORT"] = str(free_port())
    ddp = ["--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu"]
    command = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(path), *ddp]
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [*command, "--collective_timeout=5"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=240)  # the start of 2 processes, 1 batch, then 5 s of waiting
        except subprocess.TimeoutExpired:
            pass
        finally:
            time.sleep(0.5)
            try:
                os.killpg(proc.pid, 9)  # the stalled rank, and rank 0 if it is still waiting
            except ProcessLookupError:
                pass
    text = stderr.read_text()
    assert proc.returncode == 2, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: rank 0 of 2 waited 5 s at a collective for a peer that never came "
        "(--collective_timeout): another rank stopped or hangs, its own output says where"
    ], text[-4000:]
    assert "Traceback" not in text, text[-4000:]


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_collective_timeout_that_is_not_a_positive_number_is_refused_in_one_line(
    value, tmp_path, tiny_lm_dir, capsys
):
    from helpers.ddp_runs import PROMPTS, config

    from rlkl_lightning.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    path = config(tmp_path, (tiny_lm_dir, tiny_lm_dir), prompts, "bad", "", 2)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(path), f"--collective_timeout={value}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: `collective_timeout` must be a "), err


def test_only_torch_distributeds_timeouts_become_the_ranks_line(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    from rlkl_lightning.cli import collective_timeout

    monkeypatch.setattr(collective_timeout, "_RUN", {"strategy": None, "seconds": None})
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
        "2000ms for recv operation to complete"
    )
    assert collective_timeout.timeout_message(gloo) is None  # no process group in this run
    collective_timeout.apply_collective_timeout(DDPStrategy(), 2)
    line = collective_timeout.timeout_message(gloo)
    assert line is not None and line.startswith("rank 0 of 1 waited 2 s at a collective"), line
    for other in (RuntimeError("the reward server: read timeout"), ValueError("gloo timed out")):
        assert collective_timeout.timeout_message(other) is None
