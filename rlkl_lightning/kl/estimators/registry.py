"""The registry of KL estimators: one name, one :class:`Estimator`, one place.

Every estimator the package knows is registered here by the file that defines it (one file per
estimator in ``rlkl_lightning/kl/estimators/``, imported when the package is), with the one
call shape of every registry (:class:`~rlkl_lightning.components.Registry`):
``ESTIMATORS.register("k3")(Estimator("k3", k3, loss=True))``. A user's own estimator needs no
registration: an option names it as any component (:mod:`rlkl_lightning.components`): the
dotted import path of an :class:`Estimator` (``mypackage.module.k4``), or a
``{class_path, init_args}`` block of a class or function that makes one from its arguments.
docs/extending.md shows both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlkl_lightning.components import Registry, check_arguments, plain_spec

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "estimator_names",
    "estimator_spec",
    "kl_estimator",
    "per_token_kl",
    "sample_estimators",
]

#: Where an estimator is used: ``"reward"`` (the measured KL ``objective/kl`` and, with
#: ``placement: reward``, the penalty in the reward) or ``"loss"`` (differentiated as the KL
#: term of the loss, ``placement: loss``).
ROLES = ("reward", "loss")


@dataclass(frozen=True)
class Estimator:
    """A per-token KL estimator: its name, its formula and where it may be used.

    Args:
        name: The name options use (``k1``); a registered name has no dot.
        formula: The per-token KL from the log-ratio ``l_t = log pi(y_t|s_t) - log
            ref(y_t|s_t)`` of the sampled tokens: a tensor of any shape in, the same shape
            out, in nats, in the input's dtype; differentiable through ``l_t`` when ``loss``.
            None for an estimator that needs the full logits (``exact``), which only the
            pipeline can compute.
        loss: Whether it may be differentiated as the KL term of the loss
            (:func:`~rlkl_lightning.kl.loss.kl_loss`, ``placement: loss``).
        reward: Whether it may be the measured KL ``objective/kl`` (the controller's input)
            and the penalty in the reward.
    """

    name: str
    formula: Callable[[Tensor], Tensor] | None
    loss: bool = False
    reward: bool = True

    @property
    def needs_logits(self) -> bool:
        """True for an estimator without a per-token formula of the log-ratio (``exact``)."""
        return self.formula is None

    def per_token(self, logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
        """The per-token KL of the sampled tokens: :attr:`formula` of their log-ratio.

        Args:
            logprobs: ``log pi(y_t|s_t)`` of the sampled tokens under the policy, any shape.
            ref_logprobs: ``log ref(y_t|s_t)`` under the reference, same shape.

        Returns:
            A tensor of the same shape, in nats, in the inputs' dtype promoted to at least
            float32.

        Raises:
            ValueError: For an estimator that needs the logits, or mismatched shapes.
        """
        if self.formula is None:
            raise ValueError(
                f"estimator {self.name!r} has no per-token formula of the log-ratio: it needs "
                "the full logits"
            )
        if logprobs.shape != ref_logprobs.shape:
            raise ValueError(
                "per_token_kl: `logprobs` and `ref_logprobs` must have the same shape, got "
                f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
            )
        dtype = compute_dtype(logprobs, ref_logprobs)
        return self.formula(logprobs.to(dtype) - ref_logprobs.to(dtype))


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """Floating dtype for the math: the inputs' promoted dtype, at least float32."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"expected floating-point tensors, got dtype {dtype}")
    return torch.promote_types(dtype, torch.float32)


def _check(estimator: Any, where: str) -> Estimator:
    """``estimator`` if it is a well-formed :class:`Estimator`, else a ValueError."""
    if not isinstance(estimator, Estimator):
        raise ValueError(
            f"{where} must be an rlkl_lightning.kl.estimators.Estimator, got "
            f"{type(estimator).__name__} {estimator!r}"
        )
    if not isinstance(estimator.name, str) or not estimator.name:
        raise ValueError(f"{where}: `name` must be a non-empty string, got {estimator.name!r}")
    if estimator.formula is not None and not callable(estimator.formula):
        raise ValueError(f"{where}: `formula` must be callable or None, got {estimator.formula!r}")
    if not (estimator.loss or estimator.reward):
        raise ValueError(
            f"{where}: estimator {estimator.name!r} is usable nowhere (loss=False, reward=False)"
        )
    return estimator


#: Estimators the pipeline computes from the full logits, not from a formula: registered by
#: the package alone.
PIPELINE_COMPUTED = ("exact",)


def _registrable(name: str, estimator: Any) -> None:
    """Refuse to register what is not an :class:`Estimator` named ``name`` with a formula."""
    _check(estimator, "register")
    if estimator.name != name:
        raise ValueError(
            f"register: the estimator {estimator.name!r} is registered as {name!r}; use its name"
        )
    if estimator.needs_logits and name not in PIPELINE_COMPUTED:
        raise ValueError(
            f"register: estimator {name!r} has no formula; estimators that need the full "
            "logits are computed by the pipeline itself (like `exact`)"
        )


#: Every registered estimator by name, in the order of registration.
ESTIMATORS = Registry(
    "penalty.estimator",
    "an Estimator (or a class or function that makes one from its init_args)",
    check=_registrable,
)


def estimator_names(role: str | None = None) -> tuple[str, ...]:
    """The registered names usable in ``role`` (None: all): those with a formula first.

    Args:
        role: ``"reward"``, ``"loss"`` or None (see :data:`ROLES`).
    """
    usable = [e for _, e in ESTIMATORS.items() if role is None or getattr(e, role)]
    return tuple(e.name for e in usable if not e.needs_logits) + tuple(
        e.name for e in usable if e.needs_logits
    )


def kl_estimator(
    name_or_path: Any,
    option: str = "penalty.estimator",
    role: str | None = None,
    owner: str | None = None,
) -> Estimator:
    """The estimator a registered name, a dotted path or a ``{class_path, init_args}`` names.

    Args:
        name_or_path: A registered name (``k1``), the dotted path of a user's own
            :class:`Estimator` (``mypackage.module.k4``), a ``{class_path, init_args}`` mapping
            of a class or function that makes one, or an :class:`Estimator`.
        option: The option's name, for error messages.
        role: ``"reward"`` or ``"loss"``: the estimator must declare it may be used there;
            None: no check.
        owner: Prefix of error messages (a function's name), if any.

    Returns:
        The estimator.

    Raises:
        ValueError: For an unknown name (listing the registered names usable in ``role``), a
            path that does not import or names no :class:`Estimator`, arguments its maker does
            not take, an estimator not usable in ``role``, a plugged estimator that needs the
            logits or takes a registered name.
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"kl_estimator: `role` must be one of {ROLES} or None, got {role!r}")
    prefix = f"{owner}: " if owner else ""
    names = estimator_names(role)
    where = f"{prefix}`{option}`"
    try:
        target, init_args = ESTIMATORS.resolve(name_or_path, option, names)
    except ValueError as error:
        raise ValueError(f"{prefix}{error}") from None
    if not isinstance(target, Estimator) and callable(target):
        check_arguments(target, init_args, option)
        target = target(**init_args)
    if not isinstance(name_or_path, Estimator):
        where = f"{where} = {name_or_path!r}"
    estimator = _check(target, where)
    plugged = ESTIMATORS.name_of(estimator) is None
    if plugged and estimator.name in ESTIMATORS:
        raise ValueError(
            f"{prefix}`{option}`: the plugged estimator's name {estimator.name!r} is a registered "
            f"one's ({ESTIMATORS.names()}); give it its own name, under which it is logged "
            "(`objective/kl_<name>`)"
        )
    if plugged and estimator.needs_logits:
        raise ValueError(
            f"{prefix}`{option}`: the plugged estimator {estimator.name!r} has no formula; an "
            "estimator that needs the full logits (like `exact`) cannot be plugged in, only "
            "built into the pipeline. Give it a per-token formula of the log-ratio."
        )
    if role is not None and not getattr(estimator, role):
        if not plugged:
            raise ValueError(f"{prefix}{ESTIMATORS.error(name_or_path, option, names=names)}")
        use = "as the KL term of the loss" if role == "loss" else "as the measured KL"
        raise ValueError(
            f"{prefix}`{option}`: estimator {estimator.name!r} ({name_or_path!r}) declares "
            f"{role}=False, so it cannot be used {use}; registered ones that can: {names}"
        )
    return estimator


def estimator_spec(value: Any, option: str = "penalty.estimator") -> str | dict[str, Any]:
    """An estimator option as a plain value for hyperparameters and checkpoints.

    A registered name or a dotted path stays the string it is; a ``{class_path, init_args}``
    mapping (or a class, a ``functools.partial``) becomes the plain spec with every argument;
    an :class:`Estimator` object, its registered name or, for a plugged one, its maker's spec.

    Raises:
        ValueError: As :func:`kl_estimator`.
    """
    if isinstance(value, str):
        return value
    target, init_args = ESTIMATORS.resolve(value, option)
    if isinstance(target, Estimator):
        name = ESTIMATORS.name_of(target)
        if name is not None:
            return name
    if inspect.isclass(target) or inspect.isfunction(target):
        return plain_spec(target, init_args)
    raise ValueError(
        f"`{option}`: a plugged Estimator object cannot be stored as a plain value; name it by "
        f"its dotted path (mypackage.module.name) or by the class that makes it, got {value!r}"
    )


def sample_estimators(*chosen: Any) -> dict[str, Estimator]:
    """The estimators with a per-token formula that a batch computes, by name.

    Every registered estimator with a formula, by name, in registration order; then each
    ``chosen`` option that is a plugged estimator, under its own name (its KL is logged as
    ``objective/kl_<name>``). A registered name that needs the logits (``exact``) is left
    out: the pipeline computes it from the logits.

    Args:
        chosen: The run's estimator options (e.g. ``penalty.estimator``).

    Raises:
        ValueError: As :func:`kl_estimator`, for a chosen option that names none.
    """
    found = {name: e for name, e in ESTIMATORS.items() if not e.needs_logits}
    for option in chosen:
        estimator = kl_estimator(option)
        if estimator.name not in ESTIMATORS:
            found[estimator.name] = estimator
    return found


def per_token_kl(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str | Estimator = "k1"
) -> Tensor:
    """Per-token KL estimate from the log-probabilities of the sampled tokens.

    Args:
        logprobs: ``log pi(y_t|s_t)`` of the sampled tokens under the policy, any shape.
        ref_logprobs: ``log ref(y_t|s_t)`` under the reference, same shape.
        estimator: A registered name with a formula (``"k1"``, ``"k2"``, ``"k3"``), a dotted
            path to an :class:`Estimator`, or one. ``"exact"`` needs full logits: use
            :func:`~rlkl_lightning.kl.estimators.exact_kl`.

    Returns:
        A tensor of the same shape, in nats, in the inputs' dtype promoted to at least float32.

    Raises:
        ValueError: For an unknown estimator, one that needs the logits, or mismatched shapes.
    """
    found = kl_estimator(estimator, "estimator", owner="per_token_kl")
    if found.needs_logits:
        raise ValueError(
            f"per_token_kl: estimator {found.name!r} is not sample-based; compute it from full "
            "logits with exact_kl(logits, ref_logits). Sample-based estimators: "
            f"{tuple(n for n in estimator_names() if not ESTIMATORS[n].needs_logits)}"
        )
    return found.per_token(logprobs, ref_logprobs)
