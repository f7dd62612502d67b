"""Mixed precision and gradient checkpointing on the CPU.

Log-softmax, KL, advantages and losses are float32 whatever the model dtype. On one batch
(18 responses of 12 tokens, tiny GPT-2 policy and a different reference) the bf16 numbers
were measured against float32 at: per-sequence KL k1 5e-3 nats, k2/k3 9e-4, exact 2e-4; loss
8e-4 relative (bf16-true; bf16-mixed is closer). The tolerances below are about 3x those.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from helpers.trainers import fit_on_prompts
from lightning.pytorch import seed_everything
from lightning.pytorch.plugins import MixedPrecision

from rlkl_lightning import PPOModule
from rlkl_lightning.models.loading import enable_gradient_checkpointing, load_causal_lm
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is", "the food", "it was really", "a story", "not a"]
LORA = {"r": 4, "target_modules": ["c_attn"], "fan_in_fan_out": True}
KL_TOLERANCE = {"kl_k1": 0.015, "kl_k2": 3e-3, "kl_k3": 3e-3, "kl_exact": 1e-3}  # nats/seq
FLOAT32_FIELDS = ("logprobs", "ref_logprobs", "kl", "scores", "values", "advantages", "returns")


def good_fraction(prompt: str, response: str) -> float:
    words = response.split()
    return sum(w == "good" for w in words) / max(len(words), 1)


def module(policy, peft=None, gradient_checkpointing=False, **overrides) -> PPOModule:
    args = dict(
        policy=str(policy),
        reward=FunctionReward(good_fraction),
        sampling={"max_prompt_tokens": 8, "max_new_tokens": 12},
        optimization={"ppo_epochs": 1, "num_minibatches": 2, "lr": 3e-3},
        logging={"log_samples_every": 0},
        models={"peft": peft, "gradient_checkpointing": gradient_checkpointing},
    )
    args.update(overrides)
    return PPOModule(**args)


def score_shape_loss(mod: PPOModule, traj, prompts, context):
    """Phases 2-4 (one loss) on fixed sampled tokens, in ``mod``'s dtype, under ``context``."""
    with context:
        scores = score_tokens(mod.policy, traj, 1.0)
        traj, _, diagnostics = mod.score(prompts, traj._replace(logprobs=scores.logprobs), scores)
        traj = mod.shape(traj)
        # Old log-probs a little off, so that the ratio and its clip take part.
        old = traj.logprobs + 0.05 * torch.randn(traj.logprobs.shape, generator=GEN.manual_seed(3))
        loss, stats = mod.loss(traj._replace(logprobs=old))
    return traj, diagnostics, loss, stats


GEN = torch.Generator()


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_kl_and_losses_stay_within_tolerance_of_float32(tiny_lm_dir, tmp_path, precision):
    from helpers.tiny_models import make_tiny_lm

    reference = make_tiny_lm(tmp_path / "reference", seed=1)
    fp32 = module(tiny_lm_dir, reference=str(reference), penalty={"estimator": "k3"})
    prompts = PROMPTS * 3
    seed_everything(1)
    traj, _ = fp32.rollout(prompts)
    want = score_shape_loss(fp32, traj, prompts, contextlib.nullcontext())
    if precision == "bf16-true":
        low, context = copy.deepcopy(fp32).to(torch.bfloat16), contextlib.nullcontext()
        assert next(low.policy.parameters()).dtype == torch.bfloat16
    else:
        low, context = fp32, torch.autocast("cpu", dtype=torch.bfloat16)
    got = score_shape_loss(low, traj, prompts, context)

    for field in FLOAT32_FIELDS:
        assert getattr(got[0], field).dtype == torch.float32, field
    assert got[2].dtype == torch.float32
    for key, tolerance in KL_TOLERANCE.items():
        error = float((got[1][key] - want[1][key]).abs().max())
        assert error < tolerance, (key, error)
    assert float((got[1]["kl_k1"] - want[1]["kl_k1"]).abs().max()) > 0  # bf16 did run
    assert float(got[2]) == pytest.approx(float(want[2]), rel=3e-3)
    for key in ("loss/policy", "loss/value"):
        assert float(got[3][key]) == pytest.approx(float(want[3][key]), rel=2e-3, abs=3e-5), key


def fit(mod, **settings):
    """Two batches of 4 prompts, of 2 optimizer steps each."""
    return fit_on_prompts(mod, PROMPTS * 2, 4, max_steps=4, **settings)


