"""Gold vs proxy: where optimising the trained score stopped improving the true one.

Runs that log ``objective/gold_score`` (a ``gold_reward``: on the default world, the world's
own sentiment, :mod:`rlkl_lightning.world.gold`) beside the proxy ``objective/score`` are read
back here. Each run's batches are cut into ``BLOCKS`` consecutive blocks; a block's mean KL,
proxy and gold are one point of ``gold_proxy.png`` (gold and proxy against KL, a panel per run
group, a line per seed), like the checkpoints of Gao et al. 2022 (arXiv 2210.10760).

Per run (``n`` batches), with the standard error of a block mean ``s / sqrt(m)`` (``s``: the
standard deviation of per-batch gold around its block's mean, pooled over blocks; ``m``: the
block's batches) and "beyond 2 SE" meaning a difference of two block means larger than twice
the standard error of that difference:

- ``final_gold``: mean gold over the last 20% of batches (as ``final_score``);
- the **gold peak**: the block with the highest mean gold, its KL, gold and proxy;
- the **verdict**, where proxy optimisation stopped paying off in gold:

  - ``fell``: the last block's gold is below the peak's beyond 2 SE: it stopped at the
    peak's KL (Gao et al.'s over-optimisation);
  - ``plateau``: it did not fall, but gold stopped improving at the first block that no later
    block beats beyond 2 SE (its KL; the proxy's gain after it is reported);
  - ``rising``: the last block beats the one before beyond 2 SE: gold still improving at the
    end, it never stopped paying off;
  - ``short``: one batch per block, no spread to judge by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare.events import FINAL_FRACTION, read_scalars

if TYPE_CHECKING:
    from rlkl_lightning.compare.runs import Run

GOLD_TAG = keys.GOLD_SCORE
BLOCKS = 10  # points per run on gold_proxy.png


@dataclass
class GoldCurve:
    """A run's per-batch KL, proxy score and gold score (the batches that logged all three)."""

    kl: np.ndarray
    proxy: np.ndarray
    gold: np.ndarray


def read_gold_curve(log_dir: Path) -> GoldCurve | None:
    """The run's :class:`GoldCurve`, or None if it logged no gold score."""
    scalars = read_scalars(log_dir)
    gold = scalars.get(GOLD_TAG, {})
    steps = sorted(s for s in gold if s in scalars.get(keys.SCORE, {}))
    if not steps:
        return None
    return GoldCurve(
        kl=np.array([scalars[keys.KL][s] for s in steps]),
        proxy=np.array([scalars[keys.SCORE][s] for s in steps]),
        gold=np.array([gold[s] for s in steps]),
    )


def analyse(curve: GoldCurve, blocks: int = BLOCKS) -> dict[str, Any]:
    """Block means, the gold peak and the verdict (module docstring)."""
    n = len(curve.gold)
    parts = np.array_split(np.arange(n), min(blocks, n))
    mean = {
        k: np.array([getattr(curve, k)[p].mean() for p in parts]) for k in ("kl", "proxy", "gold")
    }
    gold, sizes, last = mean["gold"], np.array([len(p) for p in parts]), len(parts) - 1
    residual = np.concatenate([curve.gold[p] - curve.gold[p].mean() for p in parts])
    dof = n - len(parts)
    spread = math.sqrt(float(residual @ residual) / dof) if dof > 0 else math.nan

    def two_se(i: int, j: int) -> float:
        return 2 * spread * math.sqrt(1 / sizes[i] + 1 / sizes[j])

    peak = int(np.argmax(gold))
    drop = float(gold[peak] - gold[last])
    # The first block that no later block beats beyond 2 SE: gold stopped improving there.
    plateau = next(
        k
        for k in range(last + 1)
        if all(gold[j] - gold[k] <= two_se(k, j) for j in range(k + 1, last + 1))
    )
    if math.isnan(spread):
        verdict = "short"
    elif drop > two_se(peak, last):
        verdict = "fell"
    else:
        verdict = "rising" if plateau == last else "plateau"
    final = max(1, math.ceil(FINAL_FRACTION * n))
    at = {"peak": peak, "plateau": plateau, "last": last}
    return {
        "final_gold": float(curve.gold[-final:].mean()),
        "blocks": {k: v.tolist() for k, v in mean.items()},
        "verdict": verdict,
        "gold_fell": verdict == "fell",
        "gold_drop": drop,
        "gold_drop_two_se": None if math.isnan(spread) else two_se(peak, last),
        **{f"{name}_block": k for name, k in at.items()},
        **{
            f"{name}_{q}": float(mean[q][k])
            for name, k in at.items()
            for q in ("kl", "gold", "proxy")
        },
    }


