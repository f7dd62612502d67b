"""Under ``CI=true`` a skip in tests/compiled or tests/vllm fails the run (tests/conftest.py).

Those folders skip where their environment is missing (no C++ compiler for torch.compile, no
vLLM); in CI that would pass a broken environment as a row of skips. Each case runs pytest as
a process on a tree of tiny test files under a copy of the project's own tests/conftest.py: a
skip from a fixture, a module skipped whole while collected, an expected failure (not a skip),
and a skip in another folder (still a skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

FILES = {
    "compiled/test_steps.py": """
import pytest

@pytest.fixture(scope="module")
def toolchain():
    pytest.skip("no C++ compiler here")

def test_one(toolchain):
    pass

def test_two(toolchain):
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_known_bug():
    assert False
""",
    "vllm/test_engine.py": """
import pytest

pytest.skip("needs vLLM", allow_module_level=True)

def test_samples():
    pass
""",
    "other/test_elsewhere.py": """
import pytest

def test_skipped_elsewhere():
    pytest.skip("not here")
""",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ci_skips")
    (root / "tests").mkdir()
    (root / "tests" / "conftest.py").write_text(CONFTEST.read_text())
    for name, text in FILES.items():
        (root / "tests" / name).parent.mkdir(exist_ok=True)
        (root / "tests" / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def runs(tree) -> dict[str | None, tuple[int, str]]:
    """Exit status and output of one pytest run of the tree without ``CI`` and with each value."""
    found = {}
    for ci in (None, "false", "true"):
        env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no xdist, hypothesis, ...: a quick start
        if ci is not None:
            env["CI"] = ci
        args = ["-p", "no:cacheprovider", "-rA", "--continue-on-collection-errors", "tests"]
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        found[ci] = done.returncode, done.stdout + done.stderr
    return found


@pytest.mark.parametrize("ci", [None, "false"])
def test_without_ci_true_the_folders_skip(runs, ci):
    code, out = runs[ci]
    assert code == 0, out
    assert "= 4 skipped, 1 xfailed in " in out.splitlines()[-1], out


def test_under_ci_true_a_skip_from_a_fixture_fails_with_its_reason(runs):
    code, out = runs["true"]
    assert code == 1, out
    for test in ("test_one", "test_two"):
        assert (
            f"ERROR tests/compiled/test_steps.py::{test} - skipped under CI=true, where a skip in "
            "tests/{compiled,vllm} fails (a broken environment must not pass as skips): "
            "Skipped: no C++ compiler here"
        ) in out
    assert "XFAIL tests/compiled/test_steps.py::test_known_bug" in out  # not a skip


def test_under_ci_true_a_module_skipped_while_collected_fails(runs):
    _, out = runs["true"]
    assert "ERROR tests/vllm/test_engine.py - skipped under CI=true" in out
    assert "needs vLLM" in out


def test_under_ci_true_a_skip_elsewhere_stays_a_skip(runs):
    _, out = runs["true"]
    assert "SKIPPED [1] tests/other/test_elsewhere.py:5: not here" in out
    assert "= 1 skipped, 1 xfailed, 3 errors in " in out.splitlines()[-1], out
