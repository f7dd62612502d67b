"""The vLLM engine's tensor parallelism and its logged costs, without vLLM.

``engine.kind: {class_path: vllm, init_args: {tensor_parallel_size: N}}``: a size that is not
an integer >= 1, or that does not divide the training world size, is refused by name. A group of
``N`` contiguous ranks gathers its prompts (of unequal row counts and widths), and every rank
sends the group's rows with the same seeds, from the group's index and the row in the gathered
batch (with ``N=1``, today's per-rank seeds), and keeps its own rows. An engine with weights of
its own logs ``perf/push_s``, its push's peak memory and every rank's process peak; the native
loop logs neither unless ``logging.peak_memory`` asks. The real 2-process run is
``tests/vllm/test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlkl_lightning import RLOOModule
from rlkl_lightning.algorithms.engines.vllm import (
    check_tensor_parallel,
    group_prompts,
    group_seeds,
    request_seed,
)
from rlkl_lightning.algorithms.memory import process_peak_bytes
from rlkl_lightning.algorithms.metrics import peak_memory_metrics
from rlkl_lightning.algorithms.options import Engine
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is really very", "the food", "a"]
SAMPLING = {"max_prompt_tokens": 8, "max_new_tokens": 6, "temperature": 0.7}


def tp(size):
    return {"class_path": "vllm", "init_args": {"tensor_parallel_size": size}}


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "2", None])
def test_a_size_that_is_not_an_integer_at_least_1_is_refused_by_name(size):
    with pytest.raises(
        ValueError,
        match=r"^`engine.kind.init_args.tensor_parallel_size` must be an integer >= 1, got ",
    ):
        Engine(kind=tp(size)).build()


@pytest.mark.parametrize(("size", "world"), [(2, 1), (2, 3), (4, 2), (3, 4)])
def test_a_size_that_does_not_divide_the_world_size_is_refused_in_one_line(size, world):
    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(size, world)
    message = str(refused.value)
    assert "\n" not in message
    assert f"`engine.kind.init_args.tensor_parallel_size`={size} must divide" in message
    assert f"world size, {world}:" in message


@pytest.mark.parametrize(("size", "world"), [(1, 1), (1, 3), (2, 2), (2, 4), (4, 8)])
def test_a_dividing_size_runs(size, world):
    check_tensor_parallel(size, world)


def test_one_process_with_a_group_of_two_stops_at_start_before_vllm_is_needed(tiny_lm_dir):
    module = RLOOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: 0.0),
        sampling=SAMPLING,
        engine={"kind": tp(2)},
    )
    assert module.rollout_engine.tensor_parallel_size == 2
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size`=2 must divide the training world size, 1:"
    ):
        module.rollout_engine.start(module)


def test_with_size_1_the_group_seeds_are_the_ranks_seeds_of_earlier_releases():
    for seed, batch, rank in [(0, 0, 0), (3, 7, 1), (42, 1000, 5)]:
        assert group_seeds(seed, batch, rank, 5) == [
            request_seed(seed, batch, rank, row) for row in range(5)
        ]
    # Another group, another batch or another run: other seeds.
    seeds = {s for g in range(3) for b in range(2) for s in group_seeds(1, b, g, 4)}
    assert len(seeds) == 3 * 2 * 4


def fake_world(monkeypatch, everyone):
    """Rank r of len(everyone) ranks, whose all_gather_object hands back ``everyone``."""

    def gather(out, obj):
        out[:] = everyone

    monkeypatch.setattr(dist, "get_world_size", lambda: len(everyone))
    monkeypatch.setattr(dist, "all_gather_object", gather)


def left_padded(rows, width):
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


def test_a_group_gathers_its_ranks_prompts_in_rank_order_and_each_keeps_its_rows(monkeypatch):
    # 4 ranks, groups of 2: rank 2 holds 1 row (width 2), rank 3 holds 3 rows (width 4).
    rows = [[[1, 2]], [[3], [4, 5]], [[6, 7]], [[8, 9, 10, 11], [12], [13, 14]]]
    widths = [2, 2, 2, 4]
    everyone = [left_padded(r, w) for r, w in zip(rows, widths, strict=True)]
    fake_world(monkeypatch, everyone)
    for rank, (first, mine) in {2: (2, slice(0, 1)), 3: (2, slice(1, 4))}.items():
        ids, mask, kept = group_prompts(*everyone[rank], rank, 2)
        assert kept == mine
        assert ids.shape == mask.shape == (4, 4)  # the group's rows, left padded to its widest
        got = [row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]
        assert got == rows[first] + rows[first + 1]
        assert torch.equal(
            ids[kept][mask[kept].bool()], everyone[rank][0][everyone[rank][1].bool()]
        )
    ids, mask, kept = group_prompts(*everyone[1], 1, 2)  # group 0: ranks 0 and 1
    assert kept == slice(1, 3)
    assert [row[k.bool()].tolist() for row, k in zip(ids, mask, strict=True)] == [
        [1, 2],
        [3],
        [4, 5],
    ]


class RecordingLLM:
    """vLLM's ``LLM`` stand-in: records the requests and seeds, answers each row's first token."""

    def __init__(self):
        self.push_enabled, self.weights_of, self.calls = True, None, []

    def push(self, weights, owner):
        for _ in weights:
            pass
        self.weights_of = owner

    def sample(self, prompt_ids, prompt_mask, seeds, sampling, eos_token_id, pad_token_id, rows):
        self.calls.append((prompt_ids.clone(), prompt_mask.clone(), seeds, rows))
        first = [row[keep.bool()][0] for row, keep in zip(prompt_ids, prompt_mask, strict=True)]
        tokens = torch.stack(first)[rows].unsqueeze(1).repeat(1, 2)
        return tokens, torch.full(tokens.shape, -1.0)


def test_every_rank_of_a_group_samples_its_gathered_rows_with_the_groups_seeds(
    tiny_lm_dir, monkeypatch
):
    module = RLOOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: 0.0),
        sampling=SAMPLING,
        engine={"kind": tp(2)},
    )
    ids, mask = module._encode_prompts(PROMPTS)
    other_ids, other_mask = module._encode_prompts(PROMPTS[:1])
    # Rank 1 of 2 (group 0): rank 0 holds one prompt, this rank four.
    fake_world(monkeypatch, [(other_ids, other_mask), (ids, mask)])
    monkeypatch.setattr(type(module), "global_rank", property(lambda self: 1))
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    module.batches_seen, module.skipped_batches = 3, 1
    llm = module.rollout_engine.llm_engine = RecordingLLM()
    traj, _ = module.rollout_engine.sample(module, ids, mask, keep_logits=False)
    ((group_ids, group_mask, seeds, rows),) = llm.calls
    assert rows == slice(1, 5) and len(group_ids) == 5
    assert seeds == [request_seed(5, 4, 0, row) for row in range(5)]  # group 0, batch 3 + 1
    assert seeds[1:] != [request_seed(5, 4, 1, row) for row in range(4)]  # not the rank's own
    assert torch.equal(traj.input_ids[:, : ids.shape[1]], ids)  # this rank's prompts
    want = torch.stack([row[keep.bool()][0] for row, keep in zip(ids, mask, strict=True)])
    assert torch.equal(traj.response_ids[:, 0], want)  # this rank's rows of the group's answers


def test_peak_memory_is_every_ranks_value_under_its_own_key():
    before = process_peak_bytes(torch.device("cpu")) / 1e9  # getrusage's, unless a phase reset it
    one = peak_memory_metrics(0, 1, torch.device("cpu"), lambda x: x)
    others = torch.tensor([[0.0, 0.0, 7.5]], dtype=torch.float64)  # rank 2's, on another process
    three = peak_memory_metrics(1, 3, torch.device("cpu"), lambda x: x + others)
    after = process_peak_bytes(torch.device("cpu")) / 1e9
    assert list(one) == ["perf/peak_mem_gb/rank0"]
    for own in (one["perf/peak_mem_gb/rank0"].item(), three["perf/peak_mem_gb/rank1"].item()):
        assert before * (1 - 1e-6) <= own <= after * (1 + 1e-6)  # a float32 of the peak then
    assert list(three) == [f"perf/peak_mem_gb/rank{r}" for r in range(3)]
    assert three["perf/peak_mem_gb/rank0"].item() == 0.0  # (rank 0 would add its own)
    assert three["perf/peak_mem_gb/rank2"].item() == 7.5


@pytest.mark.parametrize(
    ("kind", "peak_memory", "logged"),
    [
        ("native", False, set()),
        ("native", True, {"perf/peak_mem_gb/rank0"}),
        ("vllm", False, {"perf/push_s", "perf/peak_mem_gb/rank0", "perf/peak_mem_gb/push/rank0"}),
    ],
)
def test_push_time_and_peak_memory_are_logged_with_vllm_or_when_asked(
    tiny_lm_dir, kind, peak_memory, logged
):
    from helpers.trainers import fit_on_prompts

    module = RLOOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: float(len(r))),
        sampling=SAMPLING,
        engine={"kind": kind},
        logging={"log_samples_every": 0, "peak_memory": peak_memory},
    )
    if kind == "vllm":
        module.rollout_engine.llm_engine = RecordingLLM()
    trainer = fit_on_prompts(module, PROMPTS * 2, batch_size=4)
    metrics = trainer.callback_metrics
    phases = {f"perf/peak_mem_gb/{p}/rank0" for p in ("rollout", "score", "update")}
    assert phases <= set(metrics)  # every run: the phases' peaks
    extra = {k for k in metrics if k == "perf/push_s" or k.startswith("perf/peak_mem")} - phases
    assert extra == logged
    if "perf/push_s" in logged:
        assert 0 < metrics["perf/push_s"].item() < 60
    if logged:
        assert 0.05 < metrics["perf/peak_mem_gb/rank0"].item() < 100
    peak = process_peak_bytes(torch.device("cpu")) / 1e9
    for key in phases:  # each phase's peak resident set, at most the process's peak
        # (logged as float32: its rounding may land a few parts in 1e8 above the float64 peak)
        assert 0.05 < metrics[key].item() <= peak * (1 + 1e-7)
