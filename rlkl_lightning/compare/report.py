"""Aggregate the study's runs over seeds and write ``curves.png``, ``report.md``, ``summary.json``.

With a beta sweep, ``frontier.png`` shows final score and held-out perplexity against final KL
for every run, so one sees where the adaptive controller lands among the fixed betas; with 3 or
more fixed-beta runs the report also fits the frontier (:mod:`.frontier`) and gives every other
run's gap to it at equal KL, with its standard error. When the
runs log a gold score, ``gold_proxy.png`` and the report's "Gold vs proxy" section come from
:mod:`.gold`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.events import (
    METRICS,
    SETTLE_TOLERANCE,
    SETTLE_WINDOW,
    Curves,
    read_curves,
    run_metrics,
)
from rlkl_lightning.compare.frontier import Frontier, fit_frontier, frontier_gap
from rlkl_lightning.compare.gold import gold_report

if TYPE_CHECKING:
    from rlkl_lightning.compare.config import StudyConfig
    from rlkl_lightning.compare.runs import Run

SMOOTH = 5  # batches in the moving average of the score and KL curves
KL_FIELDS = ("target", "unit", "low", "high")  # of the CLI's `kl` group (KLSettings)


def kl_settings(runs: list[Run]) -> dict[str, Any]:
    """The KL target, unit and monitor band shared by every run.

    Raises:
        ValueError: If the runs do not share them (their numbers would not be comparable).
    """
    from rlkl_lightning.kl.settings import KLSettings

    defaults = KLSettings()
    seen = set()
    for run in runs:
        kl = yaml.safe_load(run.config.read_text()).get("kl") or {}
        seen.add(tuple(kl.get(k, getattr(defaults, k)) for k in KL_FIELDS))
    if len(seen) != 1:
        raise ValueError(
            f"compare: the runs must share kl.target, kl.unit, kl.low and kl.high; got {seen}"
        )
    return dict(zip(KL_FIELDS, seen.pop(), strict=True))


def aggregate(per_seed: list[dict[str, float | None]]) -> dict[str, Any]:
    """Mean over seeds of each metric, with the standard deviation and the per-seed values.

    A metric that is None for some seed (``settle_batch`` of a run that never settled) has no
    mean or standard deviation (None); its per-seed values keep the None.
    """
    out: dict[str, Any] = {"std": {}, "per_seed": {}}
    for name in METRICS:
        seeds = [m[name] for m in per_seed]
        out["per_seed"][name] = [None if v is None else float(v) for v in seeds]
        if any(v is None for v in seeds):
            out[name] = out["std"][name] = None
            continue
        v = np.array(seeds, dtype=float)
        out[name] = float(v.mean())
        out["std"][name] = float(v.std(ddof=1)) if len(v) > 1 else None
    return {name: out[name] for name in METRICS} | {"std": out["std"], "per_seed": out["per_seed"]}


def verdict(groups: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Does adaptive reach similar or better score with KL closer to target than fixed?

    "Similar or better" means the adaptive mean is at least the fixed mean minus two standard
    errors of the difference (over seeds); with one seed there is no error estimate and only
    the point values count. "Closer" compares the KL tracking errors.
    """
    if "adaptive" not in groups or "fixed" not in groups:
        return None
    a, f = groups["adaptive"], groups["fixed"]
    diff = a["final_score"] - f["final_score"]
    n_a, n_f = len(a["per_seed"]["final_score"]), len(f["per_seed"]["final_score"])
    if n_a > 1 and n_f > 1:
        se = math.sqrt(a["std"]["final_score"] ** 2 / n_a + f["std"]["final_score"] ** 2 / n_f)
    else:
        se = 0.0
    return {
        "score_difference": diff,
        "score_difference_2se": 2 * se if n_a > 1 and n_f > 1 else None,
        "similar_or_better_score": bool(diff >= -2 * se),
        "kl_closer_to_target": bool(a["kl_tracking_error"] < f["kl_tracking_error"]),
    }


def differences(groups: dict[str, dict[str, Any]], first: str, second: str) -> dict[str, Any]:
    """``second`` minus ``first`` for every metric, with two standard errors of the difference.

    ``beyond_two_se`` says whether the difference of the means exceeds twice its standard
    error ``sqrt(s_a^2 / n_a + s_b^2 / n_b)`` (over seeds); with a single seed on either side
    there is no error estimate (``two_se`` None, ``beyond_two_se`` False). A metric without a
    mean on either side (a run that never settled) has no difference (None).
    """
    a, b = groups[first], groups[second]
    out: dict[str, Any] = {"first": first, "second": second}
    for name in METRICS:
        n_a, n_b = len(a["per_seed"][name]), len(b["per_seed"][name])
        if a[name] is None or b[name] is None:  # a run that never settled: no mean
            out[name] = {"difference": None, "two_se": None, "beyond_two_se": False}
            continue
        diff = b[name] - a[name]
        two_se = None
        if n_a > 1 and n_b > 1:
            two_se = 2 * math.sqrt(a["std"][name] ** 2 / n_a + b["std"][name] ** 2 / n_b)
        out[name] = {
            "difference": diff,
            "two_se": two_se,
            "beyond_two_se": bool(two_se is not None and abs(diff) > two_se),
        }
    return out


