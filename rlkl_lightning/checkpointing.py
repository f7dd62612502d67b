"""Checkpoint files that survive a kill, and the run a ``--ckpt_path last`` resumes.

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

**The run to resume.** With a ``TensorBoardLogger`` or ``CSVLogger`` and no fixed ``version``,
every start opens a new ``<save_dir>/<name>/version_N`` directory, and Lightning looks for
``last.ckpt`` only in the new, empty one. :func:`newest_last_checkpoint` finds the newest
``last*.ckpt`` among the ``version_*/checkpoints`` directories of one ``<save_dir>/<name>``;
``RLKLCLI`` resumes that run in its own version directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


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


def newest_last_checkpoint(runs_root: str | os.PathLike) -> Path | None:
    """The newest ``last*.ckpt`` of the runs in ``runs_root`` (``<save_dir>/<name>``), or None.

    Looks in ``runs_root/version_*/checkpoints``, where ``ModelCheckpoint`` writes when it is
    given no ``dirpath``; "newest" is the latest modification time, as Lightning picks among
    the ``last`` files of one directory.
    """
    found = [  # ModelCheckpoint's "last" files: last.ckpt, last-v1.ckpt, ...
        path for path in Path(runs_root).glob("version_*/checkpoints/last*.ckpt") if path.is_file()
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
