"""The capability budget's model of its plant: which KL holds the budget, from the run's own data.

Along a run the log excess of the held-out perplexity is close to linear in a lagged log KL,
with a level that drifts slowly: ``log x = c + a z + d t``, where ``z`` is the log KL seen
through a lag kernel (a weighted sum of first-order lags, :data:`KERNELS`) and ``t`` the batch.
:class:`ExcessModel` keeps ``z`` for each kernel, fits ``(c, a, d)`` to the evaluations for each
by weighted least squares (a fading memory, ``a`` drawn toward 1 and ``d`` toward 0), takes the
kernel that explains them (the first, unless a longer one that the evaluations span leaves
:data:`SLACK` of its residual), and answers the log KL that brings the excess to the budget's
within the kernel's horizon (:data:`LEAD`). docs/budget.md derives it.
"""

from __future__ import annotations

import math
from typing import Any

#: The lag kernels the bank tries: ``((lag in batches, weight), ...)``, weights summing to 1.
#: The first is the worlds': in 32 logged runs on four worlds about half the perplexity's
#: answer to the KL came within 5 batches and the rest over 30-200 (pooled by world, a 50-batch
#: lag fitted better than a 30-batch one); a review's plants lag by 100 and 200.
KERNELS: tuple[tuple[tuple[float, float], ...], ...] = (
    ((5.0, 0.5), (50.0, 0.5)),
    ((100.0, 1.0),),
    ((200.0, 1.0),),
)
#: The first-order lags the kernels are made of.
LAGS = tuple(sorted({lag for kernel in KERNELS for lag, _ in kernel}))
#: The share of the KL now that a kernel still remembers at the answer's horizon: the law asks
#: for the KL that brings the excess to the budget by the batch at which the kernel keeps this
#: much of what it has seen (12 batches for the first kernel, 82 and 164 for the others), not
#: for the KL that does so once the lags have settled, which reached the band too late.
LEAD = 0.44
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
#: The drift carried ahead is the slope of the chosen kernel's offsets (``log x - a z``) over
#: the evaluations of the last ``max(TREND_BATCHES, TREND_EVALUATIONS x interval)`` batches,
#: once they span :data:`TREND_SPAN`: the fit's own drift, over its memory, stayed at 0
#: through the start-up and saw a creep at a constant KL only after 125-200 batches.
TREND_BATCHES = 80.0
TREND_EVALUATIONS = 8
TREND_SPAN = 40.0
#: The trend is carried only once the excess, as the trailing mean of :data:`REACHED_MEAN`
#: evaluations, has reached this share of the budget's: on the way up, a fit whose elasticity
#: has not caught up with a slow lag reads the lag's answer as a creep and slows the approach.
REACHED = 0.8
REACHED_MEAN = 3


def horizon(kernel: tuple[tuple[float, float], ...]) -> float:
    """The batches after which ``kernel`` keeps :data:`LEAD` of a KL (its weights' decay)."""
    low, high = 0.0, 20.0 * max(lag for lag, _ in kernel)
    for _ in range(100):  # bisection: the kept share falls monotonically with the batches
        middle = 0.5 * (low + high)
        if sum(w * math.exp(-middle / lag) for lag, w in kernel) > LEAD:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


#: Each kernel's horizon, in batches.
HORIZONS = tuple(horizon(kernel) for kernel in KERNELS)


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


def _held(matrix: list[list[float]], rhs: list[float], held: dict[int, float]) -> list[float]:
    """The normal equations solved with the parameters in ``held`` fixed at their values."""
    free = [p for p in range(len(rhs)) if p not in held]
    right = [rhs[p] - sum(v * matrix[p][q] for q, v in held.items()) for p in free]
    values = dict(zip(free, _solve([[matrix[p][q] for q in free] for p in free], right)))
    values.update(held)
    return [values[p] for p in range(len(rhs))]


class Fit:
    """One kernel's least-squares fit: ``log x = c + a z + d (t - now) / DRIFT_UNIT``."""

    def __init__(self, c: float, elasticity: float, drift: float, residual: float) -> None:
        self.c, self.elasticity, self.drift, self.residual = c, elasticity, drift, residual


