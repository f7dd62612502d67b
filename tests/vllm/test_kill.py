"""A vLLM run killed with SIGKILL resumes with ``--ckpt_path last`` as if never killed.

As ``tests/system/test_kill.py``, with ``engine.kind="vllm"`` on the default world's model and
a reference reset after batch 3: the run is killed when batch 6 starts (its last checkpoint is
after batch 4, batch 5 was trained and logged after it), resumed with the same command plus
``--ckpt_path last`` (a new process: a new engine, the checkpoint's weights pushed into it before
the first rollout), and every logged scalar, the final weights, the optimizer state and the KL
callbacks' state equal the uninterrupted run's, bit for bit. The engine samples each response
with a seed from (seed, batch, rank, row), so the resumed batches draw what the uninterrupted
run drew.

Under DDP (2 gloo processes, one engine per rank) the run of 4 batches is killed whole (both
ranks, its process group) when batch 4 starts: its last checkpoint is after batch 2 and batch 3
was trained and logged after it. Resumed with ``--ckpt_path last`` (new engines, each rank's
random streams restored), every logged scalar but ``perf/*`` (timings, memory peaks), the
final weights, the optimizer state and the KL callbacks' state equal the uninterrupted
2-process run's, bit for bit. Each run is bounded in time (``finish``, ``kill_at_marker``): a
hang fails.
"""

from __future__ import annotations

import pytest
import yaml
from conftest import ENGINE
from helpers.kill_runs import STEPS_PER_BATCH, write_config
from system.test_kill import (
    assert_same_run,
    finish,
    kill_at_marker,
    last_checkpoint,
    scalars,
    start,
)


def vllm_config(tmp_path, policy, name, batches=None, **options):
    """The kill tests' config with the vLLM engine; ``batches``: fewer than its 6."""
    path = write_config(tmp_path, policy, name, refresh_every=3, **options)
    config = yaml.safe_load(path.read_text())
    config["model"]["init_args"]["engine"] = ENGINE
    if batches:
        config["trainer"]["max_steps"] = batches * STEPS_PER_BATCH
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_vllm_run_killed_after_a_checkpoint_resumes_bit_for_bit(world_dir, tmp_path):
    full = vllm_config(tmp_path, world_dir, "full")
    cut = vllm_config(tmp_path, world_dir, "cut", stall_at=6)
    full_proc = start(full)
    kill_at_marker(start(cut), cut, "killed_before_batch")
    assert last_checkpoint(cut)["rlkl_counters"]["batches_seen"] == 4
    finish(start(cut, False, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full)
    assert last_checkpoint(full)["rlkl_counters"]["reference_refreshes"] == 2


@pytest.mark.dist  # two training processes
def test_a_two_process_vllm_run_killed_after_a_checkpoint_resumes_bit_for_bit(world_dir, tmp_path):
    batches = 4
    full = vllm_config(tmp_path, world_dir, "full", batches)
    cut = vllm_config(tmp_path, world_dir, "cut", batches, stall_at=4)
    full_proc = start(full, True)
    kill_at_marker(start(cut, True), cut, "killed_before_batch")
    assert last_checkpoint(cut)["rlkl_counters"]["batches_seen"] == 2
    assert 2 in scalars(cut)["objective/kl"]  # batch 3 was logged after the last checkpoint
    finish(start(cut, True, "--ckpt_path", "last"), cut)
    finish(full_proc, full)
    assert_same_run(cut, full, batches)
    saved = last_checkpoint(full)
    assert len(saved["rlkl_rng"]["cpu"]) == 2  # both ranks' random streams
    assert saved["rlkl_counters"]["reference_refreshes"] == 1  # after batch 3, resumed side
    assert (cut.parent / "log.txt").read_text().count("Restored all states") == 1
