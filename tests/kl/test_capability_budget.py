"""CapabilityBudget: its law against the formula written out here, and driven by a Trainer."""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.kl_callbacks import fit
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning.compare.budget import settling
from rlkl_lightning.kl import budget_model
from rlkl_lightning.kl.budget_model import HORIZONS, KERNELS, LAGS, LEAD, ExcessModel
from rlkl_lightning.kl.capability_budget import CapabilityBudget
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import (
    ExponentialKLController,
    FixedKLController,
    LogPIDKLController,
)
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor

REF = 10.0  # the reference's perplexity in the synthetic plant
SLOPE = 0.1  # log(ppl / ref) per nat of KL: the plant's excess grows in proportion to the KL


# ---- the law, one evaluation at a time ------------------------------------------------------


def _lagged(log_kls, lag, n=5):
    """s_L after each evaluation of ``n`` batches whose mean log KL is each of ``log_kls``."""
    s, out = None, []
    for k in log_kls:
        s = k if s is None else s + (1 - math.exp(-n / lag)) * (k - s)
        out.append(s)
    return out


def _kernel(log_kls, kernel, n=5):
    """z of ``kernel`` (``((lag, weight), ...)``) after each evaluation, from its lags."""
    parts = [[w * s for s in _lagged(log_kls, lag, n)] for lag, w in kernel]
    return [sum(values) for values in zip(*parts, strict=True)]


def test_the_kernels_horizons_keep_the_lead_share_of_a_kl():
    # The first kernel keeps LEAD of a step in the KL after 11.9 batches (its 5-batch half has
    # all but forgotten it, its 50-batch half keeps 79%); a single lag after L ln(1 / LEAD).
    for kernel, horizon in zip(KERNELS, HORIZONS, strict=True):
        kept = sum(w * math.exp(-horizon / lag) for lag, w in kernel)
        assert kept == pytest.approx(LEAD, rel=1e-12)
    assert HORIZONS[0] == pytest.approx(11.92, abs=0.01)
    assert HORIZONS[1] == pytest.approx(100 * math.log(1 / LEAD), rel=1e-12)
    assert sorted(LAGS) == [5.0, 50.0, 100.0, 200.0]


def test_the_fit_is_the_weighted_ridge_least_squares_solved_a_second_way():
    # The model's normal equations against torch's least squares on the weighted rows, the
    # ridge written as two extra rows: the same (c, a, d) and residual.
    rng = random.Random(3)
    model = ExcessModel()
    rows = []
    for k in range(40):
        log_kl = math.log(1.5 + 0.5 * math.sin(k / 3) + 0.1 * rng.random())
        excess = math.exp(-2.0 + 0.8 * log_kl + 0.002 * 5 * k + rng.gauss(0, 0.05))
        model.update(log_kl, 5, excess, 1e-6)
        rows.append(log_kl)
    for i in range(len(KERNELS)):
        fit = model._fit(i)
        t_now = model.t
        w, a_rows, y = [], [], []
        for t, log_x, seen in model.history:
            w.append(math.exp(-(t_now - t) / budget_model.MEMORY))
            a_rows.append([1.0, seen[i], (t - t_now) / budget_model.DRIFT_UNIT])
            y.append(log_x)
        total = sum(w)
        sw = torch.tensor(w, dtype=torch.float64).sqrt()
        design = torch.tensor(a_rows, dtype=torch.float64) * sw[:, None]
        target = torch.tensor(y, dtype=torch.float64) * sw
        ridge_a = math.sqrt(budget_model.RIDGE_ELASTICITY * total)
        ridge_d = math.sqrt(budget_model.RIDGE_DRIFT * total)
        design = torch.cat(
            [design, torch.tensor([[0.0, ridge_a, 0.0], [0.0, 0.0, ridge_d]], dtype=torch.float64)]
        )
        target = torch.cat([target, torch.tensor([ridge_a, 0.0], dtype=torch.float64)])
        c, a, d = torch.linalg.lstsq(design, target[:, None]).solution[:, 0].tolist()
        assert (fit.c, fit.elasticity, fit.drift) == pytest.approx((c, a, d), rel=1e-9, abs=1e-12)
        residual = (
            sum(
                wi * (yi - c - a * r[1] - d * r[2]) ** 2
                for wi, yi, r in zip(w, y, a_rows, strict=True)
            )
            / total
        )
        assert fit.residual == pytest.approx(residual, rel=1e-9)
    assert model.kernel == 0  # the plant has no lag: the first kernel is kept