def _differences_table(d: dict[str, Any]) -> list[str]:
    lines = [
        f"Difference `{d['second']}` - `{d['first']}` (mean over seeds), with two standard errors "
        "of the difference:",
        "",
        "| metric | difference | 2 SE | beyond 2 SE |",
        "|---|---|---|---|",
    ]
    for name in METRICS:
        row = d[name]
        diff = "-" if row["difference"] is None else f"{row['difference']:+.3g}"
        two_se = "-" if row["two_se"] is None else f"{row['two_se']:.3g}"
        beyond = "yes" if row["beyond_two_se"] else "no"
        lines.append(f"| {name} | {diff} | {two_se} | {beyond} |")
    return lines


def _statement(v: dict[str, Any] | None, groups: dict[str, Any], kl: dict[str, Any]) -> str:
    if v is None:
        return "The study ran no `fixed` / `adaptive` pair, so there is no controller verdict."
    a, f = groups["adaptive"], groups["fixed"]
    two_se = v["score_difference_2se"]
    score = (
        "higher than"
        if v["score_difference"] > (two_se or 0.0)
        else "similar to"
        if v["similar_or_better_score"]
        else "lower than"
    )
    spread = (
        "one seed: no error estimate" if two_se is None else f"two standard errors {two_se:.3f}"
    )
    closer = "closer to" if v["kl_closer_to_target"] else "no closer to"
    yes = v["similar_or_better_score"] and v["kl_closer_to_target"]
    return (
        f"Adaptive control reached a final score {score} that of the fixed beta it started from "
        f"({a['final_score']:.3f} vs {f['final_score']:.3f}, difference "
        f"{v['score_difference']:+.3f}; {spread}) "
        f"with its KL {closer} the target of {kl['target']:g} nats per {kl['unit']} "
        f"(tracking error {a['kl_tracking_error']:.2f} vs {f['kl_tracking_error']:.2f}; final "
        f"KL {a['final_kl']:.2f} vs {f['final_kl']:.2f}; in band {a['in_band_fraction']:.0%} "
        f"vs {f['in_band_fraction']:.0%} of batches). Final beta: {a['final_kl_coef']:.3g} "
        f"(adaptive) vs {f['final_kl_coef']:.3g} (fixed). Held-out perplexity: "
        f"{a['final_perplexity']:.3f} vs {f['final_perplexity']:.3f}.\n\n"
        f"**Adaptive reached similar or better score with KL closer to target: "
        f"{'yes' if yes else 'no'}"
        + (
            " (one seed's point values alone: no error estimate, so no difference is judged "
            "against the seeds' spread; run more seeds).**"
            if two_se is None
            else ".**"
        )
    )


def write_report(runs: list[Run], study: StudyConfig, out: Path, elapsed: float) -> dict:
    """Read every run, write the three (or four) files, return the summary."""
    kl = kl_settings(runs)
    curves = {run: read_curves(run.log_dir) for run in runs}
    by_group: dict[str, list[Run]] = {}
    for run in runs:
        by_group.setdefault(run.group, []).append(run)
    groups = {}
    for group, members in by_group.items():
        metrics = [run_metrics(curves[r], kl["target"], kl["low"], kl["high"]) for r in members]
        groups[group] = {
            **aggregate(metrics),
            "seeds": [r.seed for r in members],
            "init_kl_coef": members[0].kl_coef,
        }
    refs = [c.reference_perplexity for c in curves.values() if c.reference_perplexity]
    gold, gold_lines = gold_report(by_group, groups, out)  # adds final_gold to groups
    summary: dict[str, Any] = {
        **groups,
        "reference_perplexity": float(np.mean(refs)) if refs else None,
        "target_kl": kl["target"],
        "kl_unit": kl["unit"],
        "band": [kl["low"], kl["high"]],
        "seeds": list(range(study.seeds)),
        "batches": study.batches,
        "samples_per_run": int(max(c.samples[-1] for c in curves.values())),
        "elapsed_s": round(elapsed, 1),
        "verdict": verdict(groups),
        "gold": gold,
    }
    main_groups = [g for g in study.runs if g in by_group]
    fitted = frontier_summary(groups)
    summary["frontier"] = fitted and fitted[1]
    if len(main_groups) >= 2:
        summary["differences"] = [
            differences(groups, main_groups[0], other) for other in main_groups[1:]
        ]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves({g: [curves[r] for r in by_group[g]] for g in main_groups}, kl, out)
    frontier = len(by_group) > len(main_groups)
    if frontier:
        plot_frontier(groups, kl, out, fitted and fitted[0])
    else:
        (out / "frontier.png").unlink(missing_ok=True)  # from an earlier study
    first_runs = [members[0] for members in by_group.values()]
    (out / "report.md").write_text(
        _markdown(
            summary, groups, len(runs), first_runs, study, kl, frontier, main_groups, gold_lines
        )
    )
    return summary


