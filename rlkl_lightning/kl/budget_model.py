"""The capability budget's model of its plant: how far the perplexity has yet to rise.

The held-out perplexity follows the KL with a lag of tens to hundreds of batches, so the excess
a budget measures is that of a KL some way back. :class:`ExcessModel` keeps a bank of
first-order lags of ``log KL`` (``s_L`` for each lag ``L`` in :data:`LAGS`) and, for each, the
elasticity ``a`` that best explains the measured excess's changes between evaluations
(``d log x = a d s_L``, least squares with a fading memory). The lag that explains them best,
with its elasticity, predicts the excess the perplexity will reach once it has caught up with
the KL of now: ``log x_pred = log x + a (k_now - s_L)``. docs/budget.md derives it.
"""

from __future__ import annotations

import math
from typing import Any

#: The perplexity's lags the bank tries, in batches: the default world's perplexity follows
#: the KL within batches, the review's plants in 20-200.
LAGS = (10.0, 50.0, 100.0, 200.0)
#: Lag of the "KL of now", in batches: the mean KL of an evaluation scatters by about 10%.
NOW_LAG = 10.0
#: Fading memory of the fits, in batches.
MEMORY = 200.0
#: The range of the fitted elasticity: the law study measured 0.77, a review's plant 1.3.
ELASTICITY = (0.7, 2.0)
#: The model before any fit: (lag, elasticity).
PRIOR = (100.0, 1.0)
#: A longer lag is taken unless a shorter one fits with a residual this factor smaller: the
#: fits are noisy early, and a lag too short predicts too little (the target then overshoots).
SLACK = 1.1
#: Largest prediction, in log excess.
MAX_LEAD = 1.0


class ExcessModel:
    """A bank of lagged log KLs and their fits: the excess once the perplexity catches up."""

    def __init__(self) -> None:
        self.now: float | None = None  # log KL of now (lightly smoothed)
        self.seen: list[float] | None = None  # s_L, per lag
        self.fits = [[0.0, 0.0, 0.0] for _ in LAGS]  # faded sums of dx ds, ds ds, dx dx
        self.log_excess: float | None = None  # of the last evaluation, where usable
        self.excess: float | None = None  # of the last evaluation
        self.noise = [0.0, 0.0]  # faded sum of squared one-step residuals of x, and weights
        self.n_noise = 0  # evaluations behind the noise estimate
        self.lag, self.elasticity = PRIOR

    def update(self, log_kl: float, batches: int, excess: float, floor: float) -> float:
        """Take one evaluation; return the predicted rise of ``log x`` still to come.

        Args:
            log_kl: Log of the mean KL since the last evaluation.
            batches: Batches since the last evaluation (> 0).
            excess: The measured excess ``x`` (its log is used where ``x > floor``).
            floor: The smallest excess whose log the fits use.
        """
        if self.now is None or self.seen is None:
            self.now, self.seen = log_kl, [log_kl] * len(LAGS)
        self.now += (1.0 - math.exp(-batches / NOW_LAG)) * (log_kl - self.now)
        before = list(self.seen)
        for i, lag in enumerate(LAGS):
            self.seen[i] += (1.0 - math.exp(-batches / lag)) * (log_kl - self.seen[i])
        fade = math.exp(-batches / MEMORY)
        log_x = math.log(excess) if excess > floor else None
        if log_x is not None and self.log_excess is not None:
            dx = log_x - self.log_excess
            for fit, new, old in zip(self.fits, self.seen, before, strict=True):
                ds = new - old
                fit[0] = fade * fit[0] + dx * ds
                fit[1] = fade * fit[1] + ds * ds
                fit[2] = fade * fit[2] + dx * dx
        self._choose()
        if self.excess is not None:  # the one-step residual of x: noise, once the model's
            i = LAGS.index(self.lag)  # change is taken out
            change = self.elasticity * self.excess * (self.seen[i] - before[i])
            residual = excess - self.excess - change
            self.noise = [fade * self.noise[0] + residual**2, fade * self.noise[1] + 1.0]
            self.n_noise += 1
        self.log_excess, self.excess = log_x, excess
        i = LAGS.index(self.lag)
        return min(max(self.elasticity * (self.now - self.seen[i]), 0.0), MAX_LEAD)

    def _choose(self) -> None:
        """The lag whose fit leaves the least residual, with its elasticity."""
        fits = []
        for lag, (sxs, sss, sxx) in zip(LAGS, self.fits, strict=True):
            if sss > 0.0:
                a = min(max(sxs / sss, ELASTICITY[0]), ELASTICITY[1])
                fits.append((sxx - 2.0 * a * sxs + a * a * sss, lag, a))
        if not fits:
            self.lag, self.elasticity = PRIOR
            return
        least = min(fit[0] for fit in fits)
        _, self.lag, self.elasticity = max(
            (fit for fit in fits if fit[0] <= least + (SLACK - 1.0) * abs(least)),
            key=lambda fit: fit[1],
        )

    def loop_gain(self, batches: int) -> float:
        """The largest change of the predicted log excess per unit step of log KL.

        In one evaluation of ``batches``: the measured excess's (at most the elasticity) and
        the prediction's (the elasticity times the share of the step the lag has not yet seen).
        """
        return self.elasticity * (1.0 + math.exp(-batches / self.lag))

    @property
    def noise_sd(self) -> float:
        """The evaluations' noise in the excess (sd), from the one-step residuals."""
        total, weight = self.noise
        return math.sqrt(total / (2.0 * weight)) if weight > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Everything the model carries from one evaluation to the next."""
        return {
            "lags": list(LAGS),
            "now": self.now,
            "seen": None if self.seen is None else list(self.seen),
            "fits": [list(fit) for fit in self.fits],
            "log_excess": self.log_excess,
            "excess": self.excess,
            "noise": list(self.noise),
            "n_noise": self.n_noise,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state without it (an older budget) starts afresh."""
        self.__init__()
        if not state:
            return
        self.now = state["now"]
        # A bank saved with other lags (before 0.8.0: 50, 100, 200): the lags both know keep
        # their state; a new one starts at the KL of now, unfitted.
        saved = [float(lag) for lag in state.get("lags", (50.0, 100.0, 200.0))]
        seen = dict(zip(saved, state["seen"] or [], strict=False))
        fits = dict(zip(saved, state["fits"], strict=True))
        if state["seen"] is not None:
            self.seen = [float(seen.get(lag, self.now)) for lag in LAGS]
        self.fits = [[float(v) for v in fits.get(lag, (0.0, 0.0, 0.0))] for lag in LAGS]
        self.log_excess, self.excess = state["log_excess"], state["excess"]
        self.noise = [float(v) for v in state["noise"]]
        self.n_noise = int(state["n_noise"])
        self._choose()
