"""A resume must not silently mix runs: the settings that shape the trajectory travel with it.

:class:`RunSettings` (added by :class:`~rlkl_lightning.cli.RLKLCLI`) keeps, in every
checkpoint, the options of the run that change what it trains on and how: the KL group (law,
target, unit, horizon, gains, bounds, monitor band), the model (its class and every argument
except logging ones), the data (the prompts, the batch size, the order) and the precision. A
resume whose settings differ is refused with the differences listed, before any callback state
is restored; with ``--resume_with_changes true`` the callbacks' states are
carried over (the controller keeps its beta under the new target, the drift monitor its window)
and each change is printed. ``trainer.max_steps``/``max_epochs`` are not among them: extending a
run is what a resume is for.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

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
        "data.init_args.val_batch_size",
        "data.init_args.num_workers",
        "kl.strict",
    }
)
# With trainer.precision. Not seed_everything: a resume restores every random stream.
GROUPS = ("model", "data", "kl")


def _kept(key: str) -> bool:
    """Whether option ``key`` (``"model.init_args.sampling.top_p"``) shapes the trajectory."""
    return key not in NOT_TRAJECTORY and not any(
        key.startswith(f"{skip}.") for skip in NOT_TRAJECTORY
    )


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    """``{"model.init_args.lr": "0.0001", ...}``: nested config values as comparable text."""
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}", out)
    elif _kept(prefix):
        out[prefix] = repr(value)


def trajectory_settings(config: Any) -> dict[str, str]:
    """The options of a parsed ``fit`` config that shape the trajectory, as text."""
    out: dict[str, str] = {}
    for group in GROUPS:
        _flatten(config.get(group), group, out)
    trainer = config.get("trainer")
    out["trainer.precision"] = repr(trainer.get("precision") if trainer is not None else None)
    return out


def nested_settings(saved: dict[str, str]) -> dict[str, str]:
    """A checkpoint's settings with the flat model options of 0.1.0 put in their groups.

    ``model.init_args.lr`` becomes ``model.init_args.optimization.lr``, so a checkpoint
    written before the option groups is compared like with like.
    """
    from rlkl_lightning.algorithms.options import FLAT_KEYS

    prefix = "model.init_args."
    out = {}
    for key, value in saved.items():
        if key.startswith(prefix):
            name, dot, rest = key.removeprefix(prefix).partition(".")
            place = FLAT_KEYS.get(name)
            if place is not None and not place.startswith(f"{name}."):
                key = f"{prefix}{place}{dot}{rest}"
        if _kept(key):
            out[key] = value
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
        self._compared: int | None = None  # id of the checkpoint compared last

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
        """Compare before any callback's state is restored (Lightning calls this hook first)."""
        self.compare(checkpoint)

    def compare(self, checkpoint: dict[str, Any] | None) -> None:
        """Refuse (or, allowed, print) a change of settings; the CLI calls it before ``fit``.

        Called before ``fit``, nothing of the run is touched by a refusal: not the weights,
        not the ``config.yaml`` the run's directory keeps.
        """
        if not isinstance(checkpoint, dict) or self._compared == id(checkpoint):
            return
        self._compared = id(checkpoint)
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if not isinstance(state, dict) or not isinstance(state.get("settings"), dict):
            return  # a checkpoint written without the CLI, or before this check existed
        self.changes = differences(nested_settings(state["settings"]), self.settings)
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