def test_the_fit_finds_a_noise_free_plants_elasticity_and_drift_and_wants_its_kl():
    # log x = -2 + 0.8 z + 0.01 per 5 batches, z the first kernel's: the fit recovers a and d
    # but for the ridge's pull (a toward 1, d toward 0), and the KL it wants is the one that,
    # held, brings z to the z of the budget's excess within the kernel's horizon, written out.
    model = ExcessModel()
    log_kls = [math.log(2.0 + math.sin(k / 2)) for k in range(30)]  # not collinear with time
    for k, z in enumerate(_kernel(log_kls, KERNELS[0])):
        model.update(log_kls[k], 5, math.exp(-2.0 + 0.8 * z + 0.002 * 5 * k), 1e-6)
    fit = model.fit
    assert model.kernel == 0
    assert 0.8 < fit.elasticity < 0.95  # the ridge draws it toward 1
    assert fit.drift == pytest.approx(0.2, rel=0.25)  # per 100 batches
    # The drift carried ahead: the offsets' least-squares slope over the last 80 batches,
    # computed a second way (numpy's polyfit), and close to the plant's.
    zs = _kernel(log_kls, KERNELS[0])
    recent = [k for k in range(30) if 5 * 29 - 5 * k < budget_model.TREND_BATCHES]
    offsets = [-2.0 + 0.8 * zs[k] + 0.01 * k - fit.elasticity * zs[k] for k in recent]
    slope = np.polyfit([5.0 * k for k in recent], offsets, 1)[0]
    assert model.trend == pytest.approx(100 * slope, rel=1e-9)
    assert model.trend == pytest.approx(0.2, rel=0.25)
    b = math.log(1.3)
    z = model.seen[0]
    assert z == pytest.approx(zs[-1], rel=1e-12)
    ahead = budget_model.LEVEL + budget_model.AHEAD + 2.5
    log_x = model.levels[0] + fit.elasticity * z + model.trend * ahead / 100
    z_star = z + (math.log(b) - log_x)  # the elasticity below 1: the step divides by 1
    (l5, w5), (l50, w50) = KERNELS[0]
    s5, s50 = _lagged(log_kls, l5)[-1], _lagged(log_kls, l50)[-1]
    e5, e50 = math.exp(-HORIZONS[0] / l5), math.exp(-HORIZONS[0] / l50)
    u = (z_star - w5 * e5 * s5 - w50 * e50 * s50) / (1 - LEAD)
    assert model.wanted(math.log(b), 5) == pytest.approx(u, rel=1e-9)
    # Held from now on, that KL brings z to z_star after the horizon (closed form per lag).
    z_then = sum(
        w * (u + (s - u) * math.exp(-HORIZONS[0] / lag))
        for (lag, w), s in zip(KERNELS[0], (s5, s50), strict=True)
    )
    assert z_then == pytest.approx(z_star, rel=1e-9)


def _longer_lags(rows, budget=1.3):
    """Evaluations of a logged run at which the bank holds a kernel other than its first."""
    model, before, b, longer = ExcessModel(), 0, math.log(budget), []
    for batch, kl, ratio in rows:
        model.update(math.log(kl), batch - before, max(math.log(ratio), 0.1 * b), 0.1 * b)
        before = batch
        if model.kernel > 0:
            longer.append(batch)
    return longer


@pytest.mark.parametrize("run", ["default_1.3_seed2", "kjv_1.3_seed1_080"])
def test_on_two_logged_runs_the_bank_keeps_the_first_kernel(run, monkeypatch):
    # Two real runs (tests/kl/budget_runs.json). Without the span rule and with a slack of 0.5
    # (0.10.0's first bank) a smooth 100-200-batch lag fitted their noisy ramps better from
    # batch 10 on (20 and 33 of 60 evaluations, with 0.10.0's short lag; in the run itself the
    # default-world one sat under its band for 140 batches); with the rule, the first kernel
    # all but once, and without it a long one at 17 and 8 evaluations.
    rows = json.loads((Path(__file__).parent / "budget_runs.json").read_text())[run]
    assert len(_longer_lags(rows)) <= 1
    monkeypatch.setattr(budget_model, "EVIDENCE", 0.0)
    monkeypatch.setattr(budget_model, "SLACK", 0.5)
    assert len(_longer_lags(rows)) >= 8


def test_a_longer_lag_is_chosen_only_when_it_explains_the_evaluations_clearly_better():
    # A plant whose excess follows a 100-batch lag of the KL: the bank finds it. One that
    # follows the first kernel, with noise, or a 5-batch lag: the first kernel is kept.
    for kernel, noise, chosen in [
        (((100.0, 1.0),), 0.0, 1),
        (KERNELS[0], 0.05, 0),
        (((5.0, 1.0),), 0.05, 0),
    ]:
        rng = random.Random(0)
        model = ExcessModel()
        log_kls = [math.log(1.0 if k < 10 else 3.0) for k in range(60)]
        for k, z in enumerate(_kernel(log_kls, kernel)):
            model.update(log_kls[k], 5, math.exp(-2.0 + z + rng.gauss(0, noise)), 1e-6)
        assert model.kernel == chosen, kernel


class FakeControllerCallback(SimpleNamespace):
    """What the budget reads of a KLControllerCallback: batches, the KL sums, set_target."""

    def set_target(self, target):
        self.target = target


def _wired(budget: CapabilityBudget, target: float) -> FakeControllerCallback:
    ctl = FakeControllerCallback(n_batches=0, kl_sum=0.0, kl_count=0, target=target)
    budget._controller, budget.target = ctl, target
    budget.reference = REF
    return ctl


def test_each_evaluation_follows_the_formula_with_its_clip_holds_floor_and_ceiling():
    budget = CapabilityBudget(
        1.15, raise_per_batch=0.005, fall_per_batch=0.04, min_target=0.5, max_target=4.0
    )
    ctl = _wired(budget, 2.0)
    shadow = ExcessModel()  # the model fed by hand: what the budget's own must want
    b = math.log(1.15)
    target, kl_before, held, held_low = 2.0, math.nan, 0, 0
    for ratio, batches, kl_mean in [
        (1.30, 5, 2.1),  # over budget: lower, by at most 0.04 n
        (1.05, 5, 2.0),  # under budget: raise, by at most 0.005 n
        (1.12, 10, 0.5),  # under budget but the KL lags (0.5 < 0.7 target): held
        (1.30, 5, 3.5),  # over budget, the KL above target / 0.7 and rising: held
        (1.30, 5, 3.0),  # ... the KL falls: the law follows it down, so lowered
        (1.30, 50, 2.0),  # far over budget, a long interval: down to the floor
        (1.00, 5, 0.6),  # at the reference: the excess at its floor 0.1 b
        (1.10, 500, 3.9),  # under budget, a long interval: up to the ceiling
        (1.01, 5, 0.3),  # at the reference and the KL far behind the target: no rise
        (1.60, 5, 6.0),  # far over budget, the KL above target / 0.7 and rising: no fall
    ]:
        ctl.n_batches += batches
        ctl.kl_sum += kl_mean * batches
        ctl.kl_count += batches
        new = budget.step(ratio * REF)
        shadow.update(math.log(kl_mean), batches, max(math.log(ratio), 0.1 * b), 0.1 * b)
        now = math.log(target)
        u = min(
            max(shadow.wanted(math.log(b), batches), now - 0.04 * batches), now + 0.005 * batches
        )
        if kl_mean < 0.7 * target and u > now:
            u, held = now, held + 1
        if kl_mean > target / 0.7 and not kl_mean < kl_before and u < now:
            u, held_low = now, held_low + 1
        kl_before = kl_mean
        target = min(max(math.exp(u), 0.5), 4.0)
        assert new == pytest.approx(target, rel=1e-14)
    assert (budget.n_held, budget.n_held_low) == (held, held_low)
    assert held >= 1 and held_low >= 1, (held, held_low)


