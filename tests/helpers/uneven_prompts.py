"""A data module that gives each DDP rank batches of its own size (a user's own data module).

Rank ``r`` takes its own slice of the prompts in file order, in batches of ``per_rank[r]``:
the shipped ``PromptDataModule`` gives every rank the same count, a user's sampler need not.
Run it with ``trainer.use_distributed_sampler: false`` so Lightning keeps the slices.
Used by ``tests/system/test_ddp_ppo.py`` through ``train.py`` (``class_path``).
"""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader


class UnevenPrompts(pl.LightningDataModule):
    """Rank ``r`` gets ``per_rank[r]`` prompts per batch, from its own slice of the file."""

    def __init__(self, prompts: str, per_rank: list[int], batches: int) -> None:
        super().__init__()
        self.prompts = prompts
        self.per_rank = per_rank
        self.batches = batches

    def train_dataloader(self) -> DataLoader:
        """This rank's ``batches`` batches of ``{"prompt": list[str]}``."""
        with open(self.prompts) as handle:
            lines = [line.strip() for line in handle if line.strip()]
        rank = self.trainer.global_rank
        start = self.batches * sum(self.per_rank[:rank])
        mine = lines[start : start + self.batches * self.per_rank[rank]]
        return DataLoader(
            mine, batch_size=self.per_rank[rank], collate_fn=lambda xs: {"prompt": list(xs)}
        )
