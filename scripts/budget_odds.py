"""The odds that the budget law meets issue 47's criteria, on plants fitted to a study's own runs.

    python scripts/budget_odds.py STUDY_DIR [STUDY_DIR ...] [--seeds 40] [--creep 0.0]

For each budget run of the studies (``budget_replay.budget_runs``) the script fits, from the
run's logged scalars alone:

- its **plant**: the log validation ratio at each evaluation as
  ``c min(1, K5 / 0.3) + f K5 + g KL`` of the batch KL seen through a 5-batch lag (``K5``) and
  a slow lag ``L`` (``KL``, the best of :data:`SLOW_LAGS`), by least squares, the tests' form
  (``tests/kl/test_capability_budget.py``, ``LOGGED_PLANTS``);
- its **noise**: the plant's residuals over the last three quarters of the evaluations, their
  sd and lag-1 autocorrelation, drawn as one AR(1) series that both splits share (in the runs
  the test ratio's steps follow the validation ratio's, correlation 0.9-0.98), and the test
  split's own part: the mean and sd of ``log test ratio - log validation ratio``;
- its **KL law**: the lag with which the batch KL follows the logged target (the best of
  :data:`FOLLOW_LAGS`), the batch KL's scatter about it, and its mean over batches 2-6, where
  the simulated KL starts (the first batch samples the reference itself, at a KL of 0).

It then runs this checkout's ``CapabilityBudget`` on that plant in closed loop, ``--seeds``
times, with the run's own budget arguments, evaluation interval and length, and a perfect law
beside it (the validation ratio at the budget from the first batch: only the noise), and prints
the share of each that meets the criteria (``rlkl_lightning.compare.budget.settling`` on the
simulated test ratio), then the expected number of runs that meet every criterion and the
chance that all of them do. ``--creep`` adds a perplexity that grows at a constant KL, as the
tests' creeping plants (their 0.002 is 20% of the excess per 100 batches at 1.5 nats).

What it is for: a law change is judged first on simulated plants (the issue's rule); these are
the plants of the runs the law will be judged on, and the perfect law says how much of a miss
is the noise's. Reads YAML (safe loading) and TensorBoard scalars only.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_replay import batches_of, budget_runs, ratio_curve, read_run, wired  # noqa: E402

from rlkl_lightning import metric_keys as keys  # noqa: E402
from rlkl_lightning.compare.budget import settle_by, settling  # noqa: E402
from rlkl_lightning.compare.events import read_scalars  # noqa: E402

#: The slow lags a plant may have, in batches (the tests' logged plants: 30-200).
SLOW_LAGS = (30, 50, 80, 120, 200)
#: The lags with which a batch KL may follow its target, in batches.
FOLLOW_LAGS = (3, 5, 8, 12, 15, 20, 30, 45, 60)
#: The KL of the plant's lags before the first batch (the tests' plants start there too).
START_KL = 0.05
#: The batch KL's wander about its lagged target, log sd per batch (the tests' plants').
KL_WANDER = 0.1


@dataclass
class Plant:
    """One run's fitted plant, noise and KL law."""

    c: float
    fast: float
    slow: float
    lag: int
    sd: float  # the residuals' sd, in log ratio
    rho: float  # their lag-1 autocorrelation, per evaluation
    offset: float  # mean log test ratio - log validation ratio
    split_sd: float  # each split's own noise, in log ratio
    follow: int  # the KL's lag behind the target, in batches
    kl_sd: float  # the batch KL's scatter about it, in log
    kl_start: float  # the mean KL of batches 2-6


def lagged(values: list[float], lag: float, start: float = START_KL) -> np.ndarray:
    """The first-order lag of ``values``, one step a batch, from ``start``: after each batch."""
    out, level, share = np.empty(len(values)), start, 1.0 - math.exp(-1.0 / lag)
    for i, value in enumerate(values):
        level += share * (value - level)
        out[i] = level
    return out


def fit_plant(kls: list[float], evaluations: list[tuple[int, float]]) -> tuple:
    """``(c, f, g, L, residuals)``: the least-squares plant of the log ratios, ``L`` the best."""
    k5 = lagged(kls, 5)
    at = [batch - 1 for batch, _ in evaluations]
    y = np.log([ratio for _, ratio in evaluations])
    best = None
    for lag in SLOW_LAGS:
        x = np.stack([np.minimum(1.0, k5[at] / 0.3), k5[at], lagged(kls, lag)[at]], axis=1)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        residuals = y - x @ coef
        if best is None or residuals.std() < best[-1].std():
            best = (*coef, lag, residuals)
    return best


def fit_follow(kls: list[float], targets: dict[int, float]) -> tuple[int, float]:
    """``(lag, sd)``: the lag with which the batch KL follows the target, and the KL's scatter.

    The target in force during batch ``t`` is the one logged at ``t``; judged in log from batch
    20 on (the first batches climb from 0).
    """
    target = [targets.get(t, targets[min(targets)]) for t in range(1, len(kls) + 1)]
    log_kl = np.log(np.maximum(kls, 1e-3))[20:]
    best = None
    for lag in FOLLOW_LAGS:
        before = np.concatenate([[kls[0]], lagged(target, lag, kls[0])[:-1]])
        residuals = log_kl - np.log(before[20:])
        if best is None or np.mean(residuals**2) < best[0]:
            best = (float(np.mean(residuals**2)), lag, float(residuals.std()))
    return best[1], best[2]


