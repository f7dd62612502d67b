"""Resuming exactly: a training DataLoader that resumes mid-epoch, and a checkpoint file check.

Lightning restarts a plain DataLoader from the first batch of the epoch when a run resumes
from a checkpoint saved mid-epoch, so the resumed run would see the epoch's first batches
twice and never its last ones. These pieces make the order of prompts a pure function of
(seed, epoch, position), so a resumed run draws exactly the batches the uninterrupted run
would have drawn:

* :class:`EpochShuffleSampler` shuffles with a generator seeded from ``(seed, epoch)``
  (Lightning calls ``set_epoch`` before every epoch), so the permutation of any epoch can be
  rebuilt without replaying the earlier ones;
* under DDP, :class:`RankShardSampler` deals that order round-robin to the ranks, so the
  global batch ``k`` of a run with ``W`` processes of batch ``b`` holds exactly the prompts of
  batch ``k`` of a one-process run with batch ``W * b`` (no second shuffle on top);
* :class:`ResumableDataLoader` counts the batches it has handed out in the current epoch and
  saves that count through ``state_dict``; Lightning stores it in the checkpoint and, on
  resume, calls ``load_state_dict``, after which the first iteration of the same epoch skips
  the batches already trained on.

:func:`check_checkpoint` tells a truncated, corrupt or foreign checkpoint file apart before
Lightning tries to restore it (``RLKLCLI`` calls it for ``--ckpt_path``).
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler


class EpochShuffleSampler(Sampler[int]):
    """A random permutation of ``range(n)`` that depends only on ``seed`` and the epoch.

    Args:
        n: Number of samples.
        seed: Base seed; epoch ``e`` uses ``seed * 1_000_003 + e``.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = int(n)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (Lightning calls this before every epoch)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        """Indices of the current epoch's permutation."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        """Number of samples."""
        return self.n


class RankShardSampler(DistributedSampler):
    """This rank's share of an epoch order: positions ``rank, rank + W, rank + 2W, ...``.

    The order is :class:`EpochShuffleSampler`'s permutation for ``(seed, epoch)`` when
    ``shuffle`` is set, else ``0 .. n-1``. As with ``DistributedSampler(drop_last=False)`` the
    order is padded with its first entries to a multiple of the world size ``W``, so every rank
    gets the same number of samples. Lightning leaves a ``DistributedSampler`` in place (it
    does not wrap and reshuffle it) and calls ``set_epoch`` on it before every epoch.

    Args:
        n: Number of samples.
        num_replicas: World size ``W``.
        rank: This process's global rank.
        seed: Seed of the shuffle (as in :class:`EpochShuffleSampler`).
        shuffle: Shuffle every epoch (``False``: file order).
    """

    def __init__(self, n: int, num_replicas: int, rank: int, seed: int = 0, shuffle: bool = True):
        super().__init__(
            range(int(n)), num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False
        )
        self.n = int(n)
        self.order_seed = int(seed)
        self.order_shuffle = bool(shuffle)

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of the current epoch's order."""
        if self.order_shuffle:
            inner = EpochShuffleSampler(self.n, self.order_seed)
            inner.set_epoch(self.epoch)
            order = list(inner)
        else:
            order = list(range(self.n))
        total = self.num_replicas * math.ceil(self.n / self.num_replicas) if self.n else 0
        while len(order) < total:
            order += order[: total - len(order)]
        return iter(order[self.rank : total : self.num_replicas])


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position inside the epoch is saved in checkpoints.

    Takes the arguments of :class:`torch.utils.data.DataLoader`. Lightning recognises the
    ``state_dict``/``load_state_dict`` pair, saves the state with every checkpoint and
    restores it before the resumed epoch starts. Use it with a sampler whose order depends
    only on the epoch (:class:`EpochShuffleSampler`, a ``SequentialSampler``, or the
    ``DistributedSampler`` Lightning puts in under DDP), or the skipped batches are not the
    ones already seen.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch: int | None = None
        self._yielded = 0
        self._resume: dict[str, int] | None = None

    def _sampler_epoch(self) -> int:
        sampler = self.batch_sampler.sampler if self.batch_sampler is not None else self.sampler
        return int(getattr(sampler, "epoch", getattr(self.sampler, "epoch", 0)))

    def __iter__(self) -> Iterator[Any]:
        """Iterate the current epoch, skipping the batches a loaded checkpoint had consumed.

        Lazy: the epoch is read when the first batch is requested, because Lightning creates
        the iterator of a resumed epoch before it calls ``set_epoch``.
        """
        epoch = self._sampler_epoch()
        skip = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            skip = min(self._resume["batches"], len(self))
        self._resume = None
        self._epoch = epoch
        self._yielded = skip
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator)
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch being iterated and the number of its batches handed out so far."""
        epoch = self._epoch if self._epoch is not None else self._sampler_epoch()
        return {"epoch": epoch, "batches": self._yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next iteration of the saved epoch start after the batches already seen."""
        self._resume = {
            "epoch": int(state_dict.get("epoch", 0)),
            "batches": int(state_dict.get("batches", 0)),
        }


def check_checkpoint(path: str | os.PathLike, option: str = "ckpt_path") -> None:
    """Raise a clear error if ``path`` is not a readable Lightning checkpoint.

    The file is opened the way Lightning will open it (``torch.load`` on the CPU, memory-mapped
    when it is a zip archive, so large checkpoints are not read twice) and must hold a dict
    with ``state_dict`` and ``pytorch-lightning_version``. Whether its weights fit the model is
    checked later, when the model restores them (``PPOModule.on_load_checkpoint``).

    Args:
        path: The checkpoint file.
        option: Name of the option that gave ``path``, for the message.

    Raises:
        ValueError: If the file is missing, empty, truncated, not a torch file or not a
            Lightning checkpoint; the message lists the other checkpoints in its directory.
    """
    file = Path(path).expanduser()

    def fail(problem: str) -> ValueError:
        others = sorted(p.name for p in file.parent.glob("*.ckpt") if p.name != file.name)
        hint = (
            f"resume from another checkpoint in {str(file.parent)!r} ({', '.join(others)})"
            if others
            else "resume from another checkpoint"
        )
        return ValueError(
            f"`{option}` {str(file)!r} {problem}; allowed: a checkpoint file written by "
            f"Lightning (ModelCheckpoint, Trainer.save_checkpoint), 'last' or None. {hint}, or "
            f"start a new run without `{option}`"
        )

    if not file.is_file():
        raise fail("does not exist")
    if file.stat().st_size == 0:
        raise fail("is empty (the run may have been killed while writing it)")
    try:
        checkpoint = torch.load(
            file, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(file)
        )
    except Exception as err:  # torch raises many types for a damaged file
        raise fail(
            f"cannot be read: it is truncated or corrupt ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(checkpoint, dict):
        raise fail(f"holds a {type(checkpoint).__name__}, not a Lightning checkpoint (a dict)")
    missing = [k for k in ("state_dict", "pytorch-lightning_version") if k not in checkpoint]
    if missing:
        raise fail(f"is not a Lightning checkpoint (no {missing})")
