"""Peak memory: of each phase of a training batch, and of the whole process so far.

A phase's peak needs the peak the system keeps to be reset when the phase starts: on CUDA
torch's peak statistics (``torch.cuda.reset_peak_memory_stats``), on Linux the process's peak
resident set (writing ``5`` to ``/proc/self/clear_refs``, which ``getrusage``'s ``ru_maxrss``
reads too). Every reading is folded into this module's own running peak before a reset, so
:func:`process_peak_bytes` still answers "the peak so far" for the whole process; code that
read ``torch.cuda.max_memory_*`` or ``ru_maxrss`` after a training run reads it instead. Where
the resident set's peak cannot be reset (not Linux), a CPU phase's value is the process's peak
so far at the phase's end.
"""

from __future__ import annotations

import re
import resource
import sys

import torch

#: The process's peaks seen so far, in bytes, by what they measure (``"rss"``, and
#: ``("allocated" | "reserved", cuda index)``).
_PEAKS: dict = {}
_HWM = re.compile(r"VmHWM:\s+(\d+) kB")


def _peak_rss_bytes() -> int:
    """The resident set's peak since the last reset (``VmHWM``), or ``ru_maxrss`` elsewhere."""
    try:
        with open("/proc/self/status") as status:
            found = _HWM.search(status.read())
    except OSError:
        found = None
    if found is not None:
        return int(found.group(1)) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak * (1 if sys.platform == "darwin" else 1024)


def _fold(key, value: int) -> int:
    _PEAKS[key] = max(_PEAKS.get(key, 0), value)
    return _PEAKS[key]


def _fold_readings(device: torch.device) -> None:
    """Fold what the system's peaks say now into this module's, before they are reset."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        _fold(("allocated", index), torch.cuda.max_memory_allocated(index))
        _fold(("reserved", index), torch.cuda.max_memory_reserved(index))
    _fold("rss", _peak_rss_bytes())
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # a thread's exit may have set it
    _fold("rss", ru * (1 if sys.platform == "darwin" else 1024))


def process_peak_bytes(device: torch.device, kind: str = "reserved") -> int:
    """This process's peak memory so far on ``device``, resets of :class:`PhasePeaks` included.

    On CUDA the peak of the memory torch reserved (``kind="reserved"``) or allocated
    (``"allocated"``) on the device; elsewhere the process's peak resident set.
    """
    device = torch.device(device)
    _fold_readings(device)
    if device.type != "cuda":
        return _PEAKS["rss"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _PEAKS[(kind, index)]


def _reset(device: torch.device) -> bool:
    """Reset the system's peak for ``device``; False where it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak resident set ("high water mark") := the current
    except OSError:
        return False
    return True


def _phase_reading(device: torch.device) -> int:
    """The peak since the last reset: torch's allocated memory on CUDA, else the resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _peak_rss_bytes()


class PhasePeaks:
    """The peak memory of each phase of one batch, in bytes: call :meth:`enter` at each start.

    On CUDA, the peak of the memory torch allocated on the device during the phase
    (``torch.cuda.max_memory_allocated``, reset when it starts); on a CPU, the process's peak
    resident set during the phase. Both count everything present during the phase (weights,
    optimizer state, an allocator's cache on a CPU), not its growth. A phase entered twice
    gets the larger peak of its parts.

    Args:
        device: The device whose memory is measured.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peaks: dict[str, int] = {}
        self.current: str | None = None
        self.resets = False

    def enter(self, phase: str) -> None:
        """End the current phase (if any) and start ``phase``: the peak is reset."""
        self.stop()
        _fold_readings(self.device)  # what happened since the last reset (between batches)
        self.resets = _reset(self.device)
        self.current = phase

    def stop(self) -> dict[str, int]:
        """End the current phase; returns every phase's peak so far, in bytes."""
        if self.current is not None:
            if self.device.type == "cuda" or self.resets:
                peak = _phase_reading(self.device)
            else:  # no reset: the process's peak so far
                peak = process_peak_bytes(self.device)
            _fold_readings(self.device)
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.current = None
        return self.peaks