def run_sentence(a: dict[str, Any]) -> str:
    """What one run's analysis says, in words."""
    blocks = len(a["blocks"]["gold"])
    if a["verdict"] == "short":
        return "too few batches to judge (one per block)"
    if a["verdict"] == "fell":
        return (
            f"gold peaked at KL {a['peak_kl']:.2f} ({a['peak_gold']:.3f}) and fell to "
            f"{a['last_gold']:.3f} by KL {a['last_kl']:.2f} (drop {a['gold_drop']:.3f} > 2 SE "
            f"{a['gold_drop_two_se']:.3f}) while the proxy went {a['peak_proxy']:.3f} -> "
            f"{a['last_proxy']:.3f}: proxy optimisation stopped paying off at KL "
            f"{a['peak_kl']:.2f}"
        )
    if a["verdict"] == "plateau":
        return (
            f"gold stopped improving at KL {a['plateau_kl']:.2f} (block {a['plateau_block'] + 1} "
            f"of {blocks}, {a['plateau_gold']:.3f}: no later block beyond 2 SE above it) while "
            f"the proxy went {a['plateau_proxy']:.3f} -> {a['last_proxy']:.3f}; it did not fall "
            f"(peak {a['peak_gold']:.3f} at KL {a['peak_kl']:.2f}, last block "
            f"{a['last_gold']:.3f} at KL {a['last_kl']:.2f})"
        )
    return (
        f"gold still improving at the end: the last block ({a['last_gold']:.3f} at KL "
        f"{a['last_kl']:.2f}) is beyond 2 SE above the one before; proxy {a['last_proxy']:.3f}"
    )


def gold_report(
    by_group: dict[str, list[Run]], groups: dict[str, dict[str, Any]], out: Path
) -> tuple[dict[str, Any] | None, list[str]]:
    """Read the gold of every run, write ``gold_proxy.png``; returns (summary, markdown lines).

    Adds ``final_gold`` (mean, ``std`` and ``per_seed``) to each group of ``groups`` whose runs
    all logged a gold score. Without any, removes a stale ``gold_proxy.png`` and says so.
    """
    curves = {
        g: {r.seed: c for r in runs if (c := read_gold_curve(r.log_dir)) is not None}
        for g, runs in by_group.items()
    }
    curves = {g: c for g, c in curves.items() if c and len(c) == len(by_group[g])}
    if not curves:
        (out / "gold_proxy.png").unlink(missing_ok=True)
        return None, [f"No run logged `{GOLD_TAG}` (no `gold_reward`): no gold vs proxy.", ""]
    runs = {g: {seed: analyse(c) for seed, c in cs.items()} for g, cs in curves.items()}
    for g, per_seed in runs.items():
        values = np.array([a["final_gold"] for a in per_seed.values()])
        groups[g]["final_gold"] = float(values.mean())
        groups[g]["std"]["final_gold"] = float(values.std(ddof=1)) if len(values) > 1 else None
        groups[g]["per_seed"]["final_gold"] = values.tolist()
    plot_gold_proxy(runs, out)
    statement = overall_statement(runs, groups)
    summary = {
        "runs": {g: {str(s): a for s, a in per.items()} for g, per in runs.items()},
        "statement": statement,
    }
    return summary, _markdown(runs, groups, statement)


def overall_statement(runs: dict[str, dict[int, dict]], groups: dict[str, dict]) -> str:
    """Where proxy optimisation stopped paying off in gold, over all runs, in words."""
    by_verdict: dict[str, list[str]] = {}
    for g, per_seed in runs.items():
        for seed, a in per_seed.items():
            kl = {"fell": a["peak_kl"], "plateau": a["plateau_kl"]}.get(a["verdict"], a["last_kl"])
            by_verdict.setdefault(a["verdict"], []).append(f"`{g}` seed {seed}: KL {kl:.2f}")
    said = {
        "fell": "gold peaked and then fell in {n} (at the peak: {runs})",
        "plateau": "gold stopped improving without falling in {n} (from: {runs})",
        "rising": "gold was still improving at the end in {n} ({runs})",
        "short": "{n} too short to judge",
    }
    parts = [
        said[v].format(n=f"{len(r)} run{'s' if len(r) > 1 else ''}", runs=", ".join(r))
        for v, r in ((v, by_verdict.get(v, [])) for v in said)
        if r
    ]
    within = f"Within runs, {'; '.join(parts)}"
    # Across runs: the run group with the best final gold, and those that spent more KL.
    best = max(runs, key=lambda g: groups[g]["final_gold"])
    b = groups[best]
    costly = [
        g
        for g in runs
        if groups[g]["final_kl"] > b["final_kl"]
        and groups[g]["final_score"] > b["final_score"]
        and groups[g]["final_gold"] < b["final_gold"]
    ]
    across = (
        f"Across runs, the best final gold is `{best}`'s ({b['final_gold']:.3f} at final KL "
        f"{b['final_kl']:.2f}, proxy {b['final_score']:.3f})"
    )
    # A gold below the best's is only said to be lower beyond two standard errors of the
    # difference (over seeds); one seed on either side has no error estimate.
    below = {g: _beyond_2se_below(groups[best], groups[g]) for g in runs if g != best}
    tied = [g for g, beyond in below.items() if not beyond]
    if tied:
        across += (
            " (not above these beyond 2 SE, or with one seed and no error estimate: "
            + ", ".join(f"`{g}` {groups[g]['final_gold']:.3f}" for g in tied)
            + ")"
        )

    def listed(names: list[str]) -> str:
        return ", ".join(
            f"`{g}` (KL {groups[g]['final_kl']:.2f}, proxy {groups[g]['final_score']:.3f}, gold "
            f"{groups[g]['final_gold']:.3f})"
            for g in sorted(names, key=lambda g: groups[g]["final_kl"])
        )

    lower = [g for g in costly if below[g]]
    unsure = [g for g in costly if not below[g]]
    if lower:
        across += (
            "; runs that spent more KL reached a higher proxy but a lower gold (beyond 2 SE): "
            + listed(lower)
        )
    if unsure:
        across += (
            "; runs that spent more KL reached a higher proxy and a lower mean gold, but not "
            "beyond 2 SE (or on one seed): the seeds cannot tell their gold from the best's: "
            + listed(unsure)
        )
    if not costly:
        across += "; no run that spent more KL reached a higher proxy with a lower gold"
    return f"{within}. {across}."


