"""Sweep the budget law's LEAD on the logged runs' plants of tests/kl/test_capability_budget.py.

    python scripts/budget_lead_sweep.py 0.2 0.3 0.44 0.55 0.65

For each value: the runs, of 192 (16 plants, budgets 1.15x and 1.3x, 3 seeds, validation
intervals 5 and 25), that meet issue 47's criteria (docs/budget.md, "The lead"). The plants,
the simulation and the criteria are the test's own, loaded from its file.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

from rlkl_lightning.kl import budget_model
from rlkl_lightning.kl.capability_budget import CapabilityBudget

TESTS = Path(__file__).resolve().parents[1] / "tests"


def _test_module():
    sys.path.insert(0, str(TESTS))  # the test imports its helpers from there
    spec = importlib.util.spec_from_file_location(
        "budget_test", TESTS / "kl" / "test_capability_budget.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(leads: list[float]) -> None:
    """Print, for each LEAD, the runs that meet the criteria."""
    test = _test_module()
    warnings.simplefilter("ignore", RuntimeWarning)  # the budget's own, once per run
    for lead in leads:
        budget_model.LEAD = lead
        budget_model.HORIZONS = tuple(budget_model.horizon(k) for k in budget_model.KERNELS)
        met = {}
        for n, by in ((5, 120), (25, 200)):
            for ratio in (1.15, 1.3):
                count = 0
                for plant in test.LOGGED_PLANTS:
                    for seed in range(3):
                        budget = CapabilityBudget(ratio)
                        budget.target = 1.0
                        out = test._logged_plant(budget, plant, n, seed)
                        count += not test._meets_the_criteria(out, ratio, by)
                met[f"{ratio:g}x every {n}"] = count
        print(
            f"LEAD {lead:g}: {sum(met.values())} of 192 met;",
            ", ".join(f"{k}: {v}" for k, v in met.items()),
        )


if __name__ == "__main__":
    main([float(v) for v in sys.argv[1:]] or [budget_model.LEAD])
