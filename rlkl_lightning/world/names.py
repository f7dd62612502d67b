"""The worlds' names: ``"default"`` and ``"exact"`` for the models, ``"default"`` for the data.

They are registered when this module is imported, which ``rlkl_lightning/__init__.py`` does: the
model names in :mod:`rlkl_lightning.models.named` (``policy: default`` in a config,
``PPOModule(policy="default")`` in Python) and the default world's texts in
:mod:`rlkl_lightning.data.sources` (``prompts: default``, ``heldout: default:validation``).
So the names resolve wherever the package is used, and neither the models nor the data import
the world. Each world is built on first use; this module imports only the standard library and
the two registries until a name is resolved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from rlkl_lightning.data.sources import SourceFiles, register_text_source
from rlkl_lightning.models.named import register_model_name


def default_world_model() -> Path:
    """``"default"``: the default world's SFT model (``world.build.default_model_dir``)."""
    from rlkl_lightning.world.build import default_model_dir

    return default_model_dir()


def exact_world_model() -> Path:
    """``"exact"``: the exact world's reference (``world.exact.exact_model_dir``)."""
    from rlkl_lightning.world.exact import exact_model_dir

    return exact_model_dir()


def default_world_settings(given: Any) -> Any:
    """The data module's ``world`` option as a :class:`~rlkl_lightning.world.config.WorldConfig`.

    ``None`` (the standard world) and a ``WorldConfig`` are kept; a mapping becomes one.

    Raises:
        ValueError: Naming ``world`` and its fields, for an unknown field or another type.
    """
    from rlkl_lightning.world.config import WorldConfig

    if given is None or isinstance(given, WorldConfig):
        return given
    if isinstance(given, Mapping):
        known = sorted(f.name for f in fields(WorldConfig))
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(
                f"PromptDataModule: `world` has no option {unknown[0]!r}; its options are {known}"
            )
        return WorldConfig(**given)
    raise ValueError(
        f"PromptDataModule: `world` must be a mapping of WorldConfig's options, got {given!r}"
    )


def default_world_texts(settings: Any, progress: bool) -> SourceFiles:
    """``"default"``: the default world's prompts and splits (built if missing)."""
    from rlkl_lightning.world.build import build_world

    world = build_world(settings, progress=progress)
    parts = {name: str(path) for name, path in world.splits.items()}
    return SourceFiles(
        prompts=str(world.prompts_file),
        heldout=parts["test"],
        parts=parts,
        part_is="a split of the default world",
    )


register_model_name("default", default_world_model)
register_model_name("exact", exact_world_model)
register_text_source("default", default_world_texts, default_world_settings)