def _plant(budget, tau_i, tau_p, a, n, batches, star=3.0, noise=0.0, kl_noise=0.0, seed=0):
    """The two-lag plant: the KL follows the target with a lag tau_i, the log excess follows a
    log KL with a lag tau_p and an elasticity a (at budget for a KL of `star`). Returns the
    ratio at each evaluation (noise-free) and the target after it."""
    rng = random.Random(seed)
    b = math.log(budget.budget)
    start = budget.target
    ctl = _wired(budget, start)
    p, q = math.exp(-1 / tau_i), math.exp(-1 / tau_p)
    log_kl = log_seen = math.log(start)  # the plant starts settled at the start
    ratios, targets = [], []
    for t in range(1, batches + 1):
        log_kl = p * log_kl + (1 - p) * math.log(budget.target)
        log_seen = q * log_seen + (1 - q) * log_kl
        ctl.n_batches += 1
        ctl.kl_sum += math.exp(log_kl + rng.gauss(0, kl_noise))
        ctl.kl_count += 1
        if t % n == 0:
            excess = b * math.exp(a * (log_seen - math.log(star)))
            budget.step(math.exp(excess + rng.gauss(0, noise)) * REF)
            ratios.append(math.exp(excess))
            targets.append(budget.target)
    return ratios, targets


PLANTS = [(10, 20, 0.77), (20, 100, 0.77), (20, 100, 1.3), (20, 200, 1.3)]


@pytest.mark.parametrize("n", [5, 10, 25, 50])
@pytest.mark.parametrize("tau_i,tau_p,a", PLANTS)
def test_on_plants_of_two_lags_the_loop_settles_without_passing_the_budget(tau_i, tau_p, a, n):
    # The start 3x below the target that holds the budget; the review's slow plants (20, 100)
    # and (20, 200) with an elasticity of 1.3 among them. 0.4.0's law swung a third past the
    # budget's excess on the slow plants, and oscillated at n = 50. The lead (asking for the
    # KL that reaches the budget within the kernel's horizon) passes it by up to 17% of its
    # excess (the fast plant at n = 50; 0.10.1's law, without a lead, by 0.3%): in the band.
    budget = CapabilityBudget(1.3)
    budget.target = 1.0
    ratios, targets = _plant(budget, tau_i, tau_p, a, n, batches=4000)
    assert max(ratios) < 1 + 1.2 * 0.3
    assert ratios[-1] == pytest.approx(1.3, abs=0.01 * 0.3)  # settled, within 1% of the excess
    assert targets[-1] == pytest.approx(3.0, rel=0.02)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget_ratio", [1.15, 1.3])
@pytest.mark.parametrize("tau_i,tau_p,a", PLANTS)
def test_with_noise_on_the_perplexity_and_the_kl_the_loop_stays_within_a_quarter(
    tau_i, tau_p, a, budget_ratio, seed
):
    # An evaluation's log perplexity scatters by 0.003 and a batch's KL by 25% (log sd).
    budget = CapabilityBudget(budget_ratio)
    budget.target = 1.0
    ratios, _ = _plant(budget, tau_i, tau_p, a, 5, 1500, noise=0.003, kl_noise=0.25, seed=seed)
    excess = budget_ratio - 1
    # Past the budget by at most a quarter of its excess on the fast plant. On the slow ones by
    # up to 72% of it (at 1.15x, where the noise is largest against the excess; 53% with
    # 0.10.1's law): their lag is chosen only once the evaluations span it and it fits 3x
    # better than the first kernel, and until then the first kernel's lead, half of it a
    # 50-batch lag, asks for more KL than a 100-200-batch lag answers in time (docs/budget.md,
    # "The bank's choice").
    assert max(ratios) < 1 + (1.25 if tau_p <= 20 else 1.75) * excess
    tail = ratios[-100:]  # the last 500 batches
    assert max(abs(r - budget_ratio) for r in tail) < 0.1 * excess


# The three worlds' shapes, from the budget study of 0.8.0's law (docs/studies.md): the excess
# x(K) = x0 min(1, K / 0.3) + s K^e of the KL seen over 5 batches, drifting up by rho per
# batch and nat (at 2.6 nats, rho 0.001 is half the fastest drift measured, 0.002 all of it).
WORLDS = {
    "default": (0.02, 0.094, 1.0),
    "fortunes": (0.061, 0.0565, 1.0),
    "kjv": (0.04, 0.0318, 1.25),
}


