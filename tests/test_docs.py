"""The docs say what the code does: every logged metric is defined in docs/metrics.md."""

from __future__ import annotations

from pathlib import Path

from rlkl_lightning import metric_keys

ROOT = Path(__file__).resolve().parents[1]
#: Logged by the world's SFT (docs/worlds.md), not by a training run.
NOT_A_RUNS_METRIC = {metric_keys.VAL_LOSS}


def test_every_metric_key_is_defined_in_the_metrics_page():
    page = (ROOT / "docs" / "metrics.md").read_text()
    names = {
        value
        for name, value in vars(metric_keys).items()
        if name.isupper() and isinstance(value, str)
    }
    assert metric_keys.TRUST_REGION_MASKED in names
    assert sorted(k for k in names - NOT_A_RUNS_METRIC if f"`{k}`" not in page) == []
