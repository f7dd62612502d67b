"""Tests of rlkl_lightning.kl.controllers: each law against its formula written out here."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    LogPIDKLController,
    PIKLController,
)
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl.laws import KL_LAWS
from rlkl_lightning.kl.settings import KLSettings

NAN, INF = float("nan"), float("inf")


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _make(law: str, **overrides):
    """One controller of each law with ordinary parameters."""
    params = {
        "fixed": dict(kl_coef=0.1),
        "adaptive": dict(init_kl_coef=0.1, target=6.0, horizon=1000),
        "exponential": dict(init_kl_coef=0.1, target=6.0, k=0.05),
        "pi": dict(init_kl_coef=0.1, target=6.0, kp=0.3, ki=0.05, min_kl_coef=1e-3),
        "logpid": dict(init_kl_coef=0.1, target=6.0, min_kl_coef=1e-3),
    }[law]
    params.update(overrides)
    cls = {
        "fixed": FixedKLController,
        "adaptive": AdaptiveKLController,
        "exponential": ExponentialKLController,
        "pi": PIKLController,
        "logpid": LogPIDKLController,
    }[law]
    return cls(**params)


KL_SEQUENCE = [6.0, 9.0, 12.0, 3.0, 0.0, 7.1, 5.5, 40.0, -2.0, 6.3, 6.0, 4.0]


# --------------------------------------------------------------------------------------------
# laws, step by step


def test_fixed_never_changes():
    ctl = FixedKLController(0.2)
    for kl in KL_SEQUENCE:
        assert ctl.update(kl, 64) == 0.2
    assert ctl.value == 0.2


def test_adaptive_hand_computed_step():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # e = clip(12 / 6 - 1, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 64 / 10000)
    assert ctl.update(12.0, 64) == pytest.approx(0.100128, rel=1e-15)
    assert ctl.value == ctl.update(6.0, 64)  # KL at target: beta unchanged


def test_adaptive_matches_ziegler_formula_step_by_step():
    def ziegler(beta, kl, target, n, horizon):
        error = kl / target - 1.0
        error = max(-0.2, min(0.2, error))
        return beta * (1.0 + error * n / horizon)

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    beta = 0.1
    for i, kl in enumerate(KL_SEQUENCE):
        n = 16 + 8 * i
        beta = ziegler(beta, kl, 6.0, n, 1000)
        assert ctl.update(kl, n) == pytest.approx(beta, rel=1e-14)


@pytest.mark.parametrize(
    ("kl", "factor"),
    [
        (6.0 * 1.25, 1 + 0.2 * 100 / 1000),  # above the +0.2 clip edge
        (1e6, 1 + 0.2 * 100 / 1000),
        (6.0 * 0.75, 1 - 0.2 * 100 / 1000),  # below the -0.2 clip edge
        (0.0, 1 - 0.2 * 100 / 1000),
        (-50.0, 1 - 0.2 * 100 / 1000),
        (6.6, 1 + 0.1 * 100 / 1000),  # inside the clip: e = 0.1
        (6.0, 1.0),
    ],
)
def test_adaptive_clip_edges(kl, factor):
    ctl = AdaptiveKLController(0.5, target=6.0, horizon=1000)
    assert ctl.update(kl, 100) == pytest.approx(0.5 * factor, rel=1e-14)


def test_adaptive_zero_samples_and_horizon_scaling():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    assert ctl.update(100.0, 0) == 0.1
    a = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    b = AdaptiveKLController(0.1, target=6.0, horizon=2000)
    for kl in KL_SEQUENCE:
        assert a.update(kl, 50) == b.update(kl, 100)  # same samples/horizon ratio
    assert a.value != 0.1


def test_adaptive_rejects_batches_that_make_the_factor_nonpositive():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100)
    assert ctl.update(0.0, 499) == pytest.approx(0.1 * (1 - 0.2 * 499 / 100), rel=1e-13)
    before = ctl.value
    with pytest.raises(ValueError, match=r"`n_steps` \(500 samples\) must be < 5 \* `horizon`"):
        ctl.update(0.0, 500)
    assert ctl.value == before


def test_adaptive_bounds_clamp():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100, min_kl_coef=0.05, max_kl_coef=0.11)
    assert ctl.update(100.0, 100) == 0.11  # 0.1 * 1.2 = 0.12 -> 0.11
    for _ in range(20):
        ctl.update(0.0, 100)
    assert ctl.value == 0.05


def test_exponential_matches_formula_and_ignores_batch_size():
    lo, hi = 1e-3, 0.5
    ctl = ExponentialKLController(0.1, target=6.0, k=0.2, min_kl_coef=lo, max_kl_coef=hi)
    other = ExponentialKLController(0.1, target=6.0, k=0.2, min_kl_coef=lo, max_kl_coef=hi)
    beta = 0.1
    saw_upper = saw_lower = False
    for i, kl in enumerate(KL_SEQUENCE + [30.0, 30.0, -40.0, -40.0, 6.0]):
        beta = _clip(beta * math.exp(0.2 * (kl - 6.0)), lo, hi)
        saw_upper |= beta == hi
        saw_lower |= beta == lo
        assert ctl.update(kl, 1) == pytest.approx(beta, rel=1e-13)
        assert other.update(kl, 1000 + i) == ctl.value
    assert saw_upper and saw_lower
    value = ctl.value
    assert ctl.update(6.0, 10) == value  # KL at target
    assert ctl.update(100.0, 0) == value  # no samples


def test_exponential_default_bounds_and_saturation_without_overflow():
    ctl = ExponentialKLController(0.1, target=6.0, k=10.0)
    assert (ctl.min_kl_coef, ctl.max_kl_coef) == (1e-4, 10.0)
    assert ctl.update(1e308, 1) == 10.0
    assert ctl.update(-1e308, 1) == 1e-4
    free = ExponentialKLController(0.1, target=6.0, k=10.0, min_kl_coef=None, max_kl_coef=None)
    assert free.update(1e308, 1) == sys.float_info.max
    assert free.update(-1e308, 1) == sys.float_info.min


def _pi_reference(init, target, kp, ki, clip, lo, hi, kls):
    """The PI law of the PIKLController docstring, written out independently."""
    z = math.log(init)
    betas = []
    for kl in kls:
        e = _clip((kl - target) / target, -clip, clip)
        z = _clip(z + ki * e, math.log(lo), math.log(hi))
        betas.append(_clip(math.exp(_clip(z + kp * e, math.log(lo), math.log(hi))), lo, hi))
    return betas


def test_pi_matches_formula_step_by_step():
    kls = KL_SEQUENCE + [60.0] * 60 + [1.0] * 5 + [-100.0] * 100 + [6.0, 6.0]
    expected = _pi_reference(0.1, 6.0, 0.3, 0.05, 1.0, 0.01, 1.0, kls)
    ctl = PIKLController(0.1, 6.0, kp=0.3, ki=0.05, min_kl_coef=0.01, max_kl_coef=1.0)
    got = [ctl.update(kl, 32) for kl in kls]
    assert got == pytest.approx(expected, rel=1e-12)
    assert 1.0 in got and 0.01 in got  # both bounds were reached
    # Error clip: a KL of 12 and one of 1200 both have error 1 with error_clip=1.
    a = PIKLController(0.1, 6.0, kp=0.3, ki=0.05)
    b = PIKLController(0.1, 6.0, kp=0.3, ki=0.05)
    assert a.update(12.0, 1) == b.update(1200.0, 1) == pytest.approx(0.1 * math.exp(0.35))


def test_pi_zero_error_and_zero_samples_keep_beta():
    ctl = PIKLController(0.1, 6.0, kp=0.3, ki=0.05)
    assert ctl.update(6.0, 10) == pytest.approx(0.1, rel=1e-15)  # exp(log(0.1)) may round
    ctl.update(9.0, 10)
    state = ctl.state_dict()
    assert ctl.update(100.0, 0) == state["value"]
    assert ctl.state_dict() == state


def test_pi_anti_windup_leaves_the_bound_at_the_first_sign_change():
    """After 500 saturating updates, one update below target moves beta off the upper bound
    by exactly the amount the law prescribes; an integrator without clamping would stay
    pinned for about 950 more updates."""
    kp, ki, lo, hi = 0.5, 0.1, 0.01, 1.0
    ctl = PIKLController(0.1, 6.0, kp=kp, ki=ki, min_kl_coef=lo, max_kl_coef=hi)
    for _ in range(500):
        assert ctl.update(60.0, 64) <= hi  # error clipped to +1
    assert ctl.value == hi
    assert ctl.integral == 0.0  # clamped at log(hi), not log(0.1) + 500 * 0.1
    # KL = 3: error -0.5; z = 0 - 0.05, log beta = z - 0.25.
    assert ctl.update(3.0, 64) == pytest.approx(math.exp(-0.3), rel=1e-14)

    naive_z = math.log(0.1) + 500 * ki
    flips_needed = 0
    while naive_z + kp * -0.5 >= math.log(hi):
        naive_z -= ki * 0.5
        flips_needed += 1
    assert flips_needed > 900

    # The same at the lower bound.
    ctl = PIKLController(0.1, 6.0, kp=kp, ki=ki, min_kl_coef=lo, max_kl_coef=hi)
    for _ in range(500):
        ctl.update(-1e9, 64)
    assert ctl.value == lo
    assert ctl.update(9.0, 64) > lo


# --------------------------------------------------------------------------------------------
# common behaviour


def _logpid_reference(
    init,
    target,
    kls,
    kp=0.6,
    ki=0.15,
    lead=8.0,
    fall=0.05,
    alpha=0.5,
    gamma=0.1,
    dead=0.4,
    clip=1.0,
    lo=1e-3,
    hi=10.0,
):
    """The log-PID law of the LogPIDKLController docstring, written out independently."""
    z, m, d, betas, started = math.log(init), math.log(0.3), 0.0, [], False
    for kl in kls:
        started = started or abs(kl) > 1e-4 * target  # until then, 0 up to rounding
        if not started:
            betas.append(betas[-1] if betas else init)
            continue
        y = math.log(max(kl, 0.3 * target) / target)
        m_new = alpha * y + (1 - alpha) * (m + d)
        d = gamma * (m_new - m) + (1 - gamma) * d
        m = m_new
        e = _clip(m + lead * d, -clip, clip)
        e = e * min(1.0, abs(e) / dead) if dead else e
        z = _clip(z + max(ki * e, -fall), math.log(lo), math.log(hi))
        betas.append(math.exp(_clip(z + kp * e, math.log(lo), math.log(hi))))
    return betas


def test_logpid_matches_formula_step_by_step():
    kls = [0.0, 2.4e-7, -5e-4] + KL_SEQUENCE + [60.0, 60.0, 0.5, 6.0, 6.0]
    ctl = LogPIDKLController(0.1, 6.0, min_kl_coef=1e-3, max_kl_coef=10.0)
    got = [ctl.update(kl, 64) for kl in kls]
    assert got == pytest.approx(_logpid_reference(0.1, 6.0, kls), rel=1e-12)
    other = dict(kp=0.2, ki=0.3, lead=2.0, fall=0.5, alpha=0.9, gamma=0.6, dead=0.0, clip=2.0)
    ctl = LogPIDKLController(
        0.1, 6.0, 0.2, 0.3, 2.0, 0.5, 0.9, 0.6, 0.0, 2.0, min_kl_coef=1e-3, max_kl_coef=10.0
    )
    got = [ctl.update(kl, 64) for kl in kls]
    assert got == pytest.approx(_logpid_reference(0.1, 6.0, kls, **other), rel=1e-12)


def test_logpid_falls_at_most_max_fall_per_batch_while_the_kl_is_zero():
    """A KL of 0 is an error of log(0.3) clipped to -1: the integral would fall by ki = 0.15 a
    batch, the cap holds it to 0.05, and the proportional term adds kp * -1 once: after n
    batches beta = 0.1 exp(-0.05 n - 0.6), whatever the batch size, down to the default floor
    0.1 x 0.3^2 = 0.009 (after 36 batches), where it stays."""
    ctl = LogPIDKLController(0.1, 6.0)
    ctl.update(0.01, 64)  # a first KL beyond rounding: the law has started
    for n in range(2, 61):
        expected = max(0.1 * math.exp(-0.05 * n - 0.6), 0.1 * 0.3**2)
        assert ctl.update(0.0, 64 if n % 2 else 1) == pytest.approx(expected, rel=1e-12)
    assert ctl.value == ctl.min_kl_coef == pytest.approx(0.009) and ctl.integral == pytest.approx(
        math.log(0.009)
    )
    assert ctl.log_error == pytest.approx(math.log(0.3)) and ctl.trend == 0.0
    # Without the cap the same batches take beta 0.15 / 0.05 = 3 times as far in log.
    free = LogPIDKLController(0.1, 6.0, max_fall=1.0, min_kl_coef=1e-6)
    free.update(0.01, 64)
    for _ in range(2, 31):
        free.update(0.0, 64)
    assert free.value == pytest.approx(0.1 * math.exp(-0.15 * 30 - 0.6), rel=1e-12)


def test_logpid_does_not_move_beta_while_the_kl_is_still_zero():
    """Batch 0's KL is 0 up to rounding (the policy is its reference; configs/ppo_logpid.yaml
    measured 2.4e-7, -5.1e-7, -3.0e-8 nats): it used to halve beta (0.1 -> 0.052). Until the
    first KL beyond 1e-4 x target from 0 nothing changes; after it, a 0 counts."""
    ctl = LogPIDKLController(0.1, 6.0)
    start = ctl.state_dict()
    rounding = (0.0, 2.384185791015625e-07, -5.066394805908203e-07, -2.98e-08, 6e-4, -6e-4)
    assert [ctl.update(kl, 64) for kl in rounding] == [0.1] * len(rounding)
    assert ctl.state_dict() == start and ctl.started == 0.0
    ctl.update(6.0, 64)
    assert ctl.started == 1.0 and ctl.update(0.0, 64) < ctl.value + 1 and ctl.value < 0.1
    # A state saved mid-run before `started` existed counts as started.
    old = {"law": "logpid", "value": 0.05, "integral": -3.0, "log_error": -1.0, "trend": 0.0}
    ctl.load_state_dict(old)
    assert ctl.started == 1.0 and ctl.update(0.0, 64) < 0.05


def _plateau_plant(controller, seed, plateau=100, batches=200, level=0.5, noise=0.15):
    """A KL that sits at ``level`` nats, whatever beta, for ``plateau`` batches (the policy has
    not found the reward), then takes off as ``_learning_plant``'s fully learnt KL: a fast part
    ~ beta^-0.4 (lag 2) plus a learnt part 3 (beta / 0.1)^-1 (lag 5), seen 2 batches late.
    Batch 0's KL is 0, as a policy's that starts at its reference. Returns the KLs and betas."""
    rng = np.random.default_rng(seed)
    betas, fast, learnt, kls = [controller.value], 0.0, 0.0, []
    for t in range(batches):
        beta = betas[max(0, len(betas) - 3)]
        fast += ((beta / 0.1) ** -0.4 - fast) / 2.0
        if t >= plateau:
            learnt += (3.0 * (beta / 0.1) ** -1.0 - learnt) / 5.0
        kl = level if t < plateau else fast + learnt
        kls.append(0.0 if t == 0 else max(0.0, kl * (1 + noise * rng.standard_normal())))
        betas.append(controller.update(kls[-1], 32))
    return np.array(kls), np.array(betas)


def test_logpid_a_long_plateau_winds_beta_down_only_to_its_default_floor():
    """Issue 37, item 10: over a 100-batch plateau the fall cap alone let beta fall 250x (0.1
    to 0.0004), and the take-off overshot by 250-270 nats. The default floor, 0.09 x the
    initial beta, bounds the fall at 11x, and the take-off's 10-batch mean KL overshoots by
    under 15 nats (target 6), then settles within 25% of the target."""
    for seed in range(3):
        kls, betas = _plateau_plant(LogPIDKLController(0.1, 6.0), seed)
        assert betas.min() == pytest.approx(0.1 * 0.3**2)
        settle, over = _settle_and_overshoot(kls)
        assert over < 15.0 and settle < len(kls), (seed, settle, over)
        # The same law with the floor moved out of the way winds down 250x.
        kls, betas = _plateau_plant(LogPIDKLController(0.1, 6.0, min_kl_coef=1e-9), seed)
        assert betas.min() < 0.1 / 200 and _settle_and_overshoot(kls)[1] > 200.0


def test_logpid_at_the_target_with_no_trend_keeps_beta_and_zero_samples_change_nothing():
    ctl = LogPIDKLController(0.1, 6.0)
    ctl.load_state_dict({"law": "logpid", "value": 0.05, "log_error": 0.0, "trend": 0.0})
    assert ctl.integral == pytest.approx(math.log(0.05))  # missing: from the saved beta
    for _ in range(5):
        assert ctl.update(6.0, 64) == pytest.approx(0.05, rel=1e-15)
    state = ctl.state_dict()
    assert ctl.update(600.0, 0) == ctl.value and ctl.state_dict() == state
    # Inside the dead zone a small steady error moves beta quadratically less: 0.2 / 0.4.
    near = LogPIDKLController(0.1, 6.0, kp=0.0, ki=1.0, lead=0.0, alpha=1.0)
    near.load_state_dict({"law": "logpid", "value": 0.1, "log_error": 0.0, "trend": 0.0})
    assert math.log(near.update(6.0 * math.exp(0.2), 64) / 0.1) == pytest.approx(0.2 * 0.2 / 0.4)


def test_logpid_raises_beta_on_a_fast_rise_before_the_kl_reaches_the_target():
    """The trend term: while a KL climbs 2 -> 5 nats (still below 6) beta turns up, where the
    same law without it (lead 0) holds it lower."""
    rise = (2.5, 3.2, 4.0, 5.0)
    ctl = LogPIDKLController(0.05, 6.0)
    ctl.load_state_dict({"law": "logpid", "value": 0.05, "log_error": math.log(2 / 6)})
    betas = [ctl.update(kl, 64) for kl in rise]
    flat = LogPIDKLController(0.05, 6.0, lead=0.0)
    flat.load_state_dict({"law": "logpid", "value": 0.05, "log_error": math.log(2 / 6)})
    flat_betas = [flat.update(kl, 64) for kl in rise]
    assert betas[-1] > betas[-2] > betas[0] and betas[-1] > 1.3 * flat_betas[-1]
    assert flat_betas[-1] < 0.05  # still below where it started


def test_logpid_options_are_validated():
    for name in ("alpha", "gamma"):
        with pytest.raises(ValueError, match=rf"`{name}` must lie in \(0, 1\], got 1.5"):
            _make("logpid", **{name: 1.5})
    for name in ("kp", "lead", "dead_zone"):
        with pytest.raises(ValueError, match=rf"`{name}` must be a finite number >= 0"):
            _make("logpid", **{name: -1.0})


def _learning_plant(controller, seed, takeoff_rate, batches=150, noise=0.15):
    """A simulated KL (docs/controllers.md, "The log-PID law"): a fast part ~ beta^-0.4 and a
    learnt part ~ beta^-1 that grows as the policy finds the reward, sooner at lower beta."""
    rng = np.random.default_rng(seed)
    betas, fast, learnt, found, kls = [controller.value], 0.0, 0.0, 0.01, []
    for _ in range(batches):
        beta = betas[max(0, len(betas) - 3)]  # a dead time of 2 batches
        found = min(1.0, found + takeoff_rate * (0.1 / beta) * found * (1 - found))
        fast += ((beta / 0.1) ** -0.4 - fast) / 2.0
        learnt += (found * 3.0 * (beta / 0.1) ** -1.0 - learnt) / 5.0
        kl = fast + learnt
        kls.append(max(0.0, kl * (1 + noise * rng.standard_normal())))
        betas.append(controller.update(kls[-1], 32))
    return np.array(kls)


def _settle_and_overshoot(kl, target=6.0, window=10):
    means = np.convolve(kl, np.ones(window) / window, mode="valid")
    outside = [i for i, m in enumerate(means) if abs(m - target) > 0.25 * target]
    settle = window if not outside else window + outside[-1] + 1
    return settle, max(0.0, means.max() - target)


@pytest.mark.parametrize("takeoff_rate", [0.2, 0.08, 0.025])  # reward found fast ... slowly
def test_logpid_settles_fast_without_overshoot_where_an_unlimited_variant_overshoots(
    takeoff_rate,
):
    """On a KL that sits low until the policy finds the reward, the law's 10-batch mean is
    within 25% of the target by batch 45 and overshoots by under 25% of it, one tuning for all
    three rates. Without the fall cap and the trend (lead 0, max_fall 1) it overshoots by more
    than 4 nats, and the PI law with the default world's gains settles late or overshoots."""
    for seed in range(3):
        settle, over = _settle_and_overshoot(
            _learning_plant(LogPIDKLController(0.1, 6.0), seed, takeoff_rate)
        )
        assert settle <= 45 and over <= 1.5, (seed, settle, over)
        unlimited = LogPIDKLController(0.1, 6.0, lead=0.0, max_fall=1.0)
        assert _settle_and_overshoot(_learning_plant(unlimited, seed, takeoff_rate))[1] > 4.0
        pi = PIKLController(0.1, 6.0, kp=0.77, ki=0.067)
        settle, over = _settle_and_overshoot(_learning_plant(pi, seed, takeoff_rate))
        assert takeoff_rate > 0.1 or settle > 45 or over > 1.5