def _world(budget, shape, n, rho, seed, batches=300):
    """A run on a world's shape: the KL law follows the target with a 15-batch lag, wanders
    by 10% and measures the batch KL with 25% noise; the evaluation's log ratio by 0.008.
    Returns (batch, ratio) after each evaluation."""
    rng = random.Random(seed)
    x0, slope, power = WORLDS[shape]
    ctl = _wired(budget, budget.target)
    kl = seen = 0.05
    drift = 0.0
    out = []
    for t in range(1, batches + 1):
        drift += rho * kl / 2.6
        kl += (1 - math.exp(-1 / 15)) * (budget.target * math.exp(0.1 * rng.gauss(0, 1)) - kl)
        seen += (1 - math.exp(-1 / 5)) * (kl - seen)
        ctl.n_batches += 1
        ctl.kl_sum += kl * math.exp(rng.gauss(0, 0.25) - 0.25**2 / 2)
        ctl.kl_count += 1
        if t % n == 0:
            excess = (x0 * min(1.0, seen / 0.3) + slope * seen**power) * math.exp(drift)
            budget.step(math.exp(excess + rng.gauss(0, 0.008)) * REF)
            out.append((t, math.exp(excess)))
    return out


@pytest.mark.parametrize("rho", [0.0, 0.001])
@pytest.mark.parametrize("budget_ratio", [1.15, 1.3])
@pytest.mark.parametrize("shape", sorted(WORLDS))
def test_on_the_worlds_shapes_the_ratio_is_in_its_band_by_batch_120_and_stays(
    shape, budget_ratio, rho
):
    # Issue 47's criteria on simulated runs, 3 seeds each. 0.8.0's law met them in 4 of 14 real
    # runs.
    for seed in range(3):
        budget = CapabilityBudget(budget_ratio)
        budget.target = 1.0  # configs/ppo_budget.yaml's start
        out = _world(budget, shape, 5, rho, seed)
        assert not _meets_the_criteria(out, budget_ratio, 120), seed


def _meets_the_criteria(out, budget_ratio, by):
    """Issue 47's criteria on (batch, ratio) rows, as the budget study reports them: the
    failures, named (:func:`rlkl_lightning.compare.budget.settling`)."""
    return settling(out, budget_ratio, by)["failures"]


# Two-lag plants of 16 logged budget runs of 0.10.x's law (default world 12, Python docstrings
# 2, fortunes 2; 1.15x and 1.3x): the excess x = c min(1, K5 / 0.3) + f K5 + g KL_L of the
# batch KL seen over 5 batches (K5) and over the run's slow lag L, fitted by least squares to
# each run's 60 validation ratios (L the best of 30, 50, 80, 120 and 200 batches; a line in
# the 5-batch lag alone left 1.3-2.8x the residual sd). Rows: (c, f, g, L).
LOGGED_PLANTS = [
    (0.046, 0.019, 0.049, 50), (0.093, 0.014, 0.042, 80), (0.085, 0.007, 0.037, 30),
    (0.062, 0.042, 0.026, 80), (0.039, 0.033, 0.043, 50), (0.056, 0.027, 0.057, 50),
    (0.072, 0.035, 0.047, 80), (0.042, 0.041, 0.066, 200), (0.084, 0.027, 0.035, 200),
    (0.089, 0.001, 0.077, 50), (0.076, 0.022, 0.039, 120), (0.057, 0.040, 0.046, 50),
    (0.035, 0.070, 0.042, 80), (0.082, 0.039, 0.038, 120), (0.056, 0.040, 0.051, 80),
    (0.097, 0.000, 0.067, 30),
]  # fmt: skip


def _logged_plant(budget, plant, n, seed, batches=300, creep=0.0):
    """A run on a logged run's plant, with _world's KL law and its noise on the validation,
    plus a slow wander of the excess (sd 0.008, 20 batches) and the test split's own noise;
    with ``creep``, the excess grows by ``exp(creep K / 1.5)`` a batch at a KL ``K``.
    Returns the (batch, test ratio) rows."""
    rng = random.Random(seed)
    c, fast, slow, lag = plant
    ctl = _wired(budget, budget.target)
    kl = kl_5 = kl_slow = 0.05
    wander = grown = 0.0
    out = []
    for t in range(1, batches + 1):
        grown += creep * kl / 1.5
        kl += (1 - math.exp(-1 / 15)) * (budget.target * math.exp(0.1 * rng.gauss(0, 1)) - kl)
        kl_5 += (1 - math.exp(-1 / 5)) * (kl - kl_5)
        kl_slow += (1 - math.exp(-1 / lag)) * (kl - kl_slow)
        wander = math.exp(-1 / 20) * wander + math.sqrt(1 - math.exp(-2 / 20)) * rng.gauss(0, 0.008)
        ctl.n_batches += 1
        ctl.kl_sum += kl * math.exp(rng.gauss(0, 0.25) - 0.25**2 / 2)
        ctl.kl_count += 1
        if t % n == 0:
            excess = (c * min(1.0, kl_5 / 0.3) + fast * kl_5 + slow * kl_slow) * math.exp(
                grown
            ) + wander
            budget.step(math.exp(excess + rng.gauss(0, 0.008)) * REF)
            out.append((t, math.exp(excess + rng.gauss(0, 0.008))))
    return out


@pytest.mark.parametrize("n,by,least", [(5, 120, 48), (25, 200, 46)])
@pytest.mark.parametrize("budget_ratio", [1.15, 1.3])
def test_on_logged_runs_plants_the_ratio_is_in_its_band_in_time_and_stays(
    budget_ratio, n, by, least
):
    # Issue 47's criteria on each plant, 3 seeds: at the shipped interval on all 48 runs, at
    # 25 (the band by batch 200) on 46 of 48 at least (48 at 1.3x). 0.10.1's law, which
    # answered the 5-batch lag at once, met them in 41 and 43 of 48 (1.15x, 1.3x) at
    # interval 5, 44 and 42 at 25: it raised the target past what holds the budget while the
    # slow lag had not yet answered, as in the real runs.
    met = 0
    for plant in LOGGED_PLANTS:
        for seed in range(3):
            budget = CapabilityBudget(budget_ratio)
            budget.target = 1.0  # configs/ppo_budget.yaml's start
            met += not _meets_the_criteria(_logged_plant(budget, plant, n, seed), budget_ratio, by)
    assert met >= least


