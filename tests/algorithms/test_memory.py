"""The ``perf/*`` measurements every run logs: throughput and the peak memory of each phase.

The phases' peaks are measured with the system's peak reset at each phase (on a CPU the
process's peak resident set, through ``/proc/self/clear_refs``), so these tests allocate known
amounts in known phases and read them back; the process's peak so far must survive the resets.
"""

from __future__ import annotations

import pytest
import torch

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.memory import PhasePeaks, _reset, process_peak_bytes
from rlkl_lightning.algorithms.metrics import batch_metrics, peak_memory_metrics
from rlkl_lightning.kl.estimators import estimator_names
from rlkl_lightning.trajectory import Trajectory

MIB = 2**20
resettable = pytest.mark.skipif(
    not _reset(torch.device("cpu")), reason="the peak resident set cannot be reset here"
)


def touch(mib: int) -> torch.Tensor:
    """A tensor of ``mib`` MiB whose every page is resident."""
    return torch.ones(mib * MIB // 4)


@resettable
def test_each_phase_gets_its_own_peak_and_the_process_keeps_its_own():
    peaks = PhasePeaks(torch.device("cpu"))
    peaks.enter("big")
    big = touch(192)
    del big
    peaks.enter("small")
    small = touch(16)
    peaks.enter("big")  # entered twice: the larger of its two parts
    del small
    found = peaks.stop()
    assert list(found) == ["big", "small"]
    # "small" started with 192 MiB freed (returned to the system: a large block), so its peak
    # is about 16 MiB above the resident set; "big" is 192 MiB above it.
    assert 150 * MIB < found["big"] - found["small"] < 200 * MIB
    assert process_peak_bytes(torch.device("cpu")) >= found["big"]
    after = PhasePeaks(torch.device("cpu"))
    after.enter("idle")
    idle = after.stop()["idle"]
    assert idle < found["big"] - 150 * MIB  # the reset forgot the 192 MiB ...
    assert process_peak_bytes(torch.device("cpu")) >= found["big"]  # ... this did not


def test_peak_memory_metrics_give_every_rank_every_phase_and_the_process():
    others = torch.zeros(3, 3, dtype=torch.float64)
    others[:, 2] = torch.tensor([1.5, 2.5, 7.5])  # rank 2's values, from another process
    phases = {"rollout": 2 * 10**9, "update": 3 * 10**9}
    got = peak_memory_metrics(1, 3, torch.device("cpu"), lambda x: x + others, phases)
    expected_keys = [
        *[f"perf/peak_mem_gb/rollout/rank{r}" for r in range(3)],
        *[f"perf/peak_mem_gb/update/rank{r}" for r in range(3)],
        *[f"perf/peak_mem_gb/rank{r}" for r in range(3)],
    ]
    assert list(got) == expected_keys
    assert got["perf/peak_mem_gb/rollout/rank1"].item() == 2.0
    assert got["perf/peak_mem_gb/update/rank1"].item() == 3.0
    assert got["perf/peak_mem_gb/update/rank2"].item() == 2.5
    assert got["perf/peak_mem_gb/rank0"].item() == 0.0  # rank 0 adds its own
    own = process_peak_bytes(torch.device("cpu")) / 1e9
    assert got["perf/peak_mem_gb/rank1"].item() == pytest.approx(own, rel=1e-3)
    alone = peak_memory_metrics(0, 1, torch.device("cpu"), lambda x: x, phases, process=False)
    assert list(alone) == ["perf/peak_mem_gb/rollout/rank0", "perf/peak_mem_gb/update/rank0"]


def test_throughput_counts_prompt_and_response_tokens_but_not_padding():
    b, p, r = 3, 4, 5
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    response_mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32
    )
    traj = Trajectory(
        input_ids=torch.zeros(b, p + r, dtype=torch.long),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_ids=torch.zeros(b, r, dtype=torch.long),
        response_mask=response_mask,
        kl=torch.zeros(b, r),
        scores=torch.zeros(b),
    )
    diagnostics = {f"kl_{name}": torch.zeros(b) for name in estimator_names()}
    diagnostics["entropy_sum"] = torch.tensor(0.0)
    clock = [10.0, 10.5, 11.0, 12.0]  # 2 seconds from the rollout's start to the update's end
    got = batch_metrics(traj, diagnostics, "k1", 0.1, clock, lambda x: x)
    assert got[keys.THROUGHPUT].item() == (9 + 9) / 2.0  # 9 prompt + 9 response tokens
    assert got[keys.TOKENS_PER_S].item() == 9 / 2.0  # response tokens alone
