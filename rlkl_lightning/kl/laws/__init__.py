"""KL control laws by name: the registry, and building a law's controller from a config.

A law is a class built as ``Law(init_kl_coef, target, **init_args)``: the package's laws are
the classes of :mod:`~rlkl_lightning.kl.controllers`, each registered under its short name
(``fixed``, ``adaptive``, ``exponential``, ``pi``, ``logpid``) in :data:`LAWS`; every other
file of this package is imported too, so a new law of the package is one new file with a
registered class. A config names a law with its own arguments (its gains), built-in and
plugged alike (:mod:`rlkl_lightning.components`)::

    kl:
      controller: {class_path: AdaptiveKLController, init_args: {horizon: 1000}}

or by its short name alone (``controller: logpid``: its defaults), or by the dotted path of a
user's own class (a :class:`~rlkl_lightning.kl.controllers.KLLaw` subclass to take arguments;
docs/extending.md).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from rlkl_lightning.components import check_arguments, plain_spec
from rlkl_lightning.kl.controllers import LAWS, KLController, KLLaw

__all__ = [
    "KL_LAWS",
    "LAWS",
    "KLLaw",
    "build_controller",
    "law_name",
    "law_names",
    "law_spec",
]

_PROTOCOL = ("value", "update", "state_dict", "load_state_dict")
#: The arguments a law is called with before its own: the starting beta and the target.
_CALLER_FILLS = 2

# Every file of this package registers its law when imported: a new one is one new file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: The registered laws' names once the package's files are imported; :func:`law_names` reads
#: the registry afresh.
KL_LAWS = LAWS.names()


def law_names() -> tuple[str, ...]:
    """The registered laws' names, in the order of registration."""
    return LAWS.names()


def _resolve(value: Any, option: str) -> tuple[Any, dict[str, Any]]:
    """The law's class and its arguments, checked against its signature."""
    target, init_args = LAWS.resolve(value, option)
    if not inspect.isclass(target) and hasattr(target, "update"):  # a built controller
        raise ValueError(
            f"`{option}` takes the law, not a built controller ({type(target).__name__}): it is "
            "built with the module's starting beta and the group's target. Pass the class with "
            f"its arguments, functools.partial({type(target).__name__}, ...), or a "
            "{class_path, init_args} mapping"
        )
    if not (inspect.isclass(target) or callable(target)):
        raise LAWS.error(value, option, f", which names {type(target).__name__} {target!r}")
    check_arguments(target, init_args, option, skip=_CALLER_FILLS)
    return target, init_args


def law_spec(value: Any, option: str = "kl.controller") -> dict[str, Any]:
    """A law as the plain ``{"class_path", "init_args"}`` (every argument, defaults filled in).

    Args:
        value: A registered name, a dotted path, a ``{class_path, init_args}`` mapping, a
            class or a ``functools.partial`` of one (:meth:`~rlkl_lightning.components.
            Registry.resolve`).
        option: The option, for messages.

    Raises:
        ValueError: For a value that names no law, or arguments the law does not take.
    """
    target, init_args = _resolve(value, option)
    return plain_spec(target, init_args, skip=_CALLER_FILLS)


def law_name(value: Any, option: str = "kl.controller") -> str:
    """A law's registered name (``adaptive``), or its class path for an unregistered one."""
    target, _ = _resolve(value, option)
    return LAWS.name_of(target) or law_spec(value, option)["class_path"]


def build_controller(
    value: Any,
    init_kl_coef: float,
    target: float,
    option: str = "kl.controller",
    **bounds: float,
) -> KLController:
    """The controller of a law, checked against the KLController protocol.

    Args:
        value: As :func:`law_spec`.
        init_kl_coef: Beta to start from.
        target: The target KL.
        option: The option's name, for error messages.
        **bounds: ``min_kl_coef`` / ``max_kl_coef`` the run sets (the ``kl`` group's); a law's
            own ``init_args`` may set them instead, not both to different values.

    Raises:
        ValueError: As :func:`law_spec`; a bound set twice; a plugged law that cannot be called
            so, or whose controller lacks part of the protocol. A law's own ValueError (an
            invalid gain) goes through unchanged.
    """
    law, init_args = _resolve(value, option)
    defaults = plain_spec(law, {}, skip=_CALLER_FILLS)["init_args"]
    for name, bound in bounds.items():
        given = init_args.get(name, defaults.get(name))
        if name in init_args and given != defaults.get(name) and given != bound:
            raise ValueError(
                f"`kl.{name}` ({bound!r}) and `{option}.init_args.{name}` ({given!r}) both set "
                "the bound: set one of them"
            )
    arguments = {**init_args, **bounds}
    try:
        controller = law(init_kl_coef, target, **arguments)
    except TypeError as error:
        if isinstance(law, type) and issubclass(law, KLLaw) and LAWS.name_of(law):
            raise
        name = getattr(law, "__name__", repr(law))
        raise ValueError(
            f"`{option}`: the law {name} is called as {name}(init_kl_coef, target"
            f"{''.join(f', {k}=...' for k in arguments)}) and failed: {error}"
        ) from None
    missing = [name for name in _PROTOCOL if not hasattr(controller, name)]
    if missing:
        raise ValueError(
            f"`{option}`: the law {getattr(law, '__name__', law)!r} made a "
            f"{type(controller).__name__}, which lacks {missing} of the KLController protocol "
            "(value, update, state_dict, load_state_dict)"
        )
    return controller
