"""The sampler/trainer gap: its metrics, the corrections' weights, the objective, the gate, a run.

The engine is faked: a trajectory whose ``sampler_logprobs`` are the trainer's perturbed by
hand, or a tiny run whose ``rollout`` adds them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.tiny_ppo import fit, module_args

from rlkl_lightning import RLOOModule
from rlkl_lightning import metric_keys as keys
from rlkl_lightning.algorithms.gates import trajectory_is_finite
from rlkl_lightning.algorithms.mismatch import (
    mismatch_metrics,
    mismatch_weights,
    sequence_mis_weights,
    token_tis_weights,
    weighted,
)
from rlkl_lightning.algorithms.objective import PolicyObjective
from rlkl_lightning.algorithms.options import Engine, KLPenalty, Objective
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.trajectory import Trajectory

NAN = float("nan")
#: Three responses of 4, 2 and 3 tokens; padding holds garbage, nan included.
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
TRAINER = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -3.0, NAN, 7.0], [-0.2, -1.0, -0.4, -9.0]])
SAMPLER = torch.tensor([[-1.2, -0.5, -1.0, -0.4], [-0.3, -1.0, 5.0, NAN], [-0.9, -1.1, -0.4, 0.0]])


def valid_deltas(trainer=TRAINER, sampler=SAMPLER, mask=MASK) -> list[list[float]]:
    """Each response's ``log pi - log mu`` of its valid tokens, as plain floats."""
    rows = zip(trainer.tolist(), sampler.tolist(), mask.tolist(), strict=True)
    return [[p - q for p, q, m in zip(*row, strict=True) if m] for row in rows]


def trajectory(trainer=TRAINER, sampler=SAMPLER, mask=MASK) -> Trajectory:
    ids = torch.zeros(mask.shape, dtype=torch.long)
    return Trajectory(
        ids, torch.ones_like(ids), ids, mask, logprobs=trainer, sampler_logprobs=sampler
    )


def local(values):
    return values


# ---------------------------------------------------------------- metrics
def test_metrics_are_the_hand_computed_gap_of_the_valid_tokens():
    deltas = valid_deltas()
    flat = [abs(d) for row in deltas for d in row]
    sums = [sum(row) for row in deltas]
    metrics = mismatch_metrics(trajectory(), None, local, local)
    assert metrics[keys.MISMATCH_TOKEN_ABS_MEAN].item() == pytest.approx(sum(flat) / len(flat))
    assert metrics[keys.MISMATCH_TOKEN_ABS_MAX].item() == pytest.approx(max(flat))
    assert metrics[keys.MISMATCH_SEQ_LOG_RATIO_MIN].item() == pytest.approx(min(sums))
    assert metrics[keys.MISMATCH_SEQ_LOG_RATIO_MAX].item() == pytest.approx(max(sums))
    assert keys.MISMATCH_CORRECTED_FRACTION not in metrics  # no correction, no fraction
    assert all(math.isfinite(v.item()) for v in metrics.values())  # the nan is padding


def test_metrics_of_an_unmasked_batch_are_plain_torch():
    gen = torch.Generator().manual_seed(0)
    trainer, sampler = -torch.rand(5, 6, generator=gen), -torch.rand(5, 6, generator=gen)
    traj = trajectory(trainer, sampler, torch.ones(5, 6))
    metrics = mismatch_metrics(traj, None, local, local)
    delta = trainer - sampler
    assert torch.equal(metrics[keys.MISMATCH_TOKEN_ABS_MAX], delta.abs().max())
    assert torch.allclose(metrics[keys.MISMATCH_TOKEN_ABS_MEAN], delta.abs().mean())
    assert torch.allclose(metrics[keys.MISMATCH_SEQ_LOG_RATIO_MIN], delta.sum(1).min())
    assert torch.allclose(metrics[keys.MISMATCH_SEQ_LOG_RATIO_MAX], delta.sum(1).max())


