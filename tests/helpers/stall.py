"""A rank that stops coming to the collectives: the peer a hung run waits for."""

from __future__ import annotations

import time

from lightning.pytorch import Callback


class StallRank(Callback):
    """Rank ``rank`` sleeps ``seconds`` before training batch ``batch`` (the others go on)."""

    def __init__(self, rank: int = 1, batch: int = 1, seconds: float = 600.0) -> None:
        self.rank, self.batch, self.seconds = rank, batch, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            time.sleep(self.seconds)
