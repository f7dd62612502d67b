"""What ``train.py fit --help`` ends with: the package's modules, their groups and fields.

The model is any LightningModule (``--model CLASS``), so the parser's own help shows no model
option; this page lists this package's modules' groups, each field with its default, read
from the groups' dataclasses and the modules' signatures (nothing written twice).
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import MISSING, fields
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser

from rlkl_lightning.algorithms.options import MODULE_GROUPS
from rlkl_lightning.migrations import MODULE_PREFIX

WIDTH = 100  # of the lines the page adds


class HelpfulParser(LightningArgumentParser):
    """LightningCLI's parser whose help of a subcommand ends with :func:`module_options`."""

    def format_help(self, *args: Any, **kwargs: Any) -> str:
        """The parser's help, then the modules' options (subcommand parsers only)."""
        text = super().format_help(*args, **kwargs)
        if not {"--model", "--trainer"} <= set(self._option_string_actions):
            return text  # the parser above the subcommands, or `--model.help CLASS`'s
        return f"{text}\n{module_options()}\n"


def module_options() -> str:
    """Every module of this package: its arguments, then each group with its fields' defaults."""
    from rlkl_lightning.algorithms.ppo import PPOModule
    from rlkl_lightning.algorithms.rloo import RLOOModule

    modules = (PPOModule, RLOOModule)
    names = ", ".join(f"rlkl_lightning.{m.__name__}" for m in modules)
    lines = [
        f"The modules of rlkl_lightning ({names}): in a config `model: {{class_path: ..., "
        f"init_args: {{GROUP: {{FIELD: VALUE}}}}}}`, on the command line "
        f"`--{MODULE_PREFIX}GROUP.FIELD=VALUE`; every field with its help: `--model.help "
        f"rlkl_lightning.{modules[0].__name__}`; docs/options.md.",
    ]
    lines = textwrap.wrap(lines[0], WIDTH)
    owners: dict[str, list[str]] = {}
    plain: dict[str, str] = {}  # the arguments that are not groups: the models
    for module in modules:
        for name, parameter in inspect.signature(module).parameters.items():
            if name in MODULE_GROUPS:
                owners.setdefault(name, []).append(module.__name__)
            else:
                plain[name] = _default(parameter)
    values = ", ".join(f"{name}={value}" for name, value in plain.items())
    lines += textwrap.wrap(
        f"arguments: {values}", WIDTH, initial_indent="  ", subsequent_indent="    "
    )
    for group, cls in MODULE_GROUPS.items():
        only = owners.get(group, [])
        head = f"{group}" + ("" if len(only) == len(modules) else f" ({', '.join(only)})")
        values = ", ".join(f"{f.name}={_default(f)}" for f in fields(cls))
        lines += textwrap.wrap(
            f"{head}: {values}", WIDTH, initial_indent="  ", subsequent_indent="    "
        )
    return "\n".join(lines)


def _default(field: Any) -> str:
    """A field's (or a parameter's) default as a config writes it."""
    value = field.default
    if value is MISSING and getattr(field, "default_factory", MISSING) is not MISSING:
        value = field.default_factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
