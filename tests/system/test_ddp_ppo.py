"""PPOModule under `--trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu` (gloo).

What can honestly be made equal between a 2-process run and a 1-process run: rollouts are
random, and by default each rank draws from its own stream, so the two runs would sample
different responses. ``helpers.ppo_recording.RecordingPPO`` seeds each prompt's rollout with a hash
of (prompt, batch number) instead, so a prompt gets the same response whichever process samples
it. Then the 1-process run with batches of 4 sees exactly the global batches of the 2-process
run with 2 prompts per rank (same seed, same prompt order: ``PromptDataModule`` deals the
epoch's permutation round-robin to the ranks), and everything downstream is PPOModule's own
code. The reference is a different model, so the KL is far from 0 from the first batch.

Three global batches: the first trains normally; the second holds a prompt whose reward is
``nan``, on rank 1 only; in the third every response is cut to its own length, so the ranks
hold different numbers of response tokens. Up to the third batch's update every rank holds as
many tokens as the other, so DDP's mean of the per-rank gradients is the gradient of the
global token mean (one minibatch per batch makes the update order-free), and the weights of
both runs agree; in the third batch DDP's per-rank loss normalisation differs from one
process's, so only what is computed before its update is compared there.

The test asserts:

* both ranks: the same beta in every batch, the same logged metrics and the same final
  weights, bit for bit; rank ``r`` trains on prompts ``r`` and ``r + 2`` of each global batch;
* the KL controller counted the global batch (4 samples per batch) and its beta equals the
  1-process one, so it was fed the KL of all 4 samples, not of one rank's 2 (the exponential
  law has no clip: each beta depends on the exact KL it received);
* against the 1-process run on the same global batches: identical responses (bit for bit),
  and per-sample KL, scores, whitened advantages (global statistics: whitening each rank's
  rows alone differs by > 0.05), logged metrics, the beta sequence and the weights equal to
  float32 rounding, not bit for bit: a batch of 2 and a batch of 4 pad differently and sum
  in a different order. Tolerances: 1e-5 relative plus 1e-6 absolute on KL, metrics and beta,
  1e-5 relative or absolute on the whitened advantages, 1e-5 absolute on the weights
  (measured: about 1e-6 on weights that moved by more than 1e-3);
* per-token metrics (``objective/kl_per_token``, ``objective/entropy``) are means over the
  tokens of the global batch, also when the ranks hold different numbers of tokens (the mean
  of the two ranks' own token means differs);
* each rank has its own random stream (``seed_everything`` seeds them alike; PPOModule
  offsets them by rank), and the checkpoint holds both;
* the batch with a non-finite reward on one rank only is skipped by *both* ranks (else the
  other rank would wait forever in the gradient all-reduce) with beta unchanged and the skip
  counted, exactly as the 1-process run does.
"""

from __future__ import annotations

import pytest
from helpers.ddp_runs import (
    PROMPTS,
    STEPS,
    assert_two_processes_equal_one,
    close,
    config,
    records,
    train_py,
)

pytestmark = pytest.mark.dist  # several processes: make test-dist


# packed: padding-free updates; tests/compiled/test_compiled_ddp.py runs it compiled too.
@pytest.mark.parametrize("optimization", [None, "{packing: packed}"], ids=["padded", "packed"])
def test_ppo_module_two_process_ddp_equals_one_process_on_the_global_batch(
    tmp_path, tiny_lm_dir, optimization
):
    assert_two_processes_equal_one(tmp_path, tiny_lm_dir, optimization)


def test_uneven_per_rank_batches_give_the_kl_callbacks_the_sample_weighted_kl(
    tmp_path, tiny_lm_dir
):
    """Rank 0 trains 1 prompt per batch, rank 1 trains 3, through PPOModule's own logging.

    What the controller and the drift monitor read (``objective/kl`` after Lightning's
    ``sync_dist``) must be the mean over the 4 samples of the global batch, computed here from
    each rank's recorded per-sample KLs; the plain mean of the two ranks' means differs by far
    more than the tolerance in every batch. The exponential law has no clip, so each beta
    pins the exact KL the controller used: beta' = beta * exp(k (kl - target)).
    """
    import math

    import yaml
    from helpers.ddp_runs import GAIN, TARGET
    from helpers.tiny_models import make_tiny_lm

    per_rank = [1, 3]
    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")  # 12 = 3 batches x (1 + 3)
    path = config(tmp_path, lms, prompts_file, "uneven", "", 1)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["use_distributed_sampler"] = False
    cfg["trainer"]["callbacks"] = []
    cfg["trainer"]["enable_checkpointing"] = False
    cfg["model"]["init_args"]["cut_batch"] = -1
    cfg["data"] = {
        "class_path": "helpers.uneven_prompts.UnevenPrompts",
        "init_args": {"prompts": str(prompts_file), "per_rank": per_rank, "batches": STEPS},
    }
    path.write_text(yaml.safe_dump(cfg))
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    train_py(path, tmp_path, *ddp)
    (rank0, rank1), _ = records(tmp_path / "uneven", 2)

    weighted = []
    for step in range(STEPS):
        b0, b1 = rank0["batches"][step], rank1["batches"][step]
        assert (len(b0["kl_seq"]), len(b1["kl_seq"])) == tuple(per_rank)
        kl = (sum(b0["kl_seq"]) + sum(b1["kl_seq"])) / sum(per_rank)
        unweighted = (sum(b0["kl_seq"]) / per_rank[0] + sum(b1["kl_seq"]) / per_rank[1]) / 2
        assert abs(kl - unweighted) > 1e-3 * abs(kl)  # the two means differ: not vacuous
        weighted.append(kl)
        for b in (b0, b1):
            assert close(b["metrics"]["objective/kl"], kl)
            # the monitor's window (4 batches) holds the weighted KLs so far
            assert close(b["metrics"]["kl_monitor/avg_kl"], sum(weighted) / len(weighted))
        assert b0["beta_used"] == b1["beta_used"]
    betas = [b["beta_used"] for b in rank0["batches"]] + [rank0["kl_coef"]]
    for step, kl in enumerate(weighted):
        assert close(betas[step + 1], betas[step] * math.exp(GAIN * (kl - TARGET)))
    assert rank0["controller"]["n_samples"] == STEPS * sum(per_rank)
    assert rank0["samples_seen"] == rank1["samples_seen"] == STEPS * sum(per_rank)
