"""The compiled decode's tests (``make test-compiled``): skipped where torch.compile cannot build.

They are kept out of ``make test`` (``--ignore`` in pyproject.toml): each compiled step costs
seconds of compilation. Inductor builds its CPU kernels with a C++ compiler; a machine without
one skips every test here, with the reason, instead of failing.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def inductor_builds_for_the_cpu():
    """Skip the directory unless inductor compiles a one-line function for the CPU here."""
    import torch

    from rlkl_lightning.algorithms.compiled_decode import cpu_compiler_missing

    missing = cpu_compiler_missing()
    if missing is not None:
        pytest.skip(f"torch.compile has no C++ compiler for the CPU here: {missing}")
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(3))
    except Exception as err:  # a toolchain that is there but cannot build (headers, ...)
        first = (str(err).strip().splitlines() or [""])[0]
        pytest.skip(f"torch.compile cannot build for the CPU here: {type(err).__name__}: {first}")
