"""A study on a custom world (``--world DIR``): what the world's ``study.yaml`` changes in each run.

A world built by ``python -m rlkl_lightning.world --texts FILES`` holds a ``study.yaml`` (its
model, prompts and held-out text; :mod:`rlkl_lightning.world.custom` writes it). A study on the
world drops from every run config the options the world makes moot
(:func:`without_replaced_options`), then merges the world's overrides in
(:func:`study_overrides`), after the study's own ``overrides``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rlkl_lightning.compare.config import merge
from rlkl_lightning.migrations import upgrade_init_args
from rlkl_lightning.world.custom import STUDY_FILE, open_world

#: Options of a run config that a custom world makes moot or that only the default world can
#: serve: a run on a custom world drops them from its config (back to the class default) where
#: the config sets them, before the world's ``study.yaml`` is merged in. So no run reads another
#: tokenizer, reference, text column or cut of the world's prompts, and no run scores its text
#: with the default world's gold reward (``gold_reward``: its lexicon knows nothing of the
#: user's words; a world's ``study.yaml`` may set a gold reward of its own).
REPLACED_OPTIONS = {
    "model": ("reference", "tokenizer", "gold_reward"),
    "data": ("prompt_column", "heldout_column", "prompt_words", "heldout_words", "world"),
}


def study_overrides(
    directory: str | Path, where: str = "compare: `world`", extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The world's ``study.yaml`` (``extra`` merged in), ``./`` values made paths in ``directory``.

    Raises:
        ValueError: Starting with ``where``, if ``directory`` is not a custom world.
    """
    import yaml

    world = open_world(directory, where)

    def resolve_paths(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: resolve_paths(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve_paths(v) for v in value]
        if isinstance(value, str) and value.startswith("./"):
            return str((world.root / value[2:]).resolve())
        return value

    own = yaml.safe_load((world.root / STUDY_FILE).read_text()) or {}
    problem = code_it_would_run(own)
    if problem is not None:
        raise ValueError(
            f"{where}: {world.root / STUDY_FILE} {problem}; a world's study.yaml may name only "
            "rlkl_lightning's own classes and never turn on `trust_remote_code` (a world from "
            "elsewhere never runs code): set your own in the study config's `world_overrides`"
        )
    overrides = resolve_paths(merge(own, extra or {}))
    model = overrides.get("model") or {}
    if isinstance(model.get("init_args"), dict):  # a world of an older version
        model["init_args"] = upgrade_init_args(model["init_args"])
    return overrides


def code_it_would_run(value: Any, path: str = "") -> str | None:
    """What in a world's ``study.yaml`` would run code from outside the library, or None.

    A ``class_path`` outside ``rlkl_lightning`` (a dotted path imports and builds anything
    importable) and a true ``trust_remote_code`` (a model directory's own code) both would.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "class_path" and isinstance(item, str):
                if "." in item and not item.startswith("rlkl_lightning."):
                    return f"sets `{where}: {item}`"
            elif key == "trust_remote_code" and item:
                return f"sets `{where}: {item}`"
            found = code_it_would_run(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = code_it_would_run(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def without_replaced_options(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a run config without the :data:`REPLACED_OPTIONS` a custom world makes moot.

    A study on a custom world merges the world's :func:`study_overrides` into the result.
    """
    config = copy.deepcopy(config)
    for group, names in REPLACED_OPTIONS.items():
        args = (config.get(group) or {}).get("init_args") or {}
        for name in names:
            args.pop(name, None)
    return config