@pytest.mark.parametrize("correction", ["token_tis", "sequence_mis"])
def test_two_ranks_metrics_are_the_whole_batchs(correction):
    """Split over two "ranks" of uneven token counts, the collectives give the global batch's."""
    traj = trajectory()
    _, corrected = mismatch_weights(traj, correction, 2.0)
    whole = mismatch_metrics(traj, corrected, local, local)
    halves = [torch.tensor([0]), torch.tensor([1, 2])]
    recorded = []
    for rows in halves:  # what each rank hands to the collectives
        seen = {}

        def record_sum(x, seen=seen):
            seen["sum"] = x
            return x

        def record_max(x, seen=seen):
            seen["max"] = x
            return x

        part = traj.select(rows)
        mismatch_metrics(part, mismatch_weights(part, correction, 2.0)[1], record_sum, record_max)
        recorded.append(seen)
    part = traj.select(halves[0])
    merged = mismatch_metrics(
        part,
        mismatch_weights(part, correction, 2.0)[1],
        lambda x: recorded[0]["sum"] + recorded[1]["sum"],
        lambda x: torch.maximum(recorded[0]["max"], recorded[1]["max"]),
    )
    assert merged.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.allclose(merged[key], value), key


def _rank_metrics(rank: int, init_file: str, out_dir: str, correction: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:

        def reduce(op):
            def collective(x):
                y = x.clone()
                dist.all_reduce(y, op=op)
                return y

            return collective

        part = trajectory().select(torch.tensor([[0], [1, 2]][rank]))
        corrected = mismatch_weights(part, correction, 2.0)[1]
        metrics = mismatch_metrics(
            part, corrected, reduce(dist.ReduceOp.SUM), reduce(dist.ReduceOp.MAX)
        )
        torch.save(metrics, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("correction", ["none", "sequence_mis"])
def test_two_gloo_ranks_log_the_whole_batchs_metrics(correction, tmp_path):
    """Real collectives, 2 processes of 4 and 5 tokens: each rank logs the global batch's."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    args = (str(tmp_path / "init"), str(tmp_path), correction)
    mp.start_processes(_rank_metrics, args=args, nprocs=2, join=True, start_method=method)
    whole = mismatch_metrics(
        trajectory(), mismatch_weights(trajectory(), correction, 2.0)[1], local, local
    )
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == whole.keys()
        for key, value in whole.items():
            assert torch.allclose(got[key], value), (rank, key)


# ---------------------------------------------------------------- weights
def test_token_tis_weights_are_the_truncated_ratio_of_each_valid_token():
    c = 2.0
    weights, cut = mismatch_weights(trajectory(), "token_tis", c)
    for row, deltas in enumerate(valid_deltas()):
        for t, d in enumerate(deltas):
            assert weights[row, t].item() == pytest.approx(min(math.exp(d), c), rel=1e-6)
            assert bool(cut[row, t]) == (math.exp(d) > c)
    assert torch.equal(weights * (1 - MASK), torch.zeros_like(weights))  # 0 on padding
    assert not bool((cut & ~MASK.bool()).any())
    frac = mismatch_metrics(trajectory(), cut, local, local)[keys.MISMATCH_CORRECTED_FRACTION]
    assert frac.item() == pytest.approx(1 / 9)  # one of 9 tokens: e^0.7 > 2


def test_sequence_mis_weights_keep_the_ratio_inside_the_bound_and_mask_the_rest():
    c = 2.0
    weights, masked = mismatch_weights(trajectory(), "sequence_mis", c)
    for row, deltas in enumerate(valid_deltas()):
        rho = math.exp(sum(deltas))
        out = not (1 / c <= rho <= c)
        assert bool(masked[row]) == out
        want = 0.0 if out else rho
        for t in range(len(deltas)):
            assert weights[row, t].item() == pytest.approx(want, rel=1e-6)
    assert masked.tolist() == [False, True, True]  # rho = e^-0.5, e^-2, e^0.8
    assert torch.equal(weights * (1 - MASK), torch.zeros_like(weights))
    frac = mismatch_metrics(trajectory(), masked, local, local)[keys.MISMATCH_CORRECTED_FRACTION]
    assert frac.item() == pytest.approx(2 / 3)


def test_huge_ratios_do_not_overflow_and_no_correction_gives_no_weights():
    delta = torch.tensor([[200.0, -200.0, 0.0]])
    mask = torch.ones_like(delta)
    weights, cut = token_tis_weights(delta, mask, 3.0)
    assert torch.allclose(weights, torch.tensor([[3.0, 0.0, 1.0]]))
    assert cut.tolist() == [[True, False, False]]
    weights, masked = sequence_mis_weights(torch.tensor([[400.0, -1.0]]), torch.ones(1, 2), 3.0)
    assert torch.equal(weights, torch.zeros(1, 2)) and masked.tolist() == [True]
    assert mismatch_weights(trajectory(), "none", 2.0) == (None, None)
    native = trajectory()._replace(sampler_logprobs=None)
    assert mismatch_weights(native, "token_tis", 2.0) == (None, None)


# ---------------------------------------------------------------- the objective
def tiny_policy():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=7, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    config.initializer_range = 0.5
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def scored_trajectory(policy, weights=None):
    gen = torch.Generator().manual_seed(3)
    responses = torch.randint(0, 7, (5, 4), generator=gen)
    ids = torch.cat([torch.zeros(5, 1, dtype=torch.long), responses], dim=1)
    mask = torch.tensor([[1, 1, 1, 1]] * 3 + [[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    traj = Trajectory(ids, torch.ones_like(ids), responses, mask)
    with torch.no_grad():
        old = score_tokens(policy, traj, 1.0, logits=False).logprobs
    advantages = torch.randn(5, 1, generator=gen).expand(5, 4) * mask
    return traj._replace(
        logprobs=old, ref_logprobs=old - 0.1, advantages=advantages, mismatch_weights=weights
    )


def loss_and_grads(policy, traj, objective):
    params = [p for p in policy.parameters() if p.requires_grad]
    loss, stats = objective(policy, traj, 0.3)
    return loss, torch.autograd.grad(loss, params), stats


@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_weights_of_one_give_the_loss_and_gradients_of_no_weights(placement):
    policy = tiny_policy()
    objective = PolicyObjective(Objective(ent_coef=0.01), KLPenalty(placement=placement), 1.0)
    plain = scored_trajectory(policy)
    ones = plain._replace(mismatch_weights=plain.response_mask.clone())
    loss, grads, stats = loss_and_grads(policy, plain, objective)
    loss1, grads1, stats1 = loss_and_grads(policy, ones, objective)
    assert torch.equal(loss, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads1, strict=True))
    assert stats.keys() == stats1.keys()
    assert all(torch.equal(stats[k], stats1[k]) for k in stats)


def test_without_weights_the_surrogate_reduces_with_the_aggregation_itself():
    assert weighted(masked_mean, None) is masked_mean


def test_the_weights_multiply_the_surrogate_only():
    """At the behaviour point (ratio 1), the weighted surrogate's gradient is ``-w A grad log pi``.

    The entropy bonus and the KL term of the loss are the unweighted objective's.
    """
    policy = tiny_policy()
    params = [p for p in policy.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(4)
    plain = scored_trajectory(policy)
    weights = (0.1 + 2 * torch.rand(5, 4, generator=gen)) * plain.response_mask
    traj = plain._replace(mismatch_weights=weights)
    ent = Objective(ent_coef=0.01)
    loss, stats = PolicyObjective(ent, KLPenalty(placement="loss"), 1.0)(policy, traj, 0.3)
    _, plain_stats = PolicyObjective(ent, KLPenalty(placement="loss"), 1.0)(policy, plain, 0.3)
    for key in (keys.LOSS_KL, keys.LOSS_ENTROPY_BONUS):  # not weighted
        assert torch.equal(stats[key], plain_stats[key])
    # the surrogate alone: its gradient against the closed form at ratio 1
    only = PolicyObjective(Objective(), KLPenalty(), 1.0)
    surrogate, _ = only(policy, traj, 0.0)
    got = torch.autograd.grad(surrogate, params)
    logp = score_tokens(policy, traj, 1.0, logits=False).logprobs
    want = torch.autograd.grad(
        masked_mean(-weights * traj.advantages * logp, traj.response_mask), params
    )
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(
        torch.cat([g.flatten() for g in got]),
        torch.cat([g.flatten() for g in torch.autograd.grad(only(policy, plain, 0.0)[0], params)]),
    )


def test_with_the_kl_in_the_reward_the_weights_reweight_its_gradient_and_the_docs_say_so():
    """The KL in the reward is part of the advantage, so the weights reach its gradient.

    docs/mismatch.md said the weights did not touch the KL in the reward. Here the score is 0:
    the advantage is the KL penalty's reward-to-go alone, and the weighted gradient is the
    weighted closed form, not the unweighted one.
    """
    from pathlib import Path

    policy = tiny_policy()
    params = [p for p in policy.parameters() if p.requires_grad]
    plain = scored_trajectory(policy)
    mask = plain.response_mask
    kl = (plain.logprobs - plain.ref_logprobs) * mask  # k1 per token
    advantages = -0.3 * kl.flip(1).cumsum(1).flip(1) * mask  # -beta x the KL still to come
    plain = plain._replace(advantages=advantages)
    weights = (0.1 + 2 * torch.rand(5, 4, generator=torch.Generator().manual_seed(5))) * mask
    only = PolicyObjective(Objective(), KLPenalty(placement="reward"), 1.0)
    got = torch.autograd.grad(
        only(policy, plain._replace(mismatch_weights=weights), 0.0)[0], params
    )
    unweighted = torch.autograd.grad(only(policy, plain, 0.0)[0], params)
    logp = score_tokens(policy, plain, 1.0, logits=False).logprobs
    want = torch.autograd.grad(masked_mean(-weights * advantages * logp, mask), params)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    assert not torch.allclose(flat(got), flat(unweighted))
    root = Path(__file__).resolve().parents[2]
    page = " ".join((root / "docs" / "mismatch.md").read_text().split())
    assert "the correction reweights the KL's gradient as it reweights the score's" in page
    assert (
        "the KL in the reward and the KL term of the loss are the trainer's, unweighted" not in page
    )


# ---------------------------------------------------------------- the gate
def test_a_non_finite_engine_log_prob_fails_the_finiteness_gate():
    finite = trajectory(sampler=SAMPLER.nan_to_num(0.0).where(MASK.bool(), torch.tensor(NAN)))
    finite = finite._replace(logprobs=TRAINER.nan_to_num(0.0))
    assert trajectory_is_finite(finite)  # nan on padding only
    for bad in (NAN, -math.inf, math.inf):
        sampler = finite.sampler_logprobs.clone()
        sampler[2, 1] = bad  # a valid token
        traj = finite._replace(sampler_logprobs=sampler)
        assert not trajectory_is_finite(traj), bad
        for correction in ("token_tis", "sequence_mis"):
            weights, _ = mismatch_weights(traj, correction, 2.0)
            # -inf makes the ratio +inf, which the cap would turn into a finite C: the engine's
            # log-probs themselves are what the gate checks
            assert not trajectory_is_finite(traj._replace(mismatch_weights=weights))


# ---------------------------------------------------------------- a run with a fake engine
def fake_engine(correction: str, threshold: float = 2.0) -> Engine:
    """The engine group of a run whose rollout is faked: native (no vLLM), with a correction.

    Built without ``Engine``'s own check, which ties a correction to ``kind="vllm"``.
    """
    engine = object.__new__(Engine)
    for name, value in (("correction", correction), ("correction_threshold", threshold)):
        object.__setattr__(engine, name, value)
    return engine


def run_with_fake_engine(tiny_lm_dir, shift, correction="none", nan_at=None):
    """Two batches whose "engine" log-probs are the trainer's minus ``shift`` per token."""
    torch.manual_seed(0)
    module = RLOOModule(**module_args(tiny_lm_dir, group={"responses_per_prompt": 2}))
    if correction != "none":
        module.engine = fake_engine(correction)
    rollout, update, seen = module.rollout, module.update, []

    def engine_rollout(prompts):
        traj, scores = rollout(prompts)
        sampler = traj.logprobs - shift
        if nan_at is not None:
            sampler[nan_at] = NAN
        return traj._replace(sampler_logprobs=sampler), scores

    def recording_update(traj):
        seen.append(traj)
        return update(traj)

    module.rollout, module.update = engine_rollout, recording_update
    trainer = fit(module, batches=2, batch_size=4)
    return trainer, seen


def test_a_native_run_logs_no_mismatch_and_carries_no_weights(tiny_lm_dir):
    torch.manual_seed(0)
    module = RLOOModule(**module_args(tiny_lm_dir, group={"responses_per_prompt": 2}))
    update, seen = module.update, []
    module.update = lambda traj: (seen.append(traj), update(traj))[1]
    trainer = fit(module, batches=1, batch_size=4)
    assert not [k for k in trainer.callback_metrics if k.startswith("mismatch/")]
    assert seen and all(t.sampler_logprobs is None and t.mismatch_weights is None for t in seen)


def test_a_run_with_a_shifted_engine_logs_the_shift_and_weights_the_surrogate(tiny_lm_dir):
    shift = 1.0  # exp(1) > 2: every token's weight is capped at 2
    trainer, seen = run_with_fake_engine(tiny_lm_dir, shift, "token_tis")
    metrics = trainer.callback_metrics
    last = seen[-1]
    lengths = last.response_mask.sum(1)
    assert metrics[keys.MISMATCH_TOKEN_ABS_MEAN].item() == pytest.approx(shift, rel=1e-6)
    assert metrics[keys.MISMATCH_TOKEN_ABS_MAX].item() == pytest.approx(shift, rel=1e-6)
    assert metrics[keys.MISMATCH_SEQ_LOG_RATIO_MIN].item() == pytest.approx(
        shift * lengths.min().item(), rel=1e-5
    )
    assert metrics[keys.MISMATCH_SEQ_LOG_RATIO_MAX].item() == pytest.approx(
        shift * lengths.max().item(), rel=1e-5
    )
    assert metrics[keys.MISMATCH_CORRECTED_FRACTION].item() == 1.0
    assert torch.allclose(last.mismatch_weights, 2.0 * last.response_mask)


def test_a_run_with_a_shifted_engine_and_no_correction_has_no_weights(tiny_lm_dir):
    trainer, seen = run_with_fake_engine(tiny_lm_dir, -0.25)
    assert trainer.callback_metrics[keys.MISMATCH_TOKEN_ABS_MEAN].item() == pytest.approx(0.25)
    assert keys.MISMATCH_CORRECTED_FRACTION not in trainer.callback_metrics
    assert all(t.mismatch_weights is None for t in seen)


def test_a_nan_engine_log_prob_skips_the_batch(tiny_lm_dir):
    with pytest.warns(RuntimeWarning, match="not finite"):
        trainer, seen = run_with_fake_engine(tiny_lm_dir, 0.5, "sequence_mis", nan_at=(0, 0))
    assert trainer.callback_metrics[keys.SKIPPED_BATCHES].item() == 2
    assert seen == []  # no update ran