@pytest.mark.parametrize("budget_ratio", [1.15, 1.3])
def test_on_logged_plants_that_creep_at_a_constant_kl_the_budget_is_held(budget_ratio):
    # The default world's 12 fixed-target runs (1-3.5 nats, 300 batches, 2026-11-30) raised
    # the log test ratio at a held KL by 2-16% of itself per 100 batches over batches 100-300
    # (docs/budget.md, "Creep at a constant KL"); here 0.002 a batch at 1.5 nats, faster. The
    # fit's drift, over its 150-batch memory and the start-up, saw such a creep only after
    # 125-200 batches. The trend over the last 80 batches meets the criteria on 44 of 48
    # runs (0.11.0's law: 26 and 31), the last third's mean within 0.004 of the budget on
    # average (0.11.0's: +0.012 and +0.018).
    met, lasts = 0, []
    for plant in LOGGED_PLANTS:
        for seed in range(3):
            budget = CapabilityBudget(budget_ratio)
            budget.target = 1.0
            out = _logged_plant(budget, plant, 5, seed, creep=0.002)
            met += not _meets_the_criteria(out, budget_ratio, 120)
            lasts.append(np.mean([r for t, r in out if t > 200]))
    assert met >= 44
    assert abs(np.mean(lasts) - budget_ratio) < 0.004


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("star", [0.5, 2.0])
def test_near_a_budget_of_one_the_target_holds_within_a_fifth_of_the_right_one(star, seed):
    # The review's case: budget 1.01, a plant without lag, log perplexity noise sd 0.002
    # (a fifth of log 1.01): 0.4.0's asymmetric steps dragged the target to its floor.
    budget = CapabilityBudget(1.01)
    budget.target = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the noise is under half the excess: no warning
        _, targets = _plant(budget, 1e-3, 1e-3, 1.0, 5, 1500, star=star, noise=0.002, seed=seed)
    last_third = targets[-len(targets) // 3 :]
    assert sum(last_third) / len(last_third) == pytest.approx(star, rel=0.2)
    assert budget.model.noise_sd == pytest.approx(0.002, rel=0.3)


def test_a_budget_below_the_noise_warns_once_naming_the_smallest_it_can_hold():
    budget = CapabilityBudget(1.001)
    budget.target = 1.0
    with pytest.warns(RuntimeWarning, match="scatter") as caught:
        _plant(budget, 1e-3, 1e-3, 1.0, 5, 1500, star=2.0, noise=0.002)
    said = [str(w.message) for w in caught if "scatter" in str(w.message)]
    assert len(said) == 1
    smallest = float(said[0].split("can hold is about ")[1].split(" ")[0])
    assert smallest == pytest.approx(math.exp(2 * 0.002), rel=0.002)


def test_a_kl_that_does_not_follow_the_target_down_holds_the_target_and_warns_once():
    # The KL law is stuck at 1.3 nats (PPO's floor on the default world): a budget that keeps
    # lowering the target would wind the law's beta up without end.
    budget = CapabilityBudget(1.15, min_target=0.1)
    ctl = _wired(budget, 1.3)
    targets = []
    with pytest.warns(RuntimeWarning, match="not lowered further") as caught:
        for _ in range(40):
            ctl.n_batches += 5
            ctl.kl_sum += 1.3 * 5
            ctl.kl_count += 5
            targets.append(budget.step(1.25 * REF))  # far over budget, every time
    assert len([w for w in caught if "not lowered" in str(w.message)]) == 1
    # Lowered (by at most max_step a time) until the target passed follow x the KL, then held.
    assert targets[0] < 1.3 and min(targets) == targets[-1]
    assert 1.3 * 0.7 * math.exp(-0.2) <= targets[-1] < 1.3 * 0.7
    assert budget.n_held_low >= 30 and targets[-30:] == [targets[-1]] * 30


def test_mode_max_steers_a_score_as_min_mode_steers_its_inverse():
    # A score that must stay above 0.9 x the reference's is a loss log(ref / m) against the
    # budget's log(1 / 0.9): the same targets as min mode at budget 1 / 0.9 on ref / m.
    high = CapabilityBudget(0.9, mode="max", reference_key=None)
    low = CapabilityBudget(1 / 0.9, reference_key=None)
    wired = [_wired(high, 1.0), _wired(low, 1.0)]
    high.reference = low.reference = 1.0
    rng = random.Random(0)
    for k in range(40):
        kl = 0.5 + 0.1 * k + rng.random()
        score = 0.95 - 0.02 * kl + 0.01 * rng.random()
        for ctl in wired:
            ctl.n_batches += 5
            ctl.kl_sum += kl * 5
            ctl.kl_count += 5
        assert high.step(score) == pytest.approx(low.step(1.0 / score), rel=1e-12)
    assert high.target != 1.0


def test_a_perplexity_drifting_at_a_constant_kl_is_followed_and_anticipated():
    # The excess grows as c(t) x KL, c rising by exp(rho) a batch; the KL holds the target.
    # The fit's drift is anticipated by AHEAD + n / 2 batches (the KL law's lag and the mean of
    # the coming interval), so with a KL law that follows at once the excess sits below the
    # budget, by at most rho (AHEAD + n / 2) in log (2% of it here; the ridge on the drift
    # takes some of that back), and steadily.
    rho, n = 0.001, 5
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 1.5)
    b = math.log(1.15)
    errors = []
    for k in range(400):  # log T falls by 2 in all, above the floor (0.1)
        target = budget.target
        ctl.n_batches += n
        ctl.kl_sum += target * n
        ctl.kl_count += n
        excess = b * (target / 1.5) * math.exp(rho * n * k)
        budget.step(math.exp(excess) * REF)
        errors.append(math.log(excess / b))
    steady = sum(errors[-100:]) / 100
    assert -rho * (budget_model.AHEAD + n / 2) <= steady < 0
    assert max(abs(e - steady) for e in errors[-100:]) < 0.005
    assert budget.target < 1.5 * math.exp(-1.5)


