"""KL controllers: the rules that set the KL penalty coefficient beta.

The reward the policy maximizes is shaped as ``r_t = -beta * kl_t`` (plus the score on the
last response token). A controller owns beta and updates it once per training batch from the
batch KL (in the unit the run names: nats per sequence by default, or nats per token).

Every controller follows the :class:`KLController` protocol and these common rules:

* ``value`` is the current beta; it is always finite, ``> 0`` and inside the optional bounds
  ``[min_kl_coef, max_kl_coef]``. Without bounds beta is still kept inside the positive normal
  float range, so it can neither underflow to 0 nor overflow to ``inf``. The fixed law alone
  also allows beta = 0 (no KL penalty): the other laws multiply beta, and a product with 0
  stays 0, so they refuse it.
* ``update(current_kl, n_steps)`` returns the new beta. ``n_steps`` is the number of samples
  (episodes) behind ``current_kl``, summed over all ranks; it must be an ``int >= 0``. An update
  with ``n_steps == 0`` observed nothing and leaves every law's state unchanged.
* A non-finite ``current_kl`` (nan or inf) leaves the state unchanged and emits one
  ``RuntimeWarning`` per controller instance.
* ``state_dict()`` holds the law name, beta (``value``) and the law's declared
  ``state_fields`` (the PI integral; the log-PID law's integral, filter and start flag);
  ``load_state_dict`` checks the law and gives a field missing from an older state its start
  value, so states written by older versions still load.
  Parameters (target, gains, ...) come from the constructor.
* ``set_target(target)`` moves the target of a law that has one (every law but the fixed
  one, which raises): beta is not touched, and the change takes effect at the next
  ``update``. What each law's state does on the step is in :meth:`KLLaw.set_target`
  and the law's ``_on_target_step``; the law's docstring says it.

Invalid parameters raise :class:`ValueError` at construction, naming the option and its
allowed range.

A law of its own subclasses :class:`KLLaw`, the public base that gives all of the above, and
implements :meth:`KLLaw.step`; each package law is registered under its short name in
:data:`LAWS` (``kl.controller: adaptive``), and a config gives a law its arguments (its gains)
as a ``{class_path, init_args}`` block (docs/extending.md).
"""

from __future__ import annotations

import math
import operator
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from rlkl_lightning.components import Registry

__all__ = [
    "LAWS",
    "AdaptiveKLController",
    "ExponentialKLController",
    "FixedKLController",
    "KLController",
    "KLLaw",
    "LogPIDKLController",
    "PIKLController",
    "laws_with_target",
]

#: The registered laws: ``kl.controller: adaptive`` names :class:`AdaptiveKLController`. A law
#: is built as ``Law(init_kl_coef, target, **init_args)``, with the run's bounds among the
#: arguments where it sets them (docs/extending.md).
LAWS = Registry(
    "kl.controller", "a KL control law (a KLLaw subclass, or a class of the KLController protocol)"
)


