"""A callback that records what a training process saw when its fit started (study runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback


class RecordStart(Callback):
    """Write the process's id, working directory, torch threads and one variable as JSON."""

    def __init__(self, path: str, variable: str) -> None:
        self.path, self.variable = Path(path), variable

    def on_fit_start(self, trainer, pl_module) -> None:
        seen = {
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "threads": torch.get_num_threads(),
            "value": os.environ.get(self.variable),
        }
        self.path.write_text(json.dumps(seen))