def fit_run(run: Path) -> tuple[Plant, dict, float, int, int]:
    """The run's plant, its budget arguments, starting target, interval and length."""
    scalars = read_scalars(run)
    kls, evaluations, law, logged = read_run(run, scalars)
    c, fast, slow, lag, residuals = fit_plant(kls, evaluations)
    tail = residuals[len(residuals) // 4 :]
    rho = max(0.0, float(np.corrcoef(tail[:-1], tail[1:])[0, 1]))
    test = dict(
        ratio_curve(scalars, batches_of(scalars), keys.TEST_PERPLEXITY, keys.TEST_PERPLEXITY_REF)
    )
    gaps = [math.log(test[b] / r) for b, r in evaluations[len(evaluations) // 4 :] if b in test]
    follow, kl_sd = fit_follow(kls, logged)
    plant = Plant(
        c=max(c, 0.0),
        fast=max(fast, 0.0),
        slow=max(slow, 0.0),
        lag=lag,
        sd=float(tail.std()),
        rho=rho,
        offset=float(np.mean(gaps)) if gaps else 0.0,
        split_sd=float(np.std(gaps)) / math.sqrt(2) if gaps else 0.0,
        follow=follow,
        kl_sd=kl_sd,
        kl_start=float(np.mean(kls[1:6])),
    )
    interval = evaluations[1][0] - evaluations[0][0]
    return plant, law, logged.get(1, 1.0), interval, len(kls)


def simulate(
    plant: Plant,
    law: dict,
    start_target: float,
    interval: int,
    batches: int,
    seed: int,
    creep: float = 0.0,
    perfect: bool = False,
    kls: list[float] | None = None,
) -> list[tuple[int, float]]:
    """One closed loop on ``plant``: ``(batch, test ratio)`` after each evaluation.

    ``perfect``: no law; the validation ratio's log is the budget's plus the noise. ``kls``: a
    list that receives each batch's KL (the plant's, before the scatter of its measurement).
    """
    rng = random.Random(seed)
    budget, controller = wired(law, start_target)
    shared = math.sqrt(max(plant.sd**2 - plant.split_sd**2, 0.0))
    step_sd = shared * math.sqrt(1.0 - plant.rho**2)
    kl_sd = math.sqrt(max(plant.kl_sd**2 - KL_WANDER**2, 0.0))
    kl, k5, k_slow, grown = plant.kl_start, START_KL, START_KL, 0.0
    common = rng.gauss(0.0, shared)
    out = []
    for t in range(1, batches + 1):
        grown += creep * kl / 1.5
        kl += (1 - math.exp(-1 / plant.follow)) * (
            budget.target * math.exp(KL_WANDER * rng.gauss(0, 1)) - kl
        )
        if kls is not None:
            kls.append(kl)
        k5 += (1 - math.exp(-1 / 5)) * (kl - k5)
        k_slow += (1 - math.exp(-1 / plant.lag)) * (kl - k_slow)
        controller.n_batches += 1
        controller.kl_sum += kl * math.exp(kl_sd * rng.gauss(0, 1) - kl_sd**2 / 2)
        controller.kl_count += 1
        if t % interval == 0:
            common = plant.rho * common + rng.gauss(0.0, step_sd)
            if perfect:
                log_ratio = math.log(budget.budget) + common
            else:
                x = plant.c * min(1.0, k5 / 0.3) + plant.fast * k5 + plant.slow * k_slow
                log_ratio = x * math.exp(grown) + common
            budget.step(math.exp(log_ratio + rng.gauss(0.0, plant.split_sd)))
            test = log_ratio + plant.offset + rng.gauss(0.0, plant.split_sd)
            out.append((t, math.exp(test)))
    return out


def odds(run: Path, seeds: int, creep: float) -> tuple[Plant, float, float]:
    """``(plant, share of the law's loops that meet the criteria, the perfect law's share)``."""
    plant, law, start, interval, batches = fit_run(run)
    if law.get("mode", "min") != "min":
        raise SystemExit(
            f"budget_odds: {run} steers a score (mode {law['mode']!r}); the plants"
            " are perplexity ratios, mode 'min'"
        )
    ratio = law.get("budget", 1.15)
    by = settle_by(interval)
    met = {False: 0, True: 0}
    with warnings.catch_warnings():  # the budget's own warnings, once per loop
        warnings.simplefilter("ignore")
        for perfect in (False, True):
            for seed in range(seeds):
                out = simulate(plant, law, start, interval, batches, seed, creep, perfect)
                met[perfect] += not settling(out, ratio, by)["failures"]
    return plant, met[False] / seeds, met[True] / seeds


def main(argv: list[str] | None = None) -> int:
    """Print each run's odds and the totals."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", type=Path, nargs="+", help="study (or run) directories")
    parser.add_argument("--seeds", type=int, default=40, help="closed loops per run and law")
    parser.add_argument("--creep", type=float, default=0.0, help="growth at a constant KL")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    shares = {False: [], True: []}
    for run in [run for path in args.studies for run in budget_runs(path)]:
        plant, law, perfect = odds(run, args.seeds, args.creep)
        shares[False].append(law)
        shares[True].append(perfect)
        print(
            f"{run}: {plant.c:.3f} min(1, K5/0.3) + {plant.fast:.3f} K5 + {plant.slow:.3f}"
            f" K{plant.lag}, noise {plant.sd:.4f} (autocorrelation {plant.rho:.2f}), test"
            f" {plant.offset:+.4f} ± {plant.split_sd:.4f}, KL lag {plant.follow};"
            f" the law {law:.2f}, a perfect law {perfect:.2f}"
        )
    n = len(shares[False])
    for perfect, name in ((False, "the law"), (True, "a perfect law")):
        print(
            f"{name}: {sum(shares[perfect]):.1f} of {n} runs expected to meet every criterion;"
            f" all of them with probability {math.prod(shares[perfect]):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