@pytest.mark.parametrize("law", KL_LAWS)
def test_protocol_and_repr(law):
    ctl = _make(law)
    assert isinstance(ctl, KLController)
    text = repr(ctl)
    assert text.startswith(type(ctl).__name__ + "(value=0.1")
    if law != "fixed":
        assert "target=6.0" in text


@pytest.mark.parametrize("law", KL_LAWS)
def test_non_finite_kl_keeps_state_and_warns_once(law):
    ctl = _make(law)
    ctl.update(9.0, 64)
    state = ctl.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bad in (NAN, INF, -INF, NAN, torch.tensor(NAN)):
            assert ctl.update(bad, 64) == state["value"]
    assert ctl.state_dict() == state
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1
    assert "non-finite KL" in str(runtime[0].message)
    assert runtime[0].filename == __file__  # points at the caller
    # A finite KL afterwards updates normally; another instance warns on its own.
    if law != "fixed":
        assert ctl.update(12.0, 64) != state["value"]
    with pytest.warns(RuntimeWarning, match="non-finite KL"):
        _make(law).update(NAN, 1)


@pytest.mark.parametrize("law", KL_LAWS)
@pytest.mark.parametrize("n_steps", [-1, 1.5, True, "3", None, 2.0])
def test_update_rejects_bad_n_steps(law, n_steps):
    ctl = _make(law)
    with pytest.raises(ValueError, match=r"`n_steps` must be an int >= 0 \(samples\)"):
        ctl.update(6.0, n_steps)


