"""``python -m rlkl_lightning.cli migrate OLD.yaml > NEW.yaml``: an older run config as today's.

The modules' flat options of 0.1.0 go into their groups, the module's ``kl`` group of
0.2.0-0.4.0 is named ``penalty`` (:mod:`rlkl_lightning.migrations`), and a law's gains of
0.1.0-0.4.0 (``kl.horizon``, ``kl.k``, ``kl.kp``, ``kl.ki``) become the arguments of the law in
``kl.controller``; ``CapabilityBudget``'s steps per validation of 0.3.0-0.5.0 (``max_raise``,
``max_step``) become steps per batch and the gains of its older laws (``rate``, ``gain``,
``tau``) are dropped (0.10.0's law has none); everything else is kept in its order. Options
nested or in dotted keys alike (``model.init_args.kl.init_coef: 0.3``). Where only
a group is renamed the file is rewritten in place, comments and layout kept; where flat options
move into groups it is written again from its values, and its comments are lost (the first line
says so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from rlkl_lightning.migrations import (
    FLAT_KEYS,
    renamed_group,
    upgrade_config,
    upgrade_dotted_key,
)


def migrate_text(text: str, name: str = "the config") -> str:
    """The YAML ``text`` of a run config of any older version, as today's.

    Raises:
        ValueError: For a file that is not a YAML mapping (a run config).
    """
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"`migrate`: {name} is not valid YAML: {error}") from None
    if config is None:
        return text
    if not isinstance(config, dict):
        raise ValueError(f"`migrate`: {name} must be a YAML mapping (a run config)")
    wanted = _budget_arguments(_law_arguments(upgrade_config(config)))
    if wanted == config:
        return text
    renamed = _renamed_in_place(text)
    if renamed is not None and yaml.safe_load(renamed) == wanted:
        return renamed
    note = f"# {name}, migrated by `python -m rlkl_lightning.cli migrate` (comments not kept)\n"
    return note + yaml.safe_dump(wanted, sort_keys=False, allow_unicode=True)


def _law_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the top-level ``kl``'s gains moved into its law, as ``{class_path, ...}``.

    A gain the law did not read (0.4.0 warned and ignored it) is dropped.
    """
    from rlkl_lightning.kl.laws import law_spec
    from rlkl_lightning.kl.settings import MOVED_GAINS

    def with_gains(law: Any, gains: dict[str, Any]) -> Any:
        """``law`` (a name) with the ``gains`` it reads, as a block; else ``law`` unchanged."""
        if not isinstance(law, str):
            return law
        spec = law_spec(law)
        taken = {name: value for name, value in gains.items() if name in spec["init_args"]}
        if not taken:
            return law
        return {"class_path": spec["class_path"].rpartition(".")[2], "init_args": taken}

    kl = config.get("kl")
    if isinstance(kl, dict) and MOVED_GAINS.keys() & kl.keys():
        kl = dict(kl)
        gains = {name: kl.pop(name) for name in MOVED_GAINS if name in kl}
        law = with_gains(kl.get("controller", "adaptive"), gains)  # 0.4.0's default law
        if law != kl.get("controller", "adaptive"):
            kl["controller"] = law
        config = {**config, "kl": kl}
    dotted = {f"kl.{name}" for name in MOVED_GAINS} & config.keys()
    if not dotted:
        return config
    gains = {key.removeprefix("kl."): config[key] for key in dotted}
    nested = config.get("kl")
    law = config.get(
        "kl.controller",
        nested.get("controller", "adaptive") if isinstance(nested, dict) else "adaptive",
    )
    block = with_gains(law, gains)
    out: dict[str, Any] = {}
    for key, value in config.items():  # the law's block where its name or its first gain stood
        if key != "kl.controller" and key not in dotted:
            out[key] = value
        elif "kl.controller" not in out and (key == "kl.controller" or block != law):
            out["kl.controller"] = block
    return out


