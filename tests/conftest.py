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


#: Folders whose tests are skipped where their environment is missing (a C++ compiler for
#: torch.compile, vLLM); under ``CI=true`` such a skip fails the test instead.
NO_SKIP_IN_CI = ("compiled", "vllm")


def skip_fails_in_ci(path: Path) -> bool:
    """Whether a skip of the test at ``path`` is a failure: under ``CI=true``, in those folders."""
    tests = Path(__file__).parent
    return os.environ.get("CI") == "true" and any(
        path.is_relative_to(tests / folder) for folder in NO_SKIP_IN_CI
    )


def _fail_the_skip(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        "skipped under CI=true, where a skip in tests/"
        f"{{{','.join(NO_SKIP_IN_CI)}}} fails (a broken environment must not pass as skips): "
        f"{reason}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under ``CI=true``, a test of :data:`NO_SKIP_IN_CI` that skips fails with the reason."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and skip_fails_in_ci(item.path):
        _fail_the_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """The same for a module of those folders skipped whole while it is collected."""
    report = yield
    if report.skipped and skip_fails_in_ci(collector.path):
        _fail_the_skip(report)
    return report


@pytest.fixture(autouse=True)
def _rank_zero_restored():
    """Lightning keeps the process's rank in a global that any Trainer under a (simulated)
    cluster environment sets; a test that builds one as rank 3 would silence the rank-0-only
    output of every later test in its process."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank
