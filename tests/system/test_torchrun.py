"""Two torchrun launches on the loopback address train, then resume with ``--ckpt_path last``.

As docs/scaling-out.md's commands run on two machines, with ``--master_addr=127.0.0.1`` and
both "nodes" here (one process each, gloo): each launch is bounded in time, both end with
status 0, the checkpoint holds the steps of the run and then of the resumed one, and no rank
prints a Python warning (torch's FutureWarnings for the collectives among them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.ddp_runs import ROOT, free_port

pytestmark = pytest.mark.dist  # several processes: make test-dist

#: One launch: 2 processes start, load the default world and train 2 batches (about 45 s here).
TIMEOUT_S = 300
STEPS_PER_BATCH = 16  # base/world.yaml: ppo_epochs x num_minibatches


def torchrun_pair(cwd: Path, *args: str) -> list[str]:
    """Both nodes' launches of ``train.py fit ARGS``; their stderr, node 0's first."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MASTER_PORT", None)
    procs, logs = [], []
    for node in (1, 0):
        log = (cwd / f"node{node}.log").open("w")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(ROOT / "train.py"),
            "fit",
            *args,
        ]
        procs.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        )
        logs.append(log)
    try:
        for proc in procs:
            proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the launch's own session: torchrun and its rank
        raise AssertionError(f"a torchrun launch ran past {TIMEOUT_S} s (hung?)") from None
    finally:
        for log in logs:
            log.close()
    texts = [(cwd / f"node{node}.log").read_text() for node in (0, 1)]
    for node, (proc, text) in enumerate(zip(procs[::-1], texts, strict=True)):
        assert proc.returncode == 0, f"node {node}:\n{text[-4000:]}"
    return texts


def test_two_torchrun_nodes_on_loopback_train_and_resume_without_warnings(tmp_path):
    config = str(ROOT / "configs" / "grpo_adaptive.yaml")
    run = [
        "--config",
        config,
        "--trainer.strategy=ddp",
        "--trainer.num_nodes=2",
        "--trainer.devices=1",
        "--data.init_args.batch_size=2",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
    ]
    last = tmp_path / "runs" / "grpo_adaptive" / "version_0" / "checkpoints" / "last.ckpt"
    for batches, resume in ((2, []), (3, ["--ckpt_path", "last"])):
        steps = batches * STEPS_PER_BATCH
        texts = torchrun_pair(tmp_path, *run, f"--trainer.max_steps={steps}", *resume)
        for node, text in enumerate(texts):
            assert "Warning" not in text, f"node {node}:\n{text[-4000:]}"
        assert "GLOBAL_RANK: 1, MEMBER: 2/2" in texts[1]
        checkpoint = torch.load(last, map_location="cpu", weights_only=True)
        assert checkpoint["global_step"] == steps
    assert "Restored all states from the checkpoint" in texts[0]
