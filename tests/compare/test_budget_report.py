"""The budget study's numbers: means over the last third, ratios to the initial reference."""

from __future__ import annotations

import numpy as np
import pytest

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.budget import _interval, _markdown, settle_by, settled_numbers, settling


def _scalars(n=9, steps_per_batch=4):
    steps = [steps_per_batch * (i + 1) for i in range(n)]  # optimizer steps of each batch
    scalars = {
        keys.SCORE: {s: float(i) for i, s in enumerate(steps)},
        keys.KL: {s: 2.0 * i for i, s in enumerate(steps)},
        keys.KL_TARGET: {s: 1.5 for s in steps},
        # Validations after batches 3, 6, 9; the reference is refreshed after the first.
        keys.TEST_PERPLEXITY: {steps[2]: 11.0, steps[5]: 12.0, steps[8]: 13.0},
        keys.TEST_PERPLEXITY_REF: {steps[2]: 10.0, steps[5]: 11.0, steps[8]: 11.0},
        keys.PERPLEXITY: {steps[2]: 5.5, steps[5]: 6.0, steps[8]: 6.5},
        keys.PERPLEXITY_REF: {steps[2]: 5.0, steps[5]: 5.0, steps[8]: 5.0},
    }
    return scalars


def test_the_last_third_and_the_initial_reference_are_what_the_numbers_average():
    numbers = settled_numbers(_scalars())
    # The last third of 9 batches: batches 7-9 (indices 6-8).
    assert numbers["score"] == pytest.approx((6 + 7 + 8) / 3)
    assert numbers["kl"] == pytest.approx(2 * (6 + 7 + 8) / 3)
    assert numbers["target"] == 1.5 and numbers["gold"] is None
    # Only the validation after batch 9 lies in it; its ratio is to the first reference (10).
    assert numbers["test_ratio"] == pytest.approx(13.0 / 10.0)
    assert numbers["val_ratio"] == pytest.approx(6.5 / 5.0)
    assert numbers["target_curve"][0] == (1, 1.5)


def test_without_a_moved_target_the_monitors_is_read_and_no_test_text_gives_none():
    scalars = _scalars()
    scalars[keys.MONITOR_TARGET] = scalars.pop(keys.KL_TARGET)
    del scalars[keys.TEST_PERPLEXITY]
    numbers = settled_numbers(scalars)
    assert numbers["target"] == 1.5 and numbers["test_ratio"] is None


def test_the_allowed_interval_is_twenty_percent_of_the_budgets_excess():
    assert _interval(1.15) == pytest.approx((1.12, 1.18))
    assert _interval(1.3) == pytest.approx((1.24, 1.36))


def test_settling_judges_the_smoothed_ratio_by_its_batch_after_it_and_the_last_third():
    # A ramp into the 1.3x band, a swing to 1.38 at batch 200, back to 1.3: by hand and with
    # numpy's trailing mean as the second way.
    ratios = [1.0 + 0.3 * min(1.0, t / 110) for t in range(5, 301, 5)]
    ratios[39] = 1.38 * 3 - ratios[38] - ratios[37]  # the smoothed ratio at batch 200: 1.38
    curve = list(zip(range(5, 301, 5), ratios))
    out = settling(curve, 1.3, settle_by(5))
    smooth = np.convolve(ratios, np.ones(3) / 3, mode="valid")
    assert out["by"] == 120 and out["at_by"] == pytest.approx(smooth[120 // 5 - 3])
    assert out["first_in_band"] == next(5 * (i + 3) for i, m in enumerate(smooth) if m >= 1.24)
    assert out["after"] == pytest.approx([smooth[21:].min(), smooth[21:].max()])
    assert out["after"][1] == pytest.approx(ratios[39] / 3 + ratios[38] / 3 + ratios[37] / 3)
    assert (
        out["outside"] == sum(abs(m - 1.3) > 0.075 for m in smooth[21:]) == 3
    )  # one spike, 3 windows
    assert out["last_third"] == pytest.approx(np.mean(ratios[40:]))
    assert out["failures"] == ["after batch 120: 1.3000-1.3800"] and not out["settled"]
    calm = [(t, r if t != 200 else 1.3) for t, r in curve]
    assert settling(calm, 1.3, 120)["settled"]
    late = [(t, 1.0 + 0.3 * min(1.0, t / 200)) for t, _ in curve]  # in its band at batch 165
    assert settling(late, 1.3, 120)["failures"][0].startswith("at batch 120: 1.17")
    assert settling(late, 1.3, settle_by(25))["settled"]
    low = [(t, r - 0.04 * (t > 200)) for t, r in calm]  # the last third 0.04 under: outside ±10%
    assert settling(low, 1.3, 120)["failures"] == ["last third: 1.2600"]
    assert settling(curve[:20], 1.3, 120)["failures"][0] == "the run ended before batch 120"


def test_settle_by_gives_the_issues_batches_and_a_line_between():
    assert [settle_by(n) for n in (1, 5, 10, 25, 50)] == [120, 120, 140, 200, 300]


def test_the_report_has_a_settling_table_for_the_budget_runs():
    judged = settling([(t, 1.15) for t in range(5, 301, 5)], 1.15, 120)
    run = {"group": "budget_1.15", "seed": 0, "budget": 1.15, "diverged": False, "target": 1.2,
           "kl": 1.2, "test_ratio": 1.15, "val_ratio": 1.15, "score": 0.1, "gold": None,
           "settling": {"test": judged, "val": judged}}  # fmt: skip
    study = {"batches": 300, "val_every": 5, "world": None, "elapsed_s": 60.0, "machine": "m"}
    lines = _markdown({"study": study, "frontier": None, "budgets": {}, "runs": [run]})
    assert "## Settling" in lines
    row = "| budget_1.15 | 0 | 5 | 1.150-1.150 (from 120) | 0 | 1.150 (1.135-1.165) | yes |"
    assert row + " 1.150, yes |" in lines
