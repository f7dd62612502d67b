"""CapabilityBudget: choose the KL target so that held-out perplexity stays at a budget.

A KL law holds the KL at a target; which target a run can afford is a question about
capability, not about nats. This callback is the outer loop of a cascade around the KL law:
after each validation it reads a capability metric (by default ``val/perplexity``), compares
it with the *initial* reference's value (``val/perplexity_ref`` at the first validation, kept
in checkpoints, so a refresh of the reference does not reset the budget) and moves the
target of the :class:`~rlkl_lightning.kl.controller_callback.KLControllerCallback` (and of
every :class:`~rlkl_lightning.kl.drift_monitor.KLDriftMonitor` of the same unit), slowly and
in bounded steps, so that the metric settles at ``budget`` times the reference's.
docs/budget.md derives the law and says when it cannot hold the budget.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.budget_model import ExcessModel
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import laws_with_target
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl.reading import check_name

MODES = ("min", "max")
#: Evaluations the noise estimate takes before the budget judges it.
NOISE_EVALUATIONS = 10


def _number(
    owner: str, name: str, value: Any, low: float, high: float = math.inf, closed: bool = False
) -> float:
    """``value`` as a float after checking it is a finite number in ``(low, high)``.

    ``closed``: the bounds themselves are allowed (``[low, high]``).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not (low <= value <= high if closed else low < value < high)
    ):
        left, right = ("[", "]") if closed else ("(", ")")
        if high == math.inf:
            span = f"{'>=' if closed else '>'} {low:g}"
        else:
            span = f"in {left}{low:g}, {high:g}{right}"
        raise ValueError(f"{owner}: `{name}` must be a finite number {span}, got {value!r}")
    return float(value)


def _check_validation(trainer: pl.Trainer, owner: str, monitor: str) -> None:
    """Refuse a run whose validation never runs: the budget would never act, silently."""
    limit = getattr(trainer, "limit_val_batches", 1)
    if limit == 0:
        raise ValueError(
            f"{owner}: `trainer.limit_val_batches` must be > 0 with a capability budget, got "
            f"{limit!r}: the budget moves the target after each validation ({monitor!r})"
        )
    hparams = getattr(getattr(trainer, "datamodule", None), "hparams", None)
    if hparams is not None and "heldout" in hparams and hparams["heldout"] is None:
        raise ValueError(
            f"{owner}: `data.init_args.heldout` must name the held-out text the budget steers "
            f"on ({monitor!r} is measured on it), got None: without it no validation runs "
            "(e.g. default:validation)"
        )


def _check_run_length(trainer: pl.Trainer, steps_per_batch: int) -> None:
    """Refuse a run shorter than its ``val_check_interval`` (known after its first batch)."""
    interval = getattr(trainer, "val_check_interval", None)
    if trainer.check_val_every_n_epoch is not None or not isinstance(interval, int):
        return
    loop = trainer.fit_loop.epoch_loop
    done = loop.total_batch_idx + 1  # batches of the whole run, this one included
    lengths = []
    if trainer.max_steps is not None and trainer.max_steps > 0 and steps_per_batch > 0:
        lengths.append(
            done + math.ceil((trainer.max_steps - trainer.global_step) / steps_per_batch)
        )
    batches = trainer.num_training_batches
    if trainer.max_epochs is not None and trainer.max_epochs > 0 and math.isfinite(batches):
        lengths.append(int(trainer.max_epochs * batches))
    if lengths and min(lengths) < interval:
        raise ValueError(
            f"CapabilityBudget: `trainer.val_check_interval` must be at most the run's length "
            f"({min(lengths)} batches), got {interval}: the budget moves the target only after "
            "a validation, and this run would have none"
        )


