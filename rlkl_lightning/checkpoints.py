"""Checkpoint files: atomic writes, checks before loading, plain values; the run to resume.

**Atomic writes.** Lightning's ``TorchCheckpointIO`` (2.6) serialises the checkpoint into
memory and writes it inside an fsspec transaction: for a local path, fsspec writes a temporary
file made by ``tempfile.mkstemp()`` in the system temporary directory and moves it over the
target with ``shutil.move``. That is a rename, atomic, only when the temporary directory and
the checkpoint directory are on one filesystem; with ``/tmp`` on tmpfs or on a node-local disk
``shutil.move`` copies the bytes into the target in place, and a kill during the copy leaves a
truncated ``last.ckpt`` where the previous good one was. Nothing is synced to disk either.
:class:`AtomicCheckpointIO` writes ``.<name>.partial`` next to the target, syncs it, renames it
over the target (``os.replace``, atomic on POSIX and Windows) and syncs the directory: at any
moment the target is either the previous complete checkpoint or the new complete one. A kill
leaves at most the partial file, which the next write of the same name reuses.

**When a checkpoint is written.** Lightning's ``ModelCheckpoint`` writes its step-triggered
files in ``on_train_batch_end``: before the batch's metrics reach the logger and before the
validation due at that batch, which a run resumed from the file never repeats, so a kill right
after the write lost them for good. :class:`AfterLoggingCheckpoint` decides at the same moment
and records there where the run is (a resume reads the file as Lightning reads its own), but
writes the file once the batch has been logged and validated, after flushing the loggers, with
the state the next batch starts from. ``RLKLCLI`` puts it in place of a plain
``ModelCheckpoint``.

**The run to resume.** With a ``TensorBoardLogger`` or ``CSVLogger`` and no fixed ``version``,
every start opens a new ``<save_dir>/<name>/version_N`` directory, and Lightning looks for
``last.ckpt`` only in the new, empty one. :func:`newest_last_checkpoint` finds the newest
``last*.ckpt`` among the ``version_*/checkpoints`` directories of one ``<save_dir>/<name>``;
``RLKLCLI`` resumes that run in its own version directory.

**Files from elsewhere.** :func:`check_checkpoint` tells a truncated, corrupt or foreign
checkpoint file apart before Lightning tries to restore it, and :func:`check_checkpoint_weights`
a checkpoint of another model. Checkpoints are opened with ``torch.load(weights_only=True)``,
which builds tensors and plain Python values and refuses any other object instead of running
the code its pickle names; :func:`plain` makes the hyperparameters plain values when a
checkpoint is saved, so everything stored loads that way.
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor
from typing_extensions import override


def partial_path(path: str | os.PathLike) -> Path:
    """The file a checkpoint is written to before it is renamed to ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.partial")


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local checkpoint files are replaced atomically.

    The checkpoint is written to ``.<name>.partial`` in the target's directory, synced, and
    renamed over the target, so a process killed at any moment leaves the previous checkpoint
    complete (module docstring). Remote paths (``s3://``, ...) go through Lightning's own
    writer. ``RLKLCLI`` installs it in place of Lightning's default; with a plain ``Trainer``
    pass ``Trainer(plugins=[AtomicCheckpointIO()])``.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Write ``checkpoint`` to ``path``: a partial file, synced, then renamed over ``path``.

        Raises:
            TypeError: If ``storage_options`` is given (as ``TorchCheckpointIO``).
        """
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(target)
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)


class AfterLoggingCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose files are written after the batch is logged and validated.

    Takes the arguments of ``ModelCheckpoint``. A checkpoint due at the end of a training batch
    (``every_n_train_steps``, ``train_time_interval``) is decided there, by Lightning's rules,
    and the place of the run is taken there: the loops' progress and the data loader's position
    say "after this batch", so a resume continues with the next batch and does not repeat the
    batch's logging or the validation due at it (Lightning's own reading of such a file). The
    file is written later, at the start of the next batch, at the end of the epoch or at the end
    of training, whichever comes first, after the loggers are flushed (``Logger.save``); the
    rest of its content (weights, optimizer, callbacks' states, the module's counters and
    random streams) is taken at the write. So the file holds the run as the next batch finds
    it, the validation's effects included, and once it is on disk everything the run logged up
    to then is on disk too: a kill at any moment loses nothing a resume does not redo. Files
    Lightning deletes (an older top-k checkpoint) are deleted after the write. A run that raises
    before the write leaves the previous checkpoint the last one. Lightning runs checkpoint
    callbacks last, so a callback whose ``on_train_batch_start`` changes its state has done so
    when the file is written at the next batch's start (no callback of this package does).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_deferral()

    def _init_deferral(self) -> None:
        self._taking = False  # inside on_train_batch_end: take the place, write later
        self._pending: list[tuple[str, dict[str, Any] | None]] = []
        self._pending_removals: list[str] = []

    @property
    @override
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key: checkpoints of either class resume with the other."""
        key = super().state_key
        return ModelCheckpoint.__qualname__ + key.removeprefix(type(self).__qualname__)

    @classmethod
    def replacing(cls, callback: ModelCheckpoint) -> AfterLoggingCheckpoint:
        """This class with the settings and the state of an existing ``ModelCheckpoint``."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(callback))
        new._init_deferral()
        return new

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Decide the checkpoints due at this batch (Lightning's rules); write them later."""
        self._taking = True
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._taking = False

    @override
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if not self._taking:
            self.write_pending(trainer)  # files in the order Lightning asked for them
            super()._save_checkpoint(trainer, filepath)
            return
        place = None
        if not self.save_weights_only:  # where the run is: after this batch
            connector = trainer._checkpoint_connector
            place = {
                "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
                "loops": connector._get_loops_state_dict(),
            }
        self._pending.append((filepath, place))
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath

    @override
    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        if self._pending:
            self._pending_removals.append(filepath)
        else:
            super()._remove_checkpoint(trainer, filepath)

    def write_pending(self, trainer) -> None:
        """Flush the loggers, then write the checkpoints decided and not yet written.

        Runs on every rank (the checkpoint's content is gathered from all of them).
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for logger in trainer.loggers:
            logger.save()  # TensorBoard: write its buffered events; CSV: its rows
        for filepath, place in pending:
            with trainer.profiler.profile("save_checkpoint"):
                checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
                checkpoint.update(place or {})
                trainer.strategy.save_checkpoint(checkpoint, filepath)
                trainer.strategy.barrier("Trainer.save_checkpoint")
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(self)
        removals, self._pending_removals = self._pending_removals, []
        for filepath in removals:
            super()._remove_checkpoint(trainer, filepath)

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Write what the last batch took, then Lightning's end-of-epoch saves."""
        self.write_pending(trainer)
        super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """Write what the previous batch took: it is logged and validated."""
        self.write_pending(trainer)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        """Write what the last batch took."""
        self.write_pending(trainer)
        super().on_train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Drop what was taken and not written: the previous checkpoint stays the last one."""
        self._pending, self._pending_removals = [], []
        super().on_exception(trainer, pl_module, exception)


def newest_last_checkpoint(runs_root: str | os.PathLike, version: str = "version_*") -> Path | None:
    """The newest ``last*.ckpt`` of the runs in ``runs_root`` (``<save_dir>/<name>``), or None.

    Looks in ``runs_root/version_*/checkpoints`` (or one ``version``'s), where
    ``ModelCheckpoint`` writes when it is given no ``dirpath``; "newest" is the latest
    modification time, as Lightning picks among the ``last`` files of one directory.
    """
    pattern = (
        f"{glob.escape(version) if version != 'version_*' else version}/checkpoints/last*.ckpt"
    )
    found = [  # ModelCheckpoint's "last" files: last.ckpt, last-v1.ckpt, ...
        path for path in Path(runs_root).glob(pattern) if path.is_file()
    ]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def first_resumed_step(checkpoint: dict[str, Any]) -> int | None:
    """The logger step at which a run resumed from ``checkpoint`` logs again (None: unknown).

    Lightning logs at the count of batches that took an optimizer step. A checkpoint written
    at the end of a batch holds that count before the batch is added (Lightning adds it back
    on restore: ``_TrainingEpochLoop.reset``), so the resumed run's first batch logs at the
    saved count + 1. Events a killed run logged from this step on are superseded.
    """
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    step = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
    return int(step) + 1 if step is not None else None


def check_checkpoint(
    path: str | os.PathLike, option: str = "ckpt_path", resuming: bool = True
) -> dict[str, Any]:
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
        resuming: Whether ``path`` is a run's ``--ckpt_path`` (the message offers ``last`` and
            a new run); False for a command that only reads it (``rlkl_lightning.export``).

    Returns:
        The checkpoint, as loaded (tensors memory-mapped from a zip archive).

    Raises:
        ValueError: If the file is missing, empty, truncated, not a torch file, holds objects
            that ``weights_only=True`` refuses, or is not a Lightning checkpoint; the message
            lists the other checkpoints in its directory.
    """
    file = Path(path).expanduser()

    def fail(problem: str) -> ValueError:
        folder = file if file.is_dir() else file.parent  # a directory: the checkpoints in it
        others = sorted(p.name for p in folder.glob("*.ckpt") if p.name != file.name)
        allowed = (
            "a checkpoint file written by Lightning (ModelCheckpoint, Trainer.save_checkpoint)"
        )
        if not resuming:  # a command that reads the file: no `last`, no new run
            listed = f"; the checkpoints in {str(folder)!r}: {', '.join(others)}" if others else ""
            return ValueError(f"`{option}` {str(file)!r} {problem}; allowed: {allowed}{listed}")
        hint = (
            f"resume from another checkpoint in {str(folder)!r} ({', '.join(others)})"
            if others
            else "resume from another checkpoint"
        )
        return ValueError(
            f"`{option}` {str(file)!r} {problem}; allowed: {allowed}, 'last' or None. {hint}, or "
            f"start a new run without `{option}`"
        )

    if file.is_dir():
        raise fail("is a directory, not a checkpoint file")
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
                "loads tensors and plain values and never runs code from the file "
                "(docs/checkpoints.md, 'Security')"
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
