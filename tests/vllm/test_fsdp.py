"""GRPO under Lightning's FSDPStrategy with vLLM: one engine per rank, fed gathered weights.

``configs/grpo_vllm.yaml`` through ``train.py`` with ``tests/helpers/cpu_fsdp.py``'s strategy
(``FSDPStrategy`` in CPU processes, gloo) on 2 processes for 3 batches, 8 and 4 responses a
batch on the two ranks, as ``tests/vllm/test_ddp.py`` does under DDP. Each rank holds half of
every weight; before a push it gathers the full weights unit by unit and loads them into its
own engine. Beta is the same on both ranks at every batch, the final (gathered) weights are
equal across ranks, and the sampler/trainer gap is below 1e-5 nats per token on every rank.
The negative control switches rank 1's pushes off after the first (it still gathers with rank
0): its gap exceeds the bound, rank 0's does not. Each run is bounded in time (a hang fails).
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


def run(tmp_path: Path, name: str, stale_rank: int = -1) -> list[dict]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2))
    out = tmp_path / name
    out.mkdir()
    recorder = "helpers.engine_recording.EngineRecorder"
    train_py(
        ROOT / "configs" / "grpo_vllm.yaml",
        out,
        '--trainer.strategy={"class_path": "helpers.cpu_fsdp.CPUFSDPStrategy"}',
        "--trainer.devices=2",
        "--trainer.accelerator=cpu",
        f"--trainer.max_steps={BATCHES * 16}",
        "--trainer.logger=false",
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
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_grpo_under_fsdp_pushes_the_gathered_weights_to_each_ranks_engine(tmp_path):
    ranks = run(tmp_path, "pushed")
    k = 4  # GRPO's responses per prompt (configs/base/rloo.yaml)
    assert [r["rows"] for r in ranks] == [[PER_RANK[0] * k] * BATCHES, [PER_RANK[1] * k] * BATCHES]
    assert ranks[0]["betas"] == ranks[1]["betas"] and len(set(ranks[0]["betas"])) == BATCHES
    weights = [r["weights"] for r in ranks]
    assert weights[0]["transformer.wte.weight"].dim() == 2  # gathered, not a rank's shard
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    for rank, record in enumerate(ranks):
        assert max(record["gaps"]) < GAP, (rank, record["gaps"])
        print(f"rank {rank}: gaps {[f'{g:.1e}' for g in record['gaps']]}")


def test_a_rank_whose_pushes_are_off_exceeds_the_gap_under_fsdp(tmp_path):
    ranks = run(tmp_path, "stale", stale_rank=1)
    assert max(ranks[0]["gaps"]) < GAP, ranks[0]["gaps"]
    assert ranks[1]["gaps"][0] < GAP  # the first push happened: the initial weights
    assert min(ranks[1]["gaps"][1:]) > GAP, ranks[1]["gaps"]  # then stale weights
    assert ranks[0]["betas"] == ranks[1]["betas"]
    print(f"rank 1 without pushes: gaps {[f'{g:.1e}' for g in ranks[1]['gaps']]}")
