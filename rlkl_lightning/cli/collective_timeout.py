"""A hung rank ends the run within ``--collective_timeout`` seconds, with a line naming the rank.

torch waits 30 minutes by default for a peer at a collective (an all-reduce, a barrier); a
rank that died or hangs left the others silent that long. :func:`apply_collective_timeout`
gives the process group of a run from ``train.py`` the run's timeout (unless the strategy was
given its own ``timeout``), and :func:`timeout_message` turns the backend's timeout error into
one line naming the rank that waited.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

#: Seconds a rank waits at a collective for its peers before the run stops (``train.py``).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
OPTION = "--collective_timeout"

# The strategy whose process group got the run's timeout: its rank names the message.
_RUN: dict[str, Any] = {"strategy": None, "seconds": None}


def check_collective_timeout(seconds: float) -> float:
    """``seconds`` if it is a positive finite number of seconds.

    Raises:
        ValueError: If it is not.
    """
    if not (isinstance(seconds, int | float) and 0 < float(seconds) < float("inf")):
        raise ValueError(
            f"`{OPTION.lstrip('-')}` must be a positive number of seconds, got {seconds!r}"
        )
    return float(seconds)


def apply_collective_timeout(strategy: Any, seconds: float) -> None:
    """Give ``strategy``'s process group a timeout of ``seconds``, before it is created.

    A strategy without a process group (one device) is left alone, and so is one given a
    ``timeout`` of its own (anything but torch's default).
    """
    seconds = check_collective_timeout(seconds)
    current = getattr(strategy, "_timeout", None)  # DDPStrategy, FSDPStrategy, ModelParallel
    if not isinstance(current, timedelta):
        return
    if current == default_pg_timeout:
        strategy._timeout = timedelta(seconds=seconds)
    _RUN.update(strategy=strategy, seconds=strategy._timeout.total_seconds())


def collective_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed's timeout (gloo's, the store's), not another one.

    gloo raises a plain ``RuntimeError`` quoting its source file; a timeout of the user's own
    code (a remote reward) must keep its own message.
    """
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    if "timed out" not in text and "timeout" not in text:
        return False
    distributed = getattr(dist, "DistError", ())
    return isinstance(error, distributed) or "gloo" in text or "c10d" in text


def timeout_message(error: BaseException) -> str | None:
    """One line for a collective that timed out in this run's process group, else None."""
    strategy, seconds = _RUN["strategy"], _RUN["seconds"]
    if strategy is None or not collective_timed_out(error):
        return None
    rank = getattr(strategy, "global_rank", None)
    world = getattr(strategy, "world_size", None)
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return (
        f"rank {rank} of {world} waited {seconds:g} s at a collective for a peer that never "
        f"came ({OPTION}): another rank stopped or hangs, its own output says where"
    )