def test_the_trend_is_carried_only_once_the_smoothed_excess_has_reached_its_band():
    # At a constant KL the excess rises from 0.3 to 0.75 of the budget's: the model measures a
    # trend but asks as without it until the trailing mean of 3 evaluations reaches 0.8 of it.
    import copy

    b = math.log(1.3)
    model = ExcessModel()
    shares = [0.3 + 0.45 * k / 20 for k in range(21)] + [0.9, 0.9, 0.9, 0.5, 0.5]
    carried = []
    for share in shares:
        model.update(math.log(2.0), 5, share * b, 0.1 * b)
        untrended = copy.deepcopy(model)
        untrended.trend = 0.0
        want, plain = model.wanted(math.log(b), 5), untrended.wanted(math.log(b), 5)
        assert model.trend >= 0.0
        assert want == plain if model.trend == 0.0 else (want < plain) == model.reached(math.log(b))
        carried.append(model.reached(math.log(b)))
    means = np.convolve(shares, np.ones(3) / 3, mode="valid")  # a second way: numpy's mean
    expected = [bool((means[: max(k - 2, 0)] >= 0.8 - 1e-12).any()) for k in range(1, 27)]
    assert carried == expected
    assert carried.index(True) == 22  # one evaluation at 0.9 does not open it; two do
    assert model.trend > 0.0 and all(carried[23:])  # it stays open when the excess falls back


@pytest.mark.parametrize("metric", [math.nan, math.inf, -1.0, 0.0])
def test_an_unusable_metric_leaves_the_target_and_warns_once(metric):
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 2.0)
    with pytest.warns(RuntimeWarning, match="target stays 2"):
        assert budget.step(metric) == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert budget.step(metric) == 2.0
    ctl.n_batches += 5
    assert budget.n_skipped == 2 and budget.target == 2.0


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"budget": 1.0}, "budget"),
        ({"budget": 0.9}, "budget"),
        ({"budget": 1.2, "mode": "max"}, "budget"),
        ({"mode": "lower"}, "mode"),
        ({"fall_per_batch": math.nan}, "fall_per_batch"),
        ({"raise_per_batch": -1.0}, "raise_per_batch"),
        ({"min_target": -1.0}, "min_target"),
        ({"min_target": 2.0, "max_target": 1.0}, "max_target"),
        ({"follow": 1.5}, "follow"),
        ({"error_floor": 1.0}, "error_floor"),
        ({"monitor": ""}, "monitor"),
    ],
)
def test_bad_options_are_refused_naming_the_option(kwargs, option):
    with pytest.raises(ValueError, match=f"`?{option}`? must"):
        CapabilityBudget(**kwargs)


def test_the_fixed_law_is_refused_by_name_with_the_allowed_laws():
    trainer = SimpleNamespace(callbacks=[KLControllerCallback(FixedKLController(0.1))])
    with pytest.raises(ValueError, match=r"`kl.controller` must be one of \('adaptive', "):
        CapabilityBudget().setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="exactly one KLControllerCallback"):
        CapabilityBudget().setup(SimpleNamespace(callbacks=[]), None, "fit")


# ---- a Trainer: a synthetic plant ------------------------------------------------------------


