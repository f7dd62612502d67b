"""RLOOModule's GRPO-family options: reward scaling, entropy bonus, truncated completions, the
zero-signal group filter and what the KL callbacks count when it drops groups."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers.recorders import K, RecordingRLOO
from helpers.tiny_ppo import PROMPTS, fit, good_fraction, module_args, with_options
from lightning.pytorch import seed_everything

from rlkl_lightning import AdaptiveKLController, KLControllerCallback, KLDriftMonitor, RLOOModule
from rlkl_lightning.algorithms.advantage_estimators import batch_std_of
from rlkl_lightning.algorithms.advantages import group_advantages
from rlkl_lightning.algorithms.losses import entropy_from_logits
from rlkl_lightning.algorithms.rloo import ended_with_eos, zero_std_fraction, zero_std_groups
from rlkl_lightning.masked import masked_mean
from rlkl_lightning.models.loading import disable_dropout
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.rewards import FunctionReward


def rloo(path, **overrides) -> RLOOModule:
    group = {"responses_per_prompt": K, **overrides.pop("group", {})}
    return RLOOModule(**module_args(path, group=group, **overrides))


RETURNS = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.5, 0.5, -1.0, 3.0], dtype=torch.float64)


def test_grpo_scales_written_out():
    """group / batch / none against the formulas, computed per group by hand."""
    groups = RETURNS.view(2, 4)
    centred = groups - groups.mean(dim=1, keepdim=True)
    eps = 1e-4
    by_group = centred / (groups.std(dim=1, keepdim=True) + eps)
    by_batch = centred / (RETURNS.std() + eps)
    for scale, want in (("group", by_group), ("batch", by_batch), ("none", centred)):
        got = group_advantages(RETURNS, 4, "grpo", eps=eps, scale=scale)
        torch.testing.assert_close(got, want.flatten(), rtol=0, atol=1e-12)
    given = group_advantages(RETURNS, 4, "grpo", eps=eps, scale="batch", batch_std=torch.tensor(2))
    torch.testing.assert_close(given, (centred / (2 + eps)).flatten(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"`scale` must be one of \('group',\)"):
        group_advantages(RETURNS, 4, "rloo", scale="none")


def test_zero_std_groups_and_eos():
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0 + 1e-12, 2.0, 2.0])
    assert zero_std_groups(scores, 2).tolist() == [True, False, True, True]
    assert zero_std_groups(scores, 4).tolist() == [False, False]
    ids = torch.tensor([[5, 9, 0], [5, 5, 5], [9, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    traj = SimpleNamespace(response_ids=ids, response_mask=mask, scores=torch.zeros(3))
    assert ended_with_eos(traj, 9).tolist() == [True, False, True]
    # Padding that holds the EOS id (pad == eos) is not an EOS of the response.
    traj.response_ids = torch.tensor([[5, 9, 9], [5, 5, 9], [9, 9, 9]])
    traj.response_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    assert ended_with_eos(traj, 9).tolist() == [True, False, True]


def test_frac_reward_zero_std_is_the_global_batch_fraction_of_groups():
    """``objective/frac_reward_zero_std`` is flat groups over groups of the global batch.

    Under DDP the ranks may hold different numbers of groups: this rank 1 flat group of 1, a
    simulated other rank 0 of 3 (its counts added by ``global_sum``, as the all-reduce does).
    The global fraction is 1/4; the mean of the two ranks' own fractions (what ``sync_dist``
    makes of per-rank fractions) would be 1/2.
    """
    scores = torch.tensor([1.0, 1.0])  # one flat group of k = 2
    other_rank = torch.tensor([0.0, 3.0])  # 0 flat of 3 groups

    def two_ranks(values):
        return values + other_rank

    assert float(zero_std_fraction(scores, 2, two_ranks)) == 0.25
    mixed = torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    one = zero_std_fraction(mixed, 2, lambda values: values)  # one process: its own fraction
    assert one.dtype == torch.float32
    assert float(one) == zero_std_groups(mixed, 2).float().mean().item()  # as before: 2/3


@pytest.mark.parametrize(
    ("group", "option", "bad", "allowed"),
    [
        ("group", "scale_rewards", "prompt", r"one of \('group', 'batch', 'none'\)"),
        (
            "group",
            "scale_rewards",
            "none",
            r"'group' with advantage='rloo' \(the leave-one-out .*\)",
        ),
        ("objective", "ent_coef", -0.1, "a finite number >= 0"),
        ("group", "drop_zero_std_groups", 1, "True or False"),
        ("group", "mask_truncated_completions", "yes", "True or False"),
        ("objective", "aggregation", "dapo", r"one of \('token_mean', 'sequence_mean', .*\)"),
        ("objective", "importance_ratio", "seq", r"one of \('token', 'sequence'\)"),
        ("objective", "cliprange_high", -0.28, "None or a finite number > 0"),
    ],
)
def test_bad_options_name_the_option_and_the_allowed_values(
    tiny_lm_dir, group, option, bad, allowed
):
    with pytest.raises(ValueError, match=rf"^`{group}\.{option}` must be {allowed}, got"):
        rloo(tiny_lm_dir, **{group: {option: bad}})


def test_the_entropy_bonus_is_minus_ent_coef_times_the_token_mean_entropy(tiny_lm_dir):
    seed_everything(0)
    module = rloo(tiny_lm_dir, group={"advantage": "grpo"}, objective={"ent_coef": 0.3})
    disable_dropout(module.policy)
    prompts = [p for p in PROMPTS[:2] for _ in range(K)]
    traj, scores = module.rollout(prompts)
    traj = module.shape(module.score(prompts, traj, scores)[0])
    loss, stats = module.loss(traj)
    with_options(module, objective={"ent_coef": 0.0})
    base, _ = module.loss(traj)
    logits = score_tokens(module.policy, traj, 1.0).logits
    entropy = masked_mean(entropy_from_logits(logits), traj.response_mask)
    torch.testing.assert_close(stats["loss/entropy_bonus"], entropy.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, base - 0.3 * entropy, rtol=1e-6, atol=1e-7)


def test_rows_to_train(tiny_lm_dir):
    module = rloo(tiny_lm_dir, group={"advantage": "grpo"})
    eos = module.tokenizer.eos_token_id
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # group 0 is flat
    ids = torch.full((8, 3), 7)
    ids[1::2, 1] = eos  # the odd responses end with EOS, the even ones were cut
    mask = torch.ones(8, 3)
    mask[1::2, 2] = 0
    traj = SimpleNamespace(scores=scores, response_ids=ids, response_mask=mask, sample_mask=None)
    assert module.rows_to_train(traj) is None  # the default: every response
    with_options(module, group={"drop_zero_std_groups": True})
    assert module.rows_to_train(traj).tolist() == [4, 5, 6, 7]
    with_options(module, group={"mask_truncated_completions": True})
    assert module.rows_to_train(traj).tolist() == [5, 7]
    with_options(module, group={"drop_zero_std_groups": False})
    assert module.rows_to_train(traj).tolist() == [1, 3, 5, 7]


def test_the_filter_and_the_flat_fraction_look_at_the_scored_responses_alone(tiny_lm_dir):
    """A failed reward (``nan``, out of ``sample_mask``) is left out of the test of a flat group,
    as it is of the group's baseline; the update never trains on it, and the trained fraction
    says so (docs/rewards-at-scale.md, docs/metrics.md)."""
    nan = math.nan
    # group 0: scored 1, 1, 1 and one failed (flat); group 1: 0, 1 and two failed (not flat);
    # group 2: one scored only (no baseline: out of sample_mask, not flat)
    scores = torch.tensor([1.0, 1.0, nan, 1.0, 0.0, nan, 1.0, nan, nan, nan, 2.0, nan])
    scored = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert zero_std_groups(scores, 4, scored).tolist() == [True, False, False]
    flat = zero_std_fraction(scores, 4, lambda values: values, scored)
    assert float(flat) == pytest.approx(1 / 3)
    module = rloo(tiny_lm_dir, group={"advantage": "grpo", "drop_zero_std_groups": True})
    traj = SimpleNamespace(
        scores=scores,
        sample_mask=scored,
        response_ids=torch.full((12, 3), 7),
        response_mask=torch.ones(12, 3),
    )
    assert module.rows_to_train(traj).tolist() == [4, 6]


def flat_for_the_food(prompt: str, response: str) -> float:
    """``good_fraction``, except that every response to "the food" scores 0: a flat group."""
    return 0.0 if prompt == "the food" else good_fraction(prompt, response)


def test_the_filter_trains_on_fewer_responses_but_the_kl_callbacks_count_them_all(tiny_lm_dir):
    """The KL is measured, and the callbacks count samples, over every response of the batch;
    only the update leaves the flat groups out (docs/callbacks.md)."""
    seed_everything(0)
    controller = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    callbacks = [KLControllerCallback(controller), KLDriftMonitor(target=0.5, window=2)]
    args = module_args(
        tiny_lm_dir,
        group={"responses_per_prompt": K, "advantage": "grpo", "drop_zero_std_groups": True},
        penalty={"init_coef": 0.5},
    )
    args["reward"] = FunctionReward(flat_for_the_food)
    module = RecordingRLOO(**args)
    fit(module, batches=2, batch_size=5, callbacks=callbacks)  # every prompt once per batch
    assert callbacks[0].n_samples == callbacks[1].n_samples == 2 * 5 * K
    for h in module.history:
        flat = h["objective/frac_reward_zero_std"]
        assert flat >= 0.2  # "the food", at least
        assert h["objective/trained_fraction"] == pytest.approx(1 - flat, abs=1e-7)
    replay = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    replay.update(module.history[0]["objective/kl"], 5 * K)  # all 20 responses, not the kept
    assert module.betas_used[1] == pytest.approx(replay.value, rel=1e-6)


def no_signal(prompt: str, response: str) -> float:
    """Every response scores 1: every group is flat, the filter keeps nothing."""
    return 1.0


@pytest.mark.parametrize(
    ("reward", "kept"),
    [(flat_for_the_food, "some"), (no_signal, "none")],
    ids=["flat-groups", "all-flat"],
)
def test_a_max_steps_run_trains_its_batches_whatever_the_filter_keeps(tiny_lm_dir, reward, kept):
    """A batch takes ``ppo_epochs x num_minibatches`` optimizer steps however many responses
    the filter keeps, so a run bounded by ``max_steps`` trains ``max_steps / steps`` batches.

    5 prompts x K = 20 responses in 20 minibatches: the filter keeps at most 16 (the food's
    group is flat), which ``torch.chunk`` made at most 16 steps (and none when it keeps none),
    so the run trained more batches than ``max_steps`` meant, up to ``max_epochs``.
    """
    from helpers.trainers import fit_on_prompts

    seed_everything(0)
    batches, steps = 3, 5 * K
    args = module_args(
        tiny_lm_dir,
        group={"responses_per_prompt": K, "advantage": "grpo", "drop_zero_std_groups": True},
        optimization={"ppo_epochs": 1, "num_minibatches": steps},
    )
    args["reward"] = FunctionReward(reward)
    module = RecordingRLOO(**args)
    trainer = fit_on_prompts(
        module, PROMPTS, batch_size=5, max_steps=batches * steps, max_epochs=4 * batches
    )
    assert trainer.global_step == batches * steps
    assert len(module.history) == batches
    fractions = [h["objective/trained_fraction"] for h in module.history]
    if kept == "none":
        assert fractions == [0.0] * batches
    else:
        assert all(0 < f < 0.81 for f in fractions)  # the food's group (1/5) is always left out


def test_the_options_that_drop_responses_refuse_two_processes(tiny_lm_dir):
    module = rloo(tiny_lm_dir, group={"drop_zero_std_groups": True})
    module._trainer = SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match="`group.drop_zero_std_groups`=True needs one process"):
        module.on_fit_start()


def test_masking_truncated_responses_without_an_eos_token_is_refused(tiny_lm_dir):
    # Every response counted as truncated: the update trained on none, without a word.
    module = rloo(tiny_lm_dir, group={"mask_truncated_completions": True})
    module._trainer = SimpleNamespace(world_size=1)
    module.tokenizer.eos_token = None
    with pytest.raises(ValueError, match=r"`group.mask_truncated_completions`=True .*no EOS"):
        module.on_fit_start()


def test_the_batch_scale_divides_by_the_standard_deviation_of_all_returns(tiny_lm_dir):
    """One process: ``batch_std_of`` (two passes through the strategy's sum) is ``std()``."""
    module = rloo(tiny_lm_dir, group={"advantage": "grpo", "scale_rewards": "batch"})
    got = batch_std_of(RETURNS.to(torch.float32), module.global_sum)
    torch.testing.assert_close(got, RETURNS.std(), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def other_reference(tmp_path_factory):
    """A reference that differs from the policy, so the KL term is not 0."""
    from helpers.tiny_models import make_tiny_lm

    return str(make_tiny_lm(tmp_path_factory.mktemp("reference"), seed=1))


@pytest.mark.parametrize("cls", ["PPOModule", "RLOOModule"])
def test_every_term_of_the_loss_goes_through_the_aggregation(tiny_lm_dir, other_reference, cls):
    """Loss weights ``mask / sum(mask)`` make every aggregated term a token mean again, so the
    loss and each statistic equal the default's (policy, value, entropy and KL terms alike);
    and weights that double one response change every term."""
    from rlkl_lightning import PPOModule

    seed_everything(0)
    extra = {"group": {"responses_per_prompt": K}} if cls == "RLOOModule" else {}
    module_cls = RLOOModule if cls == "RLOOModule" else PPOModule
    args = module_args(
        tiny_lm_dir,
        reference=other_reference,
        penalty={"init_coef": 0.5, "placement": "loss"},
        objective={"ent_coef": 0.1},
        **extra,
    )
    module = module_cls(**args)
    disable_dropout(module.policy)
    prompts = [p for p in PROMPTS[:2] for _ in range(K)]
    traj, scores = module.rollout(prompts)
    traj = module.shape(module.score(prompts, traj, scores)[0])
    traj = traj._replace(logprobs=traj.logprobs + 0.1)  # ratios and KL weights other than 1
    mask = traj.response_mask
    loss, stats = module.loss(traj)
    same, same_stats = module.loss(traj._replace(loss_weights=mask / mask.sum()))
    torch.testing.assert_close(same, loss, rtol=1e-6, atol=1e-7)
    for key, value in stats.items():
        torch.testing.assert_close(same_stats[key], value, rtol=1e-6, atol=1e-7)
    heavier = mask / mask.sum()
    heavier[0] *= 2
    _, other = module.loss(traj._replace(loss_weights=heavier))
    for key in [k for k in stats if k.startswith("loss/")]:
        assert not torch.allclose(other[key], stats[key]), key
