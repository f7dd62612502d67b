"""The default of a parameter, read from its function's signature (never written twice)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def defaults_of(function: Callable) -> dict[str, Any]:
    """Every parameter of a function or class, with its default: each is written once.

    A parameter without a default maps to ``inspect.Parameter.empty``. For a class whose
    ``__init__`` forwards ``**kwargs`` to its parent (``PPOModule`` to ``RLPipeline``), the
    parents' parameters are included, searched in method resolution order.
    """
    found: dict[str, Any] = {}
    owners = inspect.getmro(function) if inspect.isclass(function) else (function,)
    for owner in owners:
        if inspect.isclass(owner) and "__init__" not in vars(owner):
            continue
        target = owner.__init__ if inspect.isclass(owner) else owner
        parameters = inspect.signature(target).parameters.values()
        for p in parameters:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self":
                found.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return found


def default_of(function: Callable, name: str) -> Any:
    """The default of parameter ``name`` of a function or class (see :func:`defaults_of`).

    Raises:
        KeyError: If the signature has no parameter ``name``.
    """
    defaults = defaults_of(function)
    if name not in defaults:
        raise KeyError(f"{getattr(function, '__name__', function)!r} has no parameter {name!r}")
    return defaults[name]
