"""The world's cache: a stage built inside a run leaves the run's random generators alone."""

from __future__ import annotations

import random

import numpy as np
import torch

from rlkl_lightning.world.cache import build_stage


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_a_stage_built_inside_a_run_leaves_every_global_generator_as_it_was(tmp_path):
    """A world built while LightningCLI instantiates the module must not shift the run's draws."""

    def make(tmp):
        _draws()  # a build that trains (dropout, shuffles) draws from every generator
        torch.manual_seed(0)
        (tmp / "done").write_text("{}")

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = _draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    build_stage(tmp_path / "stage", "done", make, progress=False)
    assert _draws() == expected
    assert (tmp_path / "stage" / "done").is_file()
