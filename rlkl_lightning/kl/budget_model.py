"""The capability budget's model of its plant: which KL holds the budget, from the run's own data.

Along a run the log excess of the held-out perplexity is close to linear in a lagged log KL,
with a level that drifts slowly: ``log x = c + a s_L + d t``, where ``s_L`` is a first-order lag
of ``log KL`` over ``L`` batches and ``t`` the batch. :class:`ExcessModel` keeps ``s_L`` for each
lag in :data:`LAGS`, fits ``(c, a, d)`` to the evaluations for each by weighted least squares
(a fading memory, ``a`` drawn toward 1 and ``d`` toward 0), takes the lag that explains them
(the shortest, unless a longer one that the evaluations span leaves :data:`SLACK` of its
residual), and answers the log KL whose excess is the budget's:
``s_L + (log b - log x_hat) / a``. docs/budget.md derives it.
"""

from __future__ import annotations

import math
from typing import Any

#: The perplexity's lags the bank tries, in batches: the three worlds' perplexity follows the
#: KL within 5-10 batches; a review's plants lag by 100 and 200.
LAGS = (5.0, 25.0, 100.0, 200.0)
#: Fading memory of the fits, in batches.
MEMORY = 150.0
#: Evaluations older than this many batches are dropped (their weight is under exp(-4)).
HORIZON = 4.0 * MEMORY
#: A longer lag replaces the one chosen only if its residual is this factor of it or less.
SLACK = 0.35
#: A lag may be chosen once the evaluations span this many times it.
EVIDENCE = 1.0
#: Ridge on the elasticity toward 1 and on the drift toward 0, per unit weight.
RIDGE_ELASTICITY = 0.05
RIDGE_DRIFT = 0.05
#: Time constant of the level, in batches: the excess now is the fit's line through an
#: exponential average of the evaluations' offsets from it (the fit's own level, over its
#: memory, answers an excess above the line too slowly).
LEVEL = 20.0
#: Time unit of the drift in the fit, in batches (keeps the normal equations well scaled).
DRIFT_UNIT = 100.0
#: The range of the fitted elasticity; the step uses at least :data:`STEP_ELASTICITY`.
ELASTICITY = (0.3, 3.0)
#: The smallest elasticity a step divides by: a smaller fitted one would step further than
#: the plant moves, and a plant twice as elastic as the step assumes would swing.
STEP_ELASTICITY = 1.0
#: Batches the KL law takes to follow a new target: a drift is anticipated by this many
#: batches plus half the evaluation interval (the mean of the coming interval).
AHEAD = 20.0


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """``matrix^-1 rhs`` by Gaussian elimination with partial pivoting (a small system)."""
    size = len(rhs)
    rows = [list(row) + [value] for row, value in zip(matrix, rhs, strict=True)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(size):
            if r != col:
                f = rows[r][col] / rows[col][col]
                rows[r] = [a - f * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][size] / rows[i][i] for i in range(size)]


class Fit:
    """One lag's least-squares fit: ``log x = c + a s + d (t - now) / DRIFT_UNIT``."""

    def __init__(self, c: float, elasticity: float, drift: float, residual: float) -> None:
        self.c, self.elasticity, self.drift, self.residual = c, elasticity, drift, residual


