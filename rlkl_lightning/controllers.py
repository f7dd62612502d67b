"""KL controllers: the rules that set the KL penalty coefficient beta.

The reward the policy maximizes is shaped as ``r_t = -beta * kl_t`` (plus the score on the
last response token). A controller owns beta and updates it once per training batch from the
batch KL (in the unit the run names: nats per sequence by default, or nats per token).

Every controller follows the :class:`KLController` protocol and these common rules:

* ``value`` is the current beta; it is always finite, ``> 0`` and inside the optional bounds
  ``[min_kl_coef, max_kl_coef]``. Without bounds beta is still kept inside the positive normal
  float range, so it can neither underflow to 0 nor overflow to ``inf``.
* ``update(current_kl, n_steps)`` returns the new beta. ``n_steps`` is the number of samples
  (episodes) behind ``current_kl``, summed over all ranks; it must be an ``int >= 0``. An update
  with ``n_steps == 0`` observed nothing and leaves every law's state unchanged.
* A non-finite ``current_kl`` (nan or inf) leaves the state unchanged and emits one
  ``RuntimeWarning`` per controller instance.
* ``state_dict()`` holds the law name and all dynamic state (beta, PI integral);
  ``load_state_dict`` checks the law and reads optional fields with defaults, so states written
  by older versions still load. Parameters (target, gains, ...) come from the constructor.

Invalid parameters raise :class:`ValueError` at construction, naming the option and its
allowed range.
"""

from __future__ import annotations

import inspect
import math
import operator
import sys
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

__all__ = [
    "KL_LAWS",
    "AdaptiveKLController",
    "ExponentialKLController",
    "FixedKLController",
    "KLController",
    "PIKLController",
    "make_kl_controller",
]

KL_LAWS = ("fixed", "adaptive", "exponential", "pi")

# Without explicit bounds, beta stays inside the positive normal float range.
_BETA_FLOOR = sys.float_info.min
_BETA_CEIL = sys.float_info.max


@runtime_checkable
class KLController(Protocol):
    """What a KL controller provides (see the module docstring for the shared rules)."""

    @property
    def value(self) -> float:
        """The current beta (finite, > 0); read-only, changed only through :meth:`update`."""
        ...

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the KL of a batch of ``n_steps`` samples; return the new beta."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Return the dynamic state (law name, beta, ...)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`."""
        ...


def _finite(
    owner: str, name: str, value: Any, *, low: float, strict: bool, unit: str = ""
) -> float:
    """Return ``value`` as a float after checking it is a finite real number above ``low``."""
    relation = ">" if strict else ">="
    what = f"a finite number {relation} {low:g}" + (f" ({unit})" if unit else "")
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}") from None
    if not math.isfinite(number) or (number <= low if strict else number < low):
        raise ValueError(f"{owner}: `{name}` must be {what}, got {value!r}")
    return number


