"""Gold vs proxy: where optimising the trained score stopped improving the true one.

Runs that log ``objective/gold_score`` (a ``gold_reward``: on the default world, the world's
own sentiment, :mod:`rlkl_lightning.world.gold`) beside the proxy ``objective/score`` are read
back here. Each run's batches are cut into ``BLOCKS`` consecutive blocks; a block's mean KL,
proxy and gold are one point of ``gold_proxy.png`` (gold and proxy against KL, a panel per run
group, a line per seed), like the checkpoints of Gao et al. 2022 (arXiv 2210.10760).

Per run (``n`` batches):

- ``final_gold``: mean gold over the last 20% of batches (as ``final_score``);
- the **gold peak**: the block with the highest mean gold, its KL, gold and proxy;
- **gold fell after its peak** when the last block's gold is more than two standard errors
  below the peak's. The standard error of a block mean is ``s / sqrt(m)``, with ``s`` the
  standard deviation of per-batch gold around its block's mean (pooled over blocks) and ``m``
  the block's batches. Then proxy optimisation stopped paying off in gold at the peak's KL;
  otherwise the gold was still paying off at the run's last KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rlkl_lightning.compare.events import FINAL_FRACTION, read_scalars

if TYPE_CHECKING:
    from rlkl_lightning.compare.runs import Run

GOLD_TAG = "objective/gold_score"
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
    steps = sorted(s for s in gold if s in scalars.get("objective/score", {}))
    if not steps:
        return None
    return GoldCurve(
        kl=np.array([scalars["objective/kl"][s] for s in steps]),
        proxy=np.array([scalars["objective/score"][s] for s in steps]),
        gold=np.array([gold[s] for s in steps]),
    )


def analyse(curve: GoldCurve, blocks: int = BLOCKS) -> dict[str, Any]:
    """Block means, the gold peak and whether gold fell after it (module docstring)."""
    n = len(curve.gold)
    parts = np.array_split(np.arange(n), min(blocks, n))
    mean = {
        k: np.array([getattr(curve, k)[p].mean() for p in parts]) for k in ("kl", "proxy", "gold")
    }
    sizes = np.array([len(p) for p in parts])
    residual = np.concatenate([curve.gold[p] - curve.gold[p].mean() for p in parts])
    dof = n - len(parts)
    spread = math.sqrt(float(residual @ residual) / dof) if dof > 0 else math.nan
    peak, last = int(np.argmax(mean["gold"])), len(parts) - 1
    drop = float(mean["gold"][peak] - mean["gold"][last])
    two_se = 2 * spread * math.sqrt(1 / sizes[peak] + 1 / sizes[last])
    final = max(1, math.ceil(FINAL_FRACTION * n))
    return {
        "final_gold": float(curve.gold[-final:].mean()),
        "blocks": {k: v.tolist() for k, v in mean.items()},
        "peak_block": peak,
        "peak_kl": float(mean["kl"][peak]),
        "peak_gold": float(mean["gold"][peak]),
        "peak_proxy": float(mean["proxy"][peak]),
        "last_kl": float(mean["kl"][last]),
        "last_gold": float(mean["gold"][last]),
        "last_proxy": float(mean["proxy"][last]),
        "gold_drop": drop,
        "gold_drop_two_se": None if math.isnan(two_se) else two_se,
        "gold_fell": bool(peak < last and not math.isnan(two_se) and drop > two_se),
    }


def run_sentence(a: dict[str, Any]) -> str:
    """What one run's analysis says, in words."""
    if a["gold_drop_two_se"] is None:
        return "too few batches to judge (one per block)"
    if a["gold_fell"]:
        return (
            f"gold peaked at KL {a['peak_kl']:.2f} ({a['peak_gold']:.3f}) and fell to "
            f"{a['last_gold']:.3f} by KL {a['last_kl']:.2f} (drop {a['gold_drop']:.3f} > 2 SE "
            f"{a['gold_drop_two_se']:.3f}) while the proxy went {a['peak_proxy']:.3f} -> "
            f"{a['last_proxy']:.3f}: proxy optimisation stopped paying off at KL "
            f"{a['peak_kl']:.2f}"
        )
    where = "at the end" if a["peak_block"] == len(a["blocks"]["gold"]) - 1 else "near the end"
    return (
        f"gold still paying off: highest {where} ({a['peak_gold']:.3f} at KL "
        f"{a['peak_kl']:.2f}), last block {a['last_gold']:.3f} at KL {a['last_kl']:.2f} (within "
        f"2 SE {a['gold_drop_two_se']:.3f} of the peak); proxy {a['last_proxy']:.3f}"
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
    judged = [(g, s, a) for g, per in runs.items() for s, a in per.items()]
    judged = [(g, s, a) for g, s, a in judged if a["gold_drop_two_se"] is not None]
    fell = [(g, s, a) for g, s, a in judged if a["gold_fell"]]
    total = sum(len(per) for per in runs.values())
    short = f" ({total - len(judged)} too short to judge)" if len(judged) < total else ""
    if not judged:
        within = "Within runs, there were too few batches to judge whether gold fell"
    elif fell:
        kls = ", ".join(f"`{g}` seed {s}: KL {a['peak_kl']:.2f}" for g, s, a in fell)
        within = (
            f"Within runs, gold peaked and then fell in {len(fell)} of {len(judged)} runs{short}, "
            f"so proxy optimisation stopped paying off in gold at the peak ({kls})"
        )
    else:
        top = max(a["last_kl"] for _, _, a in judged)
        within = (
            f"Within runs, gold did not fall after its peak in any of the {len(judged)} runs"
            f"{short}: proxy optimisation still paid off in gold at every KL reached (up to "
            f"{top:.2f})"
        )
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
    if costly:
        more = ", ".join(
            f"`{g}` (KL {groups[g]['final_kl']:.2f}, proxy {groups[g]['final_score']:.3f}, gold "
            f"{groups[g]['final_gold']:.3f})"
            for g in sorted(costly, key=lambda g: groups[g]["final_kl"])
        )
        across += f"; runs that spent more KL reached a higher proxy but a lower gold: {more}"
    else:
        across += "; no run that spent more KL reached a higher proxy with a lower gold"
    return f"{within}. {across}."


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
        f"{BLOCKS} blocks of batches; gold fell after its peak when the last block's mean is "
        "more than two standard errors below the highest block's.",
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
        rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False, constrained_layout=True
    )
    for ax, (g, per_seed) in zip(axes.flat, runs.items(), strict=False):
        for i, (seed, a) in enumerate(per_seed.items()):
            color, blocks = f"C{i}", a["blocks"]
            ax.plot(blocks["kl"], blocks["gold"], "o-", color=color, label=f"gold, seed {seed}")
            ax.plot(blocks["kl"], blocks["proxy"], "x--", color=color, alpha=0.6, label="proxy")
            marker = "*" if a["gold_fell"] else "^"
            ax.plot(a["peak_kl"], a["peak_gold"], marker, color=color, markersize=14)
        ax.set(title=f"{g}: gold (solid) and proxy (dashed)", xlabel="objective/kl")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Block means of {BLOCKS} blocks per run, in batch order; star: gold's peak when gold "
        "fell after it, triangle: highest block when it did not"
    )
    fig.savefig(out / "gold_proxy.png", dpi=110)
    plt.close(fig)
