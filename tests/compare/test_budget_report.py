"""The budget study's numbers: means over the last third, ratios to the initial reference."""

from __future__ import annotations

import pytest

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.budget import _interval, settled_numbers


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
