"""Shared fixtures: tiny causal LMs and tokenizers made locally (nothing is downloaded).

The builders and helpers that test files import live in ``tests/helpers/`` (``helpers.*``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One torch thread per test process: `pytest -n 2` then uses the 2 cores without
# oversubscription (torch's OpenMP threads slow down badly when they outnumber the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2 and its tokenizer, saved with ``save_pretrained``."""
    from helpers.tiny_models import make_tiny_lm

    return make_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))
