"""What the study shows while its runs train: a bar on a terminal, plain lines anywhere else.

On a terminal, one rich bar counts the batches of all runs. Where the output is a file or a
pipe (CI logs, ``nohup``, ``| tee``) a bar would print nothing until the end, so
:class:`ProgressLines` writes a line when a run starts, a line when it ends, and every
``every`` seconds a line with the batches done, the runs in flight and an estimate of the time
left. :func:`study_progress` picks one of the two for the stream.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TextIO

PROGRESS_EVERY_S = 30.0  # seconds between progress lines when the output is not a terminal


class StudyProgress(Protocol):
    """What ``run_all`` reports to; runs are named by ``<group>-seed<k>``."""

    def started(self, name: str) -> None:
        """A run's process was started."""

    def finished(self, name: str, cpu_s: float) -> None:
        """A run ended successfully after ``cpu_s`` CPU seconds (user + system)."""

    def update(self, batches: dict[str, int]) -> None:
        """Batches done so far by each run in flight (called every half second or so)."""


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}" if minutes >= 60 else f"{minutes}:{s:02d}"


class ProgressLines:
    """Plain progress lines, for output that is not a terminal.

    Args:
        runs: Number of runs in the study.
        batches: Training batches per run.
        stream: Where to write (flushed after every line).
        every: Seconds between two progress lines (a run's start or end line does not reset
            the period).
        clock: Seconds on a monotonic clock (a test passes a fake one).
    """

    def __init__(
        self,
        runs: int,
        batches: int,
        stream: TextIO,
        every: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runs, self.batches, self.stream, self.every, self.clock = (
            runs,
            batches,
            stream,
            every,
            clock,
        )
        self.start = clock()
        self.last_line = self.start
        self.started_at: dict[str, float] = {}
        self.done = 0

    def _write(self, text: str) -> None:
        self.stream.write(f"[{_clock(self.clock() - self.start):>7}] {text}\n")
        self.stream.flush()

    def started(self, name: str) -> None:
        """Write ``start <run> (run i of n)``."""
        self.started_at[name] = self.clock()
        self._write(f"start {name} (run {len(self.started_at)} of {self.runs})")

    def finished(self, name: str, cpu_s: float) -> None:
        """Write ``done <run> in <seconds> (CPU <seconds>; k of n runs done)``.

        The CPU time (left out when NaN: unknown) is about what the run's one-thread process
        takes on an idle machine, however busy this one is.
        """
        self.done += 1
        seconds = self.clock() - self.started_at[name]
        cpu = "" if math.isnan(cpu_s) else f"CPU {cpu_s:.0f} s; "
        self._write(f"done {name} in {seconds:.0f} s ({cpu}{self.done} of {self.runs} runs done)")

    def update(self, batches: dict[str, int]) -> None:
        """Every ``every`` seconds: batches done of all, each run in flight, the time left."""
        now = self.clock()
        if now - self.last_line < self.every:
            return
        self.last_line = now
        total = self.runs * self.batches
        done = self.done * self.batches + sum(batches.values())
        flight = ", ".join(f"{name} {n}/{self.batches}" for name, n in batches.items())
        left = ""
        if done:
            left = f"; about {_clock((now - self.start) * (total - done) / done)} left"
        self._write(
            f"{done}/{total} batches ({done / total:.0%}); running: {flight or 'none'}; "
            f"{self.done} of {self.runs} runs done{left}"
        )


class ProgressBar:
    """One rich bar over the batches of all runs, for a terminal."""

    def __init__(self, runs: int, batches: int, progress) -> None:
        self.runs, self.batches, self.progress = runs, batches, progress
        self.task = progress.add_task(f"{runs} runs", total=runs * batches)
        self.done = 0

    def started(self, name: str) -> None:
        """Nothing to show: the bar counts batches."""

    def finished(self, name: str, cpu_s: float) -> None:
        """Count the run."""
        self.done += 1

    def update(self, batches: dict[str, int]) -> None:
        """Move the bar."""
        self.progress.update(
            self.task,
            completed=self.done * self.batches + sum(batches.values()),
            description=f"{self.done}/{self.runs} runs",
        )


@contextmanager
def study_progress(runs: int, batches: int, stream: TextIO | None = None) -> Iterator:
    """A :class:`ProgressBar` when ``stream`` (default stdout) is a terminal, else lines.

    A terminal is what ``stream.isatty()`` says, whatever ``FORCE_COLOR`` a CI sets.
    """
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        yield ProgressLines(runs, batches, stream)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("batches"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(file=stream, force_terminal=True)) as progress:
        yield ProgressBar(runs, batches, progress)
