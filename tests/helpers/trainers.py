"""Quiet one-epoch CPU trainers for the tests."""

from __future__ import annotations


def cpu_trainer(callbacks=(), **settings):
    """A quiet Trainer for one epoch on the CPU.

    No logger, progress bar, model summary or validation, and no checkpoints but those of a
    ``ModelCheckpoint`` among ``callbacks``; ``settings`` (``max_steps``, ``precision``,
    ``logger``, ...) replace these defaults.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    defaults = dict(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return Trainer(callbacks=list(callbacks), **{**defaults, **settings})


def fit_on_prompts(module, prompts, batch_size=8, callbacks=(), ckpt_path=None, **settings):
    """Train ``module`` over ``prompts`` with ``cpu_trainer(callbacks, **settings)``.

    ``prompts`` is a list of prompts (in batches of ``batch_size``) or a data module.
    """
    from torch.utils.data import DataLoader

    if isinstance(prompts, list):
        prompts = DataLoader(prompts, batch_size=batch_size, collate_fn=lambda xs: {"prompt": xs})
    trainer = cpu_trainer(callbacks, **settings)
    trainer.fit(module, prompts, ckpt_path=ckpt_path)
    return trainer
