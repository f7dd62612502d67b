"""The README's callbacks example is examples/callbacks_in_your_module.py, and it runs."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "callbacks_in_your_module.py"
BLOCK = re.compile(
    r"<!-- example:callbacks -->\s*```python\n(?P<code>.*?)```\s*<!-- /example:callbacks -->",
    re.DOTALL,
)


def test_readme_block_is_the_example_file():
    assert (ROOT / "README.md").is_file(), "README.md is missing"
    readme = (ROOT / "README.md").read_text()
    blocks = BLOCK.findall(readme)
    assert len(blocks) == 1, (
        "README.md must hold examples/callbacks_in_your_module.py once, as a ```python block "
        "between <!-- example:callbacks --> and <!-- /example:callbacks -->"
    )
    assert blocks[0] == EXAMPLE.read_text(), "README example differs from the example file"


def test_example_runs_and_adapts_beta(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # anything the Trainer writes stays out of the repo
    with pytest.warns(RuntimeWarning, match="KL divergence too high"):
        namespace = runpy.run_path(str(EXAMPLE), run_name="__main__")
    model, controller = namespace["model"], namespace["controller"]
    betas = model.betas
    assert len(betas) == 6 * 16
    assert betas[0] == 0.2  # the controller's initial beta, written at fit start
    assert model.kl_coef == controller.value
    assert len(set(betas)) > len(betas) // 2  # beta moved on most batches
    # Beta settled where the KL meets its target (0.5 nats): the run is long enough to matter.
    kl = float(namespace["trainer"].callback_metrics["objective/kl"])
    assert kl == pytest.approx(0.5, abs=0.05)
    assert "final beta" in capsys.readouterr().out
