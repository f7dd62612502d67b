"""Judge budget runs against a fixed-target frontier from another budget study.

    python scripts/budget_frontier_gap.py FRONTIER/summary.json BUDGETS/summary.json [...]

The fixed-target runs (`configs/compare_budget.yaml`'s `target_*` groups) do not depend on the
budget's law, so one set of them serves every law's runs on a world: run them once as a study
of their own (`--runs` with only the `target_*` groups), then judge each study of budget runs
against them here. The frontier, the gap, its standard error and the verdict are the budget
report's own (`rlkl_lightning/compare/budget.py`): `score = a + b ln(test ratio)` through the
fixed-target runs that did not diverge, and a budget group is on the frontier when its gap is
not below `-(0.02 + 2 SE)`. Reads JSON only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlkl_lightning.compare.budget import GAP_MARGIN
from rlkl_lightning.compare.frontier import fit_frontier, frontier_gap


def main(frontier_file: str, budget_files: list[str]) -> list[dict]:
    """Print the frontier and one line per budget group; returns those lines' numbers."""
    fixed = [
        r
        for r in json.loads(Path(frontier_file).read_text())["runs"]
        if r["budget"] is None and r["test_ratio"] is not None and not r["diverged"]
    ]
    frontier = fit_frontier([r["test_ratio"] for r in fixed], [r["score"] for r in fixed])
    print(
        f"frontier from {len(fixed)} fixed-target runs ({frontier_file}): score = "
        f"{frontier.intercept:.3f} + {frontier.slope:.3f} ln(ratio), residual sd "
        f"{frontier.residual_sd:.4f}"
    )
    for r in sorted(fixed, key=lambda r: (r["configured_target"], r["seed"])):
        print(
            f"  target {r['configured_target']:g}, seed {r['seed']}: test ratio "
            f"{r['test_ratio']:.3f}, score {r['score']:.3f}, KL {r['kl']:.2f}"
        )
    results = []
    for path in budget_files:
        runs = [r for r in json.loads(Path(path).read_text())["runs"] if r["budget"] is not None]
        for group in dict.fromkeys(r["group"] for r in runs):
            members = [r for r in runs if r["group"] == group]
            gap = frontier_gap(
                frontier, [r["test_ratio"] for r in members], [r["score"] for r in members]
            )
            gap["on_frontier"] = bool(gap["gap"] >= -(GAP_MARGIN + gap["two_se"]))
            gap.update(group=group, file=path)
            results.append(gap)
            print(
                f"{path}: {group}, {gap['seeds']} seeds: gap {gap['gap']:+.3f} ± "
                f"{gap['two_se']:.3f} (2 SE), inside the frontier's range "
                f"{'yes' if gap['inside_range'] else 'no'}, on the frontier "
                f"{'yes' if gap['on_frontier'] else 'no'}"
            )
    return results


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
