"""kl_loss: values, per-token gradients and importance weights against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from rlkl_lightning.kl.loss import KL_LOSS_ESTIMATORS, kl_loss, kl_loss_weights

NAN = float("nan")

# k(x) and dk/dx of each estimator at the log-ratio x.
DERIVATIVE = {
    "k1": lambda x: torch.ones_like(x),
    "k2": lambda x: x,
    "k3": lambda x: 1 - torch.exp(-x),
}
VALUE = {
    "k1": lambda x: x,
    "k2": lambda x: x**2 / 2,
    "k3": lambda x: torch.exp(-x) - 1 + x,
}


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2
    new = ref + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    old = new + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    return new, old, ref, mask


@pytest.mark.parametrize("estimator", KL_LOSS_ESTIMATORS)
@pytest.mark.parametrize("clip", [None, 1.2])
def test_value_and_gradient_are_the_weighted_token_mean(estimator, clip):
    new, old, ref, mask = _batch()
    valid = mask.bool()
    logprobs = new.clone().requires_grad_(True)
    loss = kl_loss(logprobs, old, ref, mask, estimator, clip)
    w = (new - old).exp()
    if clip is not None:
        w = w.clamp(max=clip)
        assert bool((w[valid] == clip).any()) and bool((w[valid] < clip).any())  # both cases
    log_ratio = new - ref
    n = int(valid.sum())
    torch.testing.assert_close(
        loss, (w * VALUE[estimator](log_ratio))[valid].mean(), rtol=0, atol=1e-12
    )
    loss.backward()
    # The weights are constants: d loss / d logprob_t = w_t k'(l_t) / n on valid tokens.
    want = torch.where(valid, w * DERIVATIVE[estimator](log_ratio) / n, 0.0)
    torch.testing.assert_close(logprobs.grad, want, rtol=0, atol=1e-12)


def test_on_policy_weights_are_exactly_one():
    new, _, _, _ = _batch()
    assert bool((kl_loss_weights(new, new.clone(), 2.0) == 1).all())
    assert not kl_loss_weights(new.requires_grad_(True), new.detach(), None).requires_grad


def test_padding_never_reaches_the_value_or_the_gradient():
    new, old, ref, mask = _batch()
    pad = ~mask.bool()
    logprobs = new.clone().requires_grad_(True)
    clean = kl_loss(logprobs, old, ref, mask, "k3", 2.0)
    (clean_grad,) = torch.autograd.grad(clean, logprobs)
    garbage = torch.where(pad, torch.full_like(new, NAN), new).requires_grad_(True)
    dirty = kl_loss(
        garbage,
        torch.where(pad, math.inf, old),
        torch.where(pad, -math.inf, ref),
        mask,
        "k3",
        2.0,
    )
    (dirty_grad,) = torch.autograd.grad(dirty, garbage)
    assert float(dirty.detach()) == float(clean.detach())
    assert torch.equal(dirty_grad, clean_grad)


def test_bad_arguments_name_the_option_and_the_allowed_values():
    new, old, ref, mask = _batch()
    with pytest.raises(ValueError, match=r"`estimator` must be one of \('k1', 'k2', 'k3'\)"):
        kl_loss(new, old, ref, mask, "exact", None)
    with pytest.raises(ValueError, match="`weight_clip` must be None or a number >= 1"):
        kl_loss(new, old, ref, mask, "k2", 0.5)
    with pytest.raises(ValueError, match="`ref_logprobs` must have the shape"):
        kl_loss(new, old, ref[:, :2], mask, "k2", None)
