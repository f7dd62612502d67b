import math

import pytest
import torch

from rlkl_lightning.algorithms.losses import (
    PolicyStats,
    entropy_from_logits,
    policy_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def _row(*xs: float) -> torch.Tensor:
    return torch.tensor([list(xs)], dtype=torch.float64)


def test_ratio_one_gives_minus_mean_advantage_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    logprobs = old.clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, adv, mask, cliprange=0.2)
    valid = mask.bool()
    n = int(valid.sum())
    torch.testing.assert_close(loss, -adv[valid].mean(), rtol=0, atol=1e-12)
    assert isinstance(stats, PolicyStats)
    assert stats.clipfrac == 0 and stats.approx_kl == 0
    loss.backward()
    # d loss / d logprob_t = -A_t * ratio_t / n, with ratio = 1.
    torch.testing.assert_close(logprobs.grad, -adv * valid / n, rtol=0, atol=1e-12)


def test_policy_loss_at_and_beyond_the_clip_edges():
    eps = 0.2
    # (advantage, ratio, expected per-token loss, expected d(term)/d(logprob), clipped?)
    cases = [
        (1.0, 1.5, -1.2, 0.0, True),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (1.0, 0.5, -0.5, -0.5, False),  # A > 0, ratio below 1 - eps: unclipped term is min
        (-1.0, 0.5, 0.8, 0.0, True),  # A < 0, ratio below 1 - eps: clipped, no gradient
        (-1.0, 1.5, 1.5, 1.5, False),  # A < 0, ratio above 1 + eps: unclipped term is max
        (2.0, 1.1, -2.2, -2.2, False),  # inside the trust region
        (-2.0, 0.9, 1.8, 1.8, False),  # inside the trust region
    ]
    adv = _row(*(c[0] for c in cases))
    ratio = _row(*(c[1] for c in cases))
    old = _row(-1.0, -2.0, -3.0, -0.5, -4.0, -1.5)
    logprobs = (old + ratio.log()).requires_grad_(True)
    mask = torch.ones_like(adv)
    loss, stats = policy_loss(logprobs, old, adv, mask, cliprange=eps)
    n = len(cases)
    torch.testing.assert_close(loss, torch.tensor(sum(c[2] for c in cases) / n).double())
    loss.backward()
    # The gradient of A * ratio w.r.t. logprob is A * ratio; zero wherever clipping is active.
    torch.testing.assert_close(logprobs.grad, _row(*(c[3] for c in cases)) / n, rtol=0, atol=1e-12)
    torch.testing.assert_close(stats.clipfrac, torch.tensor(2 / n).double())
    r = ratio[0]
    torch.testing.assert_close(stats.approx_kl, (r - 1 - r.log()).mean(), rtol=0, atol=1e-12)
    assert not stats.clipfrac.requires_grad and not stats.approx_kl.requires_grad


@pytest.mark.parametrize("adv", [1.5, -1.5])
def test_policy_loss_exactly_at_the_edges(adv):
    eps = 0.1
    ratio = _row(1 - eps, 1 + eps)
    old = torch.zeros_like(ratio)
    loss, _ = policy_loss(ratio.log(), old, torch.full_like(ratio, adv), torch.ones(1, 2), eps)
    # At both edges clipped and unclipped terms agree: the loss is -A * ratio there.
    torch.testing.assert_close(loss, torch.tensor(-adv).double(), rtol=0, atol=1e-12)


