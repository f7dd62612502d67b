"""KL control laws by name: the registry, the package's laws, and plugged laws by dotted path.

The package's laws are :mod:`~rlkl_lightning.kl.laws.builtin` (``fixed``, ``adaptive``,
``exponential``, ``pi``, ``logpid``); every other file of this package is imported too, so a
new law is one new file that decorates its builder with :func:`register_law`
(docs/extending.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from rlkl_lightning.kl.laws import builtin as builtin
from rlkl_lightning.kl.laws.registry import (
    LAWS,
    Law,
    build_controller,
    control_law,
    law_names,
    register_law,
)

__all__ = [
    "KL_LAWS",
    "LAWS",
    "Law",
    "build_controller",
    "control_law",
    "law_names",
    "register_law",
]

# The package's own laws first (above), then every other file, each registering its law.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: The registered laws' names once the package's files are imported; :func:`law_names` reads
#: the registry afresh.
KL_LAWS = law_names()
