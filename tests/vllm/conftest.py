"""The vLLM engine's tests: run by ``make test-vllm`` in ``.venv-vllm``, never by ``make test``.

``pyproject.toml`` leaves this folder out of the main suite (``--ignore=tests/vllm``); naming it
on the command line runs it. Every test in one process shares one vLLM engine
(:func:`~rlkl_lightning.algorithms.engines.vllm.shared_engine`), built by the first module that
samples, so the settings that size it (``max_model_len``, dtype, memory) are the same in every
in-process test: :data:`SAMPLING`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

try:
    from rlkl_lightning.algorithms.engines.vllm import import_vllm

    import_vllm()
    MISSING_VLLM = None
except RuntimeError as err:
    MISSING_VLLM = str(err)

#: The study's shape: prompts of up to 16 tokens, responses of up to 24.
SAMPLING = {"max_prompt_tokens": 16, "max_new_tokens": 24}
#: The engine of configs/*_vllm.yaml (the same settings: the same engine).
ENGINE = {"kind": "vllm", "gpu_memory_utilization": 0.02}
#: Openings in the default world's style.
PROMPTS = [
    "The pizza was",
    "I did",
    "My parents and I truly",
    "The room was",
    "Our waiter",
    "This hotel is",
    "The staff were",
    "I would not",
]


@pytest.fixture(scope="session", autouse=True)
def vllm_is_installed():
    """Skip every test here without vLLM (a failure under ``CI=true``: tests/conftest.py)."""
    if MISSING_VLLM is not None:
        pytest.skip(f"tests/vllm needs vLLM (`make test-vllm`): {MISSING_VLLM}")


@pytest.fixture(scope="session")
def world_dir() -> Path:
    """The default world's reference model (built once, cached)."""
    from rlkl_lightning.world.build import default_model_dir

    return default_model_dir()