class _BaseKLController:
    """Shared machinery: bounds, validation of ``update`` inputs, the non-finite warning."""

    law: ClassVar[str]

    def __init__(
        self,
        init_kl_coef: float,
        min_kl_coef: float | None,
        max_kl_coef: float | None,
        *,
        init_name: str = "init_kl_coef",
    ) -> None:
        owner = type(self).__name__
        self.min_kl_coef = (
            None
            if min_kl_coef is None
            else _finite(owner, "min_kl_coef", min_kl_coef, low=0.0, strict=True)
        )
        self.max_kl_coef = (
            None
            if max_kl_coef is None
            else _finite(owner, "max_kl_coef", max_kl_coef, low=0.0, strict=True)
        )
        if (
            self.min_kl_coef is not None
            and self.max_kl_coef is not None
            and self.min_kl_coef > self.max_kl_coef
        ):
            raise ValueError(
                f"{owner}: `min_kl_coef` must be <= `max_kl_coef`, "
                f"got min_kl_coef={self.min_kl_coef!r} > max_kl_coef={self.max_kl_coef!r}"
            )
        self._lo = _BETA_FLOOR if self.min_kl_coef is None else self.min_kl_coef
        self._hi = _BETA_CEIL if self.max_kl_coef is None else self.max_kl_coef
        beta = _finite(owner, init_name, init_kl_coef, low=0.0, strict=True)
        if not self._lo <= beta <= self._hi:
            raise ValueError(
                f"{owner}: `{init_name}` must lie in [`min_kl_coef`, `max_kl_coef`] = "
                f"[{self.min_kl_coef}, {self.max_kl_coef}], got {init_kl_coef!r}"
            )
        self._beta = beta
        self._warned_nonfinite = False

    # -- the protocol -------------------------------------------------------------------------

    @property
    def value(self) -> float:
        """The current beta (finite, > 0, inside the bounds)."""
        return self._beta

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the KL of a batch.

        Args:
            current_kl: The batch KL in the run's unit (nats per sequence or per token),
                already averaged over the batch and reduced across ranks. A float or a
                one-element tensor.
            n_steps: Number of samples (episodes) behind ``current_kl``, summed over all ranks.

        Returns:
            The new beta.

        Raises:
            ValueError: If ``n_steps`` is not an ``int >= 0`` or ``current_kl`` is not a number.
        """
        owner = type(self).__name__
        n = self._check_n_steps(n_steps)
        if isinstance(current_kl, (bool, str, bytes)):
            raise ValueError(f"{owner}.update: `current_kl` must be a number, got {current_kl!r}")
        try:
            kl = float(current_kl)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(
                f"{owner}.update: `current_kl` must be a number, got {current_kl!r}"
            ) from None
        if not math.isfinite(kl):
            if not self._warned_nonfinite:
                self._warned_nonfinite = True
                warnings.warn(
                    f"{owner}.update: non-finite KL ({kl}); beta stays at {self._beta:.6g}. "
                    "Further non-finite KL values are ignored without a warning.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return self._beta
        if n == 0:
            return self._beta
        self._beta = self._clamp(self._step(kl, n))
        return self._beta

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"law": ..., "value": beta}`` plus any law-specific state."""
        return {"law": self.law, "value": self._beta, **self._extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state written by :meth:`state_dict` of the same law.

        Raises:
            ValueError: If ``state`` is not a mapping, belongs to another law, or holds an
                invalid beta.
        """
        owner = type(self).__name__
        if not isinstance(state, Mapping):
            raise ValueError(
                f"{owner}.load_state_dict: expected a dict, got {type(state).__name__}"
            )
        law = state.get("law")
        if law != self.law:
            raise ValueError(
                f"{owner}.load_state_dict: the state is for law {law!r}, "
                f"this controller's law is {self.law!r}"
            )
        if "value" not in state:
            raise ValueError(f"{owner}.load_state_dict: the state has no `value` (beta)")
        beta = _finite(f"{owner}.load_state_dict", "value", state["value"], low=0.0, strict=True)
        extra = self._parse_extra_state(state, beta)
        clamped = self._clamp(beta)
        if clamped != beta:
            warnings.warn(
                f"{owner}.load_state_dict: the saved beta {beta:.6g} lies outside the bounds "
                f"[{self.min_kl_coef}, {self.max_kl_coef}]; it is clamped to {clamped:.6g}.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._beta = clamped
        self._apply_extra_state(extra)

    # -- hooks for the laws -------------------------------------------------------------------

    def _step(self, kl: float, n_steps: int) -> float:
        """Return the unclamped new beta for a finite KL and ``n_steps > 0``."""
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _parse_extra_state(self, state: Mapping[str, Any], beta: float) -> dict[str, Any]:
        return {}

    def _apply_extra_state(self, extra: dict[str, Any]) -> None:
        return None

    # -- helpers ------------------------------------------------------------------------------

    def _check_n_steps(self, n_steps: Any) -> int:
        owner = type(self).__name__
        message = f"{owner}.update: `n_steps` must be an int >= 0 (samples), got {n_steps!r}"
        if isinstance(n_steps, bool):
            raise ValueError(message)
        try:
            n = operator.index(n_steps)
        except TypeError:
            raise ValueError(message) from None
        if n < 0:
            raise ValueError(message)
        return n

    def _clamp(self, beta: float) -> float:
        return min(max(beta, self._lo), self._hi)

    def _log_to_beta(self, log_beta: float) -> float:
        """Map a log-beta to beta inside the bounds, without overflow."""
        if log_beta >= math.log(self._hi):
            return self._hi
        if log_beta <= math.log(self._lo):
            return self._lo
        return self._clamp(math.exp(log_beta))

    def _repr_fields(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        fields = {
            "value": self._beta,
            **self._repr_fields(),
            "min_kl_coef": self.min_kl_coef,
            "max_kl_coef": self.max_kl_coef,
        }
        inner = ", ".join(f"{key}={val!r}" for key, val in fields.items())
        return f"{type(self).__name__}({inner})"


class FixedKLController(_BaseKLController):
    """A constant beta.

    Args:
        kl_coef: The KL coefficient beta, a finite number > 0.
        min_kl_coef: Optional lower bound; ``kl_coef`` must not lie below it.
        max_kl_coef: Optional upper bound; ``kl_coef`` must not lie above it.
    """

    law = "fixed"

    def __init__(
        self,
        kl_coef: float,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(kl_coef, min_kl_coef, max_kl_coef, init_name="kl_coef")

    def _step(self, kl: float, n_steps: int) -> float:
        return self._beta


class AdaptiveKLController(_BaseKLController):
    """The proportional controller of Ziegler et al. 2019, §2.2 (arXiv:1909.08593).

    Per update, with ``e = clip(kl / target - 1, -0.2, 0.2)``::

        beta <- beta * (1 + e * n_steps / horizon)

    so beta moves by at most 20% per ``horizon`` samples. ``horizon`` is in samples and must
    scale with the length of training: a run of 200 batches of 64 samples sees 12,800 samples,
    and a horizon of 10,000 barely moves beta there. The factor stays positive only while
    ``n_steps < 5 * horizon``; a larger batch raises :class:`ValueError` (increase ``horizon``).

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
        horizon: float = 10000,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, low=0.0, strict=True, unit="nats")
        self.horizon = _finite(owner, "horizon", horizon, low=0.0, strict=True, unit="samples")

    def _step(self, kl: float, n_steps: int) -> float:
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

    def _repr_fields(self) -> dict[str, Any]:
        return {"target": self.target, "horizon": self.horizon}


