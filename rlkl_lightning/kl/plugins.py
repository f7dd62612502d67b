"""Naming a user's own code by its dotted import path, as a config's ``class_path`` does.

An option that takes a registered name (an estimator, a law) also takes
``mypackage.module.name``: the module is imported and the name looked up in it. The path comes
from the user's own config or command line, never from a checkpoint or a data file.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_path"]


def _import(path: str) -> Any:
    """The object at the dotted path ``module.sub.name``; ImportError/AttributeError if none."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"{path!r} is not a dotted path module.name")
    return getattr(importlib.import_module(module_name), attribute)


def import_path(path: str, option: str, what: str, names: tuple[str, ...]) -> Any:
    """The object a dotted path names, or a ValueError naming the option and the allowed names.

    Args:
        path: ``mypackage.module.name``.
        option: The option (``penalty.estimator``) the path was given to, for the message.
        what: What it should name, for the message (``an Estimator``).
        names: The registered names, for the message.
    """
    try:
        return _import(path)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"`{option}` must be one of {names} or the dotted path of {what} "
            f"(mypackage.module.name), got {path!r}, which does not import: {error}"
        ) from None