def cpu_fp16_scaler(init_scale: float) -> MixedPrecision:
    """16-mixed on the CPU: Lightning only offers bf16 there, so the plugin is built by hand."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale))


@pytest.mark.parametrize(
    "precision, peft",
    [("bf16-mixed", None), ("bf16-true", None), ("bf16-true", LORA), ("16-mixed", LORA)],
)
def test_a_short_run_trains(tiny_lm_dir, precision, peft):
    seed_everything(0)
    mod = module(tiny_lm_dir, peft=peft)
    before = {n: p.detach().float().clone() for n, p in mod.named_parameters() if p.requires_grad}
    if precision == "16-mixed":
        trainer = fit(mod, plugins=[cpu_fp16_scaler(2.0**4)])
    else:
        trainer = fit(mod, precision=precision)
    metrics = trainer.callback_metrics
    assert mod.batches_seen == 2 and mod.skipped_batches == 0
    for key in ("objective/kl", "objective/score", "loss/policy", "loss/value", "policy/grad_norm"):
        assert torch.isfinite(metrics[key]), key
    moved = [n for n, p in mod.named_parameters() if p.requires_grad]
    assert all(not torch.equal(before[n], dict(mod.named_parameters())[n].float()) for n in moved)
    want = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert {p.dtype for p in mod.parameters()} == {want}


def test_16_mixed_overflow_is_left_to_the_grad_scaler(tiny_lm_dir):
    """Scaled gradients that overflow skip that optimizer step and lower the scale; the batch
    is not skipped (else the scale, and so every batch, would stay overflowing)."""
    seed_everything(0)
    mod = module(tiny_lm_dir)
    plugin = cpu_fp16_scaler(2.0**60)
    fit(mod, plugins=[plugin])
    assert mod.batches_seen == 2 and mod.skipped_batches == 0
    assert plugin.scaler.get_scale() < 2.0**60


def test_gradient_checkpointing_uses_transformers_current_api(tiny_lm_dir):
    """No deprecated call: ``gradient_checkpointing_enable`` goes away in transformers v6."""
    model = load_causal_lm(str(tiny_lm_dir))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gradient_checkpointing_enable.*deprecated")
        enable_gradient_checkpointing(model)
    assert model.training  # the recomputation itself: the test below


@pytest.mark.parametrize("peft", [None, LORA], ids=["full", "lora"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_lm_dir, peft):
    mods = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same value head
        mods.append(module(tiny_lm_dir, peft=peft, gradient_checkpointing=checkpointing))
        mods[-1].policy.train()  # as in training; checkpointing acts only in training mode
    plain, checkpointed = mods
    prompts = PROMPTS * 2
    seed_everything(1)
    traj, scores = plain.rollout(prompts)
    traj, _, _ = plain.score(prompts, traj, scores)
    traj = plain.shape(traj)

    calls = []
    # transformers checkpoints a layer's `forward`, so watch a module inside the layer.
    inner = checkpointed.policy.transformer.h[0].attn
    inner.register_forward_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    results = []
    for mod in (plain, checkpointed):
        loss, _ = mod.loss(traj)
        loss.backward()
        grads = {n: p.grad for n, p in mod.named_parameters() if p.requires_grad}
        results.append((loss, grads))
    # Once in the forward, once more in the backward pass: the layer was recomputed (the
    # calls without gradients are the one-off check of the LM head, logprobs.py).
    assert [c for c in calls if c] == [True, True]
    (loss, grads), (loss_gc, grads_gc) = results
    assert torch.equal(loss, loss_gc)
    assert grads.keys() == grads_gc.keys()
    assert all(torch.equal(grads[n], grads_gc[n]) for n in grads)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_the_per_token_kl_diagnostics_run_under_every_true_precision(tiny_lm_dir, precision):
    """``logging.kl_token_threshold`` under a ``*-true`` precision, whose default dtype is the
    run's: the quantile levels used to be built in it and ``torch.quantile`` refused them."""
    seed_everything(0)
    mod = module(tiny_lm_dir, logging={"log_samples_every": 0, "kl_token_threshold": 0.5})
    trainer = fit(mod, precision=precision)
    assert mod.batches_seen == 2 and mod.skipped_batches == 0
    metrics = trainer.callback_metrics
    tokens = {k: float(v) for k, v in metrics.items() if k.startswith("kl_tokens/")}
    assert len(tokens) == 6 and all(torch.isfinite(torch.tensor(v)) for v in tokens.values())
    assert tokens["kl_tokens/kl_q99"] <= tokens["kl_tokens/max_kl"]
