"""GRPO under DDP with one vLLM model sharded over both ranks (``tensor_parallel_size=2``).

``configs/grpo_vllm.yaml`` through ``train.py`` on 2 gloo processes for 3 batches, rank 0
sampling 8 rows a batch and rank 1 4 (ranks of unequal row counts must not hang), with
``engine.kind: {class_path: vllm, init_args: {tensor_parallel_size: 2}}``: the two ranks form
one group. Every rank records (``helpers.engine_recording``) what its engine was asked and
answered: both ranks send the group's 12 gathered rows in rank order with the same seeds (from
the group's index and the row, :func:`~rlkl_lightning.algorithms.engines.vllm.group_seeds`) and
get the same tokens, and each rank's trajectory holds its own rows of them. Beta is the same on
both ranks at every batch, the weights are equal across ranks, the sampler/trainer gap is below
1e-5 nats per token on both (the full-tensor push is sharded by vLLM's loader), and the logged
``perf/push_s`` and both ranks' ``perf/peak_mem_gb/rank{r}`` reach the logger; no
``FutureWarning`` is shown. Bounded in time.
"""

from __future__ import annotations

import json

import pytest
from test_ddp import BATCHES, GAP, PER_RANK, run

from rlkl_lightning.algorithms.engines.vllm import group_seeds
from rlkl_lightning.compare.events import read_scalars

pytestmark = pytest.mark.dist  # two training processes

ENGINE = "rlkl_lightning.algorithms.engines.vllm.VLLMRolloutEngine"
TP = json.dumps({"class_path": ENGINE, "init_args": {"tensor_parallel_size": 2}})


def test_grpo_with_one_engine_sharded_over_two_ranks_samples_the_groups_rows_once(tmp_path):
    ranks = run(tmp_path, "tp", extra=(f"--model.init_args.engine.kind={TP}",), logged=True)
    k, seed = 4, 0  # GRPO's responses per prompt; configs/base/world.yaml's seed_everything
    rows = [PER_RANK[0] * k, PER_RANK[1] * k]
    assert [r["rows"] for r in ranks] == [[rows[0]] * BATCHES, [rows[1]] * BATCHES]
    zero, one = ranks
    assert zero["tensor_parallel"] == one["tensor_parallel"] == 2  # vLLM shards the model
    assert len(zero["requests"]) == len(one["requests"]) == BATCHES
    for batch, (asked, also) in enumerate(zip(zero["requests"], one["requests"], strict=True)):
        assert asked == also  # the same prompts, seeds and tokens on both ranks of the group
        assert asked["seeds"] == group_seeds(seed, batch, 0, sum(rows))
        assert zero["responses"][batch] == asked["tokens"][: rows[0]]  # rank 0's own rows
        assert one["responses"][batch] == asked["tokens"][rows[0] :]  # then rank 1's
    assert zero["betas"] == one["betas"] and len(set(zero["betas"])) == BATCHES
    assert all(zero["weights"][n].equal(one["weights"][n]) for n in zero["weights"])
    for rank, record in enumerate(ranks):
        assert max(record["gaps"]) < GAP, (rank, record["gaps"])
        print(f"rank {rank}: gaps {[f'{g:.1e}' for g in record['gaps']]}")
    (log_dir,) = (tmp_path / "tp" / "runs").glob("*/version_0")
    scalars = read_scalars(log_dir)
    for tag in ("perf/push_s", "perf/peak_mem_gb/rank0", "perf/peak_mem_gb/rank1"):
        assert len(scalars[tag]) == BATCHES, tag
    assert all(0 < s < 60 for s in scalars["perf/push_s"].values())
    peaks = [max(scalars[f"perf/peak_mem_gb/rank{r}"].values()) for r in range(2)]
    assert all(0.3 < p < 20 for p in peaks), peaks
    print(f"push_s {list(scalars['perf/push_s'].values())}, peak GB per rank {peaks}")
    # vLLM's groups gather with a call torch 2.13 deprecates; the console does not show it.
    assert "FutureWarning" not in (tmp_path / "tp" / "stderr.txt").read_text()
