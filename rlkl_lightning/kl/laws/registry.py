"""The registry of KL control laws: one name, one :class:`Law`, one place.

A law is a name and a builder: ``build(settings, init_kl_coef, **bounds)`` makes its
controller from the CLI's ``kl`` group (:class:`~rlkl_lightning.kl.settings.KLSettings`: the
target and the law's gains), the starting beta, and ``min_kl_coef`` / ``max_kl_coef`` where
the run sets them (unset bounds are left to the law's own defaults). The package's laws
register themselves, one file each in ``rlkl_lightning/kl/laws/``. A user's own law needs no
registration: ``kl.controller: mypackage.module.MyLaw`` names it by its dotted import path
(:func:`control_law`), and is called as::

    MyLaw(init_kl_coef, target, min_kl_coef=..., max_kl_coef=...)  # bounds only when set

The object it returns must follow the
:class:`~rlkl_lightning.kl.controllers.KLController` protocol (``value``,
``update(current_kl, n_steps)``, ``state_dict()``, ``load_state_dict(state)``) and should
keep its target in a ``target`` attribute; a path may instead name a :class:`Law`, whose
builder sees the whole ``kl`` group. docs/extending.md shows both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkl_lightning.kl.controllers import KLController
from rlkl_lightning.kl.plugins import import_path

__all__ = ["LAWS", "Law", "build_controller", "control_law", "law_names", "register_law"]

#: The builder of a law: ``(settings, init_kl_coef, **bounds) -> KLController``.
Builder = Callable[..., KLController]
_PROTOCOL = ("value", "update", "state_dict", "load_state_dict")


@dataclass(frozen=True)
class Law:
    """A KL control law: its name and how to build its controller.

    Args:
        name: The name ``kl.controller`` takes (``adaptive``); a registered name has no dot.
        build: ``build(settings, init_kl_coef, **bounds)`` returns the controller, starting at
            beta = ``init_kl_coef``; ``settings`` is the ``kl`` group
            (:class:`~rlkl_lightning.kl.settings.KLSettings`) and ``bounds`` holds
            ``min_kl_coef`` / ``max_kl_coef`` only where the run sets them.
        options: The gain options of the ``kl`` group (``horizon``, ``k``, ``kp``, ``ki``) the
            law reads; one of these set for a law that does not read it is refused
            (:class:`~rlkl_lightning.kl.settings.KLSettings`). None (a plugged law's builder
            may read any): not checked.
    """

    name: str
    build: Builder
    options: tuple[str, ...] | None = None


#: Every registered law by name, in the order of registration.
LAWS: dict[str, Law] = {}


def register_law(name: str, options: tuple[str, ...] | None = None) -> Callable[[Builder], Builder]:
    """Register the decorated builder as the law ``name`` (a package file's one decorator).

    ``options`` names the gain options of the ``kl`` group the builder reads (:class:`Law`).

    Example::

        @register_law("halving", options=())
        def halving(settings, init_kl_coef, **bounds):
            return HalvingKLController(init_kl_coef, settings.target, **bounds)

    Raises:
        ValueError: For a taken name or one that is not an identifier.
    """
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"register_law: a law's name is an identifier, got {name!r}")
    if name in LAWS:
        raise ValueError(f"register_law: the law {name!r} is already registered")

    def register(build: Builder) -> Builder:
        LAWS[name] = Law(name, build, options)
        return build

    return register


def law_names() -> tuple[str, ...]:
    """The registered laws' names, in the order of registration."""
    return tuple(LAWS)


def control_law(name_or_path: str | Law, option: str = "kl.controller") -> Law:
    """The law a registered name or a dotted import path names.

    A path to a :class:`Law` gives that law; a path to anything else callable (a class, a
    factory) gives a law that calls it as ``obj(init_kl_coef, target, **bounds)``.

    Args:
        name_or_path: A registered name (``adaptive``), a dotted path
            (``mypackage.module.MyLaw``), or a :class:`Law`.
        option: The option's name, for error messages.

    Raises:
        ValueError: For an unknown name (listing the registered ones), or a path that does not
            import or names nothing callable.
    """
    if isinstance(name_or_path, Law):
        return name_or_path
    if isinstance(name_or_path, str) and name_or_path in LAWS:
        return LAWS[name_or_path]
    names = law_names()
    if not (isinstance(name_or_path, str) and "." in name_or_path):
        raise ValueError(
            f"`{option}` must be one of {names}, got {name_or_path!r} (or the dotted path of "
            "your own law, mypackage.module.MyLaw: docs/extending.md)"
        )
    found = import_path(name_or_path, option, "a law", names)
    if isinstance(found, Law):
        return found
    if not callable(found):
        raise ValueError(
            f"`{option}`: {name_or_path!r} must name a class (or factory) called as "
            f"{name_or_path.rpartition('.')[2]}(init_kl_coef, target, min_kl_coef=..., "
            f"max_kl_coef=...), or a Law; got {type(found).__name__} {found!r}"
        )

    def build(settings: Any, init_kl_coef: float, **bounds: float) -> KLController:
        return found(init_kl_coef, settings.target, **bounds)

    return Law(name_or_path, build)


def build_controller(
    name_or_path: str | Law,
    settings: Any,
    init_kl_coef: float,
    option: str = "kl.controller",
    **bounds: float,
) -> KLController:
    """The controller of a law, checked against the KLController protocol.

    Args:
        name_or_path: As :func:`control_law`.
        settings: The ``kl`` group the builder reads (``target`` and the law's gains).
        init_kl_coef: Beta to start from.
        option: The option's name, for error messages.
        **bounds: ``min_kl_coef`` / ``max_kl_coef``, only those the run sets.

    Raises:
        ValueError: As :func:`control_law`; a plugged law that cannot be called so, or whose
            controller lacks part of the protocol. A builtin law's own ValueError (an invalid
            parameter) goes through unchanged.
    """
    law = control_law(name_or_path, option)
    plugged = LAWS.get(law.name) is not law
    if not plugged:
        return law.build(settings, init_kl_coef, **bounds)
    try:
        controller = law.build(settings, init_kl_coef, **bounds)
    except TypeError as error:
        raise ValueError(
            f"`{option}`: the law {law.name!r} is called as "
            f"{law.name.rpartition('.')[2]}(init_kl_coef, target"
            f"{''.join(f', {k}=...' for k in bounds)}) and failed: {error}"
        ) from None
    missing = [name for name in _PROTOCOL if not hasattr(controller, name)]
    if missing:
        raise ValueError(
            f"`{option}`: the law {law.name!r} made a {type(controller).__name__}, which "
            f"lacks {missing} of the KLController protocol (value, update, state_dict, "
            "load_state_dict)"
        )
    return controller