class CapabilityBudget(Callback):
    r"""Move the KL target so that a capability metric stays at ``budget`` x the reference's.

    After each validation (Lightning's sanity check is skipped) the callback reads ``monitor``
    and, the first time, the reference's value under ``reference_key``. With ``x`` the
    metric's excess over the reference (``log(m / m_ref)``; ``log(m_ref / m)`` with
    ``mode="max"``), ``b`` the budget's (``log budget``; ``log(1 / budget)`` with ``"max"``),
    ``n`` the training batches since the last evaluation and ``kl_mean`` the mean batch KL over
    them (from the controller callback's ``kl_sum``/``kl_count``), it does, in log target::

        model.update(log kl_mean, n, max(x, error_floor * b))
        want   = model.wanted(log b, n)       # the KL that brings x to b within a horizon
        u      = clip(want, log target - fall_per_batch n, log target + raise_per_batch n)
        u      = min(u, log target)  if kl_mean < follow * target          # still climbing
        u      = max(u, log target)  if kl_mean > target / follow, not falling  # law stuck
        target = clip(exp(u), min_target, max_target)

    a feed-forward law on the KL the run has measured, not on the target it asked for (``model``,
    :class:`~rlkl_lightning.kl.budget_model.ExcessModel`: ``log x`` fitted as ``c + a z + d t`` over
    the run's evaluations, ``z`` the log KL seen through a lag kernel chosen from a bank, by default
    half a 5-batch and half a 50-batch lag, ``d`` a slow drift; a rise of the offsets
    ``log x - a z`` over the last 80 batches is carried ahead, as a perplexity that creeps at a
    constant KL). It answers the KL that, held, brings the excess to the budget's within the
    kernel's horizon (12 batches for the default kernel), from the lags the KL has already
    charged: more than the KL that holds the budget while the slow lag is still catching up,
    that KL once it has. The KL law's own
    lag in following the target therefore winds nothing up, and the horizon is in batches, not
    evaluations (docs/budget.md, "Stability"). The target moves by at most ``raise_per_batch`` up
    and ``fall_per_batch`` down per batch. Two holds keep the outer loop from winding up against the
    KL law: the target does not rise while the KL has not reached ``follow`` x the target (it is
    still climbing), and it does not fall while the KL stays above target / ``follow`` and does not
    fall (the law cannot bring it lower; a lower target would only raise beta without end). Where
    the evaluations scatter by more than half the budget's excess, the callback warns once, naming
    the smallest budget it can hold. docs/budget.md derives the law.

    The new target is handed to the controller callback
    (:meth:`~rlkl_lightning.kl.controller_callback.KLControllerCallback.set_target`: the law
    uses it from the next training batch on) and to the drift monitors of the same unit, whose
    band then follows it. The target is logged every training batch under ``log_key``, the
    last measured ratio ``m / m_ref`` under ``budget/ratio``. The target, the reference value
    and the loop's counters are saved in checkpoints and put back on resume; under DDP the
    target is broadcast from rank 0, so every rank holds the same one. A non-finite metric or
    reference leaves the target unchanged: the first one warns, all are counted in
    ``n_skipped``.

    The callback needs a ``KLControllerCallback`` whose law has a target; with the fixed law
    it is refused by name at set-up (it does not move beta itself: a budget on beta is a
    different loop, and the fixed law's runs are the baseline it is judged against).

    Args:
        budget: The allowed ratio of the metric to the reference's: > 1 with ``mode="min"``
            (perplexity: 1.15 allows +15%), in (0, 1) with ``mode="max"`` (a score).
        monitor: Key the module logs the capability metric under at validation.
        reference_key: Key the module logs the reference's value under; its first finite
            value is kept for the run. None: the budget is absolute (``m_ref = 1``).
        mode: ``"min"`` (lower is better: perplexity, a held-out KL) or ``"max"``.
        raise_per_batch: Largest rise of ``log target`` per batch, > 0 (0.04: x 1.22 per 5).
        fall_per_batch: Largest fall of ``log target`` per batch, > 0 (0.04: x 0.82 per 5).
        min_target: Floor of the target (in the controller's unit), > 0.
        max_target: Ceiling of the target, > ``min_target``.
        follow: Fraction of the target the mean KL since the last evaluation must reach
            before the target may rise, in [0, 1]; at 0 it may always rise.
        error_floor: Excess, as a fraction of the budget's, below which the error stops
            growing, in (0, 1).
        log_key: Key the target is logged under; None: not logged.
    """

    def __init__(
        self,
        budget: float = 1.15,
        monitor: str = keys.PERPLEXITY,
        reference_key: str | None = keys.PERPLEXITY_REF,
        mode: str = "min",
        raise_per_batch: float = 0.04,
        fall_per_batch: float = 0.04,
        min_target: float = 0.1,
        max_target: float = 100.0,
        follow: float = 0.7,
        error_floor: float = 0.1,
        log_key: str | None = keys.KL_TARGET,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if mode not in MODES:
            raise ValueError(f"{owner}: `mode` must be one of {MODES}, got {mode!r}")
        if mode == "min":
            budget = _number(owner, "budget", budget, 1.0)
        else:
            budget = _number(owner, "budget", budget, 0.0, 1.0)
        check_name(monitor, "monitor", owner)
        check_name(reference_key, "reference_key", owner, optional=True)
        check_name(log_key, "log_key", owner, optional=True)
        self.budget = budget
        self.monitor = monitor
        self.reference_key = reference_key
        self.mode = mode
        self.raise_per_batch = _number(owner, "raise_per_batch", raise_per_batch, 0.0)
        self.fall_per_batch = _number(owner, "fall_per_batch", fall_per_batch, 0.0)
        self.min_target = _number(owner, "min_target", min_target, 0.0)
        self.max_target = _number(owner, "max_target", max_target, self.min_target)
        self.follow = _number(owner, "follow", follow, 0.0, 1.0, closed=True)
        self.error_floor = _number(owner, "error_floor", error_floor, 0.0, 1.0)
        self.log_key = log_key
        self._sign = 1.0 if mode == "min" else -1.0
        self.target: float | None = None  # set at set-up from the controller, or restored
        self.reference: float | None = None if reference_key is not None else 1.0
        self.ratio = math.nan  # the last measured m / m_ref
        self.n_evaluations = 0
        self.n_skipped = 0
        self.n_held = 0  # evaluations whose raise was held back (the KL not following)
        self.n_held_low = 0  # evaluations whose lowering was held back (the KL stuck above)
        self.n_in_band = 0  # evaluations whose ratio was within 20% of the budget's excess
        self.batches_at_eval = 0
        self.kl_sum_at_eval = 0.0
        self.kl_count_at_eval = 0
        self.model = ExcessModel()  # which KL holds the budget
        self.kl_before = math.nan  # the mean KL of the evaluation before (nan: none yet)
        self._controller: KLControllerCallback | None = None
        self._monitors: list[KLDriftMonitor] = []
        self._warned_nonfinite = False
        self._warned_stuck = False
        self._warned_noise = False
        self._restored = False  # from a checkpoint: the start of the fit says the target
        self._first_batch = False
        self._steps_at_start = 0

    @property
    @override
    def state_key(self) -> str:
        # Not the budget or the rates: a resume with changed ones (--resume_with_changes)
        # carries the target and the reference's value over.
        return self._generate_state_key(monitor=self.monitor)

    @property
    def budget_excess(self) -> float:
        """``b``: the budget as an excess in log (``log budget``, or its negative for max)."""
        return self._sign * math.log(self.budget)

    # ------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        owner = type(self).__name__
        controllers = [c for c in trainer.callbacks if isinstance(c, KLControllerCallback)]
        if len(controllers) != 1:
            raise ValueError(
                f"{owner}: needs exactly one KLControllerCallback among the trainer's "
                f"callbacks (the CLI's `kl` group adds one), found {len(controllers)}"
            )
        controller = controllers[0]
        if controller.target is None:
            law = getattr(controller.controller, "law", type(controller.controller).__name__)
            raise ValueError(
                f"{owner}: `kl.controller` must be one of {laws_with_target()} to run with a "
                f"capability budget, got {law!r}: the budget moves the KL target, and that "
                "law has none"
            )
        self._controller = controller
        self._monitors = [
            m
            for m in trainer.callbacks
            if isinstance(m, KLDriftMonitor) and m.unit == controller.unit
        ]
        if stage == "fit":
            _check_validation(trainer, owner, self.monitor)
        for callback in (controller, *self._monitors):
            callback.steered = True  # the budget's target, not the configured one, is in force
        if self.target is None:
            self.target = min(max(controller.target, self.min_target), self.max_target)
        refresh = any(type(c).__name__ == "ReferenceRefresh" for c in trainer.callbacks)
        rank_zero_info(
            f"{owner}: steers the KL target ({controller.unit}) from {self.target:.4g} within "
            f"[{self.min_target:g}, {self.max_target:g}] so that {self.monitor!r} stays at "
            f"{self.budget:g} x the initial reference's ({self.reference_key!r}); "
            f"{len(self._monitors)} drift monitor(s) follow the target."
            + (
                " With the ReferenceRefresh the ratio stays against the initial reference's "
                "value: the budget bounds what the run loses from the model it started with, "
                "and the target, a KL to the refreshed reference, is lowered as that loss "
                "accumulates (docs/budget.md)."
                if refresh
                else ""
            )
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After any checkpoint restore: the target in force is the cascade's.
        self._push()
        self._first_batch = True
        self._steps_at_start = trainer.global_step
        if self._restored and self._controller is not None and self.target is not None:
            rank_zero_info(
                f"{type(self).__name__}: resumed; the KL target in force is {self.target:.4g} "
                f"(the budget's, from the checkpoint; `kl.target` "
                f"{self._controller.initial_target:g} only starts a run)."
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(self.summary())

    def band(self) -> tuple[float, float]:
        """The ratios within 20% of the budget's excess (1.15: [1.12, 1.18])."""
        ends = (1.0 + 0.8 * (self.budget - 1.0), 1.0 + 1.2 * (self.budget - 1.0))
        return min(ends), max(ends)

    def summary(self) -> str:
        """One line on how the run held its budget: what the end of a run prints."""
        used = self.n_evaluations - self.n_skipped
        share = f" ({self.n_in_band / used:.0%})" if used else ""
        lo, hi = self.band()
        at_bound = getattr(self._controller, "n_at_bound", None)
        batches = getattr(self._controller, "n_batches", 0)
        target = "none" if self.target is None else f"{self.target:.4g}"
        return (
            f"{type(self).__name__}: {self.n_in_band} of {used} evaluations{share} with the "
            f"ratio in the band [{lo:.4g}, {hi:.4g}] (budget {self.budget:g} +- 20% of its "
            f"excess); final target {target}; beta at a bound in "
            f"{'?' if at_bound is None else at_bound} of {batches} batches; "
            f"{self.n_skipped} evaluations skipped."
        )

    def _push(self) -> None:
        if self._controller is None or self.target is None:
            return
        self._controller.set_target(self.target)
        for monitor in self._monitors:
            monitor.target = self.target

    # ------------------------------------------------------------------ the loop
    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._first_batch:
            self._first_batch = False
            _check_run_length(trainer, trainer.global_step - self._steps_at_start)
        if self.log_key is not None and self.target is not None:
            pl_module.log(self.log_key, self.target, on_step=True, on_epoch=False)
        if math.isfinite(self.ratio):
            pl_module.log(keys.BUDGET_RATIO, self.ratio, on_step=True, on_epoch=False)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._controller is None or self.target is None:
            return
        metric = self._read(trainer, self.monitor)
        if self.reference is None:
            reference = self._read(trainer, self.reference_key)
            if math.isfinite(reference) and reference > 0:
                self.reference = reference
        self.step(metric, trainer)
        self.target = float(trainer.strategy.broadcast(self.target, src=0))
        self._push()

    def step(self, metric: float, trainer: pl.Trainer | None = None) -> float:
        """One evaluation of the loop with the metric ``metric``; returns the target."""
        controller = self._controller
        assert controller is not None and self.target is not None
        batches = controller.n_batches - self.batches_at_eval
        kl_n = controller.kl_count - self.kl_count_at_eval
        kl_mean = (controller.kl_sum - self.kl_sum_at_eval) / kl_n if kl_n > 0 else math.nan
        self.batches_at_eval = controller.n_batches
        self.kl_sum_at_eval, self.kl_count_at_eval = controller.kl_sum, controller.kl_count
        self.n_evaluations += 1
        reference = self.reference
        if not (math.isfinite(metric) and metric > 0 and reference is not None and reference > 0):
            self.n_skipped += 1
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                rank_zero_warn(
                    f"{type(self).__name__}: no usable {self.monitor!r} ({metric}) or "
                    f"reference value ({reference}) at evaluation {self.n_evaluations}; the "
                    f"target stays {self.target:.6g}. Further such evaluations are counted in "
                    "`n_skipped` without a warning.",
                    category=RuntimeWarning,
                )
            return self.target
        self.ratio = metric / reference
        lo_band, hi_band = self.band()
        self.n_in_band += lo_band <= self.ratio <= hi_band
        excess = self._sign * math.log(self.ratio)
        b = self.budget_excess
        if not (math.isfinite(kl_mean) and kl_mean > 0 and batches > 0):
            return self.target  # no KL measured since the last evaluation: nothing to fit
        self.model.update(math.log(kl_mean), batches, excess, self.error_floor * b)
        self._check_noise()
        want = self.model.wanted(math.log(b), batches)
        now = math.log(self.target)
        u = min(
            max(want, now - self.fall_per_batch * batches), now + self.raise_per_batch * batches
        )
        # The KL has not reached `follow` x the target: it is still climbing, and a higher
        # target would meet the perplexity's rise with the KL law far behind it.
        if kl_mean < self.follow * self.target and u > now:
            u = now
            self.n_held += 1
        # The KL law cannot bring the KL down to the target: a lower target would only wind
        # the law's beta up (and PPO at a huge beta diverges), so the target is not lowered.
        # A KL above target / follow that is still falling is the KL law following the target
        # down with its lag, not a KL it cannot bring lower.
        falling = kl_mean < self.kl_before
        self.kl_before = kl_mean
        if self.follow * kl_mean > self.target and not falling and u < now:
            u = now
            self.n_held_low += 1
            if not self._warned_stuck:
                self._warned_stuck = True
                where = "over" if excess > b else "within"
                rank_zero_warn(
                    f"{type(self).__name__}: {self.monitor!r} is {where} budget "
                    f"({self.ratio:.4g} x the reference's, budget {self.budget:g}) and the loop "
                    f"would lower the target to {math.exp(want):.4g}, but the KL law holds the "
                    f"KL at {kl_mean:.4g}, above the target {self.target:.4g} / follow "
                    f"({self.follow:g}): the target is not lowered further while the KL does "
                    "not follow it down (the budget may be out of reach; see docs/budget.md, "
                    "'When it cannot hold the budget'). Further such evaluations are counted "
                    "in `n_held_low`.",
                    category=RuntimeWarning,
                )
        self.target = min(max(math.exp(u), self.min_target), self.max_target)
        return self.target

    def _check_noise(self) -> None:
        """Warn once where the evaluations' noise is over half the budget's excess."""
        sd, b = self.model.noise_sd, abs(self.budget_excess)
        if self._warned_noise or self.model.n_noise < NOISE_EVALUATIONS or sd <= b / 2:
            return
        self._warned_noise = True
        smallest = math.exp(2.0 * sd * self._sign)
        rank_zero_warn(
            f"{type(self).__name__}: the evaluations of {self.monitor!r} scatter by {sd:.3g} "
            f"(sd, in log), more than half the budget's excess (log {self.budget:g} = {b:.3g}): "
            f"the budget cannot tell its excess from noise, and the smallest budget this run "
            f"can hold is about {smallest:.4g} (docs/budget.md, 'When it cannot hold the "
            "budget'). Validate on more text, or set a larger budget.",
            category=RuntimeWarning,
        )

    def _read(self, trainer: pl.Trainer, key: str | None) -> float:
        if key is None:
            return math.nan
        metrics = trainer.callback_metrics
        if key not in metrics:
            raise RuntimeError(
                f"{type(self).__name__}: the module logged no {key!r} at validation; log it "
                f"in `on_validation_epoch_end` or set `monitor`/`reference_key` to one of "
                f"{sorted(k for k in metrics if not k.startswith(('objective/', 'loss/')))}"
            )
        value = metrics[key]
        return float(value.item() if isinstance(value, torch.Tensor) else value)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "reference": self.reference,
            "ratio": self.ratio,
            "n_evaluations": self.n_evaluations,
            "n_skipped": self.n_skipped,
            "n_held": self.n_held,
            "n_held_low": self.n_held_low,
            "n_in_band": self.n_in_band,
            "batches_at_eval": self.batches_at_eval,
            "kl_sum_at_eval": self.kl_sum_at_eval,
            "kl_count_at_eval": self.kl_count_at_eval,
            "model": self.model.state_dict(),
            "kl_before": self.kl_before,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        target = state_dict.get("target")
        if target is not None:
            self.target = min(max(float(target), self.min_target), self.max_target)
        if self.reference_key is not None:
            self.reference = state_dict.get("reference")
        self.ratio = float(state_dict.get("ratio", math.nan))
        self.n_evaluations = int(state_dict.get("n_evaluations", 0))
        self.n_skipped = int(state_dict.get("n_skipped", 0))
        self.n_held = int(state_dict.get("n_held", 0))
        self.n_held_low = int(state_dict.get("n_held_low", 0))
        self.n_in_band = int(state_dict.get("n_in_band", 0))
        self._restored = True
        self.batches_at_eval = int(state_dict.get("batches_at_eval", 0))
        self.kl_sum_at_eval = float(state_dict.get("kl_sum_at_eval", 0.0))
        self.kl_count_at_eval = int(state_dict.get("kl_count_at_eval", 0))
        self.model.load_state_dict(state_dict.get("model") or {})
        self.kl_before = float(state_dict.get("kl_before", math.nan))
