"""KLControllerCallback: adapts the KL coefficient beta of any LightningModule.

The callback talks to the module only through Lightning's own channels:

* the module logs its batch KL with ``self.log("objective/kl", kl)`` in ``training_step``
  and the callback reads ``trainer.callback_metrics["objective/kl"]``;
* the callback writes beta to a module attribute (default ``kl_coef``), which the module
  reads when it shapes rewards, and logs it as ``objective/kl_coef``.

Reading the KL, counting batches and samples and skipping unusable values is
:class:`~rlkl_lightning.kl.callback_base.KLCallbackBase`'s work; the helpers it uses live in
:mod:`rlkl_lightning.kl.reading` and are importable from here as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.callback_base import KLCallbackBase
from rlkl_lightning.kl.controllers import KLController, laws_with_target
from rlkl_lightning.kl.reading import (
    MONITOR_BY_UNIT,
    UNIT_NAMES,
    batch_size_of,
    check_name,
    check_target_unit,
    default_monitor,
    global_mean,
    infer_batch_size,
    read_monitored,
)

#: The default ``negative_kl_tolerance`` of each unit, beyond a k1 batch mean's noise.
NEGATIVE_KL_TOLERANCE = {"sequence": 1.0, "token": 0.05}

__all__ = [
    "MONITOR_BY_UNIT",
    "UNIT_NAMES",
    "KLControllerCallback",
    "batch_size_of",
    "check_target_unit",
    "default_monitor",
    "global_mean",
    "infer_batch_size",
    "read_monitored",
]


class KLControllerCallback(KLCallbackBase):
    r"""Update the KL coefficient of a LightningModule after every training batch.

    After each training batch the callback reads the batch KL the module logged under
    ``monitor``, averages it over the samples of the global batch (all ranks), calls
    ``controller.update(kl, n_samples)`` with the number of samples in the global batch,
    writes the new beta to ``pl_module.<attribute>`` and logs it under ``log_key``. The module
    therefore uses the updated beta from the next batch on. Every rank computes the same beta.

    The module must log the KL every training batch with ``on_step=True`` (the default in
    ``training_step``) and expose the attribute, e.g. ``self.kl_coef = 0.1`` in ``__init__``.
    A tensor attribute (e.g. a registered buffer) is updated in place.

    Batches and samples are counted here (``n_batches``, ``n_samples``): ``trainer.global_step``
    counts optimizer steps, of which PPO takes several per batch. A batch without a usable KL
    (non-finite, or not logged again since the last batch) skips the update: beta stays, the
    first such batch warns, and all are counted in ``n_skipped``.

    The controller state and the counters are saved in checkpoints, so a resumed fit continues
    the same beta trajectory.

    The target is public state: another callback (a
    :class:`~rlkl_lightning.kl.capability_budget.CapabilityBudget`) may move it with
    :meth:`set_target` (or ``callback.target = x``). The change takes effect at the next
    update of the law, i.e. with the KL of the next training batch that has a usable one and
    is not held after a refresh; beta stays as it is until then. What the law's state does on
    the step is the law's own rule (:meth:`~rlkl_lightning.kl.controllers.KLController`
    laws' ``set_target``: adaptive and exponential keep beta, PI keeps its integral, log-PID
    shifts its smoothed log error by the step's log). The fixed law has no target and refuses.
    The current target is saved in checkpoints and restored with the law's state; a resume
    whose ``target`` argument differs from the run's first (``--resume_with_changes``) steps
    from the saved target to the new one by the same rule. ``kl_sum`` and ``kl_count`` (the
    usable KLs seen and their number) let an outer loop average the KL over a span of batches.

    After the first batch with a finite KL, a controller ``target`` that looks like the other
    unit (:func:`check_target_unit`, e.g. 0.05 "per sequence" with 30-token responses) warns.

    Args:
        controller: A KL controller (``value``, ``update(current_kl, n_steps)``, ``state_dict``,
            ``load_state_dict``), e.g. ``AdaptiveKLController(0.1, target=6.0, horizon=10_000)``.
            Its ``n_steps`` are samples of the global batch.
        unit: Unit of the controlled KL, ``"sequence"`` (nats per sequence) or ``"token"`` (nats
            per token); picks the default ``monitor``. The controller's target is in this unit.
        monitor: Key the module logs the batch KL under. Defaults to ``"objective/kl"`` for
            ``unit="sequence"`` and ``"objective/kl_per_token"`` for ``unit="token"``.
        attribute: Name of the module attribute that holds beta.
        log_key: Key beta is logged under after each update; ``None`` disables logging. Two
            controller callbacks of one trainer need different keys (refused at fit start).
        batch_size_fn: ``batch -> int``, the number of samples in this rank's batch. Defaults to
            :func:`infer_batch_size` (leading size of the batch's first field).
        prog_bar: Also show beta in the progress bar.
        negative_kl_tolerance: A batch KL below ``-negative_kl_tolerance`` (in ``unit``) warns
            at once: a KL is never negative, and an estimate that far below 0 is a sign error
            or a wrong reference, not sampling noise. The update goes on; such batches are
            counted in ``n_negative``. None: 1 nat per sequence, 0.05 nats per token (a k1
            batch mean of a few samples dips a few tenths of a nat per sequence below 0 by
            noise); ``math.inf`` disables the check.
        hold_after_refresh: Batches after a refresh of the reference (read under
            ``refresh_key``) during which the controller is not updated: beta and the law's
            state stay as they were while the KL, reset to about zero, climbs back (0: the law
            sees every KL). docs/controllers.md, "Across a reference refresh". A hold of
            ``every`` batches or more of the ``ReferenceRefresh`` callback freezes beta from the
            first refresh on, and warns at set-up.
        refresh_key: Key the module logs its running count of reference refreshes under.
        bound_patience: Consecutive updates with beta at one of the law's bounds
            (``min_kl_coef``, ``max_kl_coef``) after which the callback warns, once: the law
            cannot bring the KL to the target (0: never). All updates at a bound are counted in
            ``n_at_bound``.

    Example::

        controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
        trainer = Trainer(callbacks=[KLControllerCallback(controller)])
    """

    def __init__(
        self,
        controller: KLController,
        unit: str = "sequence",
        monitor: str | None = None,
        attribute: str = "kl_coef",
        log_key: str | None = keys.KL_COEF,
        batch_size_fn: Callable[[Any], int] | None = None,
        prog_bar: bool = False,
        negative_kl_tolerance: float | None = None,
        hold_after_refresh: int = 0,
        refresh_key: str | None = keys.REFERENCE_REFRESHES,
        bound_patience: int = 20,
    ) -> None:
        owner = type(self).__name__
        if (
            isinstance(bound_patience, bool)
            or not isinstance(bound_patience, int)
            or (bound_patience < 0)
        ):
            raise ValueError(
                f"{owner}: bound_patience must be an int >= 0 (batches; 0: never warn), got "
                f"{bound_patience!r}"
            )
        tolerance = negative_kl_tolerance
        if tolerance is None:
            tolerance = NEGATIVE_KL_TOLERANCE.get(unit, 1.0)
        if (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, (int, float))
            or not (tolerance >= 0)
        ):
            raise ValueError(
                f"{owner}: negative_kl_tolerance must be a number >= 0 (math.inf disables the "
                f"check), got {tolerance!r}"
            )
        if (
            isinstance(hold_after_refresh, bool)
            or not isinstance(hold_after_refresh, int)
            or hold_after_refresh < 0
        ):
            raise ValueError(
                f"{owner}: hold_after_refresh must be an int >= 0 (batches), got "
                f"{hold_after_refresh!r}"
            )
        if isinstance(controller, type):
            raise TypeError(
                f"{owner}: controller must be a KL law instance, got the class "
                f"{controller.__name__}; construct it first, e.g. {controller.__name__}("
                "init_kl_coef=..., ...)"
            )
        missing = [
            name
            for name in ("value", "update", "state_dict", "load_state_dict")
            if not hasattr(controller, name)
        ]
        if missing:
            raise TypeError(
                f"{owner}: controller must implement the KLController protocol (value, update, "
                f"state_dict, load_state_dict); {type(controller).__name__} lacks {missing}"
            )
        super().__init__(
            unit=unit, monitor=monitor, batch_size_fn=batch_size_fn, refresh_key=refresh_key
        )
        check_name(attribute, "attribute", owner)
        check_name(log_key, "log_key", owner, optional=True)
        self.controller = controller
        self.attribute = attribute
        self.log_key = log_key
        self.prog_bar = prog_bar
        self.negative_kl_tolerance = float(tolerance)
        self.n_negative = 0
        self.hold_after_refresh = hold_after_refresh
        self.held = 0  # batches still to hold beta after the last refresh
        self.initial_target = self.target  # the `target` this run was configured with
        self.kl_sum = 0.0  # of the usable batch KLs seen (held ones too), for outer loops
        self.kl_count = 0
        self.bound_patience = bound_patience
        self.n_at_bound = 0  # updates that left beta at a bound
        self.at_bound = 0  # of them, the last consecutive ones
        self._warned_bound = False
        self.steered = False  # another callback (a CapabilityBudget) sets the target in force

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, attribute=self.attribute)

    @property
    def target(self) -> float | None:
        """The controller's target KL (in ``unit``), or None for a law without one."""
        target = getattr(self.controller, "target", None)
        return float(target) if isinstance(target, (int, float)) else None

    @target.setter
    def target(self, value: float) -> None:
        self.set_target(value)

    def set_target(self, target: float) -> None:
        """Move the controller's target to ``target`` (in ``unit``) from the next update on.

        Raises:
            ValueError: If the law has no target (the fixed law) or ``target`` is not a finite
                number > 0; nothing changes then.
        """
        owner = f"{type(self).__name__}.set_target"
        setter = getattr(self.controller, "set_target", None)
        if callable(setter):
            setter(target)
            return
        if self.target is None:
            raise ValueError(
                f"{owner}: the controller {type(self.controller).__name__} has no `target` to "
                f"move; use a law with a target: `kl.controller` one of {laws_with_target()}"
            )
        if (
            isinstance(target, bool)
            or not isinstance(target, (int, float))
            or not (0 < target < float("inf"))
        ):
            raise ValueError(f"{owner}: `target` must be a finite number > 0, got {target!r}")
        self.controller.target = float(target)  # a plugged law without set_target: kept state

    @property
    def value(self) -> float:
        """The current beta."""
        return float(self.controller.value)

    def _write(self, pl_module: pl.LightningModule) -> None:
        if not hasattr(pl_module, self.attribute):
            raise AttributeError(
                f"{type(self).__name__}: LightningModule {type(pl_module).__name__} has no "
                f"attribute `{self.attribute}`; add `self.{self.attribute} = ...` in __init__ "
                "or pass attribute=..."
            )
        current = getattr(pl_module, self.attribute)
        if isinstance(current, torch.Tensor):
            if not (current.is_floating_point() or current.is_complex()):
                # fill_ would truncate beta (0.54 -> 0) without a word
                raise TypeError(
                    f"{type(self).__name__}: `{type(pl_module).__name__}.{self.attribute}` is a "
                    f"{current.dtype} tensor, which cannot hold beta ({self.value:g}); make it "
                    "a float one, e.g. torch.tensor(0.0)"
                )
            with torch.no_grad():
                current.fill_(self.value)
        else:
            setattr(pl_module, self.attribute, self.value)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Fails early on a missing attribute and gives the sanity-check validation the initial
        # beta. With most strategies callback states are already restored here; FSDP, DeepSpeed
        # and ModelParallel restore them later, hence the write again in on_train_start.
        self._check_log_key(trainer)
        self._write(pl_module)

    def _check_log_key(self, trainer: pl.Trainer) -> None:
        """Refuse a second controller callback that logs its beta under the same key."""
        other = (
            None
            if self.log_key is None
            else self.earlier_sharing(trainer, KLControllerCallback, "log_key")
        )
        if other is not None:
            raise ValueError(
                f"{type(self).__name__}: the controller of `{self.attribute}` (monitor "
                f"{self.monitor!r}) and the one of `{other.attribute}` (monitor "
                f"{other.monitor!r}) both log beta with log_key {self.log_key!r}, and "
                "only the last value logged under a key is kept; pass another "
                "log_key=... (or None) to one of them"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs after every checkpoint restore, whatever the strategy, and before the first batch.
        self._write(pl_module)

    @override
    def on_kl(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, kl: float, n_samples: int
    ) -> None:
        if kl < -self.negative_kl_tolerance:
            self.n_negative += 1
            if self.n_negative == 1:
                rank_zero_warn(
                    f"{type(self).__name__}: {self.monitor!r} is {kl:.4g} "
                    f"({UNIT_NAMES[self.unit]}) in batch {self.n_batches}, below "
                    f"-negative_kl_tolerance={-self.negative_kl_tolerance:g}. A KL is never "
                    "negative: check the sign (log pi - log pi_ref) and the reference. The "
                    "controller takes it as a KL below target and lowers beta; further such "
                    "batches are counted in `n_negative` without a warning.",
                    category=RuntimeWarning,
                )
        self.kl_sum += kl
        self.kl_count += 1
        if self.held > 0:
            self.held -= 1  # the KL against a freshly refreshed reference: beta holds
            return
        self.controller.update(kl, n_samples)
        self._count_bound(kl)

    def _count_bound(self, kl: float) -> None:
        """Count an update that left beta at a bound; warn once after ``bound_patience``.

        A law without a target (the fixed law) has nothing to reach: its beta is never counted.
        """
        if self.target is None:
            return
        beta = self.value
        lo = getattr(self.controller, "min_kl_coef", None)
        hi = getattr(self.controller, "max_kl_coef", None)
        side = (
            "max_kl_coef"
            if hi is not None and beta >= hi
            else "min_kl_coef"
            if lo is not None and beta <= lo
            else None
        )
        if side is None:
            self.at_bound = 0
            return
        self.n_at_bound += 1
        self.at_bound += 1
        if self.at_bound == self.bound_patience and not self._warned_bound:
            self._warned_bound = True
            rank_zero_warn(
                f"{type(self).__name__}: beta has sat at its bound {side}={beta:.4g} for "
                f"{self.at_bound} consecutive batches (KL {kl:.4g} against the target "
                f"{self.target:.4g}, {UNIT_NAMES[self.unit]}): the KL law cannot reach the "
                f"target. Move the bound (`kl.{side}`) or the target; further batches at a "
                "bound are counted in `n_at_bound` (`kl.bound_patience` sets the patience, 0 "
                "silences this).",
                category=RuntimeWarning,
            )

    @override
    def on_refresh(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.held = self.hold_after_refresh

    @override
    def expect_refreshes(self, every: int) -> None:
        super().expect_refreshes(every)
        if self.hold_after_refresh >= every:
            rank_zero_warn(
                f"{type(self).__name__}: hold_after_refresh ({self.hold_after_refresh}, "
                f"`kl.hold_after_refresh`) >= the reference refresh's `every` ({every}): each "
                "refresh comes before the hold of the one before has ended, so beta is held "
                f"from the first refresh to the end of the run at {self.value:.6g} and the law "
                f"never acts again. Use hold_after_refresh < {every} (0 to let the law see "
                "every KL).",
                category=RuntimeWarning,
            )

    @override
    def skip_effect(self) -> str:
        return f"beta stays {self.value:.6g}"

    @override
    def after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(pl_module)
        if self.log_key is not None:
            pl_module.log(
                self.log_key, self.value, on_step=True, on_epoch=False, prog_bar=self.prog_bar
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "controller": self.controller.state_dict(),
            "n_negative": self.n_negative,
            "held": self.held,
            "target": self.target,
            "initial_target": self.initial_target,
            "kl_sum": self.kl_sum,
            "kl_count": self.kl_count,
            "n_at_bound": self.n_at_bound,
            "at_bound": self.at_bound,
            **super().state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("target")
        if saved is not None and self.target is not None:
            # The law's state was saved under this target: put it back before the state.
            self.controller.target = float(saved)
        self.controller.load_state_dict(state_dict["controller"])
        if (
            saved is not None
            and self.initial_target is not None
            and state_dict.get("initial_target", saved) != self.initial_target
            and not self.steered  # the steering callback puts its own target back
        ):
            self.set_target(self.initial_target)  # a changed `target` on resume: a step to it
        self.n_negative = state_dict.get("n_negative", 0)
        self.held = state_dict.get("held", 0)
        self.kl_sum = float(state_dict.get("kl_sum", 0.0))
        self.kl_count = int(state_dict.get("kl_count", 0))
        self.n_at_bound = int(state_dict.get("n_at_bound", 0))
        self.at_bound = int(state_dict.get("at_bound", 0))
        super().load_state_dict(state_dict)