def _beyond_2se_below(best: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether ``other``'s mean final gold lies below ``best``'s beyond 2 SE (over seeds)."""
    n_b, n_o = len(best["per_seed"]["final_gold"]), len(other["per_seed"]["final_gold"])
    if n_b < 2 or n_o < 2:
        return False
    s_b, s_o = best["std"]["final_gold"], other["std"]["final_gold"]
    two_se = 2 * math.sqrt(s_b**2 / n_b + s_o**2 / n_o)
    return best["final_gold"] - other["final_gold"] > two_se


def _markdown(runs, groups, statement: str) -> list[str]:
    lines = [
        "## Gold vs proxy",
        "",
        "![gold and proxy against KL](gold_proxy.png)",
        "",
        "| run | final score (proxy) | final gold |",
        "|---|---|---|",
    ]
    for g in runs:
        cells = []
        for name, fmt in (("final_score", ".3f"), ("final_gold", ".3f")):
            std = groups[g]["std"][name]
            cell = format(groups[g][name], fmt)
            cells.append(cell if std is None or math.isnan(std) else f"{cell} ± {std:{fmt}}")
        lines.append(f"| `{g}` | {' | '.join(cells)} |")
    lines += [
        "",
        f"Final gold: mean `{GOLD_TAG}` over the last 20% of batches. Each run is cut into "
        f"{BLOCKS} blocks of batches. Gold fell when the last block's mean is more than two "
        "standard errors (2 SE) below the highest block's; otherwise it stopped improving at "
        "the first block that no later block beats by more than 2 SE, or is still improving "
        "when that is the last block.",
        "",
    ]
    for g, per_seed in runs.items():
        for seed, a in per_seed.items():
            lines.append(f"- `{g}` seed {seed}: {run_sentence(a)}.")
    lines += ["", f"**{statement}**", ""]
    return lines


def plot_gold_proxy(runs: dict[str, dict[int, dict]], out: Path) -> None:
    """Gold (solid) and proxy (dashed) block means against KL, a panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(runs))
    rows = math.ceil(len(runs) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(max(5 * cols, 9), 3.8 * rows + 0.5),
        squeeze=False,
        layout="constrained",
    )
    for ax, (g, per_seed) in zip(axes.flat, runs.items(), strict=False):
        for i, (seed, a) in enumerate(per_seed.items()):
            color, blocks = f"C{i}", a["blocks"]
            ax.plot(blocks["kl"], blocks["gold"], "o-", color=color, label=f"gold, seed {seed}")
            ax.plot(
                blocks["kl"],
                blocks["proxy"],
                "x--",
                color=color,
                alpha=0.6,
                label=f"proxy, seed {seed}",
            )
            where = {"fell": ("peak", "*"), "plateau": ("plateau", "^")}.get(a["verdict"])
            if where:  # where proxy optimisation stopped paying off in gold
                name, marker = where
                ax.plot(a[f"{name}_kl"], a[f"{name}_gold"], marker, color=color, markersize=14)
        ax.set(title=f"{g}: gold (solid) and proxy (dashed)", xlabel=keys.KL)
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Means of {BLOCKS} blocks of batches per run, in batch order\nstar: gold's peak, "
        "when gold fell after it; triangle: where gold stopped improving, when it did not fall",
        fontsize=10,
    )
    fig.savefig(out / "gold_proxy.png", dpi=110)
    plt.close(fig)
