"""Tests of rlkl_lightning.kl.estimators against closed forms and second computations."""

from __future__ import annotations

import math

import pytest
import torch

from rlkl_lightning.kl.estimators import (
    KL_ESTIMATORS,
    KL_UNITS,
    exact_kl,
    per_token_kl,
    sequence_kl,
    token_mean_kl,
)

F64 = torch.float64


def _softmax_py(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _kl_py(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def _drifted_pair(eps: float, vocab: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (pi, ref) where pi's logits are ref's plus eps * a random direction."""
    gen = torch.Generator().manual_seed(seed)
    ref_logits = torch.randn(vocab, generator=gen, dtype=F64)
    direction = torch.randn(vocab, generator=gen, dtype=F64)
    logp = torch.log_softmax(ref_logits + eps * direction, dim=-1)
    logq = torch.log_softmax(ref_logits, dim=-1)
    return logp, logq


# --------------------------------------------------------------------------------------------
# exact_kl


def test_exact_kl_hand_built_distributions():
    p = [0.5, 0.3, 0.2]
    q = [0.25, 0.25, 0.5]
    expected = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    got = exact_kl(torch.tensor(p, dtype=F64).log(), torch.tensor(q, dtype=F64).log())
    assert got.shape == ()
    assert got.item() == pytest.approx(expected, rel=1e-13, abs=0)
    # Unnormalized logits: the softmax is taken by hand.
    z, w = [2.0, -1.0, 0.5, 3.0], [0.0, 0.0, 1.0, -2.0]
    got = exact_kl(torch.tensor(z, dtype=F64), torch.tensor(w, dtype=F64))
    assert got.item() == pytest.approx(_kl_py(_softmax_py(z), _softmax_py(w)), rel=1e-13)


def test_exact_kl_batched_matches_per_position_closed_form():
    gen = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(3, 4, 7, generator=gen, dtype=F64)
    ref_logits = 3 * torch.randn(3, 4, 7, generator=gen, dtype=F64)
    got = exact_kl(logits, ref_logits)
    assert got.shape == (3, 4)
    for b in range(3):
        for t in range(4):
            expected = _kl_py(
                _softmax_py(logits[b, t].tolist()), _softmax_py(ref_logits[b, t].tolist())
            )
            assert got[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_exact_kl_zero_for_identical_and_invariant_to_shifts():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=F64)
    ref_logits = torch.randn(2, 5, 11, generator=gen, dtype=F64)
    assert torch.equal(exact_kl(logits, logits), torch.zeros(2, 5, dtype=F64))
    base = exact_kl(logits, ref_logits)
    assert base.min() > 0.01  # the pair differs, so the invariance below is not vacuous
    shifted = exact_kl(logits + 123.25, ref_logits - 7.5)
    torch.testing.assert_close(shifted, base, rtol=1e-12, atol=1e-13)
    # Large logits are fine thanks to log_softmax.
    big = exact_kl(logits * 1e3 + 1e4, ref_logits * 1e3)
    assert torch.isfinite(big).all()


def test_exact_kl_float32_and_zero_probability_actions():
    neg_inf = float("-inf")
    # pi puts no mass on action 0: it contributes 0, not nan.
    got = exact_kl(torch.tensor([neg_inf, 0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0]))
    p = _softmax_py([-1e300, 0.0, 1.0])
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(_kl_py(p, [1 / 3] * 3), rel=1e-6)
    # ref puts no mass where pi has mass: the KL is infinite.
    assert exact_kl(torch.tensor([0.0, 0.0]), torch.tensor([neg_inf, 0.0])).item() == math.inf
    # Half precision inputs are computed in float32.
    half = exact_kl(torch.tensor([1.0, 2.0], dtype=torch.float16), torch.zeros(2).half())
    assert half.dtype == torch.float32


def test_exact_kl_errors():
    with pytest.raises(ValueError, match="same shape"):
        exact_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="vocabulary"):
        exact_kl(torch.tensor(1.0), torch.tensor(1.0))


# --------------------------------------------------------------------------------------------
# per_token_kl: values, exact expectations, Monte Carlo


def test_per_token_kl_values_match_formulas():
    lp = torch.tensor([-0.1, -2.0, -0.5, -7.0, -1.0], dtype=F64)
    lq = torch.tensor([-0.3, -1.0, -0.5, -0.2, -4.0], dtype=F64)
    for estimator, formula in [
        ("k1", lambda x: x),
        ("k2", lambda x: x * x / 2),
        ("k3", lambda x: math.exp(-x) - 1 + x),
    ]:
        got = per_token_kl(lp, lq, estimator)
        expected = [formula(a - b) for a, b in zip(lp.tolist(), lq.tolist())]
        assert got.dtype == F64
        assert got.tolist() == pytest.approx(expected, rel=1e-13, abs=1e-15)
    assert per_token_kl(lp, lq).tolist() == (lp - lq).tolist()  # k1 is the default
    assert per_token_kl(lp.float(), lq.half()).dtype == torch.float32


def test_k3_is_never_negative_and_accurate_for_tiny_ratios():
    log_ratio = torch.tensor([-50.0, -1.0, -1e-4, -1e-10, 0.0, 1e-10, 1e-4, 1.0, 50.0])
    k3 = per_token_kl(log_ratio, torch.zeros_like(log_ratio), "k3")
    assert (k3 >= 0).all()
    # For small |l|, k3 ~ l**2 / 2: expm1 keeps this accurate even in float32.
    small = torch.tensor([1e-4, -1e-4, 1e-3])
    k3_small = per_token_kl(small, torch.zeros(3), "k3")
    torch.testing.assert_close(k3_small, small.double().square().float() / 2, rtol=1e-3, atol=0)


def test_expectations_under_pi_are_exact_for_k1_k3():
    """Summing estimator * pi over the whole vocabulary gives the estimator's exact mean."""
    for eps in (0.3, 1.5):
        logp, logq = _drifted_pair(eps)
        p = logp.exp()
        kl = exact_kl(logp, logq).item()
        for estimator in ("k1", "k3"):
            mean = (p * per_token_kl(logp, logq, estimator)).sum().item()
            assert mean == pytest.approx(kl, rel=1e-12)
        mean_k2 = (p * per_token_kl(logp, logq, "k2")).sum().item()
        assert abs(mean_k2 - kl) > 1e-3 * kl  # k2 is biased


def test_k2_bias_vanishes_to_first_order_for_small_drift():
    """Both KL and E_pi[k2] equal E_ref[(r - 1)**2] / 2 + O(eps**3), so their relative gap is
    O(eps): it shrinks tenfold when the drift shrinks tenfold."""
    gaps = {}
    for eps in (1e-1, 1e-2, 1e-3):
        logp, logq = _drifted_pair(eps)
        kl = exact_kl(logp, logq).item()
        mean_k2 = (logp.exp() * per_token_kl(logp, logq, "k2")).sum().item()
        gaps[eps] = abs(mean_k2 - kl) / kl
    assert gaps[1e-2] < 2e-3
    for big, small in [(1e-1, 1e-2), (1e-2, 1e-3)]:
        assert 7 < gaps[big] / gaps[small] < 13


@pytest.fixture(scope="module")
def monte_carlo():
    """200k samples from a pi that drifted from ref; log-ratios of the sampled tokens."""
    logp, logq = _drifted_pair(1.5)
    gen = torch.Generator().manual_seed(1234)
    n = 200_000
    y = torch.multinomial(logp.exp(), n, replacement=True, generator=gen)
    y_ref = torch.multinomial(logq.exp(), n, replacement=True, generator=gen)
    return logp, logq, y, y_ref


def _mean_and_se(x: torch.Tensor) -> tuple[float, float]:
    return x.mean().item(), (x.std() / math.sqrt(x.numel())).item()


def test_monte_carlo_k1_k3_unbiased_k2_biased(monte_carlo):
    logp, logq, y, _ = monte_carlo
    kl = exact_kl(logp, logq).item()
    assert kl > 0.2  # a real drift
    for estimator in ("k1", "k3"):
        values = per_token_kl(logp[y], logq[y], estimator)
        mean, se = _mean_and_se(values)
        assert se < 0.01 * kl  # precise enough that a biased estimator would be caught
        assert abs(mean - kl) < 4 * se, estimator
    assert (per_token_kl(logp[y], logq[y], "k3") >= 0).all()
    k2 = per_token_kl(logp[y], logq[y], "k2")
    mean, se = _mean_and_se(k2)
    p, log_ratio = logp.exp(), logp - logq
    assert abs(mean - (p * log_ratio.square() / 2).sum().item()) < 4 * se  # its own closed form
    assert abs(mean - kl) > 10 * se  # ... which is not the KL at this drift


def test_monte_carlo_biased_forms_match_their_own_closed_forms(monte_carlo):
    logp, logq, y, y_ref = monte_carlo
    p, q, lr = logp.exp(), logq.exp(), logp - logq
    kl = (p * lr).sum().item()
    r_log_r = (p * lr.exp() * lr).sum().item()  # E_pi[r log r]
    chi2 = (p * p / q).sum().item() - 1.0  # chi²(pi‖ref)
    lr_y = lr[y]

    mean, se = _mean_and_se(lr_y.exp() * lr_y)
    assert abs(mean - r_log_r) < 4 * se
    assert abs(mean - kl) > 20 * se

    mean, se = _mean_and_se(torch.expm1(lr_y) - lr_y)
    assert abs(mean - (chi2 - kl)) < 4 * se
    assert abs(mean - kl) > 20 * se

    # exp(l) * l is the right estimator for samples from the reference.
    lr_ref = lr[y_ref]
    mean, se = _mean_and_se(lr_ref.exp() * lr_ref)
    assert abs(mean - kl) < 4 * se


def test_per_token_kl_errors():
    with pytest.raises(ValueError, match=r"'k1', 'k2', 'k3'") as info:
        per_token_kl(torch.zeros(3), torch.zeros(3), "k4")
    assert "k4" in str(info.value)
    with pytest.raises(ValueError, match="exact_kl"):
        per_token_kl(torch.zeros(3), torch.zeros(3), "exact")
    with pytest.raises(ValueError, match="same shape"):
        per_token_kl(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match="floating-point"):
        per_token_kl(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))


def test_public_constants():
    assert KL_ESTIMATORS == ("k1", "k2", "k3", "exact")
    assert KL_UNITS == ("sequence", "token")


# --------------------------------------------------------------------------------------------
# reductions with masks


def _right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


@pytest.fixture
def padded_batch():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 6, generator=gen, dtype=F64)
    mask = _right_padded_mask([6, 3, 0, 1], 6)
    return values, mask


def test_all_ones_mask_equals_no_mask(padded_batch):
    values, _ = padded_batch
    ones_bool = torch.ones_like(values, dtype=torch.bool)
    for ones in (ones_bool, ones_bool.double(), ones_bool.long()):
        assert torch.equal(sequence_kl(values, ones), sequence_kl(values))
        assert torch.equal(token_mean_kl(values, ones), token_mean_kl(values))
    torch.testing.assert_close(sequence_kl(values), values.sum(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(token_mean_kl(values), values.mean(), rtol=1e-15, atol=0)


def test_sequence_kl_equals_per_sample_loop(padded_batch):
    values, mask = padded_batch
    got = sequence_kl(values, mask)
    assert got.shape == (4,)
    for b in range(4):
        expected = sum(float(values[b, t]) for t in range(6) if mask[b, t])
        assert got[b].item() == pytest.approx(expected, rel=1e-14, abs=1e-15)
    assert got[2].item() == 0.0  # a row without valid tokens


def test_token_mean_kl_equals_mean_of_valid_entries(padded_batch):
    values, mask = padded_batch
    got = token_mean_kl(values, mask)
    assert got.shape == ()
    valid = [float(values[b, t]) for b in range(4) for t in range(6) if mask[b, t]]
    assert got.item() == pytest.approx(sum(valid) / len(valid), rel=1e-14)
    assert got.item() == pytest.approx(values[mask].mean().item(), rel=1e-14)
    # Long rows weigh more than in the mean over sequences of per-sequence means.
    per_seq_mean = (sequence_kl(values, mask)[[0, 1, 3]] / torch.tensor([6.0, 3.0, 1.0])).mean()
    assert abs(per_seq_mean.item() - got.item()) > 1e-3


@pytest.mark.parametrize("garbage", [1e30, -1e30, float("nan"), float("inf")])
def test_padding_garbage_never_changes_results(padded_batch, garbage):
    values, mask = padded_batch
    clean = torch.where(mask, values, torch.zeros((), dtype=F64))
    dirty = torch.where(mask, values, torch.full((), garbage, dtype=F64))
    for m in (mask, mask.double(), mask.int()):
        assert torch.equal(sequence_kl(dirty, m), sequence_kl(clean, mask))
        assert torch.equal(token_mean_kl(dirty, m), token_mean_kl(clean, mask))


def test_reductions_of_per_token_estimators_end_to_end():
    """sequence_kl(exact_kl(...)) over a [B, T, V] batch equals the sum of closed forms."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    ref_logits = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    mask = _right_padded_mask([3, 2], 3)
    got = sequence_kl(exact_kl(logits, ref_logits), mask)
    for b, length in enumerate([3, 2]):
        expected = sum(
            _kl_py(_softmax_py(logits[b, t].tolist()), _softmax_py(ref_logits[b, t].tolist()))
            for t in range(length)
        )
        assert got[b].item() == pytest.approx(expected, rel=1e-12)


def test_no_valid_token_gives_nan_token_mean():
    values = torch.ones(2, 3)
    assert math.isnan(token_mean_kl(values, torch.zeros(2, 3, dtype=torch.bool)).item())
    assert torch.equal(sequence_kl(values, torch.zeros(2, 3)), torch.zeros(2))


def test_reduction_errors():
    values = torch.zeros(2, 3)
    for fn in (sequence_kl, token_mean_kl):
        with pytest.raises(ValueError, match=r"`per_token` must have shape \[B, T\]"):
            fn(torch.zeros(3))
        with pytest.raises(ValueError, match="`mask` must have the same shape as `per_token`"):
            fn(values, torch.ones(2, 4))
        with pytest.raises(ValueError, match="only 0 and 1"):
            fn(values, torch.full((2, 3), 0.5))


def test_k3_is_plus_inf_for_a_policy_log_prob_of_minus_inf():
    """l = -inf: exp(-l) - 1 + l is dominated by exp(-l) = +inf (the limit), not inf - inf."""
    inf = float("inf")
    lp = torch.tensor([-inf, -2.0, -inf, 0.0], dtype=F64)
    lq = torch.tensor([-1.0, -inf, -0.5, -0.5], dtype=F64)
    k3 = per_token_kl(lp, lq, "k3")
    assert k3[0].item() == inf and k3[2].item() == inf and k3[1].item() == inf
    assert k3[3].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5, rel=1e-14)
    # nan stays nan: a broken input is not turned into a number.
    assert per_token_kl(torch.tensor([float("nan")]), torch.tensor([0.0]), "k3").isnan().all()