@pytest.mark.parametrize("kl", ["7", None, [7.0], torch.ones(2), True])
def test_update_rejects_non_numbers(kl):
    with pytest.raises(ValueError, match="`current_kl` must be a number"):
        _make("adaptive").update(kl, 10)


def test_update_accepts_tensors_and_numpy():
    a, b = _make("adaptive"), _make("adaptive")
    assert a.update(torch.tensor(9.0), torch.tensor(64)) == b.update(9.0, 64)
    assert a.update(np.float32(3.0), np.int64(8)) == b.update(3.0, 8)


# --------------------------------------------------------------------------------------------
# validation at construction


BAD_POSITIVE = [0, -1.0, NAN, INF, -INF, "6", True, None]
POSITIVE_OPTIONS = [
    ("fixed", "kl_coef"),
    ("adaptive", "init_kl_coef"),
    ("adaptive", "target"),
    ("adaptive", "horizon"),
    ("exponential", "init_kl_coef"),
    ("exponential", "target"),
    ("exponential", "k"),
    ("pi", "init_kl_coef"),
    ("pi", "target"),
    ("pi", "error_clip"),
    ("pi", "min_kl_coef"),
    ("logpid", "init_kl_coef"),
    ("logpid", "target"),
    ("logpid", "ki"),
    ("logpid", "max_fall"),
    ("logpid", "alpha"),
    ("logpid", "gamma"),
    ("logpid", "error_clip"),
    ("adaptive", "max_kl_coef"),
]


