"""What a ``train.py`` run prints: a bar over the run's batches, no notes that do not apply.

Each filter in :func:`quiet_lightning_notes` matches one message and says why it is harmless
here; everything else Lightning, torch or rlkl_lightning warns about is still shown.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from typing_extensions import override


class _DropTips(logging.Filter):
    """Drop Lightning's "💡 Tip" lines, which advertise its cloud products."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_lightning_notes() -> None:
    """Hide the stock messages a default RL run triggers although nothing is wrong."""
    # RL modules keep the frozen reference in eval mode on purpose, and the policy as Hugging
    # Face loads it (eval mode) with every dropout probability set to 0 (load_causal_lm): train
    # and eval mode compute the same numbers, so "may lead to unexpected behavior" does not apply.
    warnings.filterwarnings(
        "ignore",
        message=r"Found \d+ module\(s\) in eval mode at the start of training",
        category=PossibleUserWarning,
    )
    # A batch's optimizer steps all happen inside training_step (manual optimization), and a
    # checkpoint after the batch is exactly what a resumed run must continue from: the state
    # AFTER the updates is the one wanted, not a pre-optimization copy.
    warnings.filterwarnings(
        "ignore",
        message="Using ModelCheckpoint with manual optimization and every_n_train_steps",
        category=UserWarning,
    )
    # RLOOModule repeats each prompt in its own `on_before_batch_transfer` (a batch not in
    # groups stops the run with a clear error): the module's hook being the one used, with a
    # datamodule that has none, is the design. Lightning's note when BOTH define it stays.
    warnings.filterwarnings(
        "ignore",
        message=r"You have overridden `on_before_batch_transfer` in `LightningModule` but have "
        r"passed in a `LightningDataModule`",
        category=UserWarning,
    )
    # torch 2.13 deprecates `LeafSpec`, which Lightning 2.6's own `_pytree` helper still uses:
    # nothing a user can change, and it works unchanged.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    # vLLM's tensor-parallel groups (`tensor_parallel_size` > 1) gather with
    # `torch.distributed.all_gather_into_tensor`, which torch 2.13 deprecates: inside vLLM,
    # nothing a user can change, and it works unchanged.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch.distributed.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
    )
    drop_lightning_tips()
    warnings_on_rank_zero_only()


def warnings_on_rank_zero_only() -> None:
    """Show Python warnings in the process of global rank 0 only: each once per run, not per rank.

    Every rank runs the same code and meets the same warnings; rank 0's copy is the one shown.
    The rank is read when a warning is shown (Lightning sets it once the processes know
    theirs), so a one-process run shows everything.
    """
    if getattr(warnings.showwarning, "rank_zero_only", False):
        return
    show = warnings.showwarning

    def shown(*args: Any, **kwargs: Any) -> None:
        if getattr(rank_zero_only, "rank", 0) == 0:
            show(*args, **kwargs)

    shown.rank_zero_only = True  # type: ignore[attr-defined]
    warnings.showwarning = shown


def drop_lightning_tips() -> None:
    """Drop Lightning's "💡 Tip" info lines (they advertise its cloud products), for good."""
    # Lightning's info lines come from the logger of its `rank_zero` helpers (pytorch's or
    # fabric's, whichever was imported last).
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())


def quiet_resume_notes() -> None:
    """Hide what a resumed run triggers by design: it writes into its own, non-empty directory."""
    # A resumed run continues in the version directory of the run it resumes, which holds that
    # run's checkpoints: "exists and is not empty" is the expected state, not a name clash.
    warnings.filterwarnings(
        "ignore", message=r"Checkpoint directory .* exists and is not empty", category=UserWarning
    )


class RunProgressBar(RichProgressBar):
    """Lightning's rich progress bar; a run bounded by ``max_steps`` shows the run's batches.

    A run with ``max_epochs: -1`` ends after ``max_steps`` optimizer steps, and Lightning's
    bar then reads "Epoch 3/-2" and counts the batches of the epoch. This bar reads "Training"
    and counts the batches of the whole run (also across a resume): ``global_step // s`` of
    ``ceil(max_steps / s)``, where ``s`` is the number of optimizer steps of a batch (PPO takes
    ``ppo_epochs x num_minibatches``), measured on the first batch that steps. Until then the
    total shows as ``--``. A run bounded by epochs keeps Lightning's bar. Takes the arguments of
    ``RichProgressBar``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._steps_per_batch: int | None = None
        self._step_before = 0

    def _by_steps(self) -> bool:
        trainer = self.trainer
        return trainer.max_epochs == -1 and (trainer.max_steps or -1) > 0

    @property
    @override
    def total_train_batches(self) -> int | float:
        if not self._by_steps():
            return super().total_train_batches
        if self._steps_per_batch is None:
            return math.inf
        return math.ceil(self.trainer.max_steps / self._steps_per_batch)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not self._by_steps():
            return super()._get_train_description(current_epoch)
        return f"{'Training':{len(self.validation_description)}}"

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger version, printed as "0.000"
        return items

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._by_steps() and self.train_progress_bar_id is not None:
            return  # one bar for the whole run: not reset at epoch boundaries
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._by_steps():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        stepped = trainer.global_step - self._step_before
        if self._steps_per_batch is None and stepped > 0:
            self._steps_per_batch = stepped
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # a run resumed in the middle of an epoch
        if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
            done = trainer.global_step // self._steps_per_batch if self._steps_per_batch else 0
            self.progress.update(
                self.train_progress_bar_id, total=self.total_train_batches, completed=done
            )
        self._update_metrics(trainer, pl_module)
        self.refresh()
