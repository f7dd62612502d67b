"""A run's end and its extension: ``last.ckpt`` is the run's last batch, and extending trains.

:class:`SaveLastAtEnd` writes ``last.ckpt`` after the run's final batch, where the periodic
checkpoints would have left it up to ``every_n_train_steps`` behind; it writes it as a periodic
checkpoint would (at the end of the batch, and again after the validation that follows that
batch, as ``ModelCheckpoint`` rewrites its own ``last``), so a run extended from it continues
exactly: a resume from a checkpoint of the batch's end skips that batch's validation, and
what the validation moved (a capability budget's target) would be lost.

:class:`ExtendFinishedEpoch` makes a run bounded by ``trainer.max_steps`` resume a checkpoint
written after its epoch ended (Lightning's own ``last.ckpt`` at the end of a run that saved
nothing before) as Lightning resumes it without ``max_steps``: with the next epoch. Lightning
2.6 takes every resume under ``max_steps`` as one inside an epoch (``_FitLoop.restarting``), so
the finished epoch's batches counted as the new epoch's and ``--trainer.max_epochs=2 --ckpt_path
last`` after a run of 1 epoch ended at once, having trained nothing.
A resume whose checkpoint already reached ``max_steps`` or ``max_epochs`` trains nothing, and
Lightning says so in one line ("`Trainer.fit` stopped: `max_steps=64` reached.").
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.loop import _Loop
from typing_extensions import override


def _final_batch(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether the batch that just ended is the run's last (``max_steps`` or ``max_epochs``)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        if trainer.global_step >= trainer.max_steps:
            return True
    epochs = trainer.max_epochs
    batches = trainer.num_training_batches
    if epochs is None or epochs < 0 or not math.isfinite(batches):
        return False
    return trainer.current_epoch + 1 >= epochs and batch_idx + 1 >= batches


class SaveLastAtEnd(Callback):
    """After the run's final batch, every ``ModelCheckpoint`` with ``save_last`` writes ``last``.

    Runs after the ``ModelCheckpoint`` callbacks (the CLI puts it last): one that saved at this
    step already is left alone. If a validation follows the final batch, ``last`` is written
    again after it: Lightning resumes a checkpoint written at a batch's end after that batch's
    validation, which would never run. The file is what the callback writes as its ``last``
    (name, versioning, the previous one removed), through its own (private)
    ``_save_last_checkpoint``; ``tests/system/test_resume.py`` fails if Lightning changes it.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[ModelCheckpoint, int]] = []  # (callback, global step) to redo

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._saved = []
        if not _final_batch(trainer, batch_idx):
            return
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.save_last:
                continue
            saved_at = getattr(callback, "_last_global_step_saved", None)
            if saved_at == trainer.global_step:
                continue  # its own save; it rewrites `last` after a validation itself
            callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
            # Not a save of its own schedule: a save the callback makes later at this step
            # (its top-k at the validation that ends an epoch) still happens.
            callback._last_global_step_saved = saved_at
            self._saved.append((callback, trainer.global_step))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        saved, self._saved = self._saved, []
        for callback, step in saved:
            if step == trainer.global_step and callback.last_model_path:
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class ExtendFinishedEpoch(Callback):
    """A resume under ``max_steps`` from a finished epoch starts the next epoch (see module).

    Whether the checkpoint's epoch finished is read from the checkpoint as loaded (as
    Lightning's ``_FitLoop.restarting`` reads it), before the fit loop's own restart logic
    moves its counters.
    """

    def __init__(self) -> None:
        self._finished_epoch = False

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
        current = progress.get("current", {})
        values = [current.get(key) for key in ("ready", "started", "processed")]
        self._finished_epoch = values[0] is not None and len(set(values)) == 1 and values[0] > 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.fit_loop
        finished, self._finished_epoch = self._finished_epoch, False
        if finished and loop.restarting and trainer.max_steps not in (None, -1):
            # Lightning's rule without max_steps: "if the last epoch completely finished, we are
            # not actually restarting" (_FitLoop.restarting); its setter adds `or max_steps`.
            _Loop.restarting.fset(loop, False)