class ExcessModel:
    """A bank of log KLs seen through lag kernels, each with its fit: the log KL to ask for."""

    def __init__(self) -> None:
        self.t = 0  # batches seen
        self.lagged: list[float] | None = None  # the log KL's first-order lag, per LAGS
        self.seen: list[float] | None = None  # z, per kernel
        self.history: list[tuple[int, float, list[float]]] = []  # (t, log x, z per kernel)
        self.excess: float | None = None  # the last evaluation's excess
        self.noise = [0.0, 0.0]  # faded sum of squared one-step residuals of x, and weights
        self.n_noise = 0  # evaluations behind the noise estimate
        self.levels: list[float | None] = [None] * len(KERNELS)  # per kernel: log x - a z
        self.kernel = 0  # the kernel chosen
        self.fit = Fit(0.0, 1.0, 0.0, 0.0)
        self.fits: list[Fit] = []
        self.trend = 0.0  # the drift carried ahead, per DRIFT_UNIT batches (>= 0)

    def update(self, log_kl: float, batches: int, excess: float, floor: float) -> None:
        """Take one evaluation: the mean log KL of its ``batches`` and its excess ``x``.

        ``floor``: the smallest excess whose log the fits use (a smaller one is taken as it).
        """
        before = None if self.seen is None else list(self.seen)
        if self.lagged is None:
            self.lagged = [log_kl] * len(LAGS)
        self.t += batches
        for j, lag in enumerate(LAGS):
            self.lagged[j] += (1.0 - math.exp(-batches / lag)) * (log_kl - self.lagged[j])
        self.seen = self._kernels()
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
            i = self.kernel  # of x, once the model's change is taken out
            change = self.fit.elasticity * self.excess * (self.seen[i] - before[i])
            residual = excess - self.excess - change
            fade = math.exp(-batches / MEMORY)
            self.noise = [fade * self.noise[0] + residual**2, fade * self.noise[1] + 1.0]
            self.n_noise += 1
        self.excess = excess

    def _kernels(self) -> list[float]:
        """``z`` per kernel: its weighted sum of the lagged log KLs."""
        assert self.lagged is not None
        return [sum(w * self.lagged[LAGS.index(lag)] for lag, w in k) for k in KERNELS]

    def _fit(self, i: int) -> Fit:
        """Weighted ridge least squares of ``log x`` on ``(1, z_i, t)``."""
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
            c, a, d = _held(matrix, rhs, {2: 0.0})
        bounded = min(max(a, ELASTICITY[0]), ELASTICITY[1])
        if bounded != a:  # a at its bound: (c, d) again with a fixed
            c, a, d = _held(matrix, rhs, {1: bounded})
            if d < 0.0:
                c, a, d = _held(matrix, rhs, {1: bounded, 2: 0.0})
        residual = sum(w * (lx - c - a * v[1] - d * v[2]) ** 2 for w, v, lx in rows) / total
        return Fit(c, a, d, residual)

    def _choose(self) -> None:
        """The first kernel, unless a longer one explains the evaluations clearly better."""
        self.fits = fits = [self._fit(i) for i in range(len(KERNELS))]
        span = self.t - self.history[0][0] if self.history else 0
        pick = 0
        for i in range(1, len(KERNELS)):
            # A kernel is judged only on evaluations that span its longest lag: over fewer
            # batches a smooth long lag fits a noisy ramp better than the KL it lags.
            longest = max(lag for lag, _ in KERNELS[i])
            if span >= EVIDENCE * longest and fits[i].residual < SLACK * fits[pick].residual:
                pick = i
        self.kernel, self.fit = pick, fits[pick]
        self.trend = self._trend()

    def _trend(self) -> float:
        """The slope of the chosen kernel's offsets ``log x - a z`` over the recent evaluations.

        Least squares on the batch, unweighted, over :data:`TREND_BATCHES` (or
        :data:`TREND_EVALUATIONS` intervals, where that is longer); 0 until they span
        :data:`TREND_SPAN` batches, and where it falls (the perplexity does not recover at a
        constant KL). With the model's ``a`` off by a factor, the slope in closed loop is off
        by the same factor, and the step, which divides by ``a``, asks for the right KL.
        """
        if len(self.history) < 3:
            return 0.0
        interval = self.history[-1][0] - self.history[-2][0]
        window = max(TREND_BATCHES, TREND_EVALUATIONS * interval)
        i, a = self.kernel, self.fit.elasticity
        rows = [(t, lx - a * s[i]) for t, lx, s in self.history if self.t - t < window]
        if len(rows) < 3 or rows[-1][0] - rows[0][0] < TREND_SPAN:
            return 0.0
        mean_t = sum(t for t, _ in rows) / len(rows)
        mean_o = sum(o for _, o in rows) / len(rows)
        sxx = sum((t - mean_t) ** 2 for t, _ in rows)
        slope = sum((t - mean_t) * (o - mean_o) for t, o in rows) / sxx
        return max(slope, 0.0) * DRIFT_UNIT

    def wanted(self, log_budget: float, batches: int) -> float:
        """The log KL to ask for: the one that brings the excess to the budget's in time.

        From the chosen kernel's fit: the excess now is ``level + a z``, the level an average
        of the evaluations' offsets from the line over :data:`LEVEL` batches; their rising
        trend (:meth:`_trend`) is anticipated by :data:`LEVEL` + :data:`AHEAD` + ``batches`` / 2
        batches (the level's lag, the KL law's, the coming interval's mean).
        ``z* = z + (log b - log x) / max(a, 1)`` is the ``z`` that gives the budget's excess
        (the step divides by at least :data:`STEP_ELASTICITY`); a log KL ``u`` held from now
        on brings each lag ``s_j`` to ``u + (s_j - u) e_j`` within the kernel's horizon ``H``
        (``e_j = exp(-H / L_j)``), so ``z`` to ``z*`` when
        ``u = (z* - sum_j w_j e_j s_j) / (1 - LEAD)``.
        """
        assert self.seen is not None and self.lagged is not None, "update() first"
        i = self.kernel
        z, fit, level = self.seen[i], self.fit, self.levels[i]
        assert level is not None
        ahead = LEVEL + AHEAD + batches / 2
        trend = self.trend if self.reached(log_budget) else 0.0
        log_x = level + fit.elasticity * z + trend * ahead / DRIFT_UNIT
        z_star = z + (log_budget - log_x) / max(fit.elasticity, STEP_ELASTICITY)
        kept = sum(
            w * math.exp(-HORIZONS[i] / lag) * self.lagged[LAGS.index(lag)] for lag, w in KERNELS[i]
        )
        return (z_star - kept) / (1.0 - LEAD)

    def reached(self, log_budget: float) -> bool:
        """Whether the smoothed excess has reached the budget's ``exp(log_budget)``.

        Smoothed as the trailing mean of :data:`REACHED_MEAN` evaluations, reached at
        :data:`REACHED` of the budget's, in any of the evaluations the model keeps.
        """
        xs = [math.exp(lx) for _, lx, _ in self.history]
        goal = REACHED * math.exp(log_budget) * REACHED_MEAN
        n = REACHED_MEAN
        return any(sum(xs[k - n : k]) >= goal for k in range(n, len(xs) + 1))

    @property
    def noise_sd(self) -> float:
        """The evaluations' noise in the excess (sd), from the one-step residuals."""
        total, weight = self.noise
        return math.sqrt(total / (2.0 * weight)) if weight > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Everything the model carries from one evaluation to the next."""
        return {
            "version": 3,
            "kernels": [[list(part) for part in kernel] for kernel in KERNELS],
            "t": self.t,
            "lagged": None if self.lagged is None else list(self.lagged),
            "history": [[t, lx, list(s)] for t, lx, s in self.history],
            "levels": list(self.levels),
            "excess": self.excess,
            "noise": list(self.noise),
            "n_noise": self.n_noise,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older model (before 0.11.0) starts afresh.

        The older fits answered another question (other lags, no lead).
        """
        self.__init__()
        kernels = [[list(part) for part in kernel] for kernel in KERNELS]
        if not state or state.get("version") != 3 or state.get("kernels") != kernels:
            return
        self.t = int(state["t"])
        if state["lagged"] is not None:
            self.lagged = [float(v) for v in state["lagged"]]
            self.seen = self._kernels()
        self.history = [(int(t), float(lx), [float(v) for v in s]) for t, lx, s in state["history"]]
        self.levels = [None if v is None else float(v) for v in state["levels"]]
        self.excess = state["excess"]
        self.noise = [float(v) for v in state["noise"]]
        self.n_noise = int(state["n_noise"])
        if self.history:
            self._choose()
