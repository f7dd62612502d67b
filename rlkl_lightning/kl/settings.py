"""The ``kl`` group of the command line: one target shared by the controller and the monitor."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from rlkl_lightning.defaults import default_of
from rlkl_lightning.kl.controller_callback import UNIT_NAMES, KLControllerCallback
from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    KLController,
    PIKLController,
)
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl.laws import LAWS, Law, build_controller, control_law

#: The options of the group that only some laws read (each law declares which:
#: :class:`~rlkl_lightning.kl.laws.Law`'s ``options``).
GAIN_OPTIONS = ("horizon", "k", "kp", "ki")


@dataclass
class KLSettings:
    """KL control of a PPO run.

    An option that feeds a class takes its default from that class's signature.

    Args:
        controller: the control law: ``fixed``, ``adaptive`` (Ziegler et al. 2019),
            ``exponential``, ``pi`` or ``logpid`` (a PID law on log KL whose defaults need no
            per-world tuning; it takes only ``target`` and the bounds from this group), or
            the dotted import path of your own law (``mypackage.module.MyLaw``, called as
            ``MyLaw(init_kl_coef, target, min_kl_coef=..., max_kl_coef=...)`` with the bounds
            only when set; docs/extending.md).
        target: target KL in ``unit``; drives the adaptive laws and the drift monitor (with a
            fixed beta it is only monitored).
        unit: ``sequence`` (nats per sequence, read from ``objective/kl``) or ``token``
            (nats per response token, read from ``objective/kl_per_token``).
        horizon: adaptive law's horizon, in samples (scale it with the samples the run sees).
        k: gain of the exponential law, per nat of error.
        kp: proportional gain of the PI law.
        ki: integral gain of the PI law. Each of ``horizon``, ``k``, ``kp``, ``ki`` set away
            from its default for a law that does not read it is refused, naming it.
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
        law = control_law(self.controller, "kl.controller")  # an unknown name or path raises
        self._check_gains(law)
        if self.unit not in UNIT_NAMES:
            raise ValueError(f"`kl.unit` must be one of {tuple(UNIT_NAMES)}, got {self.unit!r}")
        if not (isinstance(self.target, int | float) and math.isfinite(self.target)) or (
            self.target <= 0
        ):
            raise ValueError(f"`kl.target` must be a finite number > 0, got {self.target!r}")

    def _check_gains(self, law: Law) -> None:
        """Warn of a gain option set (away from its default) for a law that does not read it.

        A warning, not an error: a study's shared overrides set a gain for every run, whatever
        its law; what must not happen is that it is ignored without a word.
        """
        if law.options is None:  # a plugged law's builder may read any option of the group
            return
        readers = {
            name: [other.name for other in LAWS.values() if name in (other.options or ())]
            for name in GAIN_OPTIONS
        }
        for name in GAIN_OPTIONS:
            value = getattr(self, name)
            if name in law.options or value == _FIELD_DEFAULTS[name]:
                continue
            takes = ", ".join(f"`kl.{o}`" for o in law.options) or "no gain option"
            rank_zero_warn(
                f"`kl.{name}` is set ({value!r}) but the {law.name!r} law does not use it, so it "
                f"is ignored: the law takes {takes} (with `kl.target` and the bounds). Remove "
                f"`kl.{name}`, or pick a law that uses it: `kl.controller` "
                f"{' or '.join(map(repr, readers[name]))}",
                category=RuntimeWarning,
            )

    def kl_controller(self, init_kl_coef: float) -> KLController:
        """The controller of law ``controller``, starting at beta = ``init_kl_coef``."""
        bounds = {
            name: bound
            for name in ("min_kl_coef", "max_kl_coef")
            if (bound := getattr(self, name)) is not None  # None: the law's default
        }
        return build_controller(self.controller, self, init_kl_coef, "kl.controller", **bounds)

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


#: Each gain option's default, against which "set" is judged.
_FIELD_DEFAULTS = {f.name: f.default for f in fields(KLSettings) if f.name in GAIN_OPTIONS}