class PlantModule(pl.LightningModule):
    """KL = 1 / beta each batch; held-out perplexity = REF * exp(SLOPE * KL of the last batch).

    Records the target the budget logged after each batch (keyed by the global batch index).
    """

    def __init__(self, n_batches=40, rank_offsets=(0.0, 0.0)):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.kl_coef = 1.0
        self.n_batches = n_batches
        self.rank_offsets = rank_offsets
        self.kl = 0.0
        self.targets: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        self.kl = 1.0 / self.kl_coef
        self.log("objective/kl", self.kl)
        return (self.layer(batch[0]) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        metrics = self.trainer.callback_metrics
        if "objective/kl_target" in metrics:
            i = self.trainer.fit_loop.epoch_loop.total_batch_idx
            self.targets[i] = float(metrics["objective/kl_target"])

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        # Under DDP each rank measures its own value; sync_dist averages them.
        ppl = REF * math.exp(SLOPE * self.kl + self.rank_offsets[self.global_rank])
        self.log("val/perplexity", ppl, sync_dist=True)
        self.log("val/perplexity_ref", REF, sync_dist=True)

    def train_dataloader(self):
        data = torch.randn(4 * self.n_batches, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(1, 3)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _callbacks(**budget):
    controller = KLControllerCallback(ExponentialKLController(1.0, target=3.0, k=0.3))
    monitor = KLDriftMonitor(3.0, window=4, verbose=False)
    return [controller, monitor, CapabilityBudget(**{"budget": 1.15, **budget})]


VAL = dict(limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)


def test_the_cascade_settles_at_the_budget_and_the_monitor_follows_its_target():
    module = PlantModule(n_batches=160)
    callbacks = _callbacks()
    fit(module, callbacks, **VAL)
    controller, monitor, budget = callbacks
    # At equilibrium exp(SLOPE * KL) = 1.15 and the KL law holds KL = target.
    assert budget.target == pytest.approx(math.log(1.15) / SLOPE, rel=0.02)
    assert budget.ratio == pytest.approx(1.15, rel=0.003)
    assert controller.target == monitor.target == budget.target
    assert module.targets[159] == pytest.approx(
        budget.target, rel=1e-3
    )  # logged before the last move
    assert budget.reference == REF and budget.n_skipped == 0


def test_a_resume_continues_the_cascade_bit_for_bit(tmp_path):
    whole = PlantModule(n_batches=24)
    fit(whole, _callbacks(), **VAL)
    first = PlantModule(n_batches=24)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=11, save_top_k=-1)
    fit(first, [*_callbacks(), saver], max_steps=11, **VAL)
    resumed = PlantModule(n_batches=24)
    callbacks = _callbacks()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # restored without a warning
        fit(resumed, callbacks, ckpt_path=str(tmp_path / "epoch=0-step=11.ckpt"), **VAL)
    assert {i: t for i, t in resumed.targets.items() if i >= 11} == {
        i: t for i, t in whole.targets.items() if i >= 11
    }
    assert callbacks[2].target == whole.trainer.callbacks[2].target


def test_a_refresh_of_the_reference_does_not_reset_the_budget():
    budget = CapabilityBudget(1.15)
    trainer = SimpleNamespace(
        callback_metrics={"val/perplexity": torch.tensor(12.0), "val/perplexity_ref": 10.0},
        sanity_checking=False,
        strategy=SimpleNamespace(broadcast=lambda x, src=0: x),
    )
    ctl = _wired(budget, 2.0)
    budget.reference = None
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 5, 10.0, 5
    budget.on_validation_end(trainer, None)
    trainer.callback_metrics["val/perplexity_ref"] = 11.5  # a refreshed reference's
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 10, 20.0, 10
    budget.on_validation_end(trainer, None)
    assert budget.reference == 10.0 and budget.ratio == pytest.approx(1.2)
    state = budget.state_dict()
    again = CapabilityBudget(1.15)
    again.load_state_dict(state)
    assert again.reference == 10.0 and again.target == budget.target


# ---- two real processes (gloo) ------------------------------------------------------------


class RankPlant(PlantModule):
    def __init__(self, out_dir):
        super().__init__(n_batches=20, rank_offsets=(0.02, -0.01))
        self.out_dir = str(out_dir)

    def on_train_end(self):
        budget = next(c for c in self.trainer.callbacks if isinstance(c, CapabilityBudget))
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump({"targets": self.targets, "target": budget.target}, f)


def test_two_process_ddp_gives_every_rank_the_same_target(tmp_path):
    fork = "fork" in multiprocessing.get_all_start_methods()
    fit(
        RankPlant(tmp_path),
        _callbacks(),
        strategy="ddp_fork" if fork else "ddp_spawn",
        devices=2,
        use_distributed_sampler=False,
        **VAL,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    # sync_dist averages the ranks' perplexities: a single process with the mean's offset.
    offset = math.log((math.exp(0.02) + math.exp(-0.01)) / 2)
    single = PlantModule(n_batches=20, rank_offsets=(offset,))
    callbacks = _callbacks()
    fit(single, callbacks, **VAL)
    assert ranks[0]["target"] == pytest.approx(callbacks[2].target, rel=1e-6)
    assert ranks[0]["target"] != pytest.approx(3.0, rel=1e-3)  # it moved


def test_logpid_law_with_a_budget_runs_and_logs_the_target():
    module = PlantModule(n_batches=12)
    controller = KLControllerCallback(LogPIDKLController(1.0, target=3.0))
    budget = CapabilityBudget(1.15)
    fit(module, [controller, budget], **VAL)
    assert len(module.targets) == 12 and budget.n_evaluations == 6


# ---- what a run is told (issue 47, item 5) --------------------------------------------------


def test_a_lowering_held_under_budget_says_within_budget_not_over():
    # Under budget the model can still want a lower KL (a drift it anticipates, or a long lag
    # still to be seen): here it wants 1 nat, and the KL law holds the KL above target / follow.
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 2.0)
    budget.model.wanted = lambda log_budget, batches: 0.0
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 5, 3.5 * 5, 5
    with pytest.warns(RuntimeWarning, match="not lowered further") as caught:
        assert budget.step(1.145 * REF) == 2.0
    (message,) = [str(w.message) for w in caught]
    assert (
        "is within budget (1.145 x the reference's, budget 1.15) and the loop would lower "
        "the target to 1," in message
    )
    assert "over budget" not in message


def _setup_trainer(*extra, limit_val_batches=1.0, heldout="default:validation"):
    controller = KLControllerCallback(ExponentialKLController(1.0, target=3.0))
    data = SimpleNamespace(hparams={"heldout": heldout})
    return SimpleNamespace(
        callbacks=[controller, *extra], limit_val_batches=limit_val_batches, datamodule=data
    )


@pytest.mark.parametrize(
    ("settings", "option"),
    [
        ({"limit_val_batches": 0}, "`trainer.limit_val_batches` must be > 0"),
        ({"limit_val_batches": 0.0}, "`trainer.limit_val_batches` must be > 0"),
        ({"heldout": None}, "`data.init_args.heldout` must name the held-out text"),
    ],
)
def test_a_run_without_validation_is_refused_at_set_up_naming_the_option(settings, option):
    with pytest.raises(ValueError, match=re.escape(option)) as info:
        CapabilityBudget().setup(_setup_trainer(**settings), None, "fit")
    assert "\n" not in str(info.value)


def test_a_run_shorter_than_its_validation_interval_is_refused_after_its_first_batch():
    module = PlantModule(n_batches=8)
    with pytest.raises(ValueError, match=r"`trainer.val_check_interval` must be at most the "):
        fit(
            module,
            _callbacks(),
            limit_val_batches=1,
            val_check_interval=10,
            check_val_every_n_epoch=None,
        )
    # A run of the interval's length is one evaluation, and is accepted.
    callbacks = _callbacks()
    fit(
        PlantModule(n_batches=8),
        callbacks,
        limit_val_batches=1,
        val_check_interval=8,
        check_val_every_n_epoch=None,
    )
    assert callbacks[2].n_evaluations == 1


def test_with_a_reference_refresh_the_set_up_says_which_reference_the_ratio_is_against(caplog):
    from rlkl_lightning import ReferenceRefresh

    with caplog.at_level("INFO"):
        CapabilityBudget().setup(_setup_trainer(ReferenceRefresh(every=10)), None, "fit")
    (said,) = [r.getMessage() for r in caplog.records if "CapabilityBudget" in r.getMessage()]
    assert "the ratio stays against the initial reference's value" in said


def test_the_end_of_a_run_prints_one_summary_line(caplog):
    module = PlantModule(n_batches=40)
    callbacks = _callbacks()
    with caplog.at_level("INFO"):
        fit(module, callbacks, **VAL)
    budget = callbacks[2]
    lines = [r.getMessage() for r in caplog.records if "evaluations skipped" in r.getMessage()]
    assert lines == [budget.summary()]
    assert 0 < budget.n_in_band < budget.n_evaluations == 20
    share = f"{budget.n_in_band / 20:.0%}"
    assert lines[0] == (
        f"CapabilityBudget: {budget.n_in_band} of 20 evaluations ({share}) with the ratio in "
        f"the band [1.12, 1.18] (budget 1.15 +- 20% of its excess); final target "
        f"{budget.target:.4g}; beta at a bound in {callbacks[0].n_at_bound} of 40 batches; "
        "0 evaluations skipped."
    )


def test_a_resume_says_once_which_target_is_in_force_and_the_monitor_takes_it(tmp_path, caplog):
    first = PlantModule(n_batches=24)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=11, save_top_k=-1)
    fit(first, [*_callbacks(), saver], max_steps=11, **VAL)
    saved = first.trainer.callbacks[2].target
    # Another configured target (--resume_with_changes): the budget's is the one in force.
    controller = KLControllerCallback(ExponentialKLController(1.0, target=1.0, k=0.3))
    monitor = KLDriftMonitor(1.0, window=4, verbose=False)
    budget = CapabilityBudget(budget=1.15)
    resumed = PlantModule(n_batches=12)
    with warnings.catch_warnings(), caplog.at_level("INFO"):
        warnings.simplefilter("error", RuntimeWarning)  # no "judged against 1" from the monitor
        fit(
            resumed,
            [controller, monitor, budget],
            ckpt_path=str(tmp_path / "epoch=0-step=11.ckpt"),
            max_steps=12,
            **VAL,
        )
    said = [r.getMessage() for r in caplog.records if "target in force" in r.getMessage()]
    assert said == [
        f"CapabilityBudget: resumed; the KL target in force is {saved:.4g} (the budget's, from "
        "the checkpoint; `kl.target` 1 only starts a run)."
    ]
    assert resumed.targets[11] == pytest.approx(saved, rel=1e-7)  # logged as float32
    assert controller.target == monitor.target == budget.target


