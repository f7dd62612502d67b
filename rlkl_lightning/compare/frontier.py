"""The fixed-beta frontier: score against log KL fitted across fixed-beta runs, with a band.

Every fixed-beta run (the ``fixed`` group and the sweep's ``fixed_<beta>`` groups, every seed)
gives a point (final KL, final score). The frontier is the least-squares line

    score = a + b * ln(KL)

through those points (ordinary least squares, each seed its own point). With ``n`` points,
residual variance ``s^2 = RSS / (n - 2)`` and ``x = ln KL``, the fitted score at ``x0`` has the
standard error ``s * sqrt(1/n + (x0 - mean x)^2 / Sxx)``, ``Sxx = sum (x - mean x)^2`` (the
textbook variance of a regression mean; e.g. Draper & Smith, "Applied Regression Analysis",
1998, §1.4).

A law's **gap** is its vertical distance to the frontier at the KL it reached: the mean over
its seeds of ``score_i - (a + b ln KL_i)``. Its standard error adds two independent parts: the
seeds' scatter of the gaps (``sd / sqrt(m)`` over ``m`` seeds; none with one seed) and the
frontier's own error at the law's mean ``ln KL`` (the fit's points are other runs). A gap
beyond twice that error says the law lies above (or below) what fixed betas reach at its KL.
With one seed the first part cannot be measured and is left out: the standard error is the
frontier's alone and ignores the law's own seed-to-seed noise (comparable to the residual sd
``s``), so two of them cover far less than 95% (about half when the two parts are alike); the
report says so beside such a gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Frontier", "fit_frontier", "frontier_gap"]


@dataclass(frozen=True)
class Frontier:
    """A fitted line ``score = intercept + slope * ln(KL)`` with what its band needs.

    Attributes:
        intercept: ``a``.
        slope: ``b``, score per unit of ``ln KL``.
        residual_sd: ``s``, the points' scatter about the line (``sqrt(RSS / (n - 2))``).
        n: Number of points.
        mean_log_kl: Mean ``ln KL`` of the points.
        sxx: ``sum (ln KL - mean)^2``.
        log_kl_range: Smallest and largest ``ln KL`` of the points.
    """

    intercept: float
    slope: float
    residual_sd: float
    n: int
    mean_log_kl: float
    sxx: float
    log_kl_range: tuple[float, float]

    def score(self, kl: float | np.ndarray) -> float | np.ndarray:
        """The fitted score at ``kl`` (nats, > 0)."""
        return self.intercept + self.slope * np.log(kl)

    def standard_error(self, kl: float | np.ndarray) -> float | np.ndarray:
        """The standard error of the fitted score (the line, not a new point) at ``kl``."""
        x = np.log(kl)
        return self.residual_sd * np.sqrt(1.0 / self.n + (x - self.mean_log_kl) ** 2 / self.sxx)


def fit_frontier(kl: Sequence[float], score: Sequence[float]) -> Frontier:
    """Least-squares ``score = a + b ln(kl)`` through the fixed-beta runs' points.

    Raises:
        ValueError: With fewer than 3 points, a non-positive or non-finite KL, a non-finite
            score, or fewer than 2 distinct KLs (no slope, or no residual to judge the fit by).
    """
    kl_arr, y = np.asarray(kl, dtype=float), np.asarray(score, dtype=float)
    if kl_arr.shape != y.shape or kl_arr.ndim != 1:
        raise ValueError(f"frontier: `kl` and `score` must be 1-D and alike, got {kl_arr.shape}")
    if len(y) < 3:
        raise ValueError(f"frontier: needs at least 3 fixed-beta runs, got {len(y)}")
    if not (np.isfinite(kl_arr).all() and (kl_arr > 0).all() and np.isfinite(y).all()):
        raise ValueError("frontier: every final KL must be finite and > 0, every score finite")
    x = np.log(kl_arr)
    mean_x = float(x.mean())
    sxx = float(((x - mean_x) ** 2).sum())
    if sxx <= 1e-12 * max(1.0, mean_x**2):
        raise ValueError("frontier: the fixed-beta runs must reach at least 2 distinct KLs")
    slope = float(((x - mean_x) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * mean_x)
    rss = float(((y - intercept - slope * x) ** 2).sum())
    return Frontier(
        intercept=intercept,
        slope=slope,
        residual_sd=math.sqrt(rss / (len(y) - 2)),
        n=len(y),
        mean_log_kl=mean_x,
        sxx=sxx,
        log_kl_range=(float(x.min()), float(x.max())),
    )


def frontier_gap(frontier: Frontier, kl: Sequence[float], score: Sequence[float]) -> dict:
    """A law's vertical gap to the frontier at its own final KL, with its standard error.

    Args:
        frontier: The fitted fixed-beta frontier.
        kl: The law's final KL per seed.
        score: Its final score per seed.

    Returns:
        ``gap`` (mean of ``score_i - frontier(kl_i)``), ``se`` (``sqrt(sd^2 / m + se_f^2)``, the
        seeds' part only with 2 or more seeds), ``two_se``, ``beyond_two_se``, ``seeds`` and
        ``inside_range`` (whether the law's mean ``ln KL`` lies within the fixed betas' range:
        outside it the line extrapolates).
    """
    kl_arr, y = np.asarray(kl, dtype=float), np.asarray(score, dtype=float)
    if len(y) == 0 or kl_arr.shape != y.shape:
        raise ValueError("frontier: a law needs one final KL and one score per seed")
    gaps = y - frontier.score(kl_arr)
    m = len(gaps)
    x0 = float(np.log(kl_arr).mean())
    se_fit = float(frontier.standard_error(math.exp(x0)))
    se_seeds = float(gaps.std(ddof=1) / math.sqrt(m)) if m > 1 else 0.0
    se = math.sqrt(se_seeds**2 + se_fit**2)
    gap = float(gaps.mean())
    lo, hi = frontier.log_kl_range
    return {
        "gap": gap,
        "se": se,
        "two_se": 2 * se,
        "beyond_two_se": bool(abs(gap) > 2 * se),
        "seeds": m,
        "kl": math.exp(x0),
        "inside_range": bool(lo <= x0 <= hi),
    }