#: CapabilityBudget's steps of 0.3.0-0.5.0 (per validation) and 0.6.0's (per batch).
_BUDGET_STEPS = {"max_raise": "raise_per_batch", "max_step": "fall_per_batch"}
#: CapabilityBudget's gains of laws it no longer has: 0.3.0-0.6.0's ``rate``, 0.7.0-0.9.0's
#: ``gain`` and ``tau`` (0.10.0's feed-forward law has no gain).
_BUDGET_DROPPED = frozenset({"rate", "gain", "tau"})


def _budget_arguments(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with a ``CapabilityBudget``'s old steps per validation as steps per batch.

    The gains of its older laws (``rate``, ``gain``, ``tau``) are dropped; without a whole-batch
    ``trainer.val_check_interval`` the steps cannot be converted and are dropped too (the
    defaults apply).
    """
    trainer = config.get("trainer")
    callbacks = trainer.get("callbacks") if isinstance(trainer, dict) else None
    if not isinstance(callbacks, list):
        return config
    interval = trainer.get("val_check_interval")
    per = interval if isinstance(interval, int) and not isinstance(interval, bool) else None
    changed = []
    for callback in callbacks:
        args = callback.get("init_args") if isinstance(callback, dict) else None
        if (
            not isinstance(args, dict)
            or not str(callback.get("class_path", "")).endswith("CapabilityBudget")
            or not (_BUDGET_DROPPED | _BUDGET_STEPS.keys()) & args.keys()
        ):
            changed.append(callback)
            continue
        args = {name: value for name, value in args.items() if name not in _BUDGET_DROPPED}
        for old, new in _BUDGET_STEPS.items():
            if old in args:
                value = args.pop(old)
                if per is not None and per > 0 and isinstance(value, int | float):
                    args[new] = value / per
        changed.append({**callback, "init_args": args})
    return {**config, "trainer": {**trainer, "callbacks": changed}}


def _renamed_in_place(text: str) -> str | None:
    """``text`` with the module's renamed groups renamed where they stand, or None.

    None where more must change than a key's name: a flat option of 0.1.0 to move, or an old
    and a new group both given.
    """
    top = yaml.compose(text)
    edits = []
    if isinstance(top, yaml.MappingNode):  # dotted keys: `model.init_args.kl.init_coef: 0.3`
        given = {key.value for key, _ in top.value}
        for key, value in top.value:
            new = upgrade_dotted_key(key.value, isinstance(value, yaml.MappingNode))
            if new == key.value:
                continue
            if new in given or key.start_mark.line != key.end_mark.line:
                return None  # an old and a new spelling, or a key over several lines
            edits.append((key.start_mark.line, key.start_mark.column, key.end_mark.column, new))
    init_args = _child(_child(top, "model"), "init_args")
    if not isinstance(init_args, yaml.MappingNode):
        init_args = yaml.MappingNode("tag:yaml.org,2002:map", [])
    keys = [key.value for key, _ in init_args.value]
    if any(key in FLAT_KEYS for key in keys):
        return None
    for key, value in init_args.value:
        new = renamed_group(key.value)
        if new is None or not isinstance(value, yaml.MappingNode):
            continue
        if new in keys or key.start_mark.line != key.end_mark.line:
            return None
        edits.append((key.start_mark.line, key.start_mark.column, key.end_mark.column, new))
    lines = text.splitlines(keepends=True)
    for line, start, end, new in sorted(edits, reverse=True):  # right to left on a line
        lines[line] = lines[line][:start] + new + lines[line][end:]
    return "".join(lines)


def _child(node: Any, name: str) -> Any:
    """The value node of key ``name`` in a mapping node, or None."""
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((value for key, value in node.value if key.value == name), None)


def main(args: list[str] | None = None) -> None:
    """Print the migrated config; a file that cannot be read ends with one line, status 2."""
    parser = argparse.ArgumentParser(
        prog="python -m rlkl_lightning.cli migrate",
        description="Print a run config of an older version (0.1.0-0.5.0) as today's.",
    )
    parser.add_argument("config", help="the old YAML run config")
    path = Path(parser.parse_args(args).config)
    try:
        sys.stdout.write(migrate_text(path.read_text(encoding="utf-8"), str(path)))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
