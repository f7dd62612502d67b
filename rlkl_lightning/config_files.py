"""Run configs that say only what differs: the plain mapping a config file composes to.

A run config may start from shared bases, with the parser's own include key (``config:``,
paths relative to the including file), and set what differs with dotted keys
(``trainer.logger.init_args.name: ppo_adaptive``); a group may also be given as the path of a
file that holds it (``kl: base/kl.yaml``). ``train.py`` resolves both itself (jsonargparse); the
study, the scripts and the tests that read or derive a config need the same composition as a
plain mapping, and :func:`compose` gives it. ``tests/system/test_configs.py`` checks, for every
shipped config, that the parser reads the composed mapping as it reads the file.

The rules are the parser's: includes merge key by key in their order; a dotted key sets one
value; a nested mapping given beside an include replaces that whole branch; a list replaces a
list (callbacks are never merged across files: a run that adds a callback lists them all).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

#: The parser's include key.
INCLUDE = "config"
#: The groups that may be given as the path of a file that holds them.
GROUPS = ("trainer", "model", "data", "kl")
_SUFFIXES = (".yaml", ".yml")


def compose(path: str | Path) -> dict[str, Any]:
    """The plain, nested mapping of the config at ``path``, its bases and dotted keys resolved."""
    return _compose(Path(path), ())


def _compose(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ValueError(f"config: {path} includes itself ({chain})")
    if not path.is_file():
        raise ValueError(f"config: {str(path)!r} is not a file")
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"config: {path} must hold a mapping of options, got {type(raw).__name__}")
    result: dict[str, Any] = {}
    for key, value in raw.items():
        if key == INCLUDE:
            for base in [value] if isinstance(value, str) else list(value or []):
                merge_into(result, _compose(path.parent / base, (*seen, resolved)))
            continue
        if key in GROUPS and isinstance(value, str) and value.endswith(_SUFFIXES):
            value = _compose(path.parent / value, (*seen, resolved))
        _set(result, str(key).split("."), copy.deepcopy(value))
    return result


def merge_into(target: dict[str, Any], source: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``source`` into ``target`` key by key: mappings recursively, anything else replaced."""
    for key, value in source.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            merge_into(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def _set(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[keys[-1]] = value
