"""The default of a parameter, read from its function's signature (never written twice)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def defaults_of(function: Callable) -> dict[str, Any]:
    """Every parameter of a function or class, with its default: each is written once.

    A parameter without a default maps to ``inspect.Parameter.empty``. A class's are those of
    its ``__init__`` (no module forwards ``**kwargs`` to its parent: each takes its groups).
    """
    target = function.__init__ if inspect.isclass(function) else function
    return {
        p.name: p.default
        for p in inspect.signature(target).parameters.values()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    }


def default_of(function: Callable, name: str) -> Any:
    """The default of parameter ``name`` of a function or class (see :func:`defaults_of`).

    Raises:
        KeyError: If the signature has no parameter ``name``.
    """
    defaults = defaults_of(function)
    if name not in defaults:
        raise KeyError(f"{getattr(function, '__name__', function)!r} has no parameter {name!r}")
    return defaults[name]
