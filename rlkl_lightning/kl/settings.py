"""The ``kl`` group of the command line: one target shared by the controller and the monitor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning.pytorch import Callback

from rlkl_lightning.defaults import default_of
from rlkl_lightning.kl.controller_callback import UNIT_NAMES, KLControllerCallback
from rlkl_lightning.kl.controllers import (
    KL_LAWS,
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    LogPIDKLController,
    PIKLController,
)
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor


@dataclass
class KLSettings:
    """KL control of a PPO run.

    An option that feeds a class takes its default from that class's signature.

    Args:
        controller: the control law: ``fixed``, ``adaptive`` (Ziegler et al. 2019),
            ``exponential``, ``pi`` or ``logpid`` (a PID law on log KL whose defaults need no
            per-world tuning; it takes only ``target`` and the bounds from this group).
        target: target KL in ``unit``; drives the adaptive laws and the drift monitor (with a
            fixed beta it is only monitored).
        unit: ``sequence`` (nats per sequence, read from ``objective/kl``) or ``token``
            (nats per response token, read from ``objective/kl_per_token``).
        horizon: adaptive law's horizon, in samples (scale it with the samples the run sees).
        k: gain of the exponential law, per nat of error.
        kp: proportional gain of the PI law.
        ki: integral gain of the PI law.
        min_kl_coef: lower bound of beta (None: the law's default).
        max_kl_coef: upper bound of beta (None: the law's default).
        window: drift monitor's moving-average window, in batches.
        high: the monitor warns when the average KL exceeds ``high`` x target.
        low: the monitor warns when the average KL falls below ``low`` x target.
        strict: stop training on a drift excursion instead of warning.
        min_batches: drift monitor's warm-up: batches with a usable KL before it first judges
            the average (None: the monitor's default, ``window + min(2 * window, 20)``: the KL
            starts at 0 and rises, and that rise alone should not warn "too low").
        hysteresis: the monitor's excursion ends only once the average is back inside the
            band by this fraction of the edge (0: at the edge).
        hold_after_refresh: batches after a refresh of the reference during which beta holds
            (a ``ReferenceRefresh`` callback; docs/controllers.md, "Across a reference
            refresh").
    """

    controller: str = "adaptive"
    target: float = 6.0  # no class default: Ziegler et al. 2019's target, nats per sequence
    unit: str = default_of(KLControllerCallback, "unit")
    horizon: float = default_of(AdaptiveKLController, "horizon")
    k: float = default_of(ExponentialKLController, "k")
    kp: float = default_of(PIKLController, "kp")
    ki: float = default_of(PIKLController, "ki")
    min_kl_coef: float | None = None
    max_kl_coef: float | None = None
    window: int = default_of(KLDriftMonitor, "window")
    high: float = default_of(KLDriftMonitor, "high")
    low: float = default_of(KLDriftMonitor, "low")
    strict: bool = default_of(KLDriftMonitor, "strict")
    min_batches: int | None = default_of(KLDriftMonitor, "min_batches")
    hysteresis: float = default_of(KLDriftMonitor, "hysteresis")
    hold_after_refresh: int = default_of(KLControllerCallback, "hold_after_refresh")

    def __post_init__(self) -> None:
        if self.controller not in KL_LAWS:
            raise ValueError(f"`kl.controller` must be one of {KL_LAWS}, got {self.controller!r}")
        if self.unit not in UNIT_NAMES:
            raise ValueError(f"`kl.unit` must be one of {tuple(UNIT_NAMES)}, got {self.unit!r}")
        if not (isinstance(self.target, int | float) and math.isfinite(self.target)) or (
            self.target <= 0
        ):
            raise ValueError(f"`kl.target` must be a finite number > 0, got {self.target!r}")

    def kl_controller(self, init_kl_coef: float) -> KLController:
        """The controller of law ``controller``, starting at beta = ``init_kl_coef``."""
        bounds = {
            name: bound
            for name in ("min_kl_coef", "max_kl_coef")
            if (bound := getattr(self, name)) is not None  # None: the law's default
        }
        match self.controller:
            case "fixed":
                return FixedKLController(init_kl_coef, **bounds)
            case "adaptive":
                return AdaptiveKLController(init_kl_coef, self.target, self.horizon, **bounds)
            case "exponential":
                return ExponentialKLController(init_kl_coef, self.target, self.k, **bounds)
            case "pi":
                return PIKLController(init_kl_coef, self.target, self.kp, self.ki, **bounds)
            case "logpid":
                return LogPIDKLController(init_kl_coef, self.target, **bounds)
        raise AssertionError(f"no controller for law {self.controller!r}")  # see __post_init__

    def callbacks(self, init_kl_coef: float) -> list[Callback]:
        """The controller callback and the drift monitor for a module starting at this beta."""
        controller = KLControllerCallback(
            self.kl_controller(init_kl_coef),
            unit=self.unit,
            hold_after_refresh=self.hold_after_refresh,
        )
        monitor = KLDriftMonitor(
            self.target,
            window=self.window,
            high=self.high,
            low=self.low,
            unit=self.unit,
            strict=self.strict,
            min_batches=self.min_batches,
            hysteresis=self.hysteresis,
        )
        return [controller, monitor]
