"""RLOOModule and the KL placements on tiny local models: groups, counting, shaping, losses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.recorders import K, RecordingPPO, RecordingRLOO
from helpers.tiny_ppo import PROMPTS, fit, module_args, text_loader, with_options
from lightning.pytorch import seed_everything

from rlkl_lightning import (
    AdaptiveKLController,
    KLControllerCallback,
    KLDriftMonitor,
    PPOModule,
    RLOOModule,
)
from rlkl_lightning.algorithms.advantages import group_advantages
from rlkl_lightning.algorithms.rloo import repeat_each
from rlkl_lightning.kl.estimators import sequence_kl
from rlkl_lightning.kl.loss import kl_loss
from rlkl_lightning.models.loading import disable_dropout
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.rewards import FunctionReward


def rloo(path, **overrides) -> RLOOModule:
    group = {"responses_per_prompt": K, **overrides.pop("group", {})}
    return RLOOModule(**module_args(path, group=group, **overrides))


# ---------------------------------------------------------------- groups and counting
def test_repeat_each_repeats_every_field_in_place():
    batch = {"prompt": ["a", "b"], "id": torch.tensor([[1, 2], [3, 4]]), "tag": ("x", "y")}
    out = repeat_each(batch, 3)
    assert out["prompt"] == ["a"] * 3 + ["b"] * 3
    assert out["tag"] == ["x"] * 3 + ["y"] * 3
    assert torch.equal(out["id"], torch.tensor([[1, 2]] * 3 + [[3, 4]] * 3))
    with pytest.raises(TypeError, match="cannot repeat a batch field of type int"):
        repeat_each({"prompt": 3}, 2)


def test_the_callbacks_count_responses_with_no_batch_size_fn(tiny_lm_dir):
    """A plain Trainer: 2 batches of 3 prompts are 2 x 12 responses for both callbacks."""
    seed_everything(0)
    controller = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    callbacks = [KLControllerCallback(controller), KLDriftMonitor(target=0.5, window=2)]
    module = RecordingRLOO(
        **module_args(tiny_lm_dir, group={"responses_per_prompt": K}, penalty={"init_coef": 0.5})
    )
    val = text_loader(["the film was very good", "bad food"], 2)
    trainer = fit(module, batches=3, batch_size=3, callbacks=callbacks, val=val)
    for prompts in module.prompts_seen:  # each prompt K times in a row
        assert len(prompts) == 3 * K
        assert all(prompts[i] == prompts[i - i % K] for i in range(len(prompts)))
    assert callbacks[0].n_samples == callbacks[1].n_samples == 3 * 3 * K
    assert module.samples_seen == 3 * 3 * K
    assert trainer.callback_metrics["progress/samples"] == 3 * 3 * K
    # The controller moved beta by the responses of each batch (Ziegler et al.'s n_steps).
    replay = AdaptiveKLController(init_kl_coef=0.5, target=0.5, horizon=64)
    expected = [replay.value]
    for h in module.history[:-1]:
        expected.append(replay.update(h["objective/kl"], 3 * K))
    assert module.betas_used == pytest.approx(expected, rel=1e-6)
    assert "val/perplexity" in trainer.callback_metrics


def test_validation_batches_are_not_repeated(tiny_lm_dir):
    module = rloo(tiny_lm_dir)
    batch = {"text": ["a", "b"]}
    module._trainer = SimpleNamespace(training=False)
    assert module.on_before_batch_transfer(batch, 0) is batch
    module._trainer = SimpleNamespace(training=True)
    assert module.on_before_batch_transfer(batch, 0) == {"text": ["a"] * K + ["b"] * K}


def test_a_batch_that_is_not_in_groups_stops_with_a_clear_error(tiny_lm_dir):
    module = rloo(tiny_lm_dir)
    with pytest.raises(
        ValueError, match="must hold each prompt `group.responses_per_prompt`=4 times"
    ):
        module.training_step({"prompt": ["a", "a", "b", "b"]}, 0)


@pytest.mark.parametrize(
    ("group", "option", "bad", "allowed"),
    [
        ("group", "responses_per_prompt", 1, "an integer >= 2"),
        (
            "group",
            "advantage",
            "ppo",
            r"one of \('rloo', 'grpo'\) or the dotted path of a group-level advantage .*",
        ),
        ("penalty", "placement", "advantage", r"one of \('reward', 'loss'\)"),
    ],
)
def test_bad_options_name_the_option_and_the_allowed_values(
    tiny_lm_dir, group, option, bad, allowed
):
    with pytest.raises(ValueError, match=rf"^`{group}\.{option}` must be {allowed}, got"):
        rloo(tiny_lm_dir, **{group: {option: bad}})


# ---------------------------------------------------------------- shaping and losses
@pytest.fixture(scope="module")
def other_reference(tmp_path_factory):
    """A reference that differs from the policy, so the KL is far from 0."""
    from helpers.tiny_models import make_tiny_lm

    return str(make_tiny_lm(tmp_path_factory.mktemp("reference"), seed=1))


def scored(module, prompts):
    """A rollout of ``prompts`` through phases 1-2 (no trainer), dropout off."""
    disable_dropout(module.policy)
    traj, policy_scores = module.rollout(prompts)
    traj, _, _ = module.score(prompts, traj, policy_scores)
    assert float(sequence_kl(traj.kl, traj.response_mask).abs().max()) > 0.1
    return traj


@pytest.mark.parametrize("method", ["rloo", "grpo"])
def test_rloo_shaping_is_the_group_advantage_of_the_sequence_return(
    tiny_lm_dir, other_reference, method
):
    seed_everything(0)
    reward = FunctionReward(lambda p, r: float(len(r.split())) / 8)
    module = rloo(
        tiny_lm_dir,
        reference=other_reference,
        reward=reward,
        group={"advantage": method},
        penalty={"init_coef": 0.3},
    )
    traj = scored(module, [p for p in PROMPTS[:3] for _ in range(K)])
    mask = traj.response_mask
    returns = traj.scores - 0.3 * sequence_kl(traj.kl, mask)
    want = group_advantages(returns, K, method)[:, None] * mask
    torch.testing.assert_close(module.shape(traj).advantages, want, rtol=0, atol=0)
    # With the KL in the loss the return is the score alone, whatever beta.
    module.kl_coef = 5.0
    with_options(module, penalty={"placement": "loss"})
    want = group_advantages(traj.scores, K, method)[:, None] * mask
    torch.testing.assert_close(module.shape(traj).advantages, want, rtol=0, atol=0)


def test_ppo_rewards_hold_no_kl_when_the_kl_is_in_the_loss(tiny_lm_dir, other_reference):
    seed_everything(0)
    module = PPOModule(
        **module_args(tiny_lm_dir, reference=other_reference, penalty={"init_coef": 0.7})
    )
    traj = scored(module, PROMPTS[:4])
    in_reward = module.shape(traj)
    with_options(module, penalty={"placement": "loss"})
    in_loss = module.shape(traj)
    with_options(module, penalty={"placement": "reward"})
    module.kl_coef = 0.0
    torch.testing.assert_close(in_loss, module.shape(traj), rtol=0, atol=0)  # = beta 0
    assert not torch.allclose(in_loss.advantages, in_reward.advantages)


@pytest.mark.parametrize("cls", [PPOModule, RLOOModule])
def test_kl_in_the_loss_adds_beta_times_kl_loss(tiny_lm_dir, other_reference, cls):
    """The loss with the KL in the loss = the loss without it + beta x kl_loss / s, recomputed.

    ``s``: PPO's whitening scale (``traj.kl_scale``, one per batch); RLOO divides nothing.
    """
    seed_everything(0)
    extra = {"group": {"responses_per_prompt": K}} if cls is RLOOModule else {}
    kl = {"init_coef": 0.7, "placement": "loss", "loss_estimator": "k3", "loss_weight_clip": 1.5}
    module = cls(**module_args(tiny_lm_dir, reference=other_reference, penalty=kl, **extra))
    traj = module.shape(scored(module, [p for p in PROMPTS[:2] for _ in range(K)]))
    # Log-probs "at rollout time" that differ from now: weights other than 1, some capped.
    old = traj.logprobs + 0.5 * torch.randn_like(traj.logprobs)
    traj = traj._replace(logprobs=old)
    loss, stats = module.loss(traj)
    with_options(module, penalty={"placement": "reward"})
    base, base_stats = module.loss(traj)
    assert "loss/kl" not in base_stats
    new = score_tokens(module.policy, traj, 1.0, logits=False).logprobs
    weights = (new - old).exp()[traj.response_mask.bool()]
    assert bool((weights > 1.5).any()) and bool((weights < 1.5).any())
    term = kl_loss(new, old, traj.ref_logprobs, traj.response_mask, "k3", 1.5)
    torch.testing.assert_close(stats["loss/kl"], term.detach(), rtol=1e-6, atol=1e-7)
    if cls is RLOOModule:
        assert traj.kl_scale is None
        scale = 1.0
    else:
        scale = traj.kl_scale[0]
        assert bool((traj.kl_scale == scale).all()) and float(scale) != pytest.approx(1.0)
    torch.testing.assert_close(loss, base + 0.7 * term / scale, rtol=1e-6, atol=1e-7)
    assert stats["loss/total"] == loss.detach()


# ---------------------------------------------------------------- training
@pytest.mark.slow  # training runs of 25-30 batches: make test-slow
def test_rloo_learns_a_trivial_reward(tiny_lm_dir):
    seed_everything(0)
    module = RecordingRLOO(**module_args(tiny_lm_dir, group={"responses_per_prompt": K}))
    fit(module, batches=30, batch_size=4)
    scores = [h["objective/score"] for h in module.history]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert first < 0.15
    assert last > first + 0.3, (first, last)


@pytest.mark.slow  # training runs of 25-30 batches: make test-slow
@pytest.mark.parametrize("cls", [PPOModule, RLOOModule])
def test_a_large_beta_in_the_loss_keeps_the_kl_near_zero(tiny_lm_dir, cls):
    """k2 in the loss regularises: beta 20 holds the KL that beta 0 lets run away."""
    recorder = RecordingRLOO if cls is RLOOModule else RecordingPPO
    extra = {"group": {"responses_per_prompt": K}} if cls is RLOOModule else {}
    batch_size = 4 if cls is RLOOModule else 16
    results = {}
    for beta in (0.0, 20.0):
        seed_everything(1)
        kl = {"init_coef": beta, "placement": "loss", "loss_estimator": "k2"}
        module = recorder(**module_args(tiny_lm_dir, penalty=kl, **extra))
        fit(module, batches=25, batch_size=batch_size)
        results[beta] = sum(h["objective/kl_k3"] for h in module.history[-5:]) / 5
        assert "loss/kl" in module.history[-1]
    assert results[0.0] > 1.0, results  # without a penalty the policy runs away
    assert results[20.0] < 0.1 * results[0.0], results
