"""Model names that stand for a model built elsewhere, such as ``"default"`` and ``"exact"``.

``policy: default`` names the default world's model, which the world builds on first use; the
world lives above the models (:mod:`rlkl_lightning.world` imports from here, never the other
way round), so it registers its names here: importing ``rlkl_lightning`` imports
:mod:`rlkl_lightning.world.names`, which calls :func:`register_model_name`.
:func:`~rlkl_lightning.models.loading.resolve_model_path` then maps a registered name to the
directory its resolver returns.
"""

from __future__ import annotations

import os
from collections.abc import Callable

_RESOLVERS: dict[str, Callable[[], str | os.PathLike[str]]] = {}


def register_model_name(name: str, resolver: Callable[[], str | os.PathLike[str]]) -> None:
    """Make ``name`` stand for the model directory that ``resolver()`` returns (or builds).

    The resolver is called each time the name is resolved, so it should be cheap once its model
    exists (the worlds' resolvers return their cached directory). Registering a name again
    replaces its resolver.
    """
    _RESOLVERS[name] = resolver


def model_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_RESOLVERS)


def resolve_named_model(name: str) -> str | None:
    """The directory of the model ``name`` stands for, or None if it is not a registered name."""
    resolver = _RESOLVERS.get(name)
    return None if resolver is None else str(resolver())