@pytest.mark.parametrize(
    ("law", "option", "bad"),
    [
        (law, option, bad)
        for law, option in POSITIVE_OPTIONS
        for bad in BAD_POSITIVE
        if not (bad is None and option in ("min_kl_coef", "max_kl_coef"))  # None: no bound
        and not (law == "fixed" and bad == 0)  # a fixed beta of 0: no KL penalty
    ],
)
def test_positive_options_are_validated(law, option, bad):
    relation = ">=" if (law, option) == ("fixed", "kl_coef") else ">"
    with pytest.raises(ValueError, match=rf": `{option}` must be a finite number {relation} 0"):
        _make(law, **{option: bad})


def test_beta_zero_is_the_fixed_laws_and_the_multiplicative_laws_refuse_it():
    fixed = FixedKLController(0.0)
    assert [fixed.update(kl, 64) for kl in (0.0, 6.0, 1e6)] == [0.0, 0.0, 0.0]
    assert fixed.state_dict() == {"law": "fixed", "value": 0.0}
    fixed.load_state_dict({"law": "fixed", "value": 0})
    assert fixed.value == 0.0 and math.copysign(1.0, FixedKLController(-0.0).value) == 1.0
    for law in ("adaptive", "exponential", "pi"):
        with pytest.raises(ValueError) as info:
            _make(law, init_kl_coef=0.0)
        message = str(info.value)
        assert "`init_kl_coef` must be a finite number > 0, got 0.0" in message
        assert "multiplies beta, and from 0 it could never move" in message
        assert "use the fixed law (FixedKLController(0.0), `kl.controller: fixed`" in message
        with pytest.raises(ValueError, match="could never move"):
            _make(law).load_state_dict({"law": law, "value": 0.0})


