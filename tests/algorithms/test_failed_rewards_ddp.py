"""Under DDP the masks of failed rewards enter the global statistics: two gloo ranks, one of
whose samples fail, give what one process gives on the two ranks' samples together.
"""

import datetime
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlkl_lightning.algorithms.advantage_estimators import (
    ADVANTAGES,
    gae_advantages,
    on_scored_rows,
)
from rlkl_lightning.algorithms.metrics import batch_metrics, reward_metrics
from rlkl_lightning.algorithms.options import GroupOptions, PPOOptions
from rlkl_lightning.trajectory import Trajectory

pytestmark = pytest.mark.dist  # two processes: make test-dist

B, T = 4, 5


def rank_data(rank: int) -> tuple[Trajectory, dict]:
    """Rank 0: every reward scored; rank 1: three of its four failed."""
    g = torch.Generator().manual_seed(rank)
    mask = (torch.arange(T) < torch.randint(2, T + 1, (B,), generator=g)[:, None]).float()
    scores = torch.randn(B, generator=g)
    failed = torch.tensor([False] * B) if rank == 0 else torch.tensor([True, True, False, True])
    scores = scores.masked_fill(failed, math.nan)
    traj = Trajectory(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T),
        response_ids=torch.zeros(B, T, dtype=torch.long),
        response_mask=mask,
        kl=torch.rand(B, T, generator=g),
        scores=scores,
        values=torch.randn(B, T, generator=g),
        sample_mask=~failed,
    )
    seq = (traj.kl * mask).sum(1)
    diagnostics = {"kl_k1": seq, "kl_k2": seq, "kl_k3": seq, "kl_exact": seq}
    diagnostics.update(entropy_sum=mask.sum(), failed=failed)
    return traj, diagnostics


def statistics(traj, diagnostics, global_sum, distributed):
    """The masked statistics the pipeline computes from one rank's (or all) samples."""
    ppo = on_scored_rows(gae_advantages, traj, 0.1, PPOOptions(), global_sum)
    grpo = ADVANTAGES["group"]["grpo"](
        traj,
        0.1,
        GroupOptions(responses_per_prompt=2, advantage="grpo", scale_rewards="batch"),
        global_sum,
    )
    logged = batch_metrics(
        traj, diagnostics, "k1", 0.1, [0.0, 1.0, 2.0, 3.0], global_sum, distributed
    )
    kl = diagnostics["kl_k1"]
    rewards = reward_metrics(diagnostics["failed"], {"retries": 1}, global_sum, kl)
    return {
        "kl_scale": ppo.kl_scale[ppo.sample_mask][0],
        "grpo": grpo.advantages[:, 0],
        "kl": logged["objective/kl"],
        "kl_per_token": logged["objective/kl_per_token"],
        "failed_kl": rewards["reward/failed_kl"],
        "score": logged["objective/score"],
        "failed_fraction": rewards["reward/failed_fraction"],
        "retries": rewards["reward/retries"],
    }


def worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))

    def global_sum(x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    try:
        traj, diagnostics = rank_data(rank)
        out[rank] = {
            k: v.tolist() for k, v in statistics(traj, diagnostics, global_sum, True).items()
        }
    finally:
        dist.destroy_process_group()


def test_masks_enter_the_global_statistics_of_two_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.start_processes(worker, args=(port, out), nprocs=2, join=True, start_method="spawn")
    (t0, d0), (t1, d1) = rank_data(0), rank_data(1)
    both = Trajectory(
        *(None if a is None else torch.cat([a, b]) for a, b in zip(t0, t1, strict=True))
    )
    together = {k: torch.cat([d0[k], d1[k]]) if d0[k].dim() else d0[k] + d1[k] for k in d0}
    one = statistics(both, together, lambda x: x, False)
    for rank in (0, 1):
        got = out[rank]
        assert got["kl_scale"] == pytest.approx(float(one["kl_scale"]), rel=1e-6)
        # the KL the controller reads: the 5 trained samples'; the failed ones' apart
        assert got["kl"] == pytest.approx(float(one["kl"]), rel=1e-6)
        assert got["kl_per_token"] == pytest.approx(float(one["kl_per_token"]), rel=1e-6)
        assert got["failed_kl"] == pytest.approx(float(one["failed_kl"]), rel=1e-6)
        assert got["score"] == pytest.approx(float(one["score"]), rel=1e-6)  # the 5 scored
        assert got["failed_fraction"] == 3 / 8 and got["retries"] == 2
    seq, trained = together["kl_k1"], both.sample_mask
    assert float(one["kl"]) == pytest.approx(float(seq[trained].mean()), rel=1e-6)
    tokens = both.response_mask[trained].sum()
    assert float(one["kl_per_token"]) == pytest.approx(float(seq[trained].sum() / tokens), rel=1e-6)
    assert float(one["failed_kl"]) == pytest.approx(float(seq[~trained].mean()), rel=1e-6)
    grpo = torch.tensor(out[0]["grpo"] + out[1]["grpo"])
    torch.testing.assert_close(grpo, one["grpo"].float(), rtol=1e-5, atol=1e-6)
    assert grpo[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # rank 1's groups have < 2 scored


def test_a_ddp_run_trains_on_while_most_of_one_ranks_rewards_fail(tiny_lm_dir, tmp_path):
    import yaml
    from helpers.ddp_runs import train_py
    from helpers.kill_runs import write_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = write_config(tmp_path, tiny_lm_dir, "ddp")
    data = yaml.safe_load(config.read_text())
    data["model"]["init_args"]["reward"] = {"class_path": "helpers.kill_helpers.RankFailingReward"}
    data["trainer"].update(strategy="ddp", devices=2, max_steps=4)  # 2 batches per rank
    config.write_text(yaml.safe_dump(data))
    train_py(config, config.parent, timeout=300)  # a mismatched collective would hang: bounded
    (version,) = (config.parent / "runs" / "tiny").glob("version_*")
    events = EventAccumulator(str(version))
    events.Reload()
    failed = [e.value for e in events.Scalars("reward/failed_fraction")]
    # 6 prompts a rank: batches of 4 and 2; rank 1 trains on 1 sample each time (not skipped)
    assert failed == [3 / 8, 1 / 4]
    assert [e.value for e in events.Scalars("progress/skipped_batches")] == [0.0, 0.0]
    assert all(math.isfinite(e.value) for e in events.Scalars("objective/score"))
