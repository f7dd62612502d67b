"""A resume must not silently mix runs: the settings that shape the trajectory travel with it.

:class:`RunSettings` (added by :class:`~rlkl_lightning.cli.RLKLCLI`) keeps, in every
checkpoint, the options of the run that change what it trains on and how: the KL group (law,
target, unit, horizon, gains, bounds, monitor band), the model (its class and every argument
except logging ones), the data (the prompts, the batch size, the order), the precision and the
callbacks that change the weights, the reference or the target (``ReferenceRefresh``: ``every``,
``alpha``, ...; ``CapabilityBudget``: ``budget``, its gains and bounds, and with it the held-out
text it steers on and when validation runs). A
resume whose settings differ is refused with the differences listed, before any callback state
is restored; with ``--resume_with_changes true`` the callbacks' states are
carried over (the controller keeps its beta under the new target, the drift monitor its window)
and each change is printed; the optimizer's settings (``optimization.lr``, ``weight_decay``)
are applied to the restored optimizer (:func:`apply_optimizer_settings`).
``trainer.max_steps``/``max_epochs`` are not among them: extending a run is what a resume is
for.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from rlkl_lightning.migrations import ADDED_GROUPS, MODULE_PREFIX, upgrade_settings_key

# Options that change what is logged or how fast, never what is trained.
NOT_TRAJECTORY = frozenset(
    {
        "model.init_args.logging",
        "model.init_args.gold_reward",
        "data.init_args.heldout",
        "data.init_args.heldout_column",
        "data.init_args.heldout_split",
        "data.init_args.heldout_words",
        "data.init_args.num_heldout",
        "data.init_args.test_heldout",
        "data.init_args.test_split",
        "data.init_args.num_test",
        "data.init_args.val_batch_size",
        "data.init_args.num_workers",
        "kl.strict",
        "kl.bound_patience",
    }
)
# With trainer.precision. Not seed_everything: a resume restores every random stream.
GROUPS = ("model", "data", "kl")
# Callbacks (by class name) that change the trajectory: compared as
# `trainer.callbacks.ReferenceRefresh.init_args.every`. The key `trainer.callbacks` lists them.
TRAJECTORY_CALLBACKS = ("ReferenceRefresh", "CapabilityBudget")
CALLBACKS_KEY = "trainer.callbacks"
#: With a ``CapabilityBudget`` the held-out text is what it steers on: it shapes the trajectory.
STEERED = frozenset(
    f"data.init_args.{name}"
    for name in ("heldout", "heldout_column", "heldout_split", "heldout_words", "num_heldout")
)
#: With a ``CapabilityBudget`` each validation is a step of its loop: when it runs and on how
#: much of that text shape the trajectory too (compared when both runs have a budget).
STEERED_TRAINER = tuple(
    f"trainer.{name}"
    for name in ("val_check_interval", "check_val_every_n_epoch", "limit_val_batches")
)


def _kept(key: str, steered: bool = False) -> bool:
    """Whether option ``key`` (``"model.init_args.sampling.top_p"``) shapes the trajectory."""
    skipped = NOT_TRAJECTORY - STEERED if steered else NOT_TRAJECTORY
    return key not in skipped and not any(key.startswith(f"{skip}.") for skip in skipped)


def _flatten(value: Any, prefix: str, out: dict[str, str], steered: bool = False) -> None:
    """``{"model.init_args.lr": "0.0001", ...}``: nested config values as comparable text."""
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict) and value:
        for key, item in value.items():
            if not str(key).startswith("__"):  # the parser's `__path__` of a group's file
                _flatten(item, f"{prefix}.{key}", out, steered)
    elif _kept(prefix, steered):
        out[prefix] = repr(value)


def trajectory_settings(config: Any) -> dict[str, str]:
    """The options of a parsed ``fit`` config that shape the trajectory, as text."""
    out: dict[str, str] = {}
    trainer = config.get("trainer")
    callbacks = (trainer.get("callbacks") if trainer is not None else None) or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    steered = any(
        str(getattr(c, "class_path", "")).endswith(".CapabilityBudget") for c in callbacks
    )
    for group in GROUPS:
        value = config.get(group)
        if group == "kl" and value is not None:
            value = _with_law_spec(value)
        _flatten(value, group, out, steered)
    out["trainer.precision"] = repr(trainer.get("precision") if trainer is not None else None)
    for key in STEERED_TRAINER if steered else ():
        out[key] = repr(trainer.get(key.partition(".")[2]) if trainer is not None else None)
    names = []
    for callback in callbacks:
        name = str(getattr(callback, "class_path", "")).rpartition(".")[2]
        if name not in TRAJECTORY_CALLBACKS:
            continue
        name = name if name not in names else f"{name}#{names.count(name) + 1}"
        names.append(name)
        _flatten(getattr(callback, "init_args", None), f"{CALLBACKS_KEY}.{name}.init_args", out)
    out[CALLBACKS_KEY] = repr(names)
    return out


def _with_law_spec(kl: Any) -> dict[str, Any]:
    """The ``kl`` group with its law as the plain spec, whichever form named it.

    ``controller: adaptive`` and ``{class_path: AdaptiveKLController, init_args: {horizon:
    10000}}`` are the same law: both are compared (and kept) as
    ``kl.controller.class_path`` and ``kl.controller.init_args.*``, every argument written out.
    """
    from rlkl_lightning.kl.laws import law_spec

    kl = kl.as_dict() if hasattr(kl, "as_dict") else dict(kl)
    if "controller" in kl:
        kl["controller"] = law_spec(kl["controller"])
    return kl


def _old_law(saved: dict[str, str]) -> dict[str, str]:
    """A 0.1.0-0.4.0 checkpoint's law (a name, the gains beside it) as the spec of today.

    ``kl.controller: 'adaptive'`` with ``kl.horizon: 1000.0`` becomes
    ``kl.controller.class_path`` and ``kl.controller.init_args.horizon``; the gains of other
    laws, which that run did not read, are dropped. A law that no longer imports is kept as it
    was (the comparison then lists it).
    """
    import ast

    from rlkl_lightning.kl.laws import law_spec
    from rlkl_lightning.kl.settings import MOVED_GAINS

    saved = dict(saved)
    gains = {name: saved.pop(f"kl.{name}") for name in MOVED_GAINS if f"kl.{name}" in saved}
    if "kl.controller" not in saved:
        return saved
    try:
        name = ast.literal_eval(saved["kl.controller"])
        spec = law_spec(name)
    except (ValueError, SyntaxError):
        return saved
    del saved["kl.controller"]
    for key, value in gains.items():
        if key in spec["init_args"]:
            spec["init_args"][key] = ast.literal_eval(value)
    _flatten(spec, "kl.controller", saved)
    return saved


def nested_settings(saved: dict[str, str]) -> dict[str, str]:
    """A checkpoint's settings under today's names (:mod:`rlkl_lightning.migrations`).

    ``model.init_args.lr`` (0.1.0) becomes ``model.init_args.optimization.lr`` and
    ``model.init_args.kl.init_coef`` (0.2.0-0.4.0) ``model.init_args.penalty.init_coef``, so
    an older checkpoint is compared like with like; a group added since the checkpoint was
    written (``engine``), or an option added to a group the checkpoint has (``ppo.advantage``),
    is filled in with its defaults, which that run used.
    """
    from dataclasses import fields

    from rlkl_lightning.algorithms.options import MODULE_GROUPS

    saved = _old_law(saved)
    steered = "CapabilityBudget" in saved.get(CALLBACKS_KEY, "")
    out = {}
    for group in ADDED_GROUPS:  # a checkpoint from before the group ran with its defaults
        if not any(key.startswith(f"{MODULE_PREFIX}{group}.") for key in saved):
            for f in fields(MODULE_GROUPS[group]):
                out[f"{MODULE_PREFIX}{group}.{f.name}"] = repr(f.default)
    for key, value in saved.items():
        key = upgrade_settings_key(key)
        if _kept(key, steered):
            out[key] = value
    for group, cls in MODULE_GROUPS.items():  # an option added since: the run used its default
        head = f"{MODULE_PREFIX}{group}."
        had = {key.removeprefix(head).partition(".")[0] for key in out if key.startswith(head)}
        for f in fields(cls) if had else ():
            if f.name not in had and _kept(f"{head}{f.name}", steered):
                out[f"{head}{f.name}"] = repr(f.default)
    return out


def differences(saved: dict[str, str], current: dict[str, str]) -> list[str]:
    """``option: checkpoint -> now`` for every option whose value changed (or appeared)."""
    missing = "(unset)"
    return [
        f"{key}: {saved.get(key, missing)} -> {current.get(key, missing)}"
        for key in sorted(saved.keys() | current.keys())
        if saved.get(key, missing) != current.get(key, missing)
    ]


class RunSettings(Callback):
    """Keeps the trajectory's settings in checkpoints; refuses a resume that changes them.

    Args:
        settings: Option -> value (as text) of this run (:func:`trajectory_settings`).
        allow_changes: Carry the callbacks' states over a change of settings (printed) instead
            of refusing the resume (``--resume_with_changes``).
    """

    def __init__(self, settings: dict[str, str], allow_changes: bool = False) -> None:
        self.settings = dict(settings)
        self.allow_changes = allow_changes
        self.changes: list[str] = []  # of the last resume
        self._compared: str | None = None  # the settings of the checkpoint compared last

    @property
    @override
    def state_key(self) -> str:
        return "RunSettings"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"settings": dict(self.settings)}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Compare before any callback's state is restored (Lightning calls this hook first).

        With changes allowed, a controller whose law changed gets the checkpoint's beta under
        its own law (:func:`carry_beta_to_new_law`).
        """
        self.compare(checkpoint)
        if self.changes:
            for line in carry_beta_to_new_law(trainer, checkpoint):
                rank_zero_info(f"  {line}")

    def compare(self, checkpoint: dict[str, Any] | None) -> None:
        """Refuse (or, allowed, print) a change of settings; the CLI calls it before ``fit``.

        Called before ``fit``, nothing of the run is touched by a refusal: not the weights,
        not the ``config.yaml`` the run's directory keeps.
        """
        if not isinstance(checkpoint, dict):
            return
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not isinstance(state, dict) or not isinstance(state.get("settings"), dict):
            return  # a checkpoint written without the CLI, or before this check existed
        compared = repr(sorted(state["settings"].items()))
        if self._compared == compared:  # the CLI compares first, Lightning's load again
            return
        self._compared = compared
        saved = nested_settings(state["settings"])
        current = self.settings
        if CALLBACKS_KEY not in saved:  # written before callbacks were compared
            current = {k: v for k, v in current.items() if not k.startswith(CALLBACKS_KEY)}
        # A budget added or removed is listed as such; a checkpoint of before this check has none.
        unshared = {k for k in STEERED_TRAINER if (k in saved) != (k in current)}
        saved = {k: v for k, v in saved.items() if k not in unshared}
        current = {k: v for k, v in current.items() if k not in unshared}
        self.changes = differences(saved, current)
        budget = all("CapabilityBudget" in s.get(CALLBACKS_KEY, "") for s in (saved, current))
        # Under a budget `kl.target` only starts a run: a resume takes the budget's target.
        unapplied = [c for c in self.changes if budget and c.startswith("kl.target: ")]
        self.changes = [c for c in self.changes if c not in unapplied]
        for line in unapplied:
            rank_zero_info(
                f"Not applied on resume: {line} (a CapabilityBudget sets the target; its own, "
                "from the checkpoint, is in force)"
            )
        if not self.changes:
            return
        listed = "\n  ".join(self.changes)
        if not self.allow_changes:
            raise ValueError(
                "`ckpt_path`: this run's settings differ from the checkpoint's in what shapes "
                f"the trajectory:\n  {listed}\nResume with the checkpoint's settings, or pass "
                "`--resume_with_changes true` to carry beta, the controller's and the drift "
                "monitor's states over to the new settings"
            )
        rank_zero_info(f"Resuming with changed settings (--resume_with_changes):\n  {listed}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a resume with changes, give the restored optimizer the configured settings."""
        if self.changes:
            for line in apply_optimizer_settings(trainer, pl_module):
                rank_zero_info(f"  applied: {line}")


def carry_beta_to_new_law(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> list[str]:
    """Rewrite a controller's saved state of another law as ``{new law, checkpoint's beta}``.

    A law's state (the adaptive law's beta alone, PI's integral, log-PID's terms) means
    nothing to another law, whose ``load_state_dict`` refuses it. The checkpoint's beta carries
    over, and the new law's own state starts from it as it would in a run started at that
    beta (its controller fills the missing fields from the beta, and clamps a beta outside its
    bounds with a warning). The callback's counters (batches, hold) are kept.

    Returns:
        One line per controller whose law changed, saying so.
    """
    from rlkl_lightning.kl.controller_callback import KLControllerCallback

    states = checkpoint.get("callbacks") or {}
    lines = []
    for callback in trainer.callbacks:
        if not isinstance(callback, KLControllerCallback):
            continue
        state = states.get(callback.state_key)
        saved = state.get("controller") if isinstance(state, dict) else None
        law = getattr(callback.controller, "law", None)
        if not isinstance(saved, dict) or law is None or saved.get("law") in (None, law):
            continue
        beta = saved.get("value")
        state["controller"] = {"law": law, "value": beta}
        shown = f"{beta:.6g}" if isinstance(beta, int | float) else repr(beta)
        lines.append(
            f"kl.controller: the law changed ({saved.get('law')!r} -> {law!r}): beta "
            f"{shown} carries over; the new law's state starts from it, as in "
            "a new run started at that beta"
        )
    return lines


# Per-group settings that are the schedule's state or the parameters, not the configuration.
_NOT_SETTINGS = frozenset({"params", "lr", "initial_lr"})


def apply_optimizer_settings(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
    """Make the restored optimizers what this run's ``configure_optimizers`` asks for.

    A restored optimizer carries the checkpoint's learning rate and weight decay in its
    parameter groups, and its scheduler the checkpoint's base learning rate: a new
    ``optimization.lr`` given on resume would be printed and not used. Here the configured
    base learning rate replaces the scheduler's (and the group's ``initial_lr``), the
    schedule's current multiplier continues (the group's lr is the new base times it), and
    every other numeric setting of a group (weight decay, betas, eps, ...) takes the configured
    value. The optimizer's state (AdamW's moments) is kept.

    Returns:
        One ``group i lr: old -> new`` line per value changed.
    """
    fresh_optimizers, _ = _init_optimizers_and_lr_schedulers(pl_module)
    schedulers = {
        id(config.scheduler.optimizer): config.scheduler
        for config in trainer.lr_scheduler_configs
        if hasattr(config.scheduler, "optimizer")
    }
    lines: list[str] = []
    for n, (restored, fresh) in enumerate(zip(trainer.optimizers, fresh_optimizers)):
        scheduler = schedulers.get(id(restored))
        name = f"optimizer {n} " if len(trainer.optimizers) > 1 else ""
        for i, (group, wanted) in enumerate(zip(restored.param_groups, fresh.param_groups)):
            where = f"{name}group {i} " if len(restored.param_groups) > 1 else name
            base = _base_lr(group, scheduler, i)
            new_base = wanted.get("initial_lr", wanted["lr"])
            if base != new_base:
                multiplier = group["lr"] / base if base else 1.0
                group["lr"] = new_base * multiplier
                group["initial_lr"] = new_base
                if scheduler is not None and hasattr(scheduler, "base_lrs"):
                    scheduler.base_lrs[i] = new_base
                    if hasattr(scheduler, "_last_lr"):
                        scheduler._last_lr[i] = group["lr"]
                lines.append(
                    f"{where}lr: {base:g} -> {new_base:g} (x {multiplier:g} of the schedule: "
                    f"{group['lr']:g})"
                )
            for key, value in wanted.items():
                if key in _NOT_SETTINGS or isinstance(value, bool):
                    continue  # flags (fused, amsgrad, ...) are how, not what
                if not isinstance(value, int | float | tuple):
                    continue
                if group.get(key) != value:
                    lines.append(f"{where}{key}: {group.get(key)} -> {value}")
                    group[key] = value
    return lines


def _base_lr(group: dict[str, Any], scheduler: Any, index: int) -> float:
    """The base learning rate a restored group's schedule multiplies."""
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        return float(scheduler.base_lrs[index])
    return float(group.get("initial_lr", group["lr"]))