def test_error_message_format():
    with pytest.raises(ValueError) as info:
        AdaptiveKLController(0.1, target=6.0, horizon=-5)
    assert str(info.value) == (
        "AdaptiveKLController: `horizon` must be a finite number > 0 (samples), got -5"
    )


@pytest.mark.parametrize("option", ["kp", "ki"])
@pytest.mark.parametrize("bad", [-0.1, NAN, INF, "1"])
def test_pi_gains_are_validated(option, bad):
    with pytest.raises(
        ValueError, match=rf"PIKLController: `{option}` must be a finite number >= 0"
    ):
        _make("pi", **{option: bad})


def test_pi_needs_a_gain():
    with pytest.raises(ValueError, match="at least one of `kp`, `ki`"):
        _make("pi", kp=0.0, ki=0.0)
    assert _make("pi", kp=0.0).update(12.0, 1) > 0.1  # pure integral is fine


@pytest.mark.parametrize("law", KL_LAWS)
def test_bounds_are_validated(law):
    with pytest.raises(ValueError, match="`min_kl_coef` must be <= `max_kl_coef`"):
        _make(law, min_kl_coef=0.2, max_kl_coef=0.05)
    init = "kl_coef" if law == "fixed" else "init_kl_coef"
    with pytest.raises(ValueError, match=rf"`{init}` must lie in \[`min_kl_coef`, `max_kl_coef`\]"):
        _make(law, min_kl_coef=0.2, max_kl_coef=1.0)
    with pytest.raises(ValueError, match=rf"`{init}` must lie in"):
        _make(law, min_kl_coef=0.01, max_kl_coef=0.05)
    pinned = _make(law, min_kl_coef=0.1, max_kl_coef=0.1)
    assert pinned.update(100.0, 64) == 0.1


