"""Places for a test to kill a ``train.py`` process at: named in its config, on ``PYTHONPATH``.

Each helper stalls the process once, at a known point, after writing a marker file; the test
waits for the marker and sends ``SIGKILL``. With the marker present (the resumed run, started
with the same command) the helper does nothing, so the kill and the resume use one config.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch

from rlkl_lightning.checkpoints import AtomicCheckpointIO
from rlkl_lightning.rewards import RewardModel

STALL_S = 600.0  # the test kills the process long before this


class StallBeforeBatch(pl.Callback):
    """Stall when batch ``at`` (1-based count of trained batches + 1) is about to start.

    The TensorBoard events logged so far are flushed first, so the killed run leaves on disk
    what it logged after its last checkpoint. Under DDP every rank stalls; rank 0 writes the
    marker.
    """

    def __init__(self, marker: str, at: int | None = None) -> None:
        self.marker, self.at = Path(marker), at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.at is None or pl_module.batches_seen + 1 != self.at or self.marker.exists():
            return
        for logger in trainer.loggers:
            getattr(logger.experiment, "flush", lambda: None)()
        trainer.strategy.barrier()  # every rank has flushed and stopped here
        if trainer.is_global_zero:
            self.marker.write_text(str(pl_module.batches_seen))
        time.sleep(STALL_S)


class StallInsideWrite(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` that stalls half-way through the ``nth`` write of file ``name``.

    The first half of the checkpoint's bytes is in the partial file (flushed to the OS) when
    the marker appears.
    """

    def __init__(self, marker: str, name: str = "last.ckpt", nth: int = 2) -> None:
        super().__init__()
        self.marker, self.name, self.nth = Path(marker), name, nth
        self.count = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        """Count the writes of ``name``; stall inside the ``nth`` one."""
        if Path(path).name == self.name:
            self.count += 1
        if self.count != self.nth or Path(path).name != self.name or self.marker.exists():
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        real_save = torch.save

        def half_then_stall(obj, file, *args, **kwargs):
            real_save(obj, file, *args, **kwargs)
            size = file.tell()
            file.seek(size // 2)
            file.truncate()
            file.flush()
            self.marker.write_text(str(size))
            time.sleep(STALL_S)

        with mock.patch("torch.save", half_then_stall):
            super().save_checkpoint(checkpoint, path, storage_options)


class StallAfterWrite(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` that stalls right after the ``nth`` write of file ``name``.

    The file is complete and renamed in place when the marker appears; nothing is flushed
    here, so what the run logged reaches the disk only if the run flushed it before the write.
    """

    def __init__(self, marker: str, name: str = "last.ckpt", nth: int = 1) -> None:
        super().__init__()
        self.marker, self.name, self.nth = Path(marker), name, nth
        self.count = 0

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        """Write; after the ``nth`` write of ``name``, write the marker and stall."""
        super().save_checkpoint(checkpoint, path, storage_options)
        if Path(path).name != self.name or self.marker.exists():
            return
        self.count += 1
        if self.count == self.nth:
            self.marker.write_text(str(checkpoint["rlkl_counters"]["batches_seen"]))
            time.sleep(STALL_S)


class UnreachableReward(RewardModel):
    """The fraction of ``good`` words in a response; its ``at``-th call raises ConnectionError.

    It fails as a remote reward server that refuses connections, once: the failure writes the
    marker, and with the marker present (the resumed run) every call answers. Every call adds
    a line to ``reward_calls`` beside the marker.
    """

    def __init__(self, marker: str, at: int = 0) -> None:
        self.marker, self.at, self.calls = Path(marker), at, 0

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Scores, or ``ConnectionError`` at call ``at`` (1-based) when no marker exists."""
        self.calls += 1
        with open(self.marker.with_name("reward_calls"), "a") as calls:
            calls.write(f"{len(prompts)}\n")
        if self.calls == self.at and not self.marker.exists():
            self.marker.write_text(str(self.calls))
            raise ConnectionError("[Errno 111] Connection refused: reward server at :8000")
        return torch.tensor(
            [sum(w == "good" for w in r.split()) / max(len(r.split()), 1) for r in responses]
        )


class RankFailingReward:
    """The fraction of ``good`` words; all but the first reward of rank 1 fail (``nan``).

    It marks failures (``marks_failures``), as ``RemoteReward`` does: the pipeline masks them.
    """

    marks_failures = True

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """Scores on rank 0; on rank 1 the first sample's, ``nan`` for the others."""
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        words = [r.split() for r in responses]
        scores = [sum(w == "good" for w in ws) / max(len(ws), 1) for ws in words]
        if rank == 1:
            scores = scores[:1] + [float("nan")] * (len(scores) - 1)
        return torch.tensor(scores)
