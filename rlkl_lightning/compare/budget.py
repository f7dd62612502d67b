"""The budget study's report: capability-budget runs beside fixed-target runs.

Every run is summarised over the **last third** of its batches (the cascade's settled part):

- ``score``, ``gold``, ``kl``, ``target``: mean ``objective/score``, ``objective/gold_score``,
  ``objective/kl`` and the KL target (``objective/kl_target`` where a budget moves it, else
  ``kl_monitor/target``) over those batches;
- ``diverged``: the settled KL above ``DIVERGED`` (5) times the target; such a run is left
  out of the frontier;
- ``test_ratio``, ``val_ratio``: mean over the validations in them of ``test/perplexity``
  (``val/perplexity``) divided by the *first* ``test/perplexity_ref`` (``val/perplexity_ref``):
  the held-out perplexity against the initial reference's, on the test split that nothing
  steers on and on the validation subset the budget steers on.

The frontier (:mod:`.frontier`) is fitted through the fixed-target runs as
``score = a + b ln(test_ratio)``, each seed its own point; a budget group's gap to it is
:func:`~rlkl_lightning.compare.frontier.frontier_gap` at its own ratios. A budget run **holds
its budget** when its ``test_ratio`` lies within ±20% of the budget's excess
(``1 + (budget - 1) * [0.8, 1.2]``); a budget group **is on the frontier** when its gap is not
below ``-(0.02 + 2 SE)``.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.events import read_scalars
from rlkl_lightning.compare.frontier import fit_frontier, frontier_gap

if TYPE_CHECKING:
    from rlkl_lightning.compare.config import StudyConfig
    from rlkl_lightning.compare.runs import Run

#: The part of a run its numbers are means over: the last third.
SETTLED_FRACTION = 1 / 3
#: A budget is held when the ratio's excess lies within this fraction of the budget's.
EXCESS_TOLERANCE = 0.2
#: A budget group may lie this far below the frontier beyond its 2 standard errors.
GAP_MARGIN = 0.02
#: A run whose settled KL exceeds this many times its target diverged: it is listed, flagged,
#: and left out of the frontier (a policy that collapsed is no point of a trade-off).
DIVERGED = 5.0
#: How a budget run **settles**: its ratio, smoothed as the trailing mean of ``SMOOTHING``
#: evaluations, inside ``EXCESS_TOLERANCE`` of the budget's excess by batch :func:`settle_by`,
#: inside ``SETTLED_TOLERANCE`` from then on, and the last third's mean inside
#: ``LAST_TOLERANCE`` of it.
SMOOTHING = 3
SETTLED_TOLERANCE = 0.25
LAST_TOLERANCE = 0.1


def settle_by(interval: int) -> int:
    """The batch by which a run validating every ``interval`` batches must be in its band.

    120 at an interval of 5, 200 at 25, on the line through them (a slower loop is given the
    time its extra evaluations take), never before 120.
    """
    return 120 + 4 * max(0, interval - 5)


def settling(curve: list[tuple[int, float]], budget: float, by: int) -> dict[str, Any]:
    """Whether a budget run settled, from its ``(batch, ratio)`` evaluations in order.

    Returns the first batch at which the smoothed ratio is inside ±``EXCESS_TOLERANCE`` of the
    excess, the smoothed ratio at ``by``, its range and the evaluations outside
    ±``SETTLED_TOLERANCE`` from ``by`` on, the last third's mean (evaluations after two thirds
    of the last one's batch) and the criteria it fails, named (none: it settled).
    """
    excess = budget - 1
    batches = [t for t, _ in curve]
    ratios = [r for _, r in curve]
    smooth = []
    for i in range(len(ratios)):
        window = ratios[max(0, i - SMOOTHING + 1) : i + 1]
        smooth.append(sum(window) / len(window))
    first = next(
        (t for t, m in zip(batches, smooth) if abs(m - budget) <= EXCESS_TOLERANCE * excess),
        None,
    )
    until = [m for t, m in zip(batches, smooth) if t <= by]
    after = [m for t, m in zip(batches, smooth) if t >= by]
    last = [r for t, r in curve if t > batches[-1] * 2 / 3]
    last_mean = sum(last) / len(last)
    failures = []
    if not after:
        failures.append(f"the run ended before batch {by}")
    elif abs(until[-1] - budget) > EXCESS_TOLERANCE * excess:
        failures.append(f"at batch {by}: {until[-1]:.4f}")
    if after and max(abs(m - budget) for m in after) > SETTLED_TOLERANCE * excess:
        failures.append(f"after batch {by}: {min(after):.4f}-{max(after):.4f}")
    if abs(last_mean - budget) > LAST_TOLERANCE * excess:
        failures.append(f"last third: {last_mean:.4f}")
    return {
        "by": by,
        "first_in_band": first,
        "at_by": until[-1] if until else None,
        "after": [min(after), max(after)] if after else None,
        "outside": sum(abs(m - budget) > SETTLED_TOLERANCE * excess for m in after),
        "last_third": last_mean,
        "failures": failures,
        "settled": not failures,
    }


def run_budget(run: Run) -> float | None:
    """The ``budget`` of a run's ``CapabilityBudget`` callback, or None (a fixed-target run)."""
    config = yaml.safe_load(run.config.read_text())
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        if str(callback.get("class_path", "")).endswith("CapabilityBudget"):
            from rlkl_lightning.defaults import default_of
            from rlkl_lightning.kl.capability_budget import CapabilityBudget

            args = callback.get("init_args") or {}
            return float(args.get("budget", default_of(CapabilityBudget, "budget")))
    return None


