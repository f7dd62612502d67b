"""Replay a logged budget run through `CapabilityBudget`'s law: the target it asked, and why.

    python scripts/budget_replay.py RUN_DIR [--no-trend] [--every N] [--until BATCH]
    python scripts/budget_replay.py STUDY_DIR [STUDY_DIR ...]

RUN_DIR is one run of a study (`runs/GROUP/seedK`: its `config.yaml` and TensorBoard events).
The law is fed what it was fed in the run: the KL of every batch (`objective/kl`, the KL the
controller callback sums) and, at each evaluation, the monitored metric over its reference
(the callback's `monitor` and `reference_key`), with the run's own `CapabilityBudget`
arguments. Open loop: the KL is the logged one, whatever the replayed law asks. With the law
the run had, every replayed target equals the logged `objective/kl_target` (the script counts
them): the check that the replay is the run. `--no-trend` replays it with the trend carried
ahead held at 0 (docs/budget.md), which shows what the trend did to each target.

Given a study's directory (or several, or several runs), it replays each budget run in it and
prints one line a run: every target given back, or the first evaluation whose target differs.
A run whose targets all come back would run again bit for bit under this checkout's law (on
the machine and software it ran on: the target is all the budget hands the training), so a law
change need only run again the runs it changes.

Reads YAML (safe loading) and TensorBoard scalars only; runs nothing from the run directory.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
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


def wired(init_args: dict, start_target: float) -> tuple[CapabilityBudget, _Controller]:
    """A budget with the law of ``init_args``, wired to a stand-in controller at the target."""
    budget = CapabilityBudget(**init_args)
    controller = _Controller(n_batches=0, kl_sum=0.0, kl_count=0, target=start_target)
    budget._controller, budget.target, budget.reference = controller, start_target, 1.0
    return budget, controller


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
    budget, controller = wired(init_args, start_target)
    if not trend:
        budget.model = NoTrend()
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


def batches_of(scalars: dict[str, dict[int, float]]) -> dict[int, int]:
    """The batch (1, 2, ...) of each logged step: a run logs one KL a batch."""
    return {step: i + 1 for i, step in enumerate(sorted(scalars[keys.KL]))}


def ratio_curve(
    scalars: dict[str, dict[int, float]], batch: dict[int, int], key: str, reference_key: str
) -> list[tuple[int, float]]:
    """``(batch, value / the reference's first value)`` of ``key``, in order."""
    references = scalars.get(reference_key, {})
    reference = references[min(references)] if references else 1.0
    return sorted((batch[s], v / reference) for s, v in scalars[key].items() if s in batch)


def budget_args(run: Path) -> dict | None:
    """The init arguments of the run's budget callback (``config.yaml``); None: it has none."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    callbacks = config.get("trainer", {}).get("callbacks") or []
    found = [c for c in callbacks if isinstance(c, dict) and c.get("class_path") == BUDGET_CLASS]
    return (found[0].get("init_args") or {}) if found else None


def read_run(
    run: Path, scalars: dict[str, dict[int, float]] | None = None
) -> tuple[list[float], list[tuple[int, float]], dict, dict[int, float]]:
    """A run's batch KLs, evaluations, budget arguments and logged targets (by batch).

    ``scalars``: the run's, where the caller has read them already.
    """
    args = budget_args(run)
    if args is None:
        raise SystemExit(f"budget_replay: {run}/config.yaml has no {BUDGET_CLASS} callback")
    scalars = read_scalars(run) if scalars is None else scalars
    batch = batches_of(scalars)
    kls = [scalars[keys.KL][step] for step in sorted(batch)]
    monitor = args.get("monitor", keys.PERPLEXITY)
    reference_key = args.get("reference_key", keys.PERPLEXITY_REF)
    evaluations = ratio_curve(scalars, batch, monitor, reference_key)
    logged_key = args.get("log_key") or keys.KL_TARGET
    logged = {batch[s]: v for s, v in scalars.get(logged_key, {}).items() if s in batch}
    law = {name: args[name] for name in LAW_ARGS if name in args}
    return kls, evaluations, law, logged


def budget_runs(path: Path) -> list[Path]:
    """The budget runs under ``path``: itself if it is a run, else ``runs/*/*`` of a study."""
    if (path / "config.yaml").is_file():
        return [path]
    found = [
        run
        for run in sorted(path.glob("runs/*/*"))
        if (run / "config.yaml").is_file() and budget_args(run) is not None
    ]
    if not found:
        raise SystemExit(f"budget_replay: no budget run in {path} (neither a run nor a study)")
    return found


def compared(records: list[dict], logged: dict[int, float]) -> tuple[int, int, dict | None]:
    """``(same, checked, first record whose target differs from the logged one or None)``."""
    same = checked = 0
    first = None
    for rec in records:
        after = logged.get(rec["batch"] + 1)  # logged at the next batch's end
        if after is not None:
            checked += 1
            if math.isclose(after, rec["target"], rel_tol=1e-6):
                same += 1
            elif first is None:
                first = rec | {"logged": after}
    return same, checked, first


def survey(paths: list[Path]) -> int:
    """One line per budget run under ``paths``; 0 where every run gives its targets back."""
    runs = [run for path in paths for run in budget_runs(path)]
    unchanged = 0
    for run in runs:
        kls, evaluations, law, logged = read_run(run)
        with warnings.catch_warnings():  # the law's own warnings, once per run: not this survey's
            warnings.simplefilter("ignore")
            records = replay(kls, evaluations, law, logged.get(1, 1.0))
        same, checked, first = compared(records, logged)
        unchanged += first is None
        line = f"{run}: {same} of {checked} targets given back"
        if first is not None:
            line += (
                f"; first differs after batch {first['batch']}"
                f" (logged {first['logged']:.3f}, replayed {first['target']:.3f})"
            )
        print(line)
    print(f"runs whose every target comes back: {unchanged} of {len(runs)}")
    return 0 if unchanged == len(runs) else 1


def main(argv: list[str] | None = None) -> int:
    """Print the replay; exit 0 where every replayed target equals the logged one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run", type=Path, nargs="+", help="one run's directory (config.yaml, events), or studies"
    )
    parser.add_argument("--no-trend", action="store_true", help="also replay without the trend")
    parser.add_argument("--every", type=int, default=1, help="print every Nth evaluation")
    parser.add_argument("--until", type=int, default=None, help="print up to this batch")
    args = parser.parse_args(argv)
    if len(args.run) > 1 or not (args.run[0] / "config.yaml").is_file():
        return survey(args.run)
    kls, evaluations, law, logged = read_run(args.run[0])
    start = logged.get(1, 1.0)
    records = replay(kls, evaluations, law, start)
    plain = replay(kls, evaluations, law, start, trend=False) if args.no_trend else None
    same, checked, _ = compared(records, logged)
    for i, rec in enumerate(records):
        after = logged.get(rec["batch"] + 1)  # logged at the next batch's end
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
