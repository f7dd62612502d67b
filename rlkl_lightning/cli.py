"""The LightningCLI of rlkl_lightning: ``python train.py fit --config configs/ppo_adaptive.yaml``.

Beside Lightning's ``model``, ``data`` and ``trainer`` groups the CLI has a ``kl`` group: the
KL target is given there once and shared by the controller and the drift monitor, whose
callbacks the CLI adds to the trainer. The initial beta is the model's ``init_kl_coef``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI

from rlkl_lightning.arguments import default_of
from rlkl_lightning.console import RunProgressBar, quiet_lightning_notes, quiet_resume_notes
from rlkl_lightning.controllers import (
    KL_LAWS,
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    PIKLController,
)
from rlkl_lightning.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl_callback import UNIT_NAMES, KLControllerCallback
from rlkl_lightning.resumable import check_checkpoint


@dataclass
class KLSettings:
    """KL control of a PPO run.

    An option that feeds a class takes its default from that class's signature.

    Args:
        controller: the control law: ``fixed``, ``adaptive`` (Ziegler et al. 2019),
            ``exponential`` or ``pi``.
        target: target KL in ``unit``; drives the adaptive laws and the drift monitor (with a
            fixed beta it is only monitored).
        unit: ``sequence`` (nats per sequence, read from ``objective/kl``) or ``token``
            (nats per response token, read from ``objective/kl_per_token``).
        horizon: adaptive law's horizon, in samples (scale it with the samples the run sees).
        k: gain of the exponential law, per nat of error.
        kp: proportional gain of the PI law.
        ki: integral gain of the PI law.
        min_kl_coef: lower bound of beta (None: the law's default).
        max_kl_coef: upper bound of beta (None: the law's default).
        window: drift monitor's moving-average window, in batches.
        high: the monitor warns when the average KL exceeds ``high`` x target.
        low: the monitor warns when the average KL falls below ``low`` x target.
        strict: stop training on a drift excursion instead of warning.
        min_batches: drift monitor's warm-up: batches with a usable KL before it first judges
            the average (None: the monitor's default, ``2 * window``: the KL starts at 0 and
            rises, and that rise alone should not warn "too low").
    """

    controller: str = "adaptive"
    target: float = 6.0  # no class default: Ziegler et al. 2019's target, nats per sequence
    unit: str = default_of(KLControllerCallback, "unit")
    horizon: float = default_of(AdaptiveKLController, "horizon")
    k: float = default_of(ExponentialKLController, "k")
    kp: float = default_of(PIKLController, "kp")
    ki: float = default_of(PIKLController, "ki")
    min_kl_coef: float | None = None
    max_kl_coef: float | None = None
    window: int = default_of(KLDriftMonitor, "window")
    high: float = default_of(KLDriftMonitor, "high")
    low: float = default_of(KLDriftMonitor, "low")
    strict: bool = default_of(KLDriftMonitor, "strict")
    min_batches: int | None = default_of(KLDriftMonitor, "min_batches")

    def __post_init__(self) -> None:
        if self.controller not in KL_LAWS:
            raise ValueError(f"`kl.controller` must be one of {KL_LAWS}, got {self.controller!r}")
        if self.unit not in UNIT_NAMES:
            raise ValueError(f"`kl.unit` must be one of {tuple(UNIT_NAMES)}, got {self.unit!r}")
        if not (isinstance(self.target, int | float) and math.isfinite(self.target)) or (
            self.target <= 0
        ):
            raise ValueError(f"`kl.target` must be a finite number > 0, got {self.target!r}")

    def kl_controller(self, init_kl_coef: float) -> KLController:
        """The controller of law ``controller``, starting at beta = ``init_kl_coef``."""
        bounds = {
            name: bound
            for name in ("min_kl_coef", "max_kl_coef")
            if (bound := getattr(self, name)) is not None  # None: the law's default
        }
        match self.controller:
            case "fixed":
                return FixedKLController(init_kl_coef, **bounds)
            case "adaptive":
                return AdaptiveKLController(init_kl_coef, self.target, self.horizon, **bounds)
            case "exponential":
                return ExponentialKLController(init_kl_coef, self.target, self.k, **bounds)
            case "pi":
                return PIKLController(init_kl_coef, self.target, self.kp, self.ki, **bounds)
        raise AssertionError(f"no controller for law {self.controller!r}")  # see __post_init__

    def callbacks(self, init_kl_coef: float) -> list[Callback]:
        """The controller callback and the drift monitor for a module starting at this beta."""
        controller = KLControllerCallback(self.kl_controller(init_kl_coef), unit=self.unit)
        monitor = KLDriftMonitor(
            self.target,
            window=self.window,
            high=self.high,
            low=self.low,
            unit=self.unit,
            strict=self.strict,
            min_batches=self.min_batches,
        )
        return [controller, monitor]


class RLKLCLI(LightningCLI):
    """LightningCLI with the ``kl`` group; any LightningModule with ``kl_coef`` gets KL control.

    The progress bar counts the batches of the run, and stock notes that do not apply to RL
    runs are hidden (:mod:`rlkl_lightning.console`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        quiet_lightning_notes()
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        """Add the ``kl`` group."""
        parser.add_class_arguments(KLSettings, "kl")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Build the trainer, then put the KL callbacks first (checkpointing stays last).

        Lightning's default progress bar is swapped for :class:`~rlkl_lightning.console.
        RunProgressBar`; a progress bar given in ``trainer.callbacks`` is kept.
        """
        config = self._get(self.config_init, "trainer", default={})
        # Before the trainer exists: Lightning adds its own callbacks to the configured list.
        configured_bar = any(isinstance(c, ProgressBar) for c in config.get("callbacks") or [])
        trainer = super().instantiate_trainer(**kwargs)
        if not configured_bar:
            for i, callback in enumerate(trainer.callbacks):
                if type(callback) in (RichProgressBar, TQDMProgressBar):  # Lightning's default
                    trainer.callbacks[i] = RunProgressBar()
        init_kl_coef = getattr(self.model, "kl_coef", None)
        if init_kl_coef is not None:
            kl: KLSettings = self._get(self.config_init, "kl")
            trainer.callbacks[:0] = kl.callbacks(float(init_kl_coef))
        return trainer

    def before_fit(self) -> None:
        """Check ``--ckpt_path`` (a file, or ``last`` once resolved) before anything loads it."""
        path = self._get(self.config_init, "ckpt_path")
        if path == "last":
            path = _last_checkpoint(self.trainer)
        if path is not None:
            quiet_resume_notes()
        if path is not None and path not in ("best", "hpc", "registry"):
            check_checkpoint(path)


def _last_checkpoint(trainer: Trainer) -> str | None:
    """The file ``ckpt_path="last"`` resolves to, as Lightning resolves it, or None.

    The newest of the ``last*.ckpt`` files of the ``ModelCheckpoint`` callbacks and the files
    of ``OnExceptionCheckpoint`` callbacks.
    """
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    candidates = {
        str(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)
    }
    for callback in trainer.checkpoint_callbacks:
        find = getattr(callback, "_find_last_checkpoints", None)
        if callable(find):
            candidates |= {str(p) for p in find(trainer)}
    existing = [p for p in candidates if os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def main(args: list[str] | None = None) -> RLKLCLI:
    """Entry point of ``train.py``."""
    return RLKLCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        trainer_defaults={
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs"},
            },
            "log_every_n_steps": 1,
        },
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
