"""The ``kl`` group of the command line: one target shared by the controller and the monitor."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields

from lightning.pytorch import Callback

from rlkl_lightning.defaults import default_of
from rlkl_lightning.kl.controller_callback import UNIT_NAMES, KLControllerCallback
from rlkl_lightning.kl.controllers import KLController, KLLaw
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl.laws import build_controller, law_spec

#: A law as the parser reads it: a string, a registered name or a dotted path; or a
#: ``{class_path, init_args}`` block of a :class:`~rlkl_lightning.kl.controllers.KLLaw`
#: subclass, built later as ``law(init_kl_coef, target)``. The string comes first: the parser
#: writes a name out only through the first type that takes it, and the block's type cannot
#: (a run's saved config read "Unable to serialize instance fixed").
LawComponent = str | Callable[[float, float], KLLaw]

#: The gains of 0.1.0-0.4.0's ``kl`` group, now the arguments of the law that reads them.
MOVED_GAINS = {"horizon": "adaptive", "k": "exponential", "kp": "pi", "ki": "pi"}


@dataclass
class KLSettings:
    """KL control of a PPO run.

    An option that feeds a class takes its default from that class's signature.

    Args:
        controller: the control law, a component with its own arguments (its gains): a
            registered name (``fixed``, ``adaptive`` (Ziegler et al. 2019), ``exponential``,
            ``pi`` or ``logpid``; the law's defaults), a ``{class_path, init_args}`` block
            (``{class_path: AdaptiveKLController, init_args: {horizon: 1000}}``; on the command
            line ``--kl.controller.init_args.horizon=2000``), or the dotted import path of your
            own law (docs/extending.md). The law is built as ``law(init_kl_coef, target,
            **init_args)``, with the bounds below where they are set.
        target: target KL in ``unit``; drives the adaptive laws and the drift monitor (with a
            fixed beta it is only monitored).
        unit: ``sequence`` (nats per sequence, read from ``objective/kl``) or ``token``
            (nats per response token, read from ``objective/kl_per_token``).
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
        bound_patience: consecutive batches with beta at a bound of the law (``min_kl_coef``,
            ``max_kl_coef``) after which the controller warns, once, that the law cannot reach
            the target (0: never).

    Attributes:
        law: the law as the plain ``{"class_path", "init_args"}`` a checkpoint keeps, every
            argument written out (:func:`~rlkl_lightning.kl.laws.law_spec`).
    """

    controller: LawComponent = "adaptive"
    target: float = 6.0  # no class default: Ziegler et al. 2019's target, nats per sequence
    unit: str = default_of(KLControllerCallback, "unit")
    min_kl_coef: float | None = None
    max_kl_coef: float | None = None
    window: int = default_of(KLDriftMonitor, "window")
    high: float = default_of(KLDriftMonitor, "high")
    low: float = default_of(KLDriftMonitor, "low")
    strict: bool = default_of(KLDriftMonitor, "strict")
    min_batches: int | None = default_of(KLDriftMonitor, "min_batches")
    hysteresis: float = default_of(KLDriftMonitor, "hysteresis")
    hold_after_refresh: int = default_of(KLControllerCallback, "hold_after_refresh")
    bound_patience: int = default_of(KLControllerCallback, "bound_patience")

    def __post_init__(self) -> None:
        # An unknown name or path, or an argument the law does not take, raises here.
        self.law = law_spec(self.controller, "kl.controller")
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
        refused = None
        try:
            return build_controller(
                self.controller, init_kl_coef, self.target, "kl.controller", **bounds
            )
        except ValueError as error:  # the law's refusal of a bound or of the starting beta
            said = re.match(
                r"\w+: (.*`(?:min_kl_coef|max_kl_coef|init_kl_coef|kl_coef)`.*)", str(error), re.S
            )
            if said is None:
                raise
            refused = _BOUND_NAMES.sub(lambda m: _AS_OPTION[m[1]], said[1])
        raise ValueError(refused)  # out here: not in the context of the law's error

    def callbacks(self, init_kl_coef: float) -> list[Callback]:
        """The controller callback and the drift monitor for a module starting at this beta.

        Raises:
            ValueError: A callback's refusal of one of this group's values, naming it as the
                group's option (``kl.window``).
        """
        law = self.kl_controller(init_kl_coef)
        refused = None
        try:
            controller = KLControllerCallback(
                law,
                unit=self.unit,
                hold_after_refresh=self.hold_after_refresh,
                bound_patience=self.bound_patience,
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
        except ValueError as error:
            said = re.match(
                r"(?:KLControllerCallback|KLDriftMonitor): (\w+) (.*)", str(error), re.S
            )
            if said is None or said[1] not in {f.name for f in fields(self)}:
                raise
            refused = f"`kl.{said[1]}` {said[2]}"
        if refused is not None:  # raised out here: not in the context of the callback's error
            raise ValueError(refused)
        return [controller, monitor]


#: A law's names for its bounds and starting beta, as the run's options name them.
_AS_OPTION = {
    "min_kl_coef": "`kl.min_kl_coef`",
    "max_kl_coef": "`kl.max_kl_coef`",
    "init_kl_coef": "the module's starting beta (`model.init_args.penalty.init_coef`)",
    "kl_coef": "the module's starting beta (`model.init_args.penalty.init_coef`)",
}
_BOUND_NAMES = re.compile(r"`(min_kl_coef|max_kl_coef|init_kl_coef|kl_coef)`")


def moved_gain(name: str, value: object) -> str:
    """The one-line message of a 0.4.0 gain option (``kl.horizon``) set in a config."""
    cls = law_spec(MOVED_GAINS[name])["class_path"].rpartition(".")[2]
    return (
        f"`kl.{name}` moved into the law's arguments: `kl.controller: {{class_path: {cls}, "
        f"init_args: {{{name}: {value}}}}}` (command line: `--kl.controller={cls} "
        f"--kl.controller.init_args.{name}={value}`; docs/controllers.md)"
    )