# --------------------------------------------------------------------------------------------
# the CLI's kl group picks the law


def test_kl_settings_build_each_law_from_its_options():
    def built(**options):
        return KLSettings(**options).kl_controller(0.2)

    assert [built(controller=law).law for law in KL_LAWS] == list(KL_LAWS)
    assert KL_LAWS == ("fixed", "adaptive", "exponential", "pi", "logpid")
    fixed = built(controller="fixed", max_kl_coef=0.3)
    assert type(fixed) is FixedKLController and (fixed.value, fixed.max_kl_coef) == (0.2, 0.3)

    adaptive = built(
        target=3.0,
        controller={"class_path": "adaptive", "init_args": {"horizon": 500.0}},
        min_kl_coef=0.1,
    )
    assert type(adaptive) is AdaptiveKLController
    assert (adaptive.target, adaptive.horizon, adaptive.min_kl_coef) == (3.0, 500.0, 0.1)

    expo = built(controller={"class_path": "ExponentialKLController", "init_args": {"k": 0.3}})
    assert type(expo) is ExponentialKLController and expo.k == 0.3
    # Unset bounds are the law's own defaults, not "no bound".
    assert (expo.min_kl_coef, expo.max_kl_coef) == (
        _default(ExponentialKLController, "min_kl_coef"),
        _default(ExponentialKLController, "max_kl_coef"),
    )
    pi = built(
        controller={
            "class_path": "rlkl_lightning.kl.controllers.PIKLController",
            "init_args": {"kp": 0.1, "ki": 0.01},
        }
    )
    assert type(pi) is PIKLController and (pi.kp, pi.ki, pi.target) == (0.1, 0.01, 6.0)
    # The log-PID law takes the target and bounds alone: its gains are its defaults.
    logpid = built(controller="logpid", target=4.0, max_kl_coef=2.0)
    assert type(logpid) is LogPIDKLController and (logpid.target, logpid.max_kl_coef) == (4.0, 2.0)
    assert (logpid.kp, logpid.ki) == (
        _default(LogPIDKLController, "kp"),
        _default(LogPIDKLController, "ki"),
    )


@pytest.mark.parametrize(
    ("law", "option", "value"),
    [("logpid", "horizon", 500.0), ("adaptive", "k", 0.3), ("pi", "horizon", 500.0)],
)
def test_a_gain_a_law_does_not_take_is_refused_naming_its_arguments(law, option, value):
    """`kl.kp` with the log-PID law was silently ignored (issue 37, item 10); a law's gains are
    its own arguments now, and one it does not take is refused, naming those it takes."""
    with pytest.raises(ValueError) as info:
        KLSettings(controller={"class_path": law, "init_args": {option: value}})
    message = str(info.value)
    assert message.startswith(f"`kl.controller.init_args` has no argument {option!r}: ")
    assert "min_kl_coef" in message  # the arguments the law takes are listed


def test_a_bound_set_both_in_the_group_and_the_laws_arguments_is_refused():
    law = {"class_path": "adaptive", "init_args": {"min_kl_coef": 0.01}}
    assert KLSettings(controller=law).kl_controller(0.1).min_kl_coef == 0.01
    assert KLSettings(controller=law, min_kl_coef=0.01).kl_controller(0.1).min_kl_coef == 0.01
    with pytest.raises(ValueError, match=r"`kl.min_kl_coef` \(0.02\) and `kl.controller"):
        KLSettings(controller=law, min_kl_coef=0.02).kl_controller(0.1)