def run_target(run: Run) -> float:
    """The run's configured ``kl.target``."""
    from rlkl_lightning.kl.settings import KLSettings

    kl = yaml.safe_load(run.config.read_text()).get("kl") or {}
    return float(kl.get("target", KLSettings().target))


def settled_numbers(scalars: dict[str, dict[int, float]]) -> dict[str, Any]:
    """A run's means over the last third of its batches (module docstring), and its curves."""
    steps = sorted(scalars.get(keys.SCORE, {}))
    if not steps:
        raise ValueError("compare: a run of the budget study logged no `objective/score`")
    first = steps[min(len(steps) - 1, int(math.floor(len(steps) * (1 - SETTLED_FRACTION))))]
    late = [s for s in steps if s >= first]

    def mean(tag: str, at: list[int]) -> float | None:
        values = [scalars[tag][s] for s in at if s in scalars.get(tag, {})]
        return float(np.mean(values)) if values else None

    target_tag = keys.KL_TARGET if keys.KL_TARGET in scalars else keys.MONITOR_TARGET
    out: dict[str, Any] = {
        "batches": len(steps),
        "score": mean(keys.SCORE, late),
        "gold": mean(keys.GOLD_SCORE, late),
        "kl": mean(keys.KL, late),
        "target": mean(target_tag, late),
    }
    for name, tag, ref_tag in (
        ("test", keys.TEST_PERPLEXITY, keys.TEST_PERPLEXITY_REF),
        ("val", keys.PERPLEXITY, keys.PERPLEXITY_REF),
    ):
        ref = scalars.get(ref_tag, {})
        values = scalars.get(tag, {})
        if not ref or not values:
            out[f"{name}_ratio"] = None
            continue
        initial = ref[min(ref)]
        out[f"{name}_ratio"] = float(
            np.mean([v / initial for s, v in values.items() if s >= first])
        )
        out[f"{name}_curve"] = [
            (steps.index(s) + 1 if s in steps else None, v / initial)
            for s, v in sorted(values.items())
        ]
    batch_of = {s: i + 1 for i, s in enumerate(steps)}
    out["target_curve"] = [
        (batch_of[s], v) for s, v in sorted(scalars.get(target_tag, {}).items()) if s in batch_of
    ]
    return out


def _interval(budget: float) -> tuple[float, float]:
    excess = budget - 1
    return 1 + excess * (1 - EXCESS_TOLERANCE), 1 + excess * (1 + EXCESS_TOLERANCE)