def _markdown(
    summary, groups, n_runs, first_runs, study, kl, frontier: bool, main_groups, extra=()
) -> str:
    unit = f"nats per {kl['unit']}"
    lines = [
        f"# Study: {' vs '.join(main_groups)}",
        "",
        f"{n_runs} runs: {', '.join(f'`{g}`' for g in groups)}; seeds "
        f"{summary['seeds']}; {study.batches} PPO batches ({summary['samples_per_run']} samples) "
        f"per run; KL target {kl['target']:g} {unit}, band "
        f"[{kl['low']:g}x, {kl['high']:g}x]. {summary['elapsed_s'] / 60:.1f} minutes on "
        f"{os.cpu_count()} CPU cores ({platform.machine()}), {study.workers} "
        f"run{'s' if study.workers > 1 else ''} at a time with {study.threads} torch thread(s) "
        "each.",
        "",
        "![curves](curves.png)",
        "",
        "| run | initial beta | final score | KL tracking error | in band | drift warnings "
        "| final KL | final beta | held-out perplexity | settle batch | overshoot |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for group, g in groups.items():
        overshoot = _cell(g, "overshoot", ".2f") + f" ({g['overshoot'] / kl['target']:.0%})"
        lines.append(
            f"| `{group}` | {g['init_kl_coef']:g} | {_cell(g, 'final_score', '.3f')} | "
            f"{_cell(g, 'kl_tracking_error', '.2f')} | {_cell(g, 'in_band_fraction', '.2f')} | "
            f"{_cell(g, 'drift_warnings', '.1f')} | {_cell(g, 'final_kl', '.2f')} | "
            f"{_cell(g, 'final_kl_coef', '.3f')} | {_cell(g, 'final_perplexity', '.3f')} | "
            f"{_cell(g, 'settle_batch', '.0f')} | {overshoot} |"
        )
    ref = summary["reference_perplexity"]
    lines += [
        "",
        f"Reference held-out perplexity: {ref:.3f}." if ref else "No held-out perplexity.",
        "Values are mean ± standard deviation over seeds. Final score and final KL: mean over "
        "the last 20% of batches; KL tracking error: mean |KL - target| / target over the "
        "second half; in band: fraction of all batches with the batch KL inside the band; "
        "drift warnings: per run; settle batch: the first batch from which the "
        f"{SETTLE_WINDOW}-batch mean KL stays within {SETTLE_TOLERANCE:.0%} of the target "
        "(per seed, and never when it had not settled by the last batch); overshoot: the "
        f"largest excursion of the {SETTLE_WINDOW}-batch mean KL above the target, {unit} (in "
        "brackets: of the target).",
        "",
        _statement(summary["verdict"], groups, kl),
        "",
    ]
    if len(main_groups) > 2:
        lines += [_tracking(groups, main_groups), ""]
    for d in summary.get("differences", []):
        lines += _differences_table(d) + [""]
    if frontier:
        lines += ["![frontier](frontier.png)", ""]
    if summary.get("frontier"):
        lines += [*_frontier_lines(summary["frontier"]), ""]
    lines += [*extra, "Repeat one run alone (the first seed of each):", "", "```"]
    lines += [rerun_command(r.config) for r in first_runs]
    lines += ["```", ""]
    return "\n".join(lines)


def rerun_command(config: Path) -> str:
    """The shell command that repeats a run alone: its config path quoted (it may hold spaces)."""
    return f"python train.py fit --config {shlex.quote(str(config))}"


def fixed_groups(groups: dict[str, dict[str, Any]]) -> list[str]:
    """The fixed-beta groups (``fixed`` and the sweep's ``fixed_<beta>``), by beta."""
    return sorted(
        (g for g in groups if g == "fixed" or g.startswith("fixed_")),
        key=lambda g: groups[g]["init_kl_coef"],
    )


def frontier_summary(
    groups: dict[str, dict[str, Any]],
) -> tuple[Frontier, dict[str, Any]] | None:
    """The fitted fixed-beta frontier and every other group's gap to it; None without a fit.

    The fit takes every seed of every fixed-beta group as a point; it needs 3 points and 2
    distinct KLs (:func:`.frontier.fit_frontier`).
    """
    fixed = fixed_groups(groups)
    kl = [v for g in fixed for v in groups[g]["per_seed"]["final_kl"]]
    score = [v for g in fixed for v in groups[g]["per_seed"]["final_score"]]
    try:
        fit = fit_frontier(kl, score)
    except ValueError:  # too few fixed-beta runs: the plot alone
        return None
    gaps = {
        g: frontier_gap(
            fit, groups[g]["per_seed"]["final_kl"], groups[g]["per_seed"]["final_score"]
        )
        for g in groups
        if g not in fixed
    }
    return fit, {
        "model": "final_score = intercept + slope * ln(final_kl), least squares over seeds",
        "intercept": fit.intercept,
        "slope": fit.slope,
        "residual_sd": fit.residual_sd,
        "points": fit.n,
        "kl_range": [math.exp(v) for v in fit.log_kl_range],
        "gaps": gaps,
    }


def _frontier_lines(f: dict[str, Any]) -> list[str]:
    lo, hi = f["kl_range"]
    lines = [
        f"Fixed-beta frontier: final score = {f['intercept']:.3f} + {f['slope']:.3f} ln(final "
        f"KL), least squares through {f['points']} fixed-beta runs (every seed a point; KL "
        f"{lo:.2f}-{hi:.2f}; residual sd {f['residual_sd']:.3f}). Each run's gap is its mean "
        "score minus the frontier at its own final KL, per seed; its standard error adds the "
        "seeds' scatter of the gap and the frontier's error there."
        + (
            " A run of one seed has no scatter to measure, so its SE is the frontier's error "
            "alone and leaves out the run's own seed-to-seed noise (about the residual sd, "
            f"{f['residual_sd']:.3f}, if it is like a fixed-beta run's): its 2 SE covers far "
            "less than 95% of the gaps a rerun would give (about half where the two are alike)"
            "; read its 'beyond 2 SE' as a hint, or run more seeds."
            if any(d["seeds"] == 1 for d in f["gaps"].values())
            else ""
        ),
        "",
        "| run | final KL | gap to the frontier | 2 SE | beyond 2 SE | seeds "
        "| KL inside the fit's range |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, d in f["gaps"].items():
        lines.append(
            f"| `{g}` | {d['kl']:.2f} | {d['gap']:+.3f} | {d['two_se']:.3f} | "
            f"{'yes' if d['beyond_two_se'] else 'no'} | {d['seeds']} | "
            f"{'yes' if d['inside_range'] else 'no (extrapolated)'} |"
        )
    return lines


def _cell(g: dict[str, Any], name: str, fmt: str) -> str:
    """``mean ± std`` over seeds; the per-seed values where some seed has none ("never")."""
    if g[name] is None:
        return ", ".join("never" if v is None else format(v, fmt) for v in g["per_seed"][name])
    std = g["std"][name]
    mean = format(g[name], fmt)
    return mean if std is None or math.isnan(std) else f"{mean} ± {format(std, fmt)}"


def _tracking(groups: dict[str, dict[str, Any]], main_groups: list[str]) -> str:
    """The runs ranked by KL tracking error, with when they settled and how far they overshot."""
    parts = []
    for g in sorted(main_groups, key=lambda g: groups[g]["kl_tracking_error"]):
        settled = groups[g]["per_seed"]["settle_batch"]
        count = sum(v is not None for v in settled)
        when = (
            f"settled at batch {_cell(groups[g], 'settle_batch', '.0f')}"
            if count == len(settled)
            else "never settled"
            if count == 0
            else f"settled in {count} of {len(settled)} seeds"
        )
        parts.append(
            f"`{g}` {groups[g]['kl_tracking_error']:.3f} ({when}, overshoot "
            f"{groups[g]['overshoot']:.2f}, in band {groups[g]['in_band_fraction']:.0%})"
        )
    return f"KL tracking error, best first: {'; '.join(parts)}."


def _smooth(x: np.ndarray, k: int = SMOOTH) -> np.ndarray:
    """Trailing moving average over up to ``k`` values (shorter at the start)."""
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - k, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _stack(series: list[np.ndarray]) -> np.ndarray:
    n = min(len(s) for s in series)  # seeds may differ by a skipped batch
    return np.stack([s[:n] for s in series])


def plot_curves(groups: dict[str, list[Curves]], kl: dict[str, Any], out: Path) -> None:
    """Score, KL (target and band), beta and held-out perplexity against samples seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    (ax_score, ax_kl), (ax_beta, ax_ppl) = axes
    target = kl["target"]
    ax_kl.axhspan(kl["low"] * target, kl["high"] * target, color="tab:green", alpha=0.08)
    ax_kl.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
    for edge in (1 - SETTLE_TOLERANCE, 1 + SETTLE_TOLERANCE):  # where settle_batch counts
        label = f"target ± {SETTLE_TOLERANCE:.0%}" if edge < 1 else None
        ax_kl.axhline(edge * target, color="black", linestyle=":", linewidth=0.8, label=label)
    for i, (group, runs) in enumerate(groups.items()):
        color = f"C{i}"
        samples = _stack([c.samples for c in runs])[0]
        for ax, field, smooth in (
            (ax_score, "score", True),
            (ax_kl, "kl", True),
            (ax_beta, "kl_coef", False),
        ):
            values = _stack([getattr(c, field) for c in runs])
            if smooth:
                values = np.stack([_smooth(v) for v in values])
            seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            ax.plot(samples, values.mean(0), color=color, label=f"{group} ({seeds})")
            ax.fill_between(samples, values.min(0), values.max(0), color=color, alpha=0.2)
        if all(len(c.perplexity) for c in runs):
            ppl = _stack([c.perplexity for c in runs])
            x = _stack([c.val_samples for c in runs])[0]
            ax_ppl.plot(x, ppl.mean(0), "o-", color=color, label=group)
            ax_ppl.fill_between(x, ppl.min(0), ppl.max(0), color=color, alpha=0.2)
    refs = [c.reference_perplexity for runs in groups.values() for c in runs]
    if refs and refs[0]:
        ax_ppl.axhline(refs[0], color="black", linestyle="--", linewidth=1, label="reference")
    unit = f"nats per {kl['unit']}"
    ax_score.set(title=f"reward-model score ({SMOOTH}-batch mean)", ylabel=keys.SCORE)
    ax_kl.set(
        title=f"KL to the reference ({SMOOTH}-batch mean); band {kl['low']:g}x-{kl['high']:g}x",
        ylabel=f"objective/kl ({unit})",
    )
    ax_beta.set(title="beta", ylabel=keys.KL_COEF, yscale="log")
    ax_ppl.set(title="held-out perplexity", ylabel=keys.PERPLEXITY)
    for ax in axes.flat:
        ax.set_xlabel("samples seen")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Lines: mean over seeds; shading: min to max over seeds")
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def plot_frontier(
    groups: dict[str, dict[str, Any]],
    kl: dict[str, Any],
    out: Path,
    fit: Frontier | None = None,
) -> None:
    """Final score and perplexity against final KL, one point per run (and the fitted line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_score, ax_ppl) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    fixed = fixed_groups(groups)
    if fit is not None:
        grid = np.exp(np.linspace(*fit.log_kl_range, 50))
        band = 2 * fit.standard_error(grid)
        line = fit.score(grid)
        ax_score.plot(
            grid, line, ":", color="black", linewidth=1, label="fitted frontier (a + b ln KL)"
        )
        ax_score.fill_between(
            grid, line - band, line + band, color="gray", alpha=0.15, label="its 2 SE band"
        )
    for ax, name in ((ax_score, "final_score"), (ax_ppl, "final_perplexity")):
        ax.axvline(kl["target"], color="black", linestyle="--", linewidth=1, label="target")
        xs = [groups[g]["final_kl"] for g in fixed]
        ax.plot(xs, [groups[g][name] for g in fixed], "-", color="gray", alpha=0.6)
        for g in fixed:
            per = groups[g]["per_seed"]
            ax.scatter(per["final_kl"], per[name], color="gray", s=15)
            ax.annotate(
                f"beta {groups[g]['init_kl_coef']:g}",
                (groups[g]["final_kl"], groups[g][name]),
                fontsize=8,
            )
        for g in (x for x in groups if x not in fixed):
            per = groups[g]["per_seed"]
            color = f"C{list(groups).index(g)}"  # the run's colour in curves.png
            ax.scatter(per["final_kl"], per[name], marker="*", s=120, color=color, label=g)
        ax.set_xlabel(f"final KL (nats per {kl['unit']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_score.set(title="score vs KL: fixed betas (gray) and the controllers", ylabel="final score")
    ax_ppl.set(title="held-out perplexity vs KL", ylabel="final perplexity")
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