@pytest.mark.parametrize("ratio", [1.05, 1.0])
def test_while_the_kl_lags_the_target_does_not_rise_by_any_term(ratio):
    # The review's reproduction: a KL stuck at 1 nat, the ratio under budget. The integral was
    # held, but the proportional term raised the target by max_raise every validation: to
    # 4.27 nats at a ratio of 1.05 and 14.9 at 1.0 after 60 validations.
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 1.0)
    budget.integral = 0.0
    targets = [1.0]
    for _ in range(60):
        ctl.n_batches += 5
        ctl.kl_sum += 1.0 * 5
        ctl.kl_count += 5
        targets.append(budget.step(ratio * REF))
    for before, after in zip(targets, targets[1:]):
        if 1.0 < 0.7 * before:  # the KL has not reached follow x the target
            assert after <= before
    assert max(targets) < math.exp(0.05) / 0.7  # a rise stops once past KL / follow
    assert targets[-20:] == [targets[-1]] * 20 and budget.n_held >= 50


def test_the_docstring_gives_each_options_default_where_it_names_a_value():
    # 0.4.0's `rate` docstring gave 0.3.0's value (gain / 80 batches) after the default
    # had become 0.1.
    import inspect

    doc = inspect.getdoc(CapabilityBudget)
    defaults = inspect.signature(CapabilityBudget).parameters
    entries = re.split(r"\n    (?=\w+: )", doc.split("Args:")[1])
    named = {}
    for entry in entries:
        name, _, text = entry.strip().partition(": ")
        found = re.search(r"\((\d+(?:\.\d+)?): ", text)
        if found:
            named[name] = float(found.group(1))
    assert set(named) == {"raise_per_batch", "fall_per_batch"}
    for name, value in named.items():
        assert value == defaults[name].default, name


def test_a_model_saved_before_0_10_starts_afresh_and_a_saved_one_round_trips():
    old = {  # 0.8.0-0.9.0's state: a bank of 10-200-batch lags with their fits
        "lags": [10.0, 50.0, 100.0, 200.0],
        "now": 0.1,
        "seen": [0.1, -0.5, -0.7, -0.9],
        "fits": [[1.0, 2.0, 3.0]] * 4,
        "log_excess": -2.0,
        "excess": 0.13,
        "noise": [0.01, 3.0],
        "n_noise": 3,
    }
    model = ExcessModel()
    model.load_state_dict(old)
    assert model.state_dict() == ExcessModel().state_dict()
    for k in range(12):
        model.update(math.log(1.0 + 0.1 * k), 5, 0.1 + 0.01 * k, 0.01)
    again = ExcessModel()
    again.load_state_dict(model.state_dict())
    assert again.state_dict() == model.state_dict()
    assert model.trend > 0 and again.trend == model.trend  # rebuilt from the history
    assert again.wanted(math.log(0.14), 5) == model.wanted(math.log(0.14), 5)
