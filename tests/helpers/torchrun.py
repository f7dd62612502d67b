"""Two torchrun launches on the loopback address, as two machines would run ``train.py``.

docs/scaling-out.md's commands with ``--master_addr=127.0.0.1`` and both "nodes" here, one
process each (gloo): :func:`train_and_resume` trains a config for 2 batches, then resumes it
with ``--ckpt_path last`` to a third, each launch bounded in time; :func:`train_whole` trains
the 3 batches in one launch, for the resumed run to be compared with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers.ddp_runs import ROOT, free_port

STEPS_PER_BATCH = 16  # base/world.yaml: ppo_epochs x num_minibatches


def torchrun_pair(cwd: Path, *args: str, timeout: float) -> list[str]:
    """Both nodes' launches of ``train.py fit ARGS``; their stderr, node 0's first.

    Each launch gets a session of its own: past ``timeout`` seconds both are killed with
    their ranks, and the test fails. A launch that ends with a status other than 0 fails it.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    procs = {}
    for node in (1, 0):
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2"),
            *(f"--node_rank={node}", "--nproc_per_node=1", "--master_addr=127.0.0.1"),
            *(f"--master_port={port}", str(ROOT / "train.py"), "fit", *args),
        ]
        with (cwd / f"node{node}.log").open("w") as log:
            procs[node] = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the launch's own session: torchrun and its rank
        raise AssertionError(f"a torchrun launch ran past {timeout} s (hung?)") from None
    texts = [(cwd / f"node{node}.log").read_text() for node in (0, 1)]
    for node, text in enumerate(texts):
        assert procs[node].returncode == 0, f"node {node}:\n{text[-4000:]}"
    return texts


def launch_args(config: str, save_dir: Path) -> list[str]:
    """``train.py fit``'s arguments for both nodes: DDP over 2 nodes of 1 process, batch 2."""
    return [
        *("--config", str(ROOT / "configs" / config)),
        *("--trainer.strategy=ddp", "--trainer.num_nodes=2", "--trainer.devices=1"),
        "--data.init_args.batch_size=2",
        f"--trainer.logger.init_args.save_dir={save_dir}",
    ]


def train_and_resume(tmp_path: Path, config: str, name: str, timeout: float) -> list[list[str]]:
    """Train ``config`` 2 batches on two loopback nodes, resume to 3; each launch's stderr.

    Each run's ``last.ckpt`` must hold the steps of its batches, and node 1 must be global
    rank 1 of 2. The run logs in ``tmp_path/runs/NAME/version_0``.
    """
    run = launch_args(config, tmp_path / "runs")
    last = tmp_path / "runs" / name / "version_0" / "checkpoints" / "last.ckpt"
    launches = []
    for batches, resume in ((2, []), (3, ["--ckpt_path", "last"])):
        steps = batches * STEPS_PER_BATCH
        texts = torchrun_pair(
            tmp_path, *run, f"--trainer.max_steps={steps}", *resume, timeout=timeout
        )
        assert "GLOBAL_RANK: 1, MEMBER: 2/2" in texts[1], texts[1][-4000:]
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == steps
        launches.append(texts)
    assert "Restored all states from the checkpoint" in launches[1][0], launches[1][0][-4000:]
    return launches


def train_whole(tmp_path: Path, config: str, timeout: float) -> None:
    """Train ``config`` 3 batches on two loopback nodes in one launch, logging in ``tmp_path``."""
    steps = 3 * STEPS_PER_BATCH
    run = launch_args(config, tmp_path / "runs")
    torchrun_pair(tmp_path, *run, f"--trainer.max_steps={steps}", timeout=timeout)