def _default(cls, name):
    return inspect.signature(cls).parameters[name].default


# Each option of the kl group that has a default in a signature, and the parameters it feeds.
FEEDS = {
    "unit": [(KLControllerCallback, "unit"), (KLDriftMonitor, "unit")],
    "window": [(KLDriftMonitor, "window")],
    "high": [(KLDriftMonitor, "high")],
    "low": [(KLDriftMonitor, "low")],
    "strict": [(KLDriftMonitor, "strict")],
    "min_batches": [(KLDriftMonitor, "min_batches")],
    "hysteresis": [(KLDriftMonitor, "hysteresis")],
    "hold_after_refresh": [(KLControllerCallback, "hold_after_refresh")],
    "bound_patience": [(KLControllerCallback, "bound_patience")],
}


def test_every_kl_settings_default_is_the_default_of_the_signature_it_feeds():
    settings_ = KLSettings()
    for option, parameters in FEEDS.items():
        for cls, name in parameters:
            assert getattr(settings_, option) == _default(cls, name), (option, cls, name)
    # The rest have no class default to follow: the law picks the class, the classes require a
    # target, and unset bounds defer to the law (see the test above).
    others = {"controller", "target", "min_kl_coef", "max_kl_coef"}
    assert {f.name for f in dataclasses.fields(KLSettings)} == set(FEEDS) | others
    # The monitor's warm-up reaches it: None is its default (window + min(2 x window, 20)), a
    # number is kept; so does the hysteresis.
    assert KLSettings(window=7).callbacks(0.1)[1].min_batches == 21
    assert KLSettings(window=50).callbacks(0.1)[1].min_batches == 70
    assert KLSettings(window=7, min_batches=3).callbacks(0.1)[1].min_batches == 3
    assert KLSettings(hysteresis=0.0).callbacks(0.1)[1].hysteresis == 0.0
    assert _default(AdaptiveKLController, "target") is inspect.Parameter.empty
    assert _default(KLDriftMonitor, "target") is inspect.Parameter.empty
    assert (settings_.min_kl_coef, settings_.max_kl_coef) == (None, None)


# --------------------------------------------------------------------------------------------
# state


@pytest.mark.parametrize("law", KL_LAWS)
def test_state_round_trip_continues_the_same_trajectory(law):
    ctl = _make(law)
    for kl in KL_SEQUENCE[:6]:
        ctl.update(kl, 64)
    state = json.loads(json.dumps(ctl.state_dict()))  # plain, serializable values
    assert state["law"] == law and state["value"] == ctl.value
    if law in ("pi", "logpid"):
        assert state["integral"] == ctl.integral != math.log(0.1)
    if law == "logpid":
        assert state["log_error"] == ctl.log_error and state["trend"] == ctl.trend != 0.0

    resumed = _make(law)
    resumed.load_state_dict(state)
    fresh = _make(law)
    assert resumed.state_dict() == ctl.state_dict()
    rest = KL_SEQUENCE[6:] + [60.0, 60.0, 1.0]
    original = [ctl.update(kl, 64) for kl in rest]
    assert [resumed.update(kl, 64) for kl in rest] == original
    if law != "fixed":
        assert [fresh.update(kl, 64) for kl in rest] != original  # the state mattered


def test_load_state_dict_errors():
    ctl = _make("pi")
    with pytest.raises(ValueError, match="state is for law 'adaptive'"):
        ctl.load_state_dict(_make("adaptive").state_dict())
    with pytest.raises(ValueError, match="state is for law None"):
        ctl.load_state_dict({"value": 0.1})
    with pytest.raises(ValueError, match="expected a dict, got list"):
        ctl.load_state_dict([("law", "pi")])
    with pytest.raises(ValueError, match="has no `value`"):
        ctl.load_state_dict({"law": "pi"})
    for bad in (-0.1, 0.0, NAN, "x"):
        with pytest.raises(ValueError, match="`value` must be a finite number > 0"):
            ctl.load_state_dict({"law": "pi", "value": bad})
    for bad in (NAN, INF, "x"):
        with pytest.raises(ValueError, match="`integral` must be a finite number"):
            ctl.load_state_dict({"law": "pi", "value": 0.2, "integral": bad})
    assert ctl.value == 0.1  # failed loads change nothing


def test_load_state_dict_older_and_out_of_bounds_states():
    ctl = _make("pi")
    ctl.load_state_dict({"law": "pi", "value": 0.2})  # no integral: starts at log(value)
    assert ctl.integral == pytest.approx(math.log(0.2), rel=1e-15)
    assert ctl.update(6.0, 8) == pytest.approx(0.2, rel=1e-15)
    bounded = _make("adaptive", max_kl_coef=0.5)
    with pytest.warns(RuntimeWarning, match="outside the bounds"):
        bounded.load_state_dict({"law": "adaptive", "value": 0.9})
    assert bounded.value == 0.5


def test_deepcopy_is_independent():
    ctl = _make("pi")
    twin = copy.deepcopy(ctl)
    ctl.update(60.0, 1)
    assert twin.value == 0.1


# --------------------------------------------------------------------------------------------
# properties


