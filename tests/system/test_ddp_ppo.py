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

import sys

import pytest
import torch
from helpers.ddp_runs import PER_RANK, PROMPTS, SEED, STEPS, TESTS, config, records, train_py

from rlkl_lightning.data.samplers import EpochShuffleSampler

pytestmark = pytest.mark.dist  # several processes: make test-dist


def close(a, b, rel=1e-5, abs=1e-6):
    return a == pytest.approx(b, rel=rel, abs=abs)


# packed: padding-free updates; tests/compiled/test_compiled_ddp.py runs it compiled too.
@pytest.mark.parametrize("optimization", [None, "{packing: packed}"], ids=["padded", "packed"])
def test_ppo_module_two_process_ddp_equals_one_process_on_the_global_batch(
    tmp_path, tiny_lm_dir, optimization
):
    from helpers.tiny_models import make_tiny_lm

    from rlkl_lightning.cli import main
    from rlkl_lightning.models.loading import load_causal_lm

    lms = (tiny_lm_dir, make_tiny_lm(tmp_path / "reference", seed=1))
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    global_batch = 2 * PER_RANK
    order = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
    batches = [order[i * global_batch : (i + 1) * global_batch] for i in range(STEPS)]
    poison = batches[1][1]  # position 5 of the epoch: dealt to rank 1 only

    ddp_cfg = config(tmp_path, lms, prompts_file, "ddp", poison, PER_RANK)
    ddp = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    options = ["--model.init_args.optimization", optimization] if optimization else []
    train_py(ddp_cfg, tmp_path, *ddp, *options)

    sys.path.insert(0, str(TESTS))
    try:
        single_cfg = config(tmp_path, lms, prompts_file, "single", poison, global_batch)
        main(["fit", "--config", str(single_cfg), *options])
    finally:
        sys.path.remove(str(TESTS))

    (rank0, rank1), (w0, w1) = records(tmp_path / "ddp", 2)
    (single,), (w_single,) = records(tmp_path / "single", 1)
    assert rank0["world_size"] == 2 and single["world_size"] == 1

    # ---- both ranks agree, bit for bit
    assert len(rank0["batches"]) == len(rank1["batches"]) == STEPS
    for b0, b1, expected in zip(rank0["batches"], rank1["batches"], batches, strict=True):
        assert b0["beta_used"] == b1["beta_used"]
        assert b0["metrics"] == b1["metrics"]  # logged metrics are global (sync_dist)
        for r in (0, 1):  # each rank's phase peaks, gathered: in both ranks' records
            assert b0["metrics"].get(f"perf/peak_mem_gb/update/rank{r}", 0) > 0.05
        # Each rank takes every second prompt of the one shared order (RankShardSampler).
        assert (b0["prompts"], b1["prompts"]) == (expected[0::2], expected[1::2])
    assert rank0["controller"] == rank1["controller"]
    assert rank0["kl_coef"] == rank1["kl_coef"]
    assert w0["final"].keys() == w1["final"].keys()
    assert all(torch.equal(w0["final"][k], w1["final"][k]) for k in w0["final"])

    # ---- the controller saw the global batch: 4 samples in each of the 3 batches (the
    # skipped one included; it updated beta on 2); the module counts the 8 it trained on.
    assert rank0["controller"]["n_samples"] == single["controller"]["n_samples"] == 12
    assert rank0["controller"]["n_skipped"] == single["controller"]["n_skipped"] == 1
    assert rank0["samples_seen"] == single["samples_seen"] == 8
    assert rank0["skipped_batches"] == rank1["skipped_batches"] == single["skipped_batches"] == 1

    # ---- the 2-process run equals the 1-process run on the same global batches
    def by_prompt(batch_records, key):
        return {
            p: v
            for rec in batch_records
            if key in rec
            for p, v in zip(rec["prompts"], rec[key], strict=True)
        }

    compared = ["objective/kl", "objective/kl_per_token", "objective/entropy", "objective/score"]
    for step in range(STEPS):
        ranks = [rank0["batches"][step], rank1["batches"][step]]
        one = single["batches"][step]
        assert one["prompts"] == batches[step]
        assert close(ranks[0]["beta_used"], one["beta_used"])
        if step == 1:  # the poisoned batch: skipped everywhere, nothing scored
            assert all("kl_seq" not in r for r in ranks + [one])
            assert ranks[0]["metrics"]["progress/skipped_batches"] == 1.0
            assert ranks[0]["beta_used"] == rank0["batches"][2]["beta_used"]
            continue
        for key in ("responses", "tokens", "kl_seq", "scores", "advantages"):
            got, want = by_prompt(ranks, key), by_prompt([one], key)
            assert got.keys() == want.keys() == set(batches[step])
            if key in ("responses", "tokens"):
                assert got == want
            else:
                # Whitened advantages have unit spread: their absolute error is relative to
                # it (float32 rounding through the whitening reached 1.5e-6 with oneDNN's
                # products, cpu_matmul="auto" on an AMD processor).
                tol = {"abs": 1e-5} if key == "advantages" else {}
                assert all(close(got[p], want[p], **tol) for p in want), key
        # Whitening each rank's rows on their own gives clearly different numbers.
        for r in ranks:
            flat = torch.tensor(sum(r["advantages_raw"], []))
            local = (flat - flat.mean()) / flat.std()
            assert (local - torch.tensor(sum(r["advantages"], []))).abs().max() > 0.05
        for key in compared + ["objective/kl_coef"] + (["loss/policy"] if step == 0 else []):
            assert close(ranks[0]["metrics"][key], one["metrics"][key]), key
        # Per-token KL over the tokens of the global batch.
        kl = [sum(r["kl_seq"]) for r in ranks]
        tokens = [sum(r["tokens"]) for r in ranks]
        pooled = sum(kl) / sum(tokens)
        assert close(ranks[0]["metrics"]["objective/kl_per_token"], pooled)
        if step == STEPS - 1:
            assert tokens[0] != tokens[1]
            mean_of_means = (kl[0] / tokens[0] + kl[1] / tokens[1]) / 2
            assert abs(mean_of_means - pooled) > 1e-3 * abs(pooled)
    assert abs(single["batches"][0]["metrics"]["objective/kl"]) > 0.1  # reference != policy
    betas = [b["beta_used"] for b in rank0["batches"]] + [rank0["kl_coef"]]
    assert len(set(betas)) == 3  # beta moved after batches 1 and 3, not after the skipped one
    assert close(rank0["kl_coef"], single["kl_coef"])
    before = w0["before_cut"]
    assert max(float((before[k] - w_single["before_cut"][k]).abs().max()) for k in before) < 1e-5
    initial = load_causal_lm(str(tiny_lm_dir)).state_dict()
    moved = max(float((before[f"policy.{k}"] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-3  # the weights did change: the comparison above is not vacuous

    # ---- the DDP checkpoint: one RNG state per rank, and the controller state
    ckpt = torch.load(tmp_path / "ddp" / "ckpt" / "last.ckpt", weights_only=True)
    rng = ckpt["rlkl_rng"]["cpu"]
    assert len(rng) == 2
    assert not torch.equal(rng[0], rng[1])  # each rank has its own random stream
    controller = next(v for k, v in ckpt["callbacks"].items() if k.startswith("KLController"))
    assert controller == rank0["controller"]


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