def test_value_loss_clip_edges_and_gradients():
    c = 0.2
    # (value, old value, return, expected max squared error, d(term)/d(value), clipped?)
    cases = [
        (0.5, 0.0, 1.0, 0.64, 0.0, True),  # moved toward R past the clip: clipped error larger
        (1.5, 1.0, 0.0, 2.25, 1.5, False),  # moved away from R: unclipped error larger
        (1.5, 0.0, 1.0, 0.64, 0.0, True),  # overshoot past R and the clip
        (-0.5, 0.0, -2.0, 3.24, 0.0, True),  # negative direction
        (0.1, 0.0, 1.0, 0.81, -0.9, False),  # inside the clip range
    ]
    values = _row(*(x[0] for x in cases)).requires_grad_(True)
    old = _row(*(x[1] for x in cases))
    returns = _row(*(x[2] for x in cases))
    loss, clipfrac = value_loss(values, old, returns, torch.ones_like(old), c)
    n = len(cases)
    torch.testing.assert_close(loss, torch.tensor(0.5 * sum(x[3] for x in cases) / n).double())
    torch.testing.assert_close(clipfrac, torch.tensor(3 / n).double())
    loss.backward()
    # 0.5 * d/dv (v - R)^2 = v - R on unclipped tokens, 0 where the clipped error is active.
    torch.testing.assert_close(values.grad, _row(*(x[4] for x in cases)) / n, rtol=0, atol=1e-12)


def test_value_loss_without_clipping_is_half_mse():
    g = torch.Generator().manual_seed(1)
    v, old, ret = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    mask = torch.ones_like(v)
    loss, clipfrac = value_loss(v, old, ret, mask, INF)
    torch.testing.assert_close(loss, 0.5 * ((v - ret) ** 2).mean(), rtol=0, atol=1e-12)
    assert clipfrac == 0


