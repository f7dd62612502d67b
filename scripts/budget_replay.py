"""Replay a logged budget run through `CapabilityBudget`'s law: the target it asked, and why.

    python scripts/budget_replay.py RUN_DIR [--no-trend] [--every N] [--until BATCH]

RUN_DIR is one run of a study (`runs/GROUP/seedK`: its `config.yaml` and TensorBoard events).
The law is fed what it was fed in the run: the KL of every batch (`objective/kl`, the KL the
controller callback sums) and, at each evaluation, the monitored metric over its reference
(the callback's `monitor` and `reference_key`), with the run's own `CapabilityBudget`
arguments. Open loop: the KL is the logged one, whatever the replayed law asks. With the law
the run had, every replayed target equals the logged `objective/kl_target` (the script counts
them): the check that the replay is the run. `--no-trend` replays it with the trend carried
ahead held at 0 (docs/budget.md), which shows what the trend did to each target.

Reads YAML (safe loading) and TensorBoard scalars only; runs nothing from the run directory.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.events import read_scalars
from rlkl_lightning.kl.budget_model import ExcessModel
from rlkl_lightning.kl.capability_budget import CapabilityBudget

BUDGET_CLASS = "rlkl_lightning.CapabilityBudget"
#: The init arguments a replay passes on: the law's (logging and monitoring are the run's).
LAW_ARGS = (
    "budget",
    "mode",
    "raise_per_batch",
    "fall_per_batch",
    "min_target",
    "max_target",
    "follow",
    "error_floor",
)


class NoTrend(ExcessModel):
    """The budget's model with the trend carried ahead held at 0."""

    def _trend(self) -> float:
        return 0.0


class _Controller(SimpleNamespace):
    """What the budget reads of the KL controller callback: batches, the KL's sums, the target."""

    def set_target(self, target: float) -> None:
        self.target = target


def replay(
    kls: list[float],
    evaluations: list[tuple[int, float]],
    init_args: dict,
    start_target: float,
    trend: bool = True,
) -> list[dict]:
    """The law over a run: one record per evaluation (batch, ratio, target after, trend).

    ``kls``: the KL of batches 1, 2, ... ``evaluations``: ``(batch, metric / reference)``
    after that batch, in order.
    """
    budget = CapabilityBudget(**init_args)
    if not trend:
        budget.model = NoTrend()
    controller = _Controller(n_batches=0, kl_sum=0.0, kl_count=0, target=start_target)
    budget._controller, budget.target, budget.reference = controller, start_target, 1.0
    records, done = [], 0
    for batch, ratio in evaluations:
        for kl in kls[done:batch]:
            controller.n_batches += 1
            controller.kl_sum += kl
            controller.kl_count += 1
        done = batch
        target = budget.step(ratio)
        carried = budget.model.reached(math.log(budget.budget_excess))
        records.append(
            {
                "batch": batch,
                "ratio": ratio,
                "target": target,
                "trend": budget.model.trend,
                "carried": carried,
            }
        )
    return records


def read_run(run: Path) -> tuple[list[float], list[tuple[int, float]], dict, dict[int, float]]:
    """A run's batch KLs, evaluations, budget arguments and logged targets (by batch)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    callbacks = config.get("trainer", {}).get("callbacks") or []
    found = [c for c in callbacks if isinstance(c, dict) and c.get("class_path") == BUDGET_CLASS]
    if not found:
        raise SystemExit(f"budget_replay: {run}/config.yaml has no {BUDGET_CLASS} callback")
    args = found[0].get("init_args") or {}
    scalars = read_scalars(run)
    steps = sorted(scalars[keys.KL])  # one KL per batch: the batches' steps, in order
    batch = {step: i + 1 for i, step in enumerate(steps)}
    kls = [scalars[keys.KL][step] for step in steps]
    monitor = scalars[args.get("monitor", "val/perplexity")]
    reference_key = args.get("reference_key", "val/perplexity_ref")
    references = scalars.get(reference_key, {})
    reference = references[min(references)] if references else 1.0
    evaluations = sorted((batch[s], v / reference) for s, v in monitor.items() if s in batch)
    logged_key = args.get("log_key") or keys.KL_TARGET
    logged = {batch[s]: v for s, v in scalars.get(logged_key, {}).items() if s in batch}
    law = {name: args[name] for name in LAW_ARGS if name in args}
    return kls, evaluations, law, logged


def main(argv: list[str] | None = None) -> int:
    """Print the replay; exit 0 where every replayed target equals the logged one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="one run's directory (config.yaml, events)")
    parser.add_argument("--no-trend", action="store_true", help="also replay without the trend")
    parser.add_argument("--every", type=int, default=1, help="print every Nth evaluation")
    parser.add_argument("--until", type=int, default=None, help="print up to this batch")
    args = parser.parse_args(argv)
    kls, evaluations, law, logged = read_run(args.run)
    start = logged.get(1, 1.0)
    records = replay(kls, evaluations, law, start)
    plain = replay(kls, evaluations, law, start, trend=False) if args.no_trend else None
    same = checked = 0
    for i, rec in enumerate(records):
        after = logged.get(rec["batch"] + 1)  # logged at the next batch's end
        if after is not None:
            checked += 1
            same += math.isclose(after, rec["target"], rel_tol=1e-6)
        shown = i % args.every == 0 and (args.until is None or rec["batch"] <= args.until)
        if shown:
            line = (
                f"batch {rec['batch']:4d}  ratio {rec['ratio']:.4f}  target {rec['target']:.3f}"
                f"  logged {'-' if after is None else f'{after:.3f}'}"
                f"  trend {rec['trend']:.3f}{'' if rec['carried'] else ' (not carried)'}"
            )
            if plain is not None:
                line += f"  without the trend {plain[i]['target']:.3f}"
            print(line)
    print(f"replayed targets equal to the logged ones: {same} of {checked}")
    return 0 if same == checked else 1


if __name__ == "__main__":
    sys.exit(main())
