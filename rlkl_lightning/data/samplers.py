"""Data order as a function of (seed, epoch, position), so a resumed run draws the same batches.

Lightning restarts a plain DataLoader at the epoch's first batch when a run resumes mid-epoch.
These pieces make the order of prompts a pure function of (seed, epoch, position):

* :class:`EpochShuffleSampler` shuffles with a generator seeded from ``(seed, epoch)``
  (Lightning calls ``set_epoch`` before every epoch), so the permutation of any epoch can be
  rebuilt without replaying the earlier ones;
* under DDP, :class:`RankShardSampler` deals that order round-robin to the ranks, so the
  global batch ``k`` of a run with ``W`` processes of batch ``b`` holds exactly the prompts of
  batch ``k`` of a one-process run with batch ``W * b`` (no second shuffle on top);
* :class:`ResumableDataLoader` counts the batches it has handed out in the current epoch and
  saves that count, and the prompts of the epoch's order they took (batches x batch size x
  processes), through ``state_dict``; Lightning stores it in the checkpoint and, on resume,
  calls ``load_state_dict``, after which the first iteration of the same epoch skips the
  prompts already trained on. A run resumed with another global batch (another number of
  processes) goes on at the same prompt of the order where that prompt starts one of its
  batches, and refuses otherwise (:func:`align_epoch_progress` moves Lightning's count of the
  epoch's batches to match).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler, SequentialSampler

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


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


class EpochSequentialSampler(SequentialSampler):
    """``0 .. n-1`` in every epoch, with the ``set_epoch`` Lightning calls before each one.

    The order never changes; the epoch is recorded so that :class:`ResumableDataLoader` can
    tell the epoch a checkpoint stopped in from the next one (a plain ``SequentialSampler``
    has no epoch: a finished epoch would look unfinished and the next one be skipped).
    """

    def __init__(self, data_source: Any) -> None:
        super().__init__(data_source)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (the order does not depend on it)."""
        self.epoch = int(epoch)


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position inside the epoch is saved in checkpoints.

    Takes the arguments of :class:`torch.utils.data.DataLoader`. Lightning recognises the
    ``state_dict``/``load_state_dict`` pair, saves the state with every checkpoint and
    restores it before the resumed epoch starts. Use it with a sampler whose order depends
    only on the epoch and that records it in ``epoch`` (:class:`EpochShuffleSampler`,
    :class:`EpochSequentialSampler`, which replaces the default sequential order, or the
    ``DistributedSampler`` Lightning puts in under DDP), or the skipped batches are not the
    ones already seen.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = inspect.signature(DataLoader.__init__).bind(self, *args, **kwargs).arguments
        given.pop("self")
        if (
            given.get("sampler") is None
            and given.get("batch_sampler") is None
            and not given.get("shuffle")
            and isinstance(given["dataset"], Sized)
        ):  # the default sequential order, with an epoch
            given["sampler"] = EpochSequentialSampler(given["dataset"])
        super().__init__(**given)
        self._epoch: int | None = None
        self._yielded = 0
        self._resume: dict[str, int] | None = None
        self.progress_shift = 0  # batches to add to Lightning's count of the resumed epoch

    def _sampler_epoch(self) -> int:
        sampler = self.batch_sampler.sampler if self.batch_sampler is not None else self.sampler
        return int(getattr(sampler, "epoch", getattr(self.sampler, "epoch", 0)))

    def _processes(self) -> int:
        """Processes the epoch's order is dealt to: the sampler's world size, else 1."""
        return int(self.sampler.num_replicas) if isinstance(self.sampler, DistributedSampler) else 1

    def _global_batch(self) -> int:
        """Prompts of the epoch's order that one batch of every process takes together."""
        return int(self.batch_size or 1) * self._processes()

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
        """The epoch, its batches so far, the prompts they took, and the order's ``size``.

        ``size`` (where the dataset has a length) lets a resume over other prompts say so.
        """
        epoch = self._epoch if self._epoch is not None else self._sampler_epoch()
        state = {
            "epoch": epoch,
            "batches": self._yielded,
            "prompts": self._yielded * self._global_batch(),
        }
        if isinstance(self.dataset, Sized):
            state["size"] = len(self.dataset)
        return state

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Make the next iteration of the saved epoch start after the prompts already seen.

        The place is the saved number of prompts of the epoch's order (a checkpoint without it:
        the saved batches of this run's global batch). A run whose global batch (``batch_size``
        x processes) differs from the saved run's starts at that prompt if it starts one of its
        own batches there, and records in ``progress_shift`` how many batches Lightning's count
        of the epoch must move (:func:`align_epoch_progress`).

        Raises:
            ValueError: If the saved place falls inside one of this run's batches: the rest of
                the epoch could not be dealt without repeating or skipping prompts.
        """
        epoch = int(state_dict.get("epoch", 0))
        batches = int(state_dict.get("batches", 0))
        size = self._global_batch()
        prompts = int(state_dict.get("prompts", batches * size))
        self.progress_shift = 0
        n = len(self.dataset) if isinstance(self.dataset, Sized) else math.inf
        if "size" in state_dict and int(state_dict["size"]) != n:  # a prompts file edited
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(
                f"resume: the checkpoint's run dealt an order of {int(state_dict['size'])} "
                f"prompts, this run has {n}: the prompts changed (a file edited in place?), so "
                "the prompts from here on are not those the checkpoint's run would have seen",
                category=RuntimeWarning,
            )
        if prompts >= n:  # the epoch was used up: nothing of it is left, whatever the batch
            batches = len(self)
        elif prompts != batches * size:
            if prompts % size:
                raise ValueError(
                    f"resume with another global batch: the checkpoint stopped {prompts} prompts "
                    f"into epoch {epoch} of the data order, inside a batch of this run's {size} "
                    f"prompts (data.batch_size {self.batch_size} x {self._processes()} "
                    "processes, --trainer.devices x --trainer.num_nodes), so the rest of the "
                    "epoch would repeat or skip prompts; resume with --trainer.devices and "
                    f"--trainer.num_nodes (and data.batch_size) whose global batch divides "
                    f"{prompts}, as the checkpoint's own does, or from a checkpoint written at "
                    "the end of an epoch"
                )
            self.progress_shift = prompts // size - batches
            batches = prompts // size
        self._resume = {"epoch": epoch, "batches": batches}


def align_epoch_progress(trainer: Trainer) -> None:
    """Make Lightning count the resumed epoch's batches in this run's global batch.

    Lightning restores its count of the epoch's batches from the checkpoint, in the batches of
    the run that wrote it, and ends the epoch when that count reaches the loader's length. A
    run resumed with another global batch (another number of processes) skips another number
    of batches (:meth:`ResumableDataLoader.load_state_dict`); without this, a run with more
    processes would end the epoch before its last prompts. Call it before the first resumed
    batch (``on_train_start``).
    """
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    for loader in combined.flattened if combined is not None else []:
        shift = getattr(loader, "progress_shift", 0)
        if isinstance(loader, ResumableDataLoader) and shift:
            current = trainer.fit_loop.epoch_loop.batch_progress.current
            current.ready += shift
            current.started += shift
            current.processed += shift
            current.completed += shift
            loader.progress_shift = 0
