"""The options of older versions, mapped onto today's: one table per change, for every reader.

- 0.1.0 -> 0.2.0: the modules' 46 flat options went into groups (:data:`FLAT_KEYS`);
- 0.3.0 added the ``engine`` group (:data:`ADDED_GROUPS`): an older run used its defaults;
- 0.4.0 -> 0.5.0: the modules' ``kl`` group (``KLPenalty``) became ``penalty``
  (:data:`RENAMED_GROUPS`); the run's top-level ``kl`` (``train.py``'s KL control) kept its name.

The command line names the new place of an old option (:mod:`rlkl_lightning.cli.app`), the
resume check compares an old checkpoint's settings under today's names
(:mod:`rlkl_lightning.cli.run_settings`), the export reads an old checkpoint's hyperparameters
(:mod:`rlkl_lightning.export`), a world built before the groups is read with its keys moved
(:mod:`rlkl_lightning.world.custom`), and ``python -m rlkl_lightning.cli migrate OLD.yaml``
rewrites a config (:func:`upgrade_config`).

The tables are history, written out: what older versions wrote does not change when a group
gains a field. So this module imports nothing from the package, and every part of it may read
them (``tests/system/test_layering.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

#: Every flat option of the modules in 0.1.0 -> its place today (``"top_p" -> "sampling.top_p"``).
FLAT_KEYS: dict[str, str] = {
    "init_kl_coef": "penalty.init_coef",
    "kl_estimator": "penalty.estimator",
    "kl_placement": "penalty.placement",
    "kl_loss_estimator": "penalty.loss_estimator",
    "kl_loss_weight_clip": "penalty.loss_weight_clip",
    "kl_trust_region": "penalty.trust_region",
    "loss_aggregation": "objective.aggregation",
    "max_prompt_tokens": "sampling.max_prompt_tokens",
    "max_new_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "stop_at_eos": "sampling.stop_at_eos",
    "ppo_epochs": "optimization.ppo_epochs",
    "num_minibatches": "optimization.num_minibatches",
    "grad_accum_steps": "optimization.grad_accum_steps",
    "lr": "optimization.lr",
    "weight_decay": "optimization.weight_decay",
    "lr_schedule": "optimization.lr_schedule",
    "warmup_batches": "optimization.warmup_batches",
    "max_grad_norm": "optimization.max_grad_norm",
    "cliprange": "objective.cliprange",
    "cliprange_high": "objective.cliprange_high",
    "importance_ratio": "objective.importance_ratio",
    "ent_coef": "objective.ent_coef",
    "trust_remote_code": "models.trust_remote_code",
    "peft": "models.peft",
    "gradient_checkpointing": "models.gradient_checkpointing",
    "cpu_matmul": "models.cpu_matmul",
    "score_clip": "safeguards.score_clip",
    "max_skipped_in_a_row": "safeguards.max_skipped_in_a_row",
    "log_samples_every": "logging.log_samples_every",
    "num_logged_samples": "logging.num_logged_samples",
    "kl_token_threshold": "logging.kl_token_threshold",
    "value_model": "ppo.value_model",
    "cliprange_value": "ppo.cliprange_value",
    "vf_coef": "ppo.vf_coef",
    "gamma": "ppo.gamma",
    "lam": "ppo.lam",
    "whiten_rewards": "ppo.whiten_rewards",
    "value_model_thread": "ppo.value_model_thread",
    "responses_per_prompt": "group.responses_per_prompt",
    "advantage": "group.advantage",
    "scale_rewards": "group.scale_rewards",
    "mask_truncated_completions": "group.mask_truncated_completions",
    "drop_zero_std_groups": "group.drop_zero_std_groups",
}

#: The modules' groups added after 0.1.0 -> the version that added them; a run written before
#: a group existed ran with that group's defaults.
ADDED_GROUPS: dict[str, str] = {"engine": "0.3.0"}

#: The modules' groups that were renamed: old name -> (name today, the version that renamed it).
RENAMED_GROUPS: dict[str, tuple[str, str]] = {"kl": ("penalty", "0.5.0")}

#: The options added to a group after 0.1.0 (``group.field`` -> the version): a checkpoint
#: written before one existed ran with its default (``cli/run_settings.py`` fills it in).
ADDED_OPTIONS: dict[str, str] = {"ppo.advantage": "0.5.0", "penalty.allow_no_gradient": "0.6.0"}

#: Where a module's options sit in a config and in the resume check's settings.
MODULE_PREFIX = "model.init_args."

#: The modules whose options were never grouped (by the last part of their ``class_path``):
#: their ``lr`` and ``weight_decay`` are their own today, not a flat option of 0.1.0.
UNGROUPED_MODULES = frozenset({"SFTModule"})


def moved_option(name: str) -> str | None:
    """Where a flat option of 0.1.0 lives now (``"top_p" -> "sampling.top_p"``), or None."""
    return FLAT_KEYS.get(name)


def renamed_group(name: str) -> str | None:
    """The name today of a module's group that was renamed (``"kl" -> "penalty"``), or None."""
    renamed = RENAMED_GROUPS.get(name)
    return renamed[0] if renamed else None


