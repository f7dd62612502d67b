"""The process's global random streams, kept across work that draws from them on its own."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def random_streams_kept() -> Iterator[None]:
    """Put Python's, NumPy's and torch's (CPU and CUDA) random streams back after the block.

    A run's draws must not depend on work it did on the side: vLLM seeds every stream when it
    starts, and a world built inside a run trains a model. Either would shift the run's
    minibatch order and samples, so a resumed or uncached run would differ from the same command
    run straight through.
    """
    import numpy as np

    python, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)
