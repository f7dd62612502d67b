"""KLCallbackBase: what every KL callback of rlkl_lightning does with the batch KL.

A module logs its batch KL with ``self.log("objective/kl", kl)`` in ``training_step``. After
each training batch a KL callback reads it from ``trainer.callback_metrics``, averages it over
the samples of the global batch (all ranks), counts batches and samples, skips a batch without
a usable KL, checks once that its target is in the unit it names, and hands the KL to its
subclass (:meth:`KLCallbackBase.on_kl`).
:class:`~rlkl_lightning.kl.controller_callback.KLControllerCallback` and
:class:`~rlkl_lightning.kl.drift_monitor.KLDriftMonitor` derive from it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.reading import (
    batch_size_of,
    check_name,
    check_target_unit,
    default_monitor,
    global_mean,
    read_monitored,
)


class KLCallbackBase(Callback, ABC):
    """Base of the KL callbacks: read, reduce and count the batch KL; subclasses decide.

    After each training batch (sanity checking is skipped) :meth:`on_train_batch_end` reads the
    KL the module logged under ``monitor``, averages it over the samples of the global batch
    (:func:`~rlkl_lightning.kl.reading.global_mean`) and counts the batch in ``n_batches`` and its
    samples in ``n_samples``. A usable KL goes to :meth:`on_kl`; after the first one the
    target's unit is checked once (:func:`~rlkl_lightning.kl.reading.check_target_unit`). A batch
    without one (a non-finite KL, or one the module did not log again since the last batch,
    which counts no samples) is counted in ``n_skipped``; the first batch of each kind warns,
    naming it (a stale value is reported as stale, not as a non-finite one).
    :meth:`after_batch` then runs, whatever the KL was. The counters are saved in checkpoints.

    A module whose reference was refreshed (reset to, or mixed with, the policy) logs the running
    count of refreshes under ``refresh_key``; when it grows, :meth:`on_refresh` runs before the
    batch's KL is handed on (the first KL measured against the refreshed reference).

    A subclass implements :meth:`on_kl`, may override :meth:`after_batch` and
    :meth:`skip_effect`, builds its own ``state_key`` and adds its fields to
    :meth:`state_dict` and :meth:`load_state_dict` through ``super()``.

    Args:
        unit: ``"sequence"`` (nats per sequence) or ``"token"`` (nats per token); picks the
            default ``monitor`` and is the unit of ``target``.
        monitor: Key the module logs the batch KL under. Defaults to ``"objective/kl"`` for
            ``unit="sequence"`` and ``"objective/kl_per_token"`` for ``unit="token"``.
        batch_size_fn: ``batch -> int``, the number of samples in this rank's batch. Defaults to
            :func:`~rlkl_lightning.kl.reading.infer_batch_size` (leading size of the batch's first
            field).
        refresh_key: Key the module logs its running count of reference refreshes under
            (``RLPipeline`` does with a ``ReferenceRefresh`` callback); None, or a key that is
            never logged: refreshes are not watched.

    Attributes:
        target: Target KL in ``unit`` (``None``: no target, no unit check).
        n_batches: Training batches seen.
        n_samples: Samples of the global batches with a freshly logged KL.
        n_skipped: Batches without a usable KL.
        unit_checked: Whether the target's unit was checked already.
        n_refreshes: Reference refreshes seen (the last count read under ``refresh_key``).
        refresh_every: Trained batches between refreshes, where a refresh callback announced
            them (:meth:`expect_refreshes`), else ``None``.
    """

    target: float | None = None

    def __init__(
        self,
        unit: str = "sequence",
        monitor: str | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        refresh_key: str | None = keys.REFERENCE_REFRESHES,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        default = default_monitor(unit, owner)
        check_name(monitor, "monitor", owner, optional=True)
        check_name(refresh_key, "refresh_key", owner, optional=True)
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise ValueError(f"{owner}: batch_size_fn must be callable, got {batch_size_fn!r}")
        self.unit = unit
        self.monitor = monitor if monitor is not None else default
        self.batch_size_fn = batch_size_fn
        self.n_batches = 0
        self.n_samples = 0
        self.n_skipped = 0
        self.unit_checked = False
        self.refresh_key = refresh_key
        self.n_refreshes = 0
        self.refresh_every: int | None = None
        self._last: Any = None
        self._before: Any = None
        self._stale = False
        self._warned_stale = False
        self._warned_nonfinite = False

    @abstractmethod
    def on_kl(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, kl: float, n_samples: int
    ) -> None:
        """Act on the KL of a training batch: finite, over ``n_samples > 0`` global samples."""

    def after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Run after every counted training batch, skipped or not (e.g. to log)."""

    def skip_effect(self) -> str:
        """What a skipped batch means for this callback, for the one-time warning."""
        return "it is ignored"

    def on_refresh(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """React to a refresh of the reference (the batch KL may be near zero from here on)."""

    def expect_refreshes(self, every: int) -> None:
        """Learn at set-up that the reference is refreshed every ``every`` trained batches.

        A ``ReferenceRefresh`` callback calls it from its ``setup`` on every KL callback whose
        ``refresh_key`` it feeds; a subclass says there what refreshes do to it (overriding
        methods call ``super()``). Stored in ``refresh_every``.
        """
        self.refresh_every = every

    def read_refreshes(self, trainer: pl.Trainer) -> bool:
        """Whether the logged count of reference refreshes grew since the last batch."""
        if self.refresh_key is None or self.refresh_key not in trainer.callback_metrics:
            return False
        count = int(float(trainer.callback_metrics[self.refresh_key]))
        grew, self.n_refreshes = count > self.n_refreshes, max(count, self.n_refreshes)
        return grew

    def read_kl(self, trainer: pl.Trainer, batch: Any) -> tuple[float, int]:
        """Return ``(kl, n_samples)`` of the global batch; ``n_samples == 0`` if none was fresh.

        A value the module did not log again in this batch (``callback_metrics`` still holds
        the tensor read after an earlier batch, or the one it held when the batch began, such
        as the last epoch's mean of a KL logged with ``on_epoch=True``) is stale: this rank
        contributes no samples, and the first one warns. Every rank takes part in the reduction
        whatever it read, so no rank is left waiting.
        """
        owner = type(self).__name__
        value = read_monitored(trainer, self.monitor, owner)
        # Each self.log call stores a new tensor and callback_metrics hands out detached views
        # of it, so a view of the storage read last time means nothing new was logged. Holding
        # on to that view keeps its storage alive: a new tensor cannot reuse the address.
        # The value held before the batch began (on_train_batch_start) is not this batch's
        # either: the previous epoch's mean of a KL logged with on_epoch=True, or a value a
        # validation run logged under the same key, replaces the last step value there.
        fresh = not any(
            isinstance(value, torch.Tensor)
            and isinstance(seen, torch.Tensor)
            and value.data_ptr() == seen.data_ptr()
            for seen in (self._last, self._before)
        )
        self._last, self._before = value, None
        n = batch_size_of(batch, self.batch_size_fn, owner) if fresh else 0
        local = float(value.item() if isinstance(value, torch.Tensor) else value)
        kl, n_global = global_mean(trainer, local, n)
        self._stale = n_global == 0 and not fresh  # nothing fresh anywhere: a stale batch
        if not fresh and n_global > 0 and not self._warned_stale:  # other ranks logged theirs
            self._warned_stale = True
            rank_zero_warn(
                f"{owner}: {self.monitor!r} was not logged in this training batch on this "
                "rank; its stale value in trainer.callback_metrics is ignored and the KL is "
                "that of the other ranks. Log the KL in every training batch.",
                category=RuntimeWarning,
            )
        return kl, n_global

    def earlier_sharing(
        self, trainer: pl.Trainer, kind: type[KLCallbackBase], attribute: str
    ) -> Any | None:
        """An earlier ``kind`` callback whose ``attribute`` (a log key) equals this one's.

        Lightning keeps only the last value logged under a key in a batch: two callbacks that
        log under one key would leave one of them out of every log without a word.
        """
        mine = getattr(self, attribute)
        for callback in trainer.callbacks:
            if callback is self:
                return None
            if isinstance(callback, kind) and getattr(callback, attribute) == mine:
                return callback
        return None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.sanity_checking:
            self._before = trainer.callback_metrics.get(self.monitor)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.sanity_checking:
            return
        kl, n_samples = self.read_kl(trainer, batch)
        self.n_batches += 1
        self.n_samples += n_samples
        if self.read_refreshes(trainer):
            self.on_refresh(trainer, pl_module)
        if math.isfinite(kl) and n_samples > 0:
            self.on_kl(trainer, pl_module, kl, n_samples)
            if not self.unit_checked:
                self.unit_checked = True
                self._check_unit(trainer)
        else:
            self.n_skipped += 1
            self._warn_skip(kl, n_samples)
        self.after_batch(trainer, pl_module)

    def _warn_skip(self, kl: float, n_samples: int) -> None:
        """Warn at the first stale batch and at the first unusable KL, each saying which."""
        owner = type(self).__name__
        if getattr(self, "_stale", False):
            if self._warned_stale:
                return
            self._warned_stale = True
            rank_zero_warn(
                f"{owner}: {self.monitor!r} was not logged in this training batch (batch "
                f"{self.n_batches}): the value in trainer.callback_metrics is stale, from an "
                f"earlier batch; {self.skip_effect()}. Log the KL in every training batch. "
                "Further skipped batches are counted in `n_skipped` without a warning.",
                category=RuntimeWarning,
            )
            return
        if self._warned_nonfinite:
            return
        self._warned_nonfinite = True
        why = (
            f"no finite KL for batch {self.n_batches} ({kl})"
            if n_samples > 0
            else f"no samples in batch {self.n_batches} (the batch size is 0 on every rank: "
            "`batch_size_fn` or the batch's leading size), so no KL to weigh"
        )
        rank_zero_warn(
            f"{owner}: {why}; {self.skip_effect()}. "
            "Further skipped batches are counted in `n_skipped` without a warning.",
            category=RuntimeWarning,
        )

    def _check_unit(self, trainer: pl.Trainer) -> None:
        """Check the target's unit, unless an earlier KL callback has the same unit and target.

        Of the KL callbacks in ``trainer.callbacks`` with this unit and target only the first
        checks, so one mistaken target warns once however many callbacks share it.
        """
        if self.target is None:
            return
        for callback in trainer.callbacks:
            if (
                isinstance(callback, KLCallbackBase)
                and callback.unit == self.unit
                and callback.target == self.target
            ):
                if callback is not self:
                    return
                break
        check_target_unit(trainer.callback_metrics, self.target, self.unit, type(self).__name__)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_batches": self.n_batches,
            "n_samples": self.n_samples,
            "n_skipped": self.n_skipped,
            "unit_checked": self.unit_checked,
            "n_refreshes": self.n_refreshes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_batches = state_dict.get("n_batches", 0)
        self.n_samples = state_dict.get("n_samples", 0)
        self.n_skipped = state_dict.get("n_skipped", 0)
        self.unit_checked = state_dict.get("unit_checked", self.n_batches > 0)
        self.n_refreshes = state_dict.get("n_refreshes", 0)