class ExponentialKLController(_BaseKLController):
    """Multiplicative law in log-beta, clamped to bounds.

    Per update (once per training batch)::

        beta <- clamp(beta * exp(k * (kl - target)), min_kl_coef, max_kl_coef)

    The exponent does **not** scale with ``n_steps``: ``k`` is a gain per update, in 1/(KL
    unit), so the rate of change per sample depends on the batch size. (``n_steps == 0`` still
    means "no data" and leaves beta unchanged.) Use :class:`AdaptiveKLController` when the step
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
        k: float,
        min_kl_coef: float | None = 1e-4,
        max_kl_coef: float | None = 10.0,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, low=0.0, strict=True, unit="nats")
        self.k = _finite(owner, "k", k, low=0.0, strict=True, unit="1/nats")

    def _step(self, kl: float, n_steps: int) -> float:
        # k * (kl - target) may overflow to +-inf for huge KL; _log_to_beta saturates it.
        return self._log_to_beta(math.log(self._beta) + self.k * (kl - self.target))

    def _repr_fields(self) -> dict[str, Any]:
        return {"target": self.target, "k": self.k}


class PIKLController(_BaseKLController):
    """Proportional-integral law on log-beta, with integrator clamping as anti-windup.

    With ``L = log(min_kl_coef)``, ``U = log(max_kl_coef)`` (the float range when a bound is
    ``None``) and ``c = error_clip``, each update with a finite KL and ``n_steps > 0`` does::

        e     = clip((kl - target) / target, -c, c)          # normalized error
        z     <- clip(z + ki * e, L, U)                       # integral term (anti-windup)
        beta  <- exp(clip(z + kp * e, L, U))

    ``z`` starts at ``log(init_kl_coef)``, so at zero error beta stays where it is. Because
    the integral term can never leave ``[L, U]``, it does not wind up while beta sits at a
    bound: after any saturation, the first update whose error has the opposite sign moves beta
    strictly off the bound (``z`` moves back by ``ki * |e|`` and ``kp * e`` points inward).
    Gains are per update (once per training batch), not per sample.

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

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        kp: float,
        ki: float,
        error_clip: float = 1.0,
        min_kl_coef: float | None = None,
        max_kl_coef: float | None = None,
    ) -> None:
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        owner = type(self).__name__
        self.target = _finite(owner, "target", target, low=0.0, strict=True, unit="nats")
        self.kp = _finite(owner, "kp", kp, low=0.0, strict=False)
        self.ki = _finite(owner, "ki", ki, low=0.0, strict=False)
        if self.kp == 0.0 and self.ki == 0.0:
            raise ValueError(f"{owner}: at least one of `kp`, `ki` must be > 0, got kp=0, ki=0")
        self.error_clip = _finite(owner, "error_clip", error_clip, low=0.0, strict=True)
        self.integral = math.log(self._beta)

    def _step(self, kl: float, n_steps: int) -> float:
        error = min(max((kl - self.target) / self.target, -self.error_clip), self.error_clip)
        log_lo, log_hi = math.log(self._lo), math.log(self._hi)
        # Anti-windup: the integral term is clamped to the actuator range [log lo, log hi].
        self.integral = min(max(self.integral + self.ki * error, log_lo), log_hi)
        return self._log_to_beta(self.integral + self.kp * error)

    def _extra_state(self) -> dict[str, Any]:
        return {"integral": self.integral}

    def _parse_extra_state(self, state: Mapping[str, Any], beta: float) -> dict[str, Any]:
        owner = f"{type(self).__name__}.load_state_dict"
        integral = state.get("integral")
        if integral is None:  # states without an integral: start it at the current beta
            return {"integral": math.log(beta)}
        if isinstance(integral, (bool, str, bytes)):
            raise ValueError(f"{owner}: `integral` must be a finite number, got {integral!r}")
        try:
            value = float(integral)
        except (TypeError, ValueError):
            raise ValueError(
                f"{owner}: `integral` must be a finite number, got {integral!r}"
            ) from None
        if not math.isfinite(value):
            raise ValueError(f"{owner}: `integral` must be a finite number, got {integral!r}")
        return {"integral": value}

    def _apply_extra_state(self, extra: dict[str, Any]) -> None:
        self.integral = min(max(extra["integral"], math.log(self._lo)), math.log(self._hi))

    def _repr_fields(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kp": self.kp,
            "ki": self.ki,
            "error_clip": self.error_clip,
            "integral": self.integral,
        }