@runtime_checkable
class KLController(Protocol):
    """What a KL controller provides (see the module docstring for the shared rules)."""

    @property
    def value(self) -> float:
        """The current beta (finite, > 0; the fixed law allows 0); changed by :meth:`update`."""

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the KL of a batch of ``n_steps`` samples; return the new beta."""

    def state_dict(self) -> dict[str, Any]:
        """Return the dynamic state (law name, beta, ...)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`."""


def _as_float(value: Any) -> float | None:
    """``value`` as a float, or None if it is not a real number (bools and strings are not)."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor of several elements
        return None


def _finite(
    owner: str, name: str, value: Any, low: float | None = 0.0, strict: bool = True, unit: str = ""
) -> float:
    """Return ``value`` as a float after checking it is a finite real number above ``low``."""
    relation = "" if low is None else f" {'>' if strict else '>='} {low:g}"
    number = _as_float(value)
    if (
        number is None
        or not math.isfinite(number)
        or (low is not None and (number <= low if strict else number < low))
    ):
        unit = f" ({unit})" if unit else ""
        raise ValueError(
            f"{owner}: `{name}` must be a finite number{relation}{unit}, got {value!r}"
        )
    return number


class KLLaw:
    """The base of a KL control law: bounds, NaN handling, checked states; a law adds its rule.

    A subclass sets ``law`` (the name its states carry; default: the class name), takes
    ``(init_kl_coef, target, <its gains>, min_kl_coef=None, max_kl_coef=None)``, calls
    ``super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)``, keeps ``self.target`` and
    implements :meth:`step`, the unclamped new beta. :meth:`update` then checks the inputs,
    keeps beta inside the bounds (the positive float range without them), leaves beta unchanged
    and warns once on a non-finite KL, and :meth:`state_dict` / :meth:`load_state_dict` carry
    beta and the fields named in ``state_fields``. Register it (``@LAWS.register("name")``) to
    give it a short name, or name it in a config by its dotted path; its gains are its
    ``init_args`` (docs/extending.md).
    """

    law: ClassVar[str]
    #: Whether the law multiplies beta (then beta = 0 could never change and is refused).
    multiplicative: ClassVar[bool] = True
    #: Whether the law steers towards a target (:meth:`set_target` moves it).
    has_target: ClassVar[bool] = True
    #: Dynamic state besides beta: each field's name and its start value as a function of
    #: beta, used at construction and for a state (from an older version) without the field.
    state_fields: ClassVar[dict[str, Callable[[float], float]]] = {}

    def __init__(
        self,
        init_kl_coef: float,
        min_kl_coef: float | None,
        max_kl_coef: float | None,
        *,
        init_name: str = "init_kl_coef",
    ) -> None:
        owner = type(self).__name__
        lo, hi = (
            None if bound is None else _finite(owner, name, bound)
            for name, bound in (("min_kl_coef", min_kl_coef), ("max_kl_coef", max_kl_coef))
        )
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"{owner}: `min_kl_coef` must be <= `max_kl_coef`, "
                f"got min_kl_coef={lo!r} > max_kl_coef={hi!r}"
            )
        self.min_kl_coef, self.max_kl_coef = lo, hi
        # Without explicit bounds, beta stays inside the positive normal float range (or at
        # 0, which only the fixed law allows).
        self._lo = (sys.float_info.min if self.multiplicative else 0.0) if lo is None else lo
        self._hi = sys.float_info.max if hi is None else hi
        beta = self._check_beta(owner, init_name, init_kl_coef)
        if not self._lo <= beta <= self._hi:
            raise ValueError(
                f"{owner}: `{init_name}` must lie in [`min_kl_coef`, `max_kl_coef`] = "
                f"[{self.min_kl_coef}, {self.max_kl_coef}], got {init_kl_coef!r}"
            )
        self._beta = beta
        self._warned_nonfinite = False
        for name, start in self.state_fields.items():
            setattr(self, name, start(beta))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "law" not in vars(cls) and not any("law" in vars(b) for b in cls.__mro__[1:-1]):
            cls.law = cls.__name__

    def _check_beta(self, owner: str, name: str, value: Any) -> float:
        """``value`` as beta: finite and > 0 (>= 0 for a law that does not multiply beta)."""
        if self.multiplicative and _as_float(value) == 0.0:
            raise ValueError(
                f"{owner}: `{name}` must be a finite number > 0, got {value!r}: the {self.law} "
                "law multiplies beta, and from 0 it could never move; for no KL penalty use "
                "the fixed law (FixedKLController(0.0), `kl.controller: fixed` in the CLI)"
            )
        return _finite(owner, name, value, strict=self.multiplicative) + 0.0  # -0.0 -> 0.0

    @property
    def value(self) -> float:
        """The current beta (finite, > 0, inside the bounds; the fixed law allows 0)."""
        return self._beta

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the KL of a batch and return the new beta.

        Args:
            current_kl: The batch KL in the run's unit (nats per sequence or per token),
                averaged over the batch and reduced across ranks; a float or 1-element tensor.
            n_steps: Number of samples (episodes) behind ``current_kl``, summed over all ranks.

        Raises:
            ValueError: If ``n_steps`` is not an ``int >= 0`` or ``current_kl`` is not a number.
        """
        owner = f"{type(self).__name__}.update"
        try:
            n = -1 if isinstance(n_steps, bool) else operator.index(n_steps)
        except TypeError:
            n = -1
        if n < 0:
            raise ValueError(f"{owner}: `n_steps` must be an int >= 0 (samples), got {n_steps!r}")
        kl = _as_float(current_kl)
        if kl is None:
            raise ValueError(f"{owner}: `current_kl` must be a number, got {current_kl!r}")
        if not math.isfinite(kl):
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                warnings.warn(
                    f"{owner}: non-finite KL ({kl}); beta stays at {self._beta:.6g}. "
                    "Further non-finite KL values are ignored without a warning.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return self._beta
        if n > 0:
            self._beta = self._clamp(self.step(kl, n))
        return self._beta

    def set_target(self, target: float) -> None:
        """Move the target KL to ``target`` (in the unit of :meth:`update`'s KL).

        Beta is not changed here: the next :meth:`update` measures its error against the new
        target. The law's own state is carried over as :meth:`_on_target_step` says (by
        default it is kept as it is); a non-finite or non-positive target raises and changes
        nothing.

        Raises:
            ValueError: For a law without a target (the fixed law), or a target that is not a
                finite number > 0.
        """
        owner = f"{type(self).__name__}.set_target"
        if not hasattr(self, "target"):
            raise ValueError(
                f"{owner}: the {self.law} law has no target to move (beta is constant); use a "
                f"law with a target: `kl.controller` one of {laws_with_target()}"
            )
        new = _finite(owner, "target", target, unit="nats")
        old, self.target = self.target, new
        if new != old:
            self._on_target_step(old, new)

    def _on_target_step(self, old: float, new: float) -> None:
        """Carry the law's state over a step of the target from ``old`` to ``new`` (kept)."""

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"law": ..., "value": beta}`` plus the law's ``state_fields``."""
        return {"law": self.law, "value": self._beta, **self._state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state written by :meth:`state_dict` of the same law.

        A missing (or None) state field gets its start value from the loaded beta; a beta
        outside this controller's bounds is clamped with a warning.

        Raises:
            ValueError: If ``state`` is not a mapping, belongs to another law, or holds an
                invalid beta or state field. A failed load changes nothing.
        """
        owner = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state, Mapping):
            raise ValueError(f"{owner}: expected a dict, got {type(state).__name__}")
        if state.get("law") != self.law:
            raise ValueError(
                f"{owner}: the state is for law {state.get('law')!r}, "
                f"this controller's law is {self.law!r}"
            )
        if "value" not in state:
            raise ValueError(f"{owner}: the state has no `value` (beta)")
        beta = self._check_beta(owner, "value", state["value"])
        fields = {
            name: start(beta)
            if state.get(name) is None
            else _finite(owner, name, state[name], None)
            for name, start in self.state_fields.items()
        }
        clamped = self._clamp(beta)
        if clamped != beta:
            warnings.warn(
                f"{owner}: the saved beta {beta:.6g} lies outside the bounds "
                f"[{self.min_kl_coef}, {self.max_kl_coef}]; it is clamped to {clamped:.6g}.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._beta = clamped
        for name, value in fields.items():
            setattr(self, name, value)

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule: the unclamped new beta for a finite KL and ``n_steps > 0``.

        :meth:`update` clamps it to the bounds; use :meth:`_log_to_beta` for a rule on log beta.
        """
        raise NotImplementedError

    def _state(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.state_fields}

    def _clamp(self, beta: float) -> float:
        return min(max(beta, self._lo), self._hi)

    def _log_to_beta(self, log_beta: float) -> float:
        """Map a log-beta to beta inside the bounds, without overflow."""
        if log_beta >= math.log(self._hi):
            return self._hi
        if log_beta <= math.log(self._lo):
            return self._lo
        return self._clamp(math.exp(log_beta))

    def __repr__(self) -> str:
        params = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        bounds = {k: params.pop(k) for k in ("min_kl_coef", "max_kl_coef")}
        fields = {"value": self._beta, **params, **self._state(), **bounds}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


@LAWS.register("fixed")
class FixedKLController(KLLaw):
    """A constant beta.

    It has no target: :meth:`set_target` raises (a capability budget cannot steer it).

    Args:
        kl_coef: The KL coefficient beta, a finite number >= 0 (0: no KL penalty, the
            baseline without KL regularisation).
        target: Not read (a constant beta has no target; the drift monitor has its own): a
            law is built as ``Law(init_kl_coef, target, ...)``, this one too.
        min_kl_coef: Optional lower bound; ``kl_coef`` must not lie below it.
        max_kl_coef: Optional upper bound; ``kl_coef`` must not lie above it.
    """

    law = "fixed"
    multiplicative = False
    has_target = False

    def __init__(
        self,
        kl_coef: float,
        target: float | None = None,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(kl_coef, min_kl_coef, max_kl_coef, init_name="kl_coef")

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule, above (:meth:`KLLaw.step`)."""
        return self._beta


@LAWS.register("adaptive")
class AdaptiveKLController(KLLaw):
    """The proportional controller of Ziegler et al. 2019, §2.2 (arXiv:1909.08593).

    Per update, with ``e = clip(kl / target - 1, -0.2, 0.2)``::

        beta <- beta * (1 + e * n_steps / horizon)

    so beta moves by at most 20% per ``horizon`` samples. A step of the target
    (:meth:`set_target`) leaves beta, the law's only state, as it is; the next update's error
    is measured against the new target. ``horizon`` is in samples and must
    scale with the length of training: a run of 200 batches of 64 samples sees 12,800 samples,
    and Ziegler et al.'s horizon (the default) barely moves beta there. The factor stays
    positive only while ``n_steps < 5 * horizon``; a larger batch raises :class:`ValueError`
    (increase ``horizon``).

    Args:
        init_kl_coef: Initial beta, a finite number > 0.
        target: Target KL, in the unit of the KL passed to :meth:`update` (nats per sequence
            by default), a finite number > 0.
        horizon: Horizon in samples (episodes summed over ranks), a finite number > 0.
        min_kl_coef: Optional lower bound on beta.
        max_kl_coef: Optional upper bound on beta.
    """

    law = "adaptive"
    #: Clip of the proportional error, Ziegler et al. 2019, §2.2.
    error_clip: ClassVar[float] = 0.2

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        horizon: float = 10_000.0,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, unit="nats")
        self.horizon = _finite(owner, "horizon", horizon, unit="samples")

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule, above (:meth:`KLLaw.step`)."""
        if n_steps * self.error_clip >= self.horizon:
            raise ValueError(
                f"{type(self).__name__}.update: `n_steps` ({n_steps} samples) must be < "
                f"5 * `horizon` ({self.horizon:g} samples) so that the step factor stays "
                "positive; increase `horizon`"
            )
        # Ziegler et al. 2019, §2.2 (arXiv:1909.08593): e_t = clip(KL_t / KL_target - 1, ±0.2),
        # beta_{t+1} = beta_t * (1 + K_beta * e_t) with K_beta = n_steps / horizon.
        error = min(max(kl / self.target - 1.0, -self.error_clip), self.error_clip)
        return self._beta * (1.0 + error * n_steps / self.horizon)


@LAWS.register("exponential")
class ExponentialKLController(KLLaw):
    """Multiplicative law in log-beta, clamped to bounds.

    Per update (once per training batch)::

        beta <- clamp(beta * exp(k * (kl - target)), min_kl_coef, max_kl_coef)

    The exponent does **not** scale with ``n_steps``: ``k`` is a gain per update, in 1/(KL
    unit), so the rate of change per sample depends on the batch size. (``n_steps == 0`` still
    means "no data" and leaves beta unchanged.) A step of the target (:meth:`set_target`) leaves
    beta, the law's only state, as it is. Use :class:`AdaptiveKLController` when the step
    should scale with the number of samples. The exponent is computed in log space, so a huge
    KL saturates at a bound instead of overflowing.

    Args:
        init_kl_coef: Initial beta, a finite number > 0 inside the bounds.
        target: Target KL in the unit of the KL passed to :meth:`update`, finite and > 0.
        k: Gain per update, in 1/(KL unit), a finite number > 0.
        min_kl_coef: Lower bound on beta; ``None`` for none.
        max_kl_coef: Upper bound on beta; ``None`` for none.
    """

    law = "exponential"

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        k: float = 0.1,
        min_kl_coef: float | None = 1e-4,
        max_kl_coef: float | None = 10.0,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, unit="nats")
        self.k = _finite(owner, "k", k, unit="1/nats")

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule, above (:meth:`KLLaw.step`)."""
        # k * (kl - target) may overflow to +-inf for huge KL; _log_to_beta saturates it.
        return self._log_to_beta(math.log(self._beta) + self.k * (kl - self.target))


class _ClampedIntegral:
    """An integral term ``z`` on log-beta, clamped to the actuator range ``[L, U]``."""

    _lo: float
    _hi: float

    @property
    def integral(self) -> float:
        """The integral term ``z`` on log-beta, always inside ``[L, U]``."""
        return self._integral

    @integral.setter
    def integral(self, z: float) -> None:
        # Anti-windup: the integral term is clamped to the actuator range [log lo, log hi].
        self._integral = min(max(z, math.log(self._lo)), math.log(self._hi))


@LAWS.register("pi")
class PIKLController(_ClampedIntegral, KLLaw):
    """Proportional-integral law on log-beta, with integrator clamping as anti-windup.

    With ``L = log(min_kl_coef)``, ``U = log(max_kl_coef)`` (the float range when a bound is
    ``None``) and ``c = error_clip``, each update with a finite KL and ``n_steps > 0`` does::

        e     = clip((kl - target) / target, -c, c)          # normalized error
        z     <- clip(z + ki * e, L, U)                       # integral term (anti-windup)
        beta  <- exp(clip(z + kp * e, L, U))

    ``z`` (:attr:`integral`, saved in the state) starts at ``log(init_kl_coef)``, so at zero
    error beta stays where it is; a saved state without it starts it at ``log`` of the saved
    beta. Because the integral term can never leave ``[L, U]``, it does not wind up while beta
    sits at a bound: after any saturation, the first update whose error has the opposite sign
    moves beta strictly off the bound (``z`` moves back by ``ki * |e|`` and ``kp * e`` points
    inward). Gains are per update (once per training batch), not per sample.

    A step of the target (:meth:`set_target`) keeps the integral ``z``: it holds the log-beta
    the law has found so far, which the step does not make wrong. The next update's error is
    measured against the new target, so beta then moves by ``kp`` times the error's change
    (a proportional kick) and ``z`` goes on from where it was.

    Args:
        init_kl_coef: Initial beta, a finite number > 0 inside the bounds.
        target: Target KL in the unit of the KL passed to :meth:`update`, finite and > 0.
        kp: Proportional gain on log-beta per unit of normalized error, finite and >= 0.
        ki: Integral gain on log-beta per update per unit of normalized error, finite and >= 0.
            At least one of ``kp``, ``ki`` must be > 0.
        error_clip: Clip ``c`` of the normalized error, a finite number > 0.
        min_kl_coef: Optional lower bound on beta.
        max_kl_coef: Optional upper bound on beta.
    """

    law = "pi"
    state_fields = {"integral": math.log}

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        kp: float = 0.5,
        ki: float = 0.05,
        error_clip: float = 1.0,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, unit="nats")
        self.kp = _finite(owner, "kp", kp, strict=False)
        self.ki = _finite(owner, "ki", ki, strict=False)
        if self.kp == 0.0 and self.ki == 0.0:
            raise ValueError(f"{owner}: at least one of `kp`, `ki` must be > 0, got kp=0, ki=0")
        self.error_clip = _finite(owner, "error_clip", error_clip)

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule, above (:meth:`KLLaw.step`)."""
        error = min(max((kl - self.target) / self.target, -self.error_clip), self.error_clip)
        self.integral = self.integral + self.ki * error
        return self._log_to_beta(self.integral + self.kp * error)


@LAWS.register("logpid")
class LogPIDKLController(_ClampedIntegral, KLLaw):
    """A PID law on the log of KL / target: one tuning for worlds whose KL answers beta unalike.

    Where the KL goes as ``beta^-a``, the loop gain from ``log beta`` to ``log KL`` is the
    elasticity ``a`` alone, whatever the KL's level, so an error in logs needs no per-world
    gain. With ``f = floor`` and ``c = error_clip``, each update with a finite KL and
    ``n_steps > 0`` does::

        y     = log(max(kl, f * target) / target)                 # floored: the KL starts at 0
        m     <- alpha * y + (1 - alpha) * (m + d)                 # smoothed log error (Holt)
        d     <- gamma * (m - m_before) + (1 - gamma) * d          # its trend per batch
        e     = clip(m + lead * d, -c, c)                          # projected `lead` batches on
        e     <- e * min(1, |e| / dead_zone)                       # quadratic near 0: less noise
        z     <- clip(z + max(ki * e, -max_fall), L, U)            # integral, falls <= max_fall
        beta  <- exp(clip(z + kp * e, L, U))

    ``L``, ``U`` are ``log`` of the bounds, as in :class:`PIKLController`. The trend term lets
    the law raise beta while a fast-rising KL is still below the target, and the integral may
    fall by at most ``max_fall`` per batch. That caps the rate, not the depth: a plateau of
    the KL (until the policy finds the reward) would wind beta down without end, and the
    take-off would then meet a beta hundreds of times too low. So the lower bound has a
    default, ``min_kl_coef = init_kl_coef * floor ** (1 / min_elasticity)`` (0.09 x
    ``init_kl_coef``): the law cannot tell a KL below ``floor * target`` from one at it, and
    where the KL goes as ``beta^-a`` with ``a >= min_elasticity`` (the smallest elasticity
    measured on the worlds), a KL it can still read at ``init_kl_coef`` reaches the target
    with beta at most ``floor ** (-1 / min_elasticity)`` times lower; a lower beta would chase
    a KL the law cannot see. The integral, clamped to ``[L, U]``, is bounded with it. Pass
    ``min_kl_coef`` to choose another floor. The upper bound has the mirror default,
    ``max_kl_coef = init_kl_coef / floor ** (1 / min_elasticity)`` (11 x ``init_kl_coef``): a
    KL that PPO's own steps keep above the target does not come down with beta, and a law
    without a ceiling raised beta to 1.5e7 there, until PPO diverged; a KL as far above the
    target at ``init_kl_coef`` as the floor's KL is below it reaches the target with beta at
    most that much higher. A target that needs more (far below what ``init_kl_coef`` holds)
    sets ``max_kl_coef``; the controller callback warns when beta sits at a bound.

    The KL of the first batch is 0 up to float rounding (the policy starts as its reference;
    the shipped config measured 2.4e-7, -5.1e-7 and -3.0e-8 nats on three seeds): until the
    first KL with ``|kl| > zero_kl * target``, an update observed nothing that answers beta
    and changes nothing (``started``, in the state, is 0). One PPO batch already moves the KL
    to about 0.04 x target, 400 times that tolerance. ``z`` (:attr:`integral`) starts at
    ``log(init_kl_coef)``, ``m`` at ``log(floor)`` (a KL of 0), ``d`` at 0; all are in the
    state. Gains are per update (once per training batch). docs/controllers.md ("The log-PID
    law") derives the defaults.

    A step of the target from ``T`` to ``T'`` (:meth:`set_target`) shifts the smoothed log
    error by ``-log(T' / T)`` once the law has started: ``m`` is a smoothed ``log kl`` minus
    ``log T``, and the smoothing of ``log kl`` does not depend on the target, so the shift is
    the value ``m`` would have had under ``T'`` all along (up to the floor). The trend ``d``
    (of ``log kl``) and the integral ``z`` are kept, so no step of the target shows up as a
    trend. Before the start, ``m`` stays at ``log(floor)``: a KL of 0 whatever the target.

    Args:
        init_kl_coef: Initial beta, a finite number > 0 inside the bounds.
        target: Target KL in the unit of the KL passed to :meth:`update`, finite and > 0.
        kp: Proportional gain on log beta per unit of log error, finite and >= 0.
        ki: Integral gain per update per unit of log error, finite and > 0.
        lead: Batches the trend projects the error ahead, finite and >= 0.
        max_fall: Largest fall of the integral (log beta) per update, finite and > 0.
        alpha: Smoothing of the log error, in (0, 1].
        gamma: Smoothing of its trend, in (0, 1].
        dead_zone: Log error below which the error is scaled down quadratically, >= 0 (0: off).
        error_clip: Clip ``c`` of the projected error, finite and > 0.
        min_kl_coef: Lower bound on beta; None: ``init_kl_coef * floor ** (1 /
            min_elasticity)``, 0.09 x ``init_kl_coef`` (above).
        max_kl_coef: Upper bound on beta; None: ``init_kl_coef / floor ** (1 /
            min_elasticity)``, 11.1 x ``init_kl_coef`` (above).
    """

    law = "logpid"
    #: The KL is floored at this fraction of the target before its log is taken.
    floor: ClassVar[float] = 0.3
    #: The smallest elasticity ``a`` of the KL to beta (``KL ~ beta^-a``) measured on the
    #: worlds (READMEs 0.50; default 0.69, code 0.93): it sets the default bounds.
    min_elasticity: ClassVar[float] = 0.5
    #: Before the law has started, a KL within this fraction of the target of 0 is the KL of
    #: a policy that is still its reference, 0 up to float rounding.
    zero_kl: ClassVar[float] = 1e-4
    state_fields = {
        "integral": math.log,
        "log_error": lambda beta: math.log(LogPIDKLController.floor),
        "trend": lambda beta: 0.0,
        "started": lambda beta: 0.0,
    }

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        kp: float = 0.6,
        ki: float = 0.15,
        lead: float = 8.0,
        max_fall: float = 0.05,
        alpha: float = 0.5,
        gamma: float = 0.1,
        dead_zone: float = 0.4,
        error_clip: float = 1.0,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        span = self.floor ** (1.0 / self.min_elasticity)  # 0.09: the default bounds' factor
        if min_kl_coef is None:  # the default floor, below init_kl_coef (itself <= the max)
            self.min_kl_coef = self._lo = self._beta * span
        if max_kl_coef is None:  # the default ceiling, above init_kl_coef (itself >= the min)
            self.max_kl_coef = self._hi = self._beta / span
        self.integral = self.integral  # clamped to the new range (it starts at init)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, unit="nats")
        self.kp = _finite(owner, "kp", kp, strict=False)
        self.ki = _finite(owner, "ki", ki)
        self.lead = _finite(owner, "lead", lead, strict=False, unit="batches")
        self.max_fall = _finite(owner, "max_fall", max_fall)
        for name, value in (("alpha", alpha), ("gamma", gamma)):
            number = _finite(owner, name, value)
            if number > 1.0:
                raise ValueError(f"{owner}: `{name}` must lie in (0, 1], got {value!r}")
            setattr(self, name, number)
        self.dead_zone = _finite(owner, "dead_zone", dead_zone, strict=False)
        self.error_clip = _finite(owner, "error_clip", error_clip)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state, as :meth:`KLLaw.load_state_dict`.

        A state written before ``started`` existed, mid-run (it has a ``log_error``), counts as
        started.
        """
        if isinstance(state, Mapping) and state.get("started") is None and "log_error" in state:
            state = {**state, "started": 1.0}
        super().load_state_dict(state)

    def _on_target_step(self, old: float, new: float) -> None:
        if self.started:
            self.log_error -= math.log(new / old)

    def step(self, kl: float, n_steps: int) -> float:
        """The law's rule, above (:meth:`KLLaw.step`)."""
        if not self.started:
            if abs(kl) <= self.zero_kl * self.target:  # still the reference: nothing to see
                return self._beta
            self.started = 1.0
        y = math.log(max(kl, self.floor * self.target) / self.target)
        before = self.log_error
        self.log_error = self.alpha * y + (1.0 - self.alpha) * (before + self.trend)
        self.trend = self.gamma * (self.log_error - before) + (1.0 - self.gamma) * self.trend
        error = self.log_error + self.lead * self.trend
        error = min(max(error, -self.error_clip), self.error_clip)
        if self.dead_zone > 0.0:
            error *= min(1.0, abs(error) / self.dead_zone)
        self.integral = self.integral + max(self.ki * error, -self.max_fall)
        return self._log_to_beta(self.integral + self.kp * error)


def laws_with_target() -> tuple[str, ...]:
    """The registered laws that have a target (all but those that keep beta constant)."""
    return tuple(name for name, law in LAWS.items() if getattr(law, "has_target", True))