any_kl = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-20.0, max_value=40.0),
)
positive = st.floats(min_value=1e-6, max_value=1e6)


@st.composite
def controllers(draw):
    """A controller of any law with random parameters, with or without bounds."""
    law = draw(st.sampled_from(KL_LAWS))
    lo = draw(st.none() | st.floats(min_value=1e-8, max_value=1.0))
    hi = draw(st.none() | st.floats(min_value=1.0, max_value=1e8))
    init = draw(st.floats(min_value=lo or 1e-8, max_value=hi or 1e8))
    bounds = dict(min_kl_coef=lo, max_kl_coef=hi)
    if law == "fixed":
        ctl = FixedKLController(init, **bounds)
    elif law == "adaptive":
        ctl = AdaptiveKLController(init, draw(positive), draw(positive), **bounds)
    elif law == "exponential":
        ctl = ExponentialKLController(init, draw(positive), draw(positive), **bounds)
    elif law == "logpid":
        unit = st.floats(min_value=1e-3, max_value=1.0)
        ctl = LogPIDKLController(
            init,
            draw(positive),
            kp=draw(st.floats(min_value=0.0, max_value=100.0)),
            ki=draw(st.floats(min_value=1e-6, max_value=100.0)),
            lead=draw(st.floats(min_value=0.0, max_value=100.0)),
            max_fall=draw(st.floats(min_value=1e-6, max_value=100.0)),
            alpha=draw(unit),
            gamma=draw(unit),
            dead_zone=draw(st.floats(min_value=0.0, max_value=10.0)),
            **bounds,
        )
    else:
        kp = draw(st.floats(min_value=0.0, max_value=100.0))
        ki = draw(st.floats(min_value=1e-6, max_value=100.0))
        clip = draw(st.floats(min_value=1e-3, max_value=1e3))
        ctl = PIKLController(init, draw(positive), kp, ki, clip, **bounds)
    return ctl


@settings(max_examples=200, deadline=None)
@example(ctl=AdaptiveKLController(1.0, target=1.0, horizon=0.125), steps=[(INF, 1)])
@given(
    ctl=controllers(),
    steps=st.lists(
        st.tuples(any_kl, st.integers(0, 64) | st.integers(0, 10**6)), min_size=1, max_size=40
    ),
)
def test_beta_stays_finite_positive_and_bounded(ctl, steps):
    lo = ctl.min_kl_coef if ctl.min_kl_coef is not None else sys.float_info.min
    hi = ctl.max_kl_coef if ctl.max_kl_coef is not None else sys.float_info.max
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for kl, n in steps:
            before = ctl.state_dict()
            # A batch too large for the horizon raises, unless its KL is ignored as non-finite.
            too_large = isinstance(ctl, AdaptiveKLController) and n * 0.2 >= ctl.horizon
            if too_large and math.isfinite(kl):
                with pytest.raises(ValueError, match="must be < 5"):
                    ctl.update(kl, n)
                assert ctl.state_dict() == before
                continue
            beta = ctl.update(kl, n)
            assert beta == ctl.value
            assert math.isfinite(beta) and beta > 0
            assert lo <= beta <= hi
            if not math.isfinite(kl) or n == 0:
                assert ctl.state_dict() == before
            if isinstance(ctl, PIKLController | LogPIDKLController):
                assert math.log(lo) <= ctl.integral <= math.log(hi)


@settings(max_examples=200, deadline=None)
@given(
    saturating=st.lists(st.floats(min_value=6.01, max_value=1e300), min_size=1, max_size=300),
    below=st.floats(min_value=-1e300, max_value=5.9),
    kp=st.floats(min_value=0.0, max_value=10.0),
    ki=st.floats(min_value=0.01, max_value=10.0),
)
def test_pi_leaves_the_upper_bound_as_soon_as_the_error_changes_sign(saturating, below, kp, ki):
    """However long beta sat at the upper bound, one update with KL below target (normalized
    error <= -0.01) moves it strictly below, by at least a factor exp(-ki * 0.01)."""
    ctl = PIKLController(0.5, 6.0, kp=kp, ki=ki, min_kl_coef=1e-3, max_kl_coef=1.0)
    while ctl.integral < 0.0:  # drive the integral term to log(max_kl_coef) first
        ctl.update(1e9, 1)
    for kl in saturating:
        ctl.update(kl, 1)
    assert ctl.value == 1.0
    assert ctl.update(below, 1) <= math.exp(-ki * 0.01)


def test_logpid_has_a_default_ceiling_mirroring_its_floor():
    # The 1-nat fixed-target run on the default world took beta to 1.5e7 without a ceiling.
    law = LogPIDKLController(0.1, 1.0)
    assert law.min_kl_coef == pytest.approx(0.1 * 0.09, rel=1e-15)
    assert law.max_kl_coef == pytest.approx(0.1 / 0.09, rel=1e-15)
    for _ in range(500):  # a KL PPO keeps at 5 x the target, whatever beta
        law.update(5.0, 8)
    assert law.value == law.max_kl_coef and law.integral == pytest.approx(math.log(0.1 / 0.09))
    assert LogPIDKLController(0.1, 1.0, max_kl_coef=2.0).max_kl_coef == 2.0
    assert LogPIDKLController(0.1, 1.0, min_kl_coef=1e-3).max_kl_coef == law.max_kl_coef
