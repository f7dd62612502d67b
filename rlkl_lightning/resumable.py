"""Resuming exactly: data order, random streams, and checks of the checkpoint being resumed.

Lightning restarts a plain DataLoader at the epoch's first batch when a run resumes mid-epoch.
These pieces make the order of prompts a pure function of (seed, epoch, position), so a
resumed run draws exactly the batches the uninterrupted run would have drawn:

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
Lightning tries to restore it (``RLKLCLI`` calls it for ``--ckpt_path``), and
:func:`check_checkpoint_weights` a checkpoint of another model. :func:`rng_states` and
:func:`restore_rng_states` carry every rank's random stream across a resume.

Checkpoints are not trusted (README, "Security"): they are opened with
``torch.load(weights_only=True)``, which builds tensors and plain Python values and refuses any
other object instead of running the code its pickle names. Everything these modules store loads
that way: RNG states are tensors, counters and controller states plain numbers, and
:func:`plain` turns the hyperparameters into plain values when a checkpoint is saved.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
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


def check_checkpoint(path: str | os.PathLike, option: str = "ckpt_path") -> dict[str, Any]:
    """Raise a clear error if ``path`` is not a readable Lightning checkpoint.

    The file is opened the way ``RLKLCLI`` has Lightning open it (``torch.load`` on the CPU with
    ``weights_only=True``, memory-mapped when it is a zip archive, so large checkpoints are not
    read twice): a pickled object that is not a tensor or a plain value is refused, never
    built. It must hold a dict with ``state_dict`` and ``pytorch-lightning_version``. Whether
    its weights fit the model is checked later, when the model restores them
    (``PPOModule.on_load_checkpoint``).

    Args:
        path: The checkpoint file.
        option: Name of the option that gave ``path``, for the message.

    Returns:
        The checkpoint, as loaded (tensors memory-mapped from a zip archive).

    Raises:
        ValueError: If the file is missing, empty, truncated, not a torch file, holds objects
            that ``weights_only=True`` refuses, or is not a Lightning checkpoint; the message
            lists the other checkpoints in its directory.
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
            file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file)
        )
    except Exception as err:  # torch raises many types for a damaged file
        text = str(err)
        unsafe = re.search(r"GLOBAL ([\w.]+)", text)
        if isinstance(err, pickle.UnpicklingError) and unsafe:
            raise fail(
                f"holds a pickled object ({unsafe.group(1)}) that only running code could "
                "rebuild: checkpoints are opened with torch.load(weights_only=True), which "
                "loads tensors and plain values and never runs code from the file (README, "
                "'Security')"
            ) from err
        reason = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)  # not torch's advice
        raise fail(
            "cannot be read: it is truncated or corrupt "
            f"({type(err).__name__}: {reason.group(1) if reason else text})"
        ) from err
    if not isinstance(checkpoint, dict):
        raise fail(f"holds a {type(checkpoint).__name__}, not a Lightning checkpoint (a dict)")
    missing = [k for k in ("state_dict", "pytorch-lightning_version") if k not in checkpoint]
    if missing:
        raise fail(f"is not a Lightning checkpoint (no {missing})")
    return checkpoint


