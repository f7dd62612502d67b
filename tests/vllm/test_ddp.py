"""GRPO under DDP with vLLM: one engine per rank through ``external_launcher``, 2 gloo processes.

``configs/grpo_vllm.yaml`` through ``train.py`` with ``--trainer.strategy=ddp
--trainer.devices=2`` for 3 batches, each rank sampling a different number of rows (2 and 1
prompts a batch, 8 and 4 responses: ranks of unequal row counts must not hang). Every rank
records (``helpers.engine_recording``) the beta of each batch, its rows, its sampler/trainer
gap, and the final weights: beta is the same on both ranks at every batch, the weights are
equal across ranks, and the gap is below 1e-5 nats per token on every rank. The negative
control switches rank 1's pushes off after the first: its gap exceeds the bound (the test can
tell a stale engine), rank 0's stays below it. Each run is bounded in time (a hang fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from helpers.ddp_runs import train_py

ROOT = Path(__file__).resolve().parents[2]
BATCHES, PER_RANK = 3, (2, 1)
GAP = 1e-5  # nats per token, the bound

pytestmark = pytest.mark.dist  # two training processes


def run(
    tmp_path: Path, name: str, stale_rank: int = -1, extra: tuple = (), logged: bool = False
) -> list[dict]:
    """Train 3 batches on 2 ranks; every rank's record. ``logged``: the config's TensorBoard.

    The run's standard error is kept in ``NAME/stderr.txt``.
    """
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2))
    out = tmp_path / name
    out.mkdir()
    recorder = "helpers.engine_recording.EngineRecorder"
    stderr = train_py(
        ROOT / "configs" / "grpo_vllm.yaml",
        out,
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
        f"--trainer.max_steps={BATCHES * 16}",
        *([] if logged else ["--trainer.logger=false"]),
        *extra,
        "--trainer.use_distributed_sampler=false",
        f"--trainer.callbacks+={recorder}",
        f"--trainer.callbacks.out_dir={out}",
        f"--trainer.callbacks.stale_rank={stale_rank}",
        "--data=helpers.uneven_prompts.UnevenPrompts",
        f"--data.prompts={prompts}",
        f"--data.per_rank=[{PER_RANK[0]}, {PER_RANK[1]}]",
        f"--data.batches={BATCHES}",
        timeout=420,
    )
    (out / "stderr.txt").write_text(stderr)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_grpo_under_ddp_samples_with_each_ranks_engine_and_the_trainers_weights(tmp_path):
    ranks = run(tmp_path, "pushed")
    k = 4  # GRPO's responses per prompt (configs/base/rloo.yaml)
    assert [r["rows"] for r in ranks] == [[PER_RANK[0] * k] * BATCHES, [PER_RANK[1] * k] * BATCHES]
    assert ranks[0]["betas"] == ranks[1]["betas"] and len(set(ranks[0]["betas"])) == BATCHES
    assert [r["tensor_parallel"] for r in ranks] == [1, 1]  # one whole engine per rank
    weights = [r["weights"] for r in ranks]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    for rank, record in enumerate(ranks):
        assert max(record["gaps"]) < GAP, (rank, record["gaps"])
        print(f"rank {rank}: gaps {[f'{g:.1e}' for g in record['gaps']]}")


def test_a_rank_whose_pushes_are_off_exceeds_the_gap(tmp_path):
    ranks = run(tmp_path, "stale", stale_rank=1)
    assert max(ranks[0]["gaps"]) < GAP, ranks[0]["gaps"]
    assert ranks[1]["gaps"][0] < GAP  # the first push happened: the initial weights
    assert min(ranks[1]["gaps"][1:]) > GAP, ranks[1]["gaps"]  # then stale weights
    assert ranks[0]["betas"] == ranks[1]["betas"]
    print(f"rank 1 without pushes: gaps {[f'{g:.1e}' for g in ranks[1]['gaps']]}")


def test_vllm_logs_on_rank_zero_only():
    import logging

    from rlkl_lightning.algorithms.engines.vllm import quiet_vllm_logs

    logger = logging.getLogger("vllm")
    level = logger.level
    try:
        quiet_vllm_logs(0)
        assert logger.getEffectiveLevel() <= logging.INFO
        quiet_vllm_logs(1)
        assert logging.getLogger("vllm.v1.engine.core").getEffectiveLevel() == logging.ERROR
    finally:
        logger.setLevel(level)