class ExcessModel:
    """A bank of lagged log KLs, each with its fit: the log KL that holds the budget."""

    def __init__(self) -> None:
        self.t = 0  # batches seen
        self.seen: list[float] | None = None  # s_L, per lag
        self.history: list[tuple[int, float, list[float]]] = []  # (t, log x, s per lag)
        self.excess: float | None = None  # the last evaluation's excess
        self.noise = [0.0, 0.0]  # faded sum of squared one-step residuals of x, and weights
        self.n_noise = 0  # evaluations behind the noise estimate
        self.levels: list[float | None] = [None] * len(LAGS)  # per lag: log x - a s_L, averaged
        self.lag = LAGS[0]
        self.fit = Fit(0.0, 1.0, 0.0, 0.0)
        self.fits: list[Fit] = []

    def update(self, log_kl: float, batches: int, excess: float, floor: float) -> None:
        """Take one evaluation: the mean log KL of its ``batches`` and its excess ``x``.

        ``floor``: the smallest excess whose log the fits use (a smaller one is taken as it).
        """
        before = None if self.seen is None else list(self.seen)
        if self.seen is None:
            self.seen = [log_kl] * len(LAGS)
        self.t += batches
        for i, lag in enumerate(LAGS):
            self.seen[i] += (1.0 - math.exp(-batches / lag)) * (log_kl - self.seen[i])
        self.history.append((self.t, math.log(max(excess, floor)), list(self.seen)))
        self.history = [h for h in self.history if self.t - h[0] < HORIZON]
        self._choose()
        log_x = self.history[-1][1]
        share = 1.0 - math.exp(-batches / LEVEL)
        for i, fit in enumerate(self.fits):
            offset = log_x - fit.elasticity * self.seen[i]
            level = self.levels[i]
            self.levels[i] = offset if level is None else level + share * (offset - level)
        if self.excess is not None and before is not None:  # noise: the one-step residual
            i = LAGS.index(self.lag)  # of x, once the model's change is taken out
            change = self.fit.elasticity * self.excess * (self.seen[i] - before[i])
            residual = excess - self.excess - change
            fade = math.exp(-batches / MEMORY)
            self.noise = [fade * self.noise[0] + residual**2, fade * self.noise[1] + 1.0]
            self.n_noise += 1
        self.excess = excess

    def _fit(self, i: int) -> Fit:
        """Weighted ridge least squares of ``log x`` on ``(1, s_i, t)``."""
        matrix = [[0.0] * 3 for _ in range(3)]
        rhs = [0.0] * 3
        rows = []
        total = 0.0
        for t, log_x, seen in self.history:
            w = math.exp(-(self.t - t) / MEMORY)
            v = (1.0, seen[i], (t - self.t) / DRIFT_UNIT)
            rows.append((w, v, log_x))
            total += w
            for p in range(3):
                rhs[p] += w * v[p] * log_x
                for q in range(3):
                    matrix[p][q] += w * v[p] * v[q]
        matrix[1][1] += RIDGE_ELASTICITY * total
        rhs[1] += RIDGE_ELASTICITY * total  # toward a = 1
        matrix[2][2] += RIDGE_DRIFT * total  # toward d = 0
        c, a, d = _solve(matrix, rhs)
        if d < 0.0:  # the perplexity does not recover at a constant KL: (c, a) without it
            d = 0.0
            c, a = _solve(
                [[matrix[0][0], matrix[0][1]], [matrix[1][0], matrix[1][1]]], [rhs[0], rhs[1]]
            )
        bounded = min(max(a, ELASTICITY[0]), ELASTICITY[1])
        if bounded != a:  # a at its bound: (c, d) again with a fixed
            a = bounded
            c, d = _solve(
                [[matrix[0][0], matrix[0][2]], [matrix[2][0], matrix[2][2]]],
                [rhs[0] - a * matrix[0][1], rhs[2] - a * matrix[2][1]],
            )
            if d < 0.0:
                d = 0.0
                c = (rhs[0] - a * matrix[0][1]) / matrix[0][0]
        residual = sum(w * (lx - c - a * v[1] - d * v[2]) ** 2 for w, v, lx in rows) / total
        return Fit(c, a, d, residual)

    def _choose(self) -> None:
        """The shortest lag, unless a longer one explains the evaluations clearly better."""
        self.fits = fits = [self._fit(i) for i in range(len(LAGS))]
        span = self.t - self.history[0][0] if self.history else 0
        pick = 0
        for i in range(1, len(LAGS)):
            # A lag is judged only on evaluations that span it: over fewer batches a smooth
            # long lag fits a noisy ramp better than the KL it lags.
            if span >= EVIDENCE * LAGS[i] and fits[i].residual < SLACK * fits[pick].residual:
                pick = i
        self.lag, self.fit = LAGS[pick], fits[pick]

    def wanted(self, log_budget: float, batches: int) -> float:
        """The log KL at which the excess is the budget's over the coming ``batches``.

        From the chosen lag's fit: the excess now is ``level + a s_L``, the level an average of
        the evaluations' offsets from the line over :data:`LEVEL` batches; a rising drift is
        anticipated by :data:`LEVEL` + :data:`AHEAD` + ``batches`` / 2 batches (the level's lag,
        the KL law's, the coming interval's mean); the step divides by at least
        :data:`STEP_ELASTICITY`.
        """
        assert self.seen is not None, "update() first"
        i = LAGS.index(self.lag)
        s, fit, level = self.seen[i], self.fit, self.levels[i]
        assert level is not None
        ahead = LEVEL + AHEAD + batches / 2
        log_x = level + fit.elasticity * s + max(fit.drift, 0.0) * ahead / DRIFT_UNIT
        return s + (log_budget - log_x) / max(fit.elasticity, STEP_ELASTICITY)

    @property
    def noise_sd(self) -> float:
        """The evaluations' noise in the excess (sd), from the one-step residuals."""
        total, weight = self.noise
        return math.sqrt(total / (2.0 * weight)) if weight > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Everything the model carries from one evaluation to the next."""
        return {
            "version": 2,
            "lags": list(LAGS),
            "t": self.t,
            "seen": None if self.seen is None else list(self.seen),
            "history": [[t, lx, list(s)] for t, lx, s in self.history],
            "levels": list(self.levels),
            "excess": self.excess,
            "noise": list(self.noise),
            "n_noise": self.n_noise,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older model (before 0.10.0, or other lags) starts afresh.

        The older fits answered another question.
        """
        self.__init__()
        if not state or state.get("version") != 2 or list(state["lags"]) != list(LAGS):
            return
        self.t = int(state["t"])
        self.seen = None if state["seen"] is None else [float(v) for v in state["seen"]]
        self.history = [(int(t), float(lx), [float(v) for v in s]) for t, lx, s in state["history"]]
        self.levels = [None if v is None else float(v) for v in state["levels"]]
        self.excess = state["excess"]
        self.noise = [float(v) for v in state["noise"]]
        self.n_noise = int(state["n_noise"])
        if self.history:
            self._choose()