def plain(value: Any) -> Any:
    """``value`` as types ``torch.load(weights_only=True)`` opens: for hyperparameters.

    ``save_hyperparameters`` keeps the arguments as given; a ``pathlib.Path``, a numpy number,
    an enum or a dataclass (a ``WorldConfig``) would make the checkpoint unloadable with
    ``weights_only=True``. Paths become strings, numpy numbers and arrays Python numbers and
    lists, enums their value, dataclasses and mappings dicts, sets lists; tensors, dtypes and
    devices stay; any other object becomes its ``repr`` (hyperparameters in a checkpoint are a
    record: ``RLKLCLI`` builds nothing from them on resume).
    """
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, Tensor | torch.dtype | torch.device):
        return value
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return plain(value.tolist())
    for kind in (bool, int, float, str):  # subclasses, e.g. numpy.float64 is a float
        if isinstance(value, kind):
            return kind(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, tuple) and hasattr(value, "_asdict"):  # a NamedTuple
        return plain(value._asdict())
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        value = sorted(value, key=repr)
    if isinstance(value, list | tuple):
        items = [plain(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return repr(value)


def plain_hyperparameters(checkpoint: dict[str, Any]) -> None:
    """Make the module's and the datamodule's hyperparameters in ``checkpoint`` :func:`plain`."""
    for key in ("hyper_parameters", "datamodule_hyper_parameters"):
        if key in checkpoint:
            checkpoint[key] = plain(checkpoint[key])


def rng_states(trainer: Trainer | None, device: torch.device) -> dict[str, list[Tensor]]:
    """The torch RNG state of every rank, for a checkpoint: rollouts and minibatches draw from it.

    Under DDP every rank's state is gathered (all ranks save a checkpoint together, so this is
    a collective), and a resumed run continues each rank's own random stream.

    Args:
        trainer: The trainer (None outside a fit: this process only).
        device: The module's device; a CUDA device's generator is saved too.

    Returns:
        ``{"cpu": [state per rank], "cuda": [...]}``.
    """
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if trainer is None or trainer.world_size == 1:
        return {key: [value] for key, value in states.items()}
    strategy = trainer.strategy
    return {  # one tensor per rank, not views into the gathered one (restore_rng_states)
        key: [t.clone() for t in strategy.all_gather(value.to(strategy.root_device)).cpu()]
        for key, value in states.items()
    }


def restore_rng_states(
    states: dict[str, list[Tensor]] | None, trainer: Trainer, device: torch.device, owner: str
) -> None:
    """Put back this rank's saved RNG state, or give a fresh multi-process run per-rank streams.

    Called right before the first batch of a fit (``on_train_start``): Lightning draws random
    numbers between loading a checkpoint and that point (sanity-check validation, creating the
    dataloader iterators). Without saved states, a run of several processes offsets each rank's
    seed by its rank: ``seed_everything`` gives every process the same seed, and the ranks
    would draw the same random numbers for their rollouts.

    Args:
        states: What :func:`rng_states` saved, or None for a fresh run.
        trainer: The trainer (rank and world size).
        device: The module's device.
        owner: Name of the module, for the warning.
    """
    rank, world = trainer.global_rank, trainer.world_size
    if states and len(states["cpu"]) == world:
        # A copy: the saved states of a DDP run are views into one gathered tensor, and torch
        # 2.13's set_rng_state crashes (segmentation fault) on a view with a storage offset.
        torch.set_rng_state(states["cpu"][rank].clone())
        if "cuda" in states and device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"][rank].clone(), device)
        return
    if states:
        rank_zero_warn(
            f"{owner}: the checkpoint holds the RNG states of {len(states['cpu'])} processes "
            f"but this run has {world}; rollouts continue with fresh random numbers (training "
            "itself resumes correctly)",
            category=RuntimeWarning,
        )
    if world > 1:
        torch.manual_seed((torch.initial_seed() + 104_729 * rank) % 2**63)


def check_checkpoint_weights(
    saved: dict[str, Tensor], current: dict[str, Tensor], owner: str
) -> None:
    """Raise a clear error if a checkpoint's weights do not belong to this model.

    The frozen reference (keys ``reference.*``) is not saved in checkpoints and not compared.

    Args:
        saved: The checkpoint's ``state_dict``.
        current: The model's own ``state_dict()``.
        owner: Name of the module, for the message.

    Raises:
        ValueError: Naming the missing, unexpected and resized keys (five of each at most).
    """
    ours = {k: v for k, v in current.items() if not k.startswith("reference.")}
    theirs = {k: v for k, v in saved.items() if not k.startswith("reference.")}
    missing = sorted(ours.keys() - theirs.keys())
    unexpected = sorted(theirs.keys() - ours.keys())
    resized = sorted(
        k
        for k in ours.keys() & theirs.keys()
        if hasattr(theirs[k], "shape") and tuple(theirs[k].shape) != tuple(ours[k].shape)
    )
    problems = [("missing", missing), ("unexpected", unexpected), ("shape differs", resized)]
    details = "; ".join(
        f"{what}: {keys[:5]}{' ...' if len(keys) > 5 else ''}" for what, keys in problems if keys
    )
    if details:
        raise ValueError(
            f"{owner}: the checkpoint (`ckpt_path`) was not written for this model "
            f"(policy/value head differ: {details}); resume with the `model` settings it was "
            "trained with, or start a new run without `ckpt_path`"
        )


class ResumableModule(LightningModule):
    """Counters, beta and random streams of an RL module, carried through checkpoints.

    Checkpoints store the counters (``trainer.global_step`` counts optimizer steps, several per
    batch, so batches and samples are counted here), ``kl_coef``, the reference's held-out
    perplexity and every rank's RNG state, and leave out the frozen ``reference`` and every
    other frozen weight (the base weights under a LoRA policy): they are rebuilt from the
    config, and put back before Lightning's strict loading. For a module with ``owner``,
    ``reference``, ``kl_coef`` and ``reference_perplexity`` attributes.
    """

    #: The counters saved in checkpoints, each an int starting at 0.
    COUNTERS = ("batches_seen", "samples_seen", "skipped_batches", "skipped_in_a_row")

    def __init__(self) -> None:
        super().__init__()
        for name in self.COUNTERS:
            setattr(self, name, 0)

    def unsaved_keys(self) -> set[str]:
        """The ``state_dict`` keys checkpoints leave out: the reference and every frozen weight.

        FSDP and activation-checkpointing wrappers are left out of the names, as they are of
        the keys of the state dict Lightning saves.
        """
        wrappers = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
        frozen = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                for wrapper in wrappers:
                    name = name.replace(wrapper, "")
                frozen.add(name)
        return frozen

    def _saved(self, state: dict[str, Any]) -> dict[str, Any]:
        unsaved = self.unsaved_keys()
        return {
            k: v for k, v in state.items() if not k.startswith("reference.") and k not in unsaved
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store counters, beta, RNG states, plain hparams; drop the reference, frozen weights."""
        plain_hyperparameters(checkpoint)
        checkpoint["state_dict"] = self._saved(checkpoint["state_dict"])
        checkpoint["rlkl_counters"] = {
            **{name: getattr(self, name) for name in self.COUNTERS},
            "kl_coef": self.kl_coef,
            "reference_perplexity": self.reference_perplexity,
        }
        checkpoint["rlkl_rng"] = rng_states(self._trainer, self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the weights fit, restore counters and beta, put the reference weights back."""
        state = checkpoint["state_dict"]
        current, unsaved = self.state_dict(), self.unsaved_keys()
        # Frozen weights may be missing (they are rebuilt); all others must be there.
        expected = {k: v for k, v in current.items() if k not in unsaved or k in state}
        check_checkpoint_weights(state, expected, self.owner)  # before any restore
        counters = checkpoint.get("rlkl_counters", {})
        for name in self.COUNTERS:
            setattr(self, name, int(counters.get(name, 0)))
        self.kl_coef = float(counters.get("kl_coef", self.kl_coef))
        self.reference_perplexity = counters.get("reference_perplexity")
        self._rng_to_restore = checkpoint.get("rlkl_rng")
        for key, value in current.items():  # the frozen weights, as the config built them
            if key.startswith("reference.") or key in unsaved:
                state.setdefault(key, value)

    def on_train_start(self) -> None:
        """Put back a loaded checkpoint's RNG state, right before the first resumed batch."""
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        restore_rng_states(states, self.trainer, self.device, self.owner)
