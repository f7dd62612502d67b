"""Driving KL callbacks without PPO: a quiet one-epoch fit, and a trainer with fake ranks."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch

from helpers.trainers import cpu_trainer


def fit(module, callbacks, ckpt_path=None, **settings):
    """``trainer.fit`` on the CPU for one epoch, quiet but for the callbacks' own warnings."""
    trainer = cpu_trainer(callbacks, **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


class FakeStrategy:
    """Sums this rank's tensor with fixed contributions of the other ranks."""

    root_device = torch.device("cpu")

    def __init__(self, others):
        self.others = others
        self.calls = []

    def reduce(self, tensor, reduce_op="mean"):
        self.calls.append(reduce_op)
        others = torch.tensor(
            [[kl * n if n else 0.0, n] for kl, n in self.others], dtype=tensor.dtype
        )
        return tensor + others.sum(0)


def fake_trainer(others, metrics=None):
    return SimpleNamespace(
        world_size=1 + len(others),
        strategy=FakeStrategy(others),
        callback_metrics=metrics or {},
        sanity_checking=False,
        callbacks=[],
    )