def upgrade_init_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """A module's options as any older version wrote them (a config, hyperparameters), as today's.

    A flat option of 0.1.0 goes into its group (``lr`` -> ``optimization.lr``), a renamed
    group takes its new name (``kl`` -> ``penalty``); every other key is kept as it is, in its
    order. Where an old and a new spelling of one option are both given, the new one wins.
    """
    upgraded: dict[str, Any] = {}
    for key, value in args.items():
        new = renamed_group(key)
        place = FLAT_KEYS.get(key)
        if new is not None and isinstance(value, Mapping):
            group, old = upgraded.setdefault(new, {}), dict(value)
            if isinstance(group, dict):
                upgraded[new] = {**old, **group}
            continue
        if place is None:
            if isinstance(value, Mapping) and isinstance(upgraded.get(key), dict):
                upgraded[key] = {**upgraded[key], **value}  # a flat key got there first
            else:
                upgraded[key] = copy.deepcopy(value)
            continue
        group, _, name = place.partition(".")
        target = upgraded.setdefault(group, {})
        if isinstance(target, dict):
            target.setdefault(name, copy.deepcopy(value))
    return upgraded


def upgrade_settings_key(key: str) -> str:
    """One key of a checkpoint's settings record under today's name.

    ``model.init_args.lr`` (0.1.0) is ``model.init_args.optimization.lr``,
    ``model.init_args.kl.init_coef`` (0.2.0-0.4.0) ``model.init_args.penalty.init_coef``.
    """
    if not key.startswith(MODULE_PREFIX):
        return key
    name, dot, rest = key.removeprefix(MODULE_PREFIX).partition(".")
    new = renamed_group(name)
    if new is not None and dot:
        return f"{MODULE_PREFIX}{new}.{rest}"
    place = FLAT_KEYS.get(name)
    if place is not None:
        return f"{MODULE_PREFIX}{place}{dot}{rest}"
    return key


def upgrade_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config of any older version as today's: its module options moved and renamed.

    Nested (``model: {init_args: {kl: ...}}``) and dotted (``model.init_args.kl.init_coef``)
    alike; where an old and a new dotted key are both given, the new one wins. The rest (the
    data, the trainer, the top-level ``kl`` of the KL control) is kept as it is, and so is a
    module that has no groups (:data:`UNGROUPED_MODULES`: ``SFTModule``'s ``lr`` is its own).
    """
    if _ungrouped_module(config):
        return copy.deepcopy(dict(config))
    upgraded: dict[str, Any] = {}
    for key, value in copy.deepcopy(dict(config)).items():
        new = upgrade_dotted_key(key, isinstance(value, Mapping))
        if new == key or new not in config:
            upgraded[new] = value
    model = upgraded.get("model")
    if isinstance(model, dict) and isinstance(model.get("init_args"), Mapping):
        model["init_args"] = upgrade_init_args(model["init_args"])
    return upgraded


def _ungrouped_module(config: Mapping[str, Any]) -> bool:
    """Whether ``config``'s model (nested or a dotted ``model.class_path``) has no groups."""
    model = config.get("model")
    class_path = model.get("class_path") if isinstance(model, Mapping) else None
    class_path = config.get("model.class_path", class_path)
    return isinstance(class_path, str) and class_path.rpartition(".")[2] in UNGROUPED_MODULES


def upgrade_dotted_key(key: Any, whole_group: bool = False) -> Any:
    """A config's dotted key under today's name (:func:`upgrade_settings_key`).

    A renamed group given whole as a dotted key (``model.init_args.kl: {...}``,
    ``whole_group``: its value is a mapping) is renamed too.
    """
    if not isinstance(key, str):
        return key
    new = upgrade_settings_key(key)
    group = renamed_group(key.removeprefix(MODULE_PREFIX)) if whole_group else None
    if new == key and key.startswith(MODULE_PREFIX) and group is not None:
        return f"{MODULE_PREFIX}{group}"
    return new