@pytest.mark.parametrize("garbage", [1e6, NAN, INF, -INF])
def test_padding_never_affects_losses_nor_gradients(garbage):
    g = torch.Generator().manual_seed(2)
    lp, old_lp, adv, v, old_v, ret = (
        torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(6)
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])

    def run(fill):
        def f(x):
            return x.masked_fill(~mask.bool(), fill)

        lp_leaf = f(lp).requires_grad_(True)
        v_leaf = f(v).requires_grad_(True)
        p_loss, stats = policy_loss(lp_leaf, f(old_lp), f(adv), mask, 0.2)
        v_loss, v_clip = value_loss(v_leaf, f(old_v), f(ret), mask, 0.2)
        (p_loss + v_loss).backward()
        return p_loss, stats, v_loss, v_clip, lp_leaf.grad, v_leaf.grad

    clean = run(0.0)
    dirty = run(garbage)
    for a, b in zip(clean, dirty, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The padding gradients are exactly zero, and the valid-token gradients are not all zero.
    valid = mask.bool()
    assert torch.all(dirty[4][~valid] == 0) and torch.all(dirty[5][~valid] == 0)
    assert dirty[4][valid].abs().sum() > 0 and dirty[5][valid].abs().sum() > 0
    # The loss is the mean over valid tokens, not a per-sequence mean.
    flat = [x[valid] for x in (lp, old_lp, adv)]
    unpadded, _ = policy_loss(*flat, torch.ones_like(flat[0]), 0.2)
    torch.testing.assert_close(clean[0], unpadded, rtol=0, atol=1e-12)


def test_entropy_equals_categorical_entropy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    got = entropy_from_logits(logits)
    assert got.shape == (2, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # Uniform logits: log V.
    torch.testing.assert_close(
        entropy_from_logits(torch.zeros(1, 1, 11)), torch.tensor([[math.log(11)]])
    )


def test_entropy_is_stable_for_extreme_and_masked_logits():
    # Very peaked distribution: finite, near zero, and equal to the direct formula.
    logits = torch.tensor([[[1000.0, 0.0, -1000.0]]], dtype=torch.float64)
    assert entropy_from_logits(logits).item() == pytest.approx(0.0, abs=1e-12)
    logits = torch.tensor([[[30.0, 0.0, 1.0]]], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    # -inf logits (masked actions) count as absent, and gradients stay finite.
    g = torch.Generator().manual_seed(4)
    full = torch.randn(4, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    banned = torch.zeros(4, 6, dtype=torch.bool)
    banned[:, [1, 4]] = True
    masked = full.masked_fill(banned, -INF)
    got = entropy_from_logits(masked)
    expected = torch.distributions.Categorical(logits=full[:, [0, 2, 3, 5]]).entropy()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    got.sum().backward()
    assert torch.isfinite(full.grad).all() and torch.all(full.grad[banned] == 0)


def test_entropy_of_half_precision_logits_is_float32():
    logits = torch.randn(2, 3, 7)
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.float32
    ref = entropy_from_logits(logits.to(torch.bfloat16).float())
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    for bad in (0.0, -0.1, NAN):
        with pytest.raises(ValueError, match="cliprange must be > 0"):
            policy_loss(x, x, x, mask, bad)
        with pytest.raises(ValueError, match="cliprange_value must be > 0"):
            value_loss(x, x, x, mask, bad)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2, 4), mask, 0.2)
    with pytest.raises(ValueError, match="returns"):
        value_loss(x, x, torch.zeros(3), mask, 0.2)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, x, torch.ones(2, 2), 0.2)
    with pytest.raises(ValueError, match="no valid entries"):
        policy_loss(x, x, x, torch.zeros(2, 3), 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_policy_loss_gradient_is_zero_where_clipping_is_active_even_if_the_ratio_overflows(dtype):
    """A log-ratio of 100 or 1000 overflows exp(); where A > 0 the clipped term is active.

    The per-token loss there is -A * (1 + eps) whatever the ratio, so its gradient is exactly
    0; the other tokens keep theirs (-A * ratio / n, as in the plain case).
    """
    eps = 0.2
    adv = torch.tensor([[1.0, 2.0, -1.0, 0.5]], dtype=dtype)
    log_ratio = torch.tensor([[100.0, 1000.0, 0.1, 0.05]], dtype=dtype)
    old = torch.full_like(adv, -3.0)
    logprobs = (old + log_ratio).requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, adv, torch.ones_like(adv), eps)
    n = 4
    r2, r3 = math.exp(0.1), math.exp(0.05)
    expected = (-1.0 * 1.2 - 2.0 * 1.2 + 1.0 * r2 - 0.5 * r3) / n
    torch.testing.assert_close(loss.item(), expected, rtol=1e-6, atol=0)
    loss.backward()
    grad = logprobs.grad[0].tolist()
    assert grad[:2] == [0.0, 0.0]  # not nan
    assert grad[2:] == pytest.approx([1.0 * r2 / n, -0.5 * r3 / n], rel=1e-6)
    assert stats.clipfrac.item() == 0.5


def test_policy_loss_gradient_unchanged_by_the_overflow_guard_on_finite_ratios():
    """Against the plain formula (no guard) on random finite ratios: the same loss and grad."""
    g = torch.Generator().manual_seed(1)
    old = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    logprobs = (old + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.ones(4, 6)
    loss, _ = policy_loss(logprobs, old, adv, mask, 0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    plain = logprobs.detach().clone().requires_grad_()
    ratio = torch.exp(plain - old)
    want = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    (want_grad,) = torch.autograd.grad(want, plain)
    assert loss.item() == want.item()
    assert torch.equal(grad, want_grad)
    assert (grad == 0).any() and (grad != 0).any()  # both kinds of token are present


def test_clip_higher_clips_above_at_its_own_range():
    """``cliprange_high``: a ratio of 1.25 with A > 0 is clipped at 1.2 but not at 1.28; below
    1 the clip stays at ``1 - cliprange``. Per-token values and gradients written out."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[1.25, 1.25, 0.7, 0.7]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1]])
    for high, clipped_first in ((None, True), (0.28, False)):
        logprobs = ratios.log().requires_grad_(True)
        loss, stats = policy_loss(logprobs, old, adv, mask, 0.2, cliprange_high=high)
        first = -1.2 if clipped_first else -1.25
        # token 3: A < 0, ratio 0.7 < 0.8: clipped (-A * 0.8 = 0.8 > 0.7); token 4: A > 0, kept.
        want = (2 * first + 0.8 - 0.7) / 4
        torch.testing.assert_close(
            loss, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12
        )
        loss.backward()
        g_first = 0.0 if clipped_first else -1.25 / 4
        want_grad = torch.tensor([[g_first, g_first, 0.0, -0.7 / 4]], dtype=torch.float64)
        torch.testing.assert_close(logprobs.grad, want_grad, rtol=0, atol=1e-12)
        assert float(stats.clipfrac) == (0.75 if clipped_first else 0.25)


def test_sequence_ratio_is_the_geometric_mean_of_the_token_ratios():
    """GSPO: every token of a response gets exp(mean_t log ratio); the gradient of each token's
    log-prob is ``-A_b s_b / N`` (token mean over N tokens, each of the |y_b| terms of response
    b carrying s_b / |y_b|); a second way: the same loss from per-response values."""
    g = torch.Generator().manual_seed(3)
    old = torch.randn(3, 4, generator=g, dtype=torch.float64) - 2
    # Sequence log-ratios +0.05, +0.05, -0.03: the first (A > 0) is clipped at eps 0.01 below.
    delta = torch.tensor([[0.1, 0.0, 0.02, 0.08], [0.07, 0.03, 9.0, 9.0], [-0.03, 9.0, 9.0, 9.0]])
    logprobs = (old + delta.to(torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv_seq = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    adv = adv_seq[:, None] * mask
    loss, _ = policy_loss(logprobs, old, adv, mask, 10.0, importance_ratio="sequence")
    lengths = mask.sum(1).to(torch.float64)
    s = torch.exp(((logprobs - old) * mask).sum(1) / lengths).detach()
    n = float(mask.sum())
    want = (lengths * -adv_seq * s).sum() / n
    torch.testing.assert_close(loss.detach(), want, rtol=0, atol=1e-12)
    loss.backward()
    want_grad = (-adv_seq * s / n)[:, None] * mask
    torch.testing.assert_close(logprobs.grad, want_grad, rtol=0, atol=1e-12)
    # With the sequence ratio clipped at eps 0.01 only the unclipped responses move.
    logprobs.grad = None
    clipped, _ = policy_loss(logprobs, old, adv, mask, 0.01, importance_ratio="sequence")
    clipped.backward()
    lo, hi = 0.99, 1.01
    active = ~(((s > hi) & (adv_seq > 0)) | ((s < lo) & (adv_seq < 0)))
    torch.testing.assert_close(logprobs.grad, want_grad * active[:, None], rtol=0, atol=1e-12)
    assert active.tolist() == [False, True, True]  # so the line above can fail


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("cliprange_high", 0.0, "cliprange_high must be > 0"),
        ("importance_ratio", "tokens", "`importance_ratio` must be one of"),
    ],
)
def test_policy_loss_rejects_bad_new_options(option, value, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        policy_loss(x, x, x, torch.ones(1, 2), 0.2, **{option: value})


def test_a_zero_advantage_with_an_overflowing_ratio_adds_nothing_and_no_nan():
    """-0 x inf is nan: a token with A = 0 and a log-ratio of 1000 adds 0 to the loss and its
    gradient, whether the clipped term would be active or not; the others are as without it."""
    old = torch.full((1, 3), -3.0, dtype=torch.float64)
    adv = torch.tensor([[0.0, 1.0, -0.5]], dtype=torch.float64)
    log_ratio = torch.tensor([[1000.0, 0.1, 0.05]], dtype=torch.float64)
    logprobs = (old + log_ratio).requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, torch.ones_like(adv), 0.2)
    loss.backward()
    r1, r2 = math.exp(0.1), math.exp(0.05)
    assert loss.item() == pytest.approx((-1.0 * r1 + 0.5 * r2) / 3, rel=1e-12)
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -r1 / 3, 0.5 * r2 / 3], rel=1e-12)