_LAW_CLASSES: dict[str, type[_BaseKLController]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    "exponential": ExponentialKLController,
    "pi": PIKLController,
}


def make_kl_controller(
    init_kl_coef: float,
    target: float | None = None,
    horizon: float | None = None,
    law: str = "adaptive",
    **law_kwargs: Any,
) -> KLController:
    """Build a KL controller from flat, config-friendly options.

    Without ``target`` the controller is fixed at ``init_kl_coef`` (``law`` must then be
    ``"adaptive"``, the default, or ``"fixed"``). With ``target`` it follows ``law``.

    Args:
        init_kl_coef: Initial (or fixed) beta, finite and > 0.
        target: Target KL in the unit the run names (nats per sequence by default), or
            ``None`` for a fixed beta.
        horizon: Horizon in samples, only for ``law="adaptive"``; ``None`` keeps the default
            of :class:`AdaptiveKLController`.
        law: One of ``"fixed"``, ``"adaptive"``, ``"exponential"``, ``"pi"``.
        **law_kwargs: Further arguments of the chosen class (``k`` for ``"exponential"``;
            ``kp``, ``ki``, ``error_clip`` for ``"pi"``; ``min_kl_coef``, ``max_kl_coef`` for
            every law).

    Returns:
        The controller.

    Raises:
        ValueError: For an unknown law, an option the law does not take, or invalid values.
    """
    if law not in _LAW_CLASSES:
        raise ValueError(f"make_kl_controller: `law` must be one of {KL_LAWS}, got {law!r}")
    if target is None:
        if law not in ("adaptive", "fixed"):
            raise ValueError(
                f"make_kl_controller: law={law!r} needs a `target` (a finite number > 0); "
                "leave `target` unset only for a fixed beta"
            )
        law = "fixed"
    elif law == "fixed":
        raise ValueError(
            "make_kl_controller: `target` has no meaning for law='fixed'; "
            f"set `target` to None or choose a law from {KL_LAWS[1:]}"
        )
    if horizon is not None and law != "adaptive":
        raise ValueError(
            f"make_kl_controller: `horizon` applies only to law='adaptive' (got law={law!r}"
            + (", no target)" if target is None else ")")
        )
    cls = _LAW_CLASSES[law]
    signature = inspect.signature(cls)
    allowed = [
        p for p in signature.parameters if p not in ("kl_coef", "init_kl_coef", "target", "horizon")
    ]
    unknown = sorted(set(law_kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"make_kl_controller: unknown option(s) {unknown} for law={law!r}; allowed: {allowed}"
        )
    required = [
        name for name in allowed if signature.parameters[name].default is inspect.Parameter.empty
    ]
    missing = [name for name in required if name not in law_kwargs]
    if missing:
        raise ValueError(f"make_kl_controller: law={law!r} needs option(s) {missing}")
    if law == "fixed":
        # Named as the caller named it (FixedKLController itself calls it `kl_coef`).
        _finite("make_kl_controller", "init_kl_coef", init_kl_coef, low=0.0, strict=True)
        return cls(init_kl_coef, **law_kwargs)
    kwargs = dict(law_kwargs)
    if horizon is not None:
        kwargs["horizon"] = horizon
    return cls(init_kl_coef, target, **kwargs)