def write_budget_report(runs: list[Run], study: StudyConfig, out: Path, elapsed: float) -> dict:
    """Read every run back, fit the frontier, judge each budget; write the report files."""
    rows = []
    for run in runs:
        numbers = settled_numbers(read_scalars(run.log_dir))
        rows.append(
            {
                "group": run.group,
                "seed": run.seed,
                "budget": run_budget(run),
                "configured_target": run_target(run),
                "cpu_s": run.cpu_s(),
                **numbers,
            }
        )
    for r in rows:
        r["settling"] = {}
        for name in ("test", "val"):
            curve = [(t, v) for t, v in r.get(f"{name}_curve", []) if t is not None]
            if r["budget"] is not None and len(curve) >= 2:
                by = settle_by(curve[1][0] - curve[0][0])
                r["settling"][name] = settling(curve, r["budget"], by)
        r["diverged"] = bool(
            r["kl"] is not None and r["target"] is not None and r["kl"] > DIVERGED * r["target"]
        )
    fixed = [
        r for r in rows if r["budget"] is None and r["test_ratio"] is not None and not r["diverged"]
    ]
    frontier = None
    if len(fixed) >= 3:
        frontier = fit_frontier([r["test_ratio"] for r in fixed], [r["score"] for r in fixed])
    budgets: dict[str, Any] = {}
    for group in dict.fromkeys(r["group"] for r in rows if r["budget"] is not None):
        members = [r for r in rows if r["group"] == group]
        budget = members[0]["budget"]
        lo, hi = _interval(budget)
        per_seed = [
            {
                "seed": r["seed"],
                "test_ratio": r["test_ratio"],
                "val_ratio": r["val_ratio"],
                "target": r["target"],
                "score": r["score"],
                "gold": r["gold"],
                "holds": bool(r["test_ratio"] is not None and lo <= r["test_ratio"] <= hi),
            }
            for r in members
        ]
        entry: dict[str, Any] = {
            "budget": budget,
            "interval": [lo, hi],
            "per_seed": per_seed,
            "holds_every_seed": all(s["holds"] for s in per_seed),
        }
        if frontier is not None:
            gap = frontier_gap(
                frontier, [r["test_ratio"] for r in members], [r["score"] for r in members]
            )
            gap["on_frontier"] = bool(gap["gap"] >= -(GAP_MARGIN + gap["two_se"]))
            entry["gap"] = gap
        budgets[group] = entry
    summary = {
        "study": {
            "batches": study.batches,
            "seeds": study.seeds,
            "val_every": study.val_every,
            "world": study.world,
            "elapsed_s": elapsed,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        },
        "frontier": None
        if frontier is None
        else {
            "intercept": frontier.intercept,
            "slope": frontier.slope,
            "residual_sd": frontier.residual_sd,
            "n": frontier.n,
        },
        "budgets": budgets,
        "runs": [{k: v for k, v in r.items() if not k.endswith("_curve")} for r in rows],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text("\n".join(_markdown(summary)) + "\n")
    plot_budget(rows, frontier, out)
    return summary


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _markdown(summary: dict[str, Any]) -> list[str]:
    s = summary["study"]
    lines = [
        "# Capability budget study",
        "",
        f"{len(summary['runs'])} runs of {s['batches']} batches, evaluated every "
        f"{s['val_every']} batches; world: {s['world'] or 'the default world'}; "
        f"{s['elapsed_s'] / 60:.1f} min on {s['machine']}. Every number is a mean over the last "
        "third of a run's batches; ratios are perplexities over the initial reference's, "
        "`test` on the test split (never steered on), `val` on the validation subset the "
        "budget steers on.",
        "",
        "## Runs",
        "",
        "| run | seed | budget | target (nats/seq) | KL (nats/seq) | test ratio | val ratio | "
        "score | gold |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["runs"]:
        flag = " (diverged: left out of the frontier)" if r["diverged"] else ""
        lines.append(
            f"| {r['group']}{flag} | {r['seed']} | "
            f"{_f(r['budget'], 'g') if r['budget'] else '-'} | "
            f"{_f(r['target'], '.2f')} | {_f(r['kl'], '.2f')} | {_f(r['test_ratio'])} | "
            f"{_f(r['val_ratio'])} | {_f(r['score'])} | {_f(r['gold'])} |"
        )
    f = summary["frontier"]
    lines += ["", "## Budgets", ""]
    if f is not None:
        lines.append(
            f"Frontier through the {f['n']} fixed-target runs: score = {f['intercept']:.3f} + "
            f"{f['slope']:.3f} ln(test ratio), residual sd {f['residual_sd']:.3f}."
        )
        lines.append("")
    lines += [
        "| budget | test ratio per seed | allowed (±20% of the excess) | holds | gap to the "
        "frontier ± 2 SE | on the frontier (gap >= -(0.02 + 2 SE)) |",
        "|---|---|---|---|---|---|",
    ]
    for group, b in summary["budgets"].items():
        ratios = ", ".join(_f(p["test_ratio"]) for p in b["per_seed"])
        gap = b.get("gap")
        gap_text = "n/a" if gap is None else f"{gap['gap']:+.3f} ± {gap['two_se']:.3f}"
        on = "n/a" if gap is None else ("yes" if gap["on_frontier"] else "no")
        lines.append(
            f"| {group} ({b['budget']:g}x) | {ratios} | {b['interval'][0]:.3f}-"
            f"{b['interval'][1]:.3f} | {'yes' if b['holds_every_seed'] else 'no'} | "
            f"{gap_text} | {on} |"
        )
    settled = [r for r in summary["runs"] if r.get("settling", {}).get("test")]
    if settled:
        lines += [
            "",
            "## Settling",
            "",
            "Each budget run's ratio, smoothed as the trailing mean of "
            f"{SMOOTHING} evaluations: the first batch inside ±{EXCESS_TOLERANCE:.0%} of the "
            "budget's excess, its range from the batch by which it must be there (120 at a "
            "validation every 5 batches, 200 at 25) and the evaluations outside "
            f"±{SETTLED_TOLERANCE:.0%} from then on, the last third's mean (within "
            f"±{LAST_TOLERANCE:.0%} allowed); settled: all three.",
            "",
            f"| run | seed | test: inside ±{EXCESS_TOLERANCE:.0%} from batch | smoothed from batch "
            f"*by* | outside ±{SETTLED_TOLERANCE:.0%} | last third (allowed) | settled | val: "
            "last third, settled |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in settled:
            t, v = r["settling"]["test"], r["settling"].get("val")
            excess = r["budget"] - 1
            lo, hi = 1 + excess * (1 - LAST_TOLERANCE), 1 + excess * (1 + LAST_TOLERANCE)
            after = "n/a" if t["after"] is None else f"{t['after'][0]:.3f}-{t['after'][1]:.3f}"
            val = (
                "n/a" if v is None else f"{v['last_third']:.3f}, {'yes' if v['settled'] else 'no'}"
            )
            lines.append(
                f"| {r['group']} | {r['seed']} | {t['first_in_band'] or 'never'} | {after} "
                f"(from {t['by']}) | {t['outside']} | {t['last_third']:.3f} ({lo:.3f}-{hi:.3f}) "
                f"| {'yes' if t['settled'] else 'no: ' + '; '.join(t['failures'])} | {val} |"
            )
    lines += [
        "",
        "`frontier.png`: score and gold score against the test ratio for every run, with the "
        "fitted frontier; `curves.png`: each budget run's target and ratios over the run.",
    ]
    return lines


def plot_budget(rows: list[dict[str, Any]], frontier: Any, out: Path) -> None:
    """``frontier.png`` (score and gold against test ratio) and ``curves.png`` (the cascade).

    Diverged runs are left off both (the report's table lists them).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("diverged")]  # listed in the report, off the axes
    groups = list(dict.fromkeys(r["group"] for r in rows))
    colors = {g: plt.cm.tab10(i % 10) for i, g in enumerate(groups)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, name in zip(axes, ("score", "gold"), strict=True):
        for r in rows:
            if r["test_ratio"] is None or r[name] is None:
                continue
            marker = "o" if r["budget"] is None else "*"
            ax.scatter(
                r["test_ratio"],
                r[name],
                color=colors[r["group"]],
                marker=marker,
                s=60 if marker == "*" else 30,
                label=r["group"],
            )
        if name == "score" and frontier is not None:
            xs = np.linspace(*[math.exp(v) for v in frontier.log_kl_range], 50)
            ax.plot(xs, frontier.score(xs), color="0.4", lw=1, label="frontier (fixed targets)")
        for r in rows:
            if r["budget"] is not None:
                ax.axvline(r["budget"], color=colors[r["group"]], lw=0.6, ls=":")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
        ax.set_xlabel("test perplexity / initial reference's (last third)")
        ax.set_ylabel(f"{name} score (last third)")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
    budget_rows = [r for r in rows if r["budget"] is not None]
    if not budget_rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in budget_rows:
        color = colors[r["group"]]
        batches, target = zip(*r["target_curve"], strict=True) if r["target_curve"] else ((), ())
        axes[0].plot(batches, target, color=color, lw=0.9, label=r["group"])
        curve = [(b, v) for b, v in r.get("test_curve", []) if b is not None]
        if curve:
            axes[1].plot(*zip(*curve, strict=True), color=color, lw=0.9, label=r["group"])
        axes[1].axhline(r["budget"], color=color, ls=":", lw=0.8)
    axes[0].set_xlabel("batch")
    axes[0].set_ylabel("KL target (nats/seq)")
    axes[1].set_xlabel("batch")
    axes[1].set_ylabel("test perplexity / initial reference's")
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
