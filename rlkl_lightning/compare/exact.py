"""The exact-world study's report: each run's exact distance to the optimum and to the frontier.

The runs train on the exact world (:mod:`rlkl_lightning.world.exact`) with its
``ExactMetrics`` callback, which logs the policy's exact KL to the reference, expected reward
and KL to ``pi*`` at the run's beta. From the last evaluation of every run (the final policy)
this module writes ``report.md``, ``summary.json`` and ``frontier.png``:

- runs with a fixed beta: ``KL(pi‖pi*)`` over seeds (mean, standard deviation, per seed), its
  fraction of the distance the run started from (``KL(ref‖pi*)``), and the final (KL, reward)
  beside the exact frontier (the largest reward any policy has at that KL);
- runs with a KL target (a control law): the final beta beside the exact beta of the target
  (:func:`rlkl_lightning.kl.optimum.beta_for_kl`), the exact KL reached, and the reward gap to
  the frontier at that KL.

A run "ends at the optimum" when its mean ``KL(pi‖pi*)`` is below ``AT_OPTIMUM`` of its
starting distance ``KL(ref‖pi*)``; the report gives the numbers for any other reading.
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
from rlkl_lightning.compare.events import overshoot, read_scalars, settle_batch
from rlkl_lightning.kl.laws import law_name

if TYPE_CHECKING:
    from rlkl_lightning.compare.config import StudyConfig
    from rlkl_lightning.compare.runs import Run

#: "At the optimum": final ``KL(pi‖pi*)`` below this fraction of the start's ``KL(ref‖pi*)``.
AT_OPTIMUM = 0.1
#: Adam steps of each placement's exact-gradient end point (converged by 1,500 on this world).
END_STEPS = 1500
_CALLBACK = "rlkl_lightning.world.exact.ExactMetrics"
_NOT_WORLD = ("every", "beta_attribute")  # ExactMetrics' own arguments


def run_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What a run's config says about it: algorithm, KL placement and estimator, law, world."""
    from rlkl_lightning.compare.runs import init_arg

    model = config.get("model") or {}
    placement = init_arg(config, "model", "penalty.placement")
    estimator = init_arg(
        config, "model", "penalty.estimator" if placement == "reward" else "penalty.loss_estimator"
    )
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    world = [c.get("init_args") or {} for c in callbacks if c.get("class_path") == _CALLBACK]
    if not world:
        raise ValueError(f"compare: a run of the exact study needs the `{_CALLBACK}` callback")
    kl = config.get("kl") or {}
    return {
        "algorithm": model.get("class_path", "").rpartition(".")[2].removesuffix("Module"),
        "placement": placement,
        "estimator": estimator,
        "law": law_name(kl.get("controller", "adaptive")),
        "target": kl.get("target", 6.0),
        "init_kl_coef": float(init_arg(config, "model", "penalty.init_coef")),
        "world": {k: v for k, v in world[0].items() if k not in _NOT_WORLD},
    }


def final_values(log_dir: Path) -> dict[str, float]:
    """The last exact evaluation of a run, its last beta and entropy, its KL to ``pi*`` half-way."""
    scalars = read_scalars(log_dir)
    names = {
        "kl_to_ref": keys.EXACT_KL_TO_REF,
        "reward": keys.EXACT_REWARD,
        "kl_to_optimum": keys.EXACT_KL_TO_OPTIMUM,
        "kl_coef": keys.KL_COEF,
        "entropy": keys.ENTROPY,
    }
    out = {}
    for name, tag in names.items():
        series = scalars.get(tag)
        if not series:
            raise ValueError(f"compare: {log_dir} has no `{tag}`; was ExactMetrics on?")
        out[name] = float(series[max(series)])
    # Still moving? The distance at the evaluation nearest to half-way through the run.
    series = scalars[keys.EXACT_KL_TO_OPTIMUM]
    out["kl_to_optimum_halfway"] = float(
        series[min(series, key=lambda s: abs(s - max(series) / 2))]
    )
    return out


def settling(log_dir: Path, target: float) -> dict[str, Any]:
    """A law's settle batch (None: never) and overshoot, as the other studies define them."""
    series = read_scalars(log_dir)[keys.KL]
    kl = np.array([series[step] for step in sorted(series)], dtype=float)
    return {"settle": settle_batch(kl, target), "overshoot": overshoot(kl, target)}


def _stats(values: list[float]) -> dict[str, Any]:
    v = np.asarray(values, dtype=float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else None,
        "per_seed": [float(x) for x in v],
    }


def summarise(runs: list[Run], end_steps: int = END_STEPS) -> dict[str, Any]:
    """Every group's settings and final exact numbers over seeds, with the world's yardsticks.

    ``end_steps``: Adam steps of each placement's exact-gradient end point.
    """
    from rlkl_lightning.kl import optimum as opt
    from rlkl_lightning.world.exact import ExactWorld, ExactWorldConfig, placement_end_point

    worlds: dict[str, ExactWorld] = {}
    groups: dict[str, dict[str, Any]] = {}
    end_points: dict[tuple[str, str, float], dict[str, float]] = {}
    for run in runs:
        settings = run_settings(yaml.safe_load(run.config.read_text()))
        key = json.dumps(settings["world"], sort_keys=True)
        if key not in worlds:
            worlds[key] = ExactWorld(ExactWorldConfig(**settings["world"]))
        g = groups.setdefault(run.group, {**settings, "seeds": [], "finals": []})
        g["seeds"].append(run.seed)
        g["finals"].append(final_values(run.log_dir))
        if settings["law"] != "fixed":
            g.setdefault("settling", []).append(settling(run.log_dir, float(settings["target"])))
    for g in groups.values():
        world = worlds[json.dumps(g.pop("world"), sort_keys=True)]
        finals = g.pop("finals")
        names = ("kl_to_ref", "reward", "kl_to_optimum", "kl_to_optimum_halfway", "kl_coef")
        for name in (*names, "entropy"):
            g[name] = _stats([f[name] for f in finals])
        frontier = [world.frontier_reward(f["kl_to_ref"]) for f in finals]
        g["frontier_reward"] = _stats(frontier)
        g["reward_gap"] = _stats([fr - f["reward"] for fr, f in zip(frontier, finals, strict=True)])
        if g["law"] == "fixed":
            best = world.optimum(g["init_kl_coef"])
            start = opt.kl(world.ref_logprobs, best.logprobs)
            g["optimum"] = {"kl": best.kl, "reward": best.reward, "start_kl_to_optimum": start}
            g["fraction_left"] = g["kl_to_optimum"]["mean"] / start
            g["at_optimum"] = g["fraction_left"] < AT_OPTIMUM
            point = (g["placement"], g["estimator"], g["init_kl_coef"])
            if point not in end_points:
                logprobs = placement_end_point(world, point[2], point[0], point[1], end_steps)
                end_points[point] = world.policy_metrics(logprobs, point[2])
            g["end_point"] = end_points[point]
        else:
            beta = world.beta_for_kl(float(g["target"]))
            best = world.optimum(beta)
            g["target_optimum"] = {"beta": beta, "kl": best.kl, "reward": best.reward}
            g["beta_ratio"] = g["kl_coef"]["mean"] / beta
            traces = g.pop("settling")
            settled = [t["settle"] for t in traces if t["settle"] is not None]
            g["settle_batch"] = {
                "per_seed": [t["settle"] for t in traces],
                "mean": float(np.mean(settled)) if settled else None,
                "never": len(traces) - len(settled),
            }
            g["overshoot"] = _stats([t["overshoot"] for t in traces])
    (world,) = worlds.values() if len(worlds) == 1 else (None,)
    reference = None
    if world is not None:
        reference = {
            "responses": len(world.rewards),
            "reward": opt.expected(world.ref_logprobs, world.rewards),
            "max_kl": opt.max_kl(world.ref_logprobs, world.rewards),
            "top_reward": float(world.rewards.max()),
        }
    return {"groups": groups, "reference": reference, "_world": world}


def write_exact_report(
    runs: list[Run], study: StudyConfig, out: Path, elapsed: float, end_steps: int = END_STEPS
) -> dict:
    """Read every run; write ``report.md``, ``summary.json`` and ``frontier.png``."""
    summary = summarise(runs, end_steps)
    world = summary.pop("_world")
    summary.update(
        {
            "seeds": list(range(study.seeds)),
            "batches": study.batches,
            "elapsed_s": round(elapsed, 1),
            "at_optimum_fraction": AT_OPTIMUM,
            "end_steps": end_steps,
        }
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if world is not None:
        plot_frontier(summary["groups"], world, out)
    (out / "report.md").write_text(_markdown(summary, study, len(runs)))
    return summary


def _cell(stats: dict[str, Any], fmt: str) -> str:
    mean = format(stats["mean"], fmt)
    return mean if stats["std"] is None else f"{mean} ± {format(stats['std'], fmt)}"


def _markdown(summary: dict[str, Any], study: StudyConfig, n_runs: int) -> str:
    groups = summary["groups"]
    fixed = {k: g for k, g in groups.items() if g["law"] == "fixed"}
    laws = {k: g for k, g in groups.items() if g["law"] != "fixed"}
    ref = summary["reference"]
    lines = [
        "# Study: the exact world",
        "",
        f"{n_runs} runs, seeds {summary['seeds']}, {study.batches} batches each; "
        f"{summary['elapsed_s'] / 60:.1f} minutes on {os.cpu_count()} CPU cores "
        f"({platform.machine()}), {study.workers} run(s) at a time with {study.threads} torch "
        "thread(s) each. Every number is exact (a sum over all responses) for the final policy; "
        "mean ± standard deviation over seeds.",
        "",
    ]
    if ref:
        lines += [
            f"The world: {ref['responses']} responses; the reference's expected reward "
            f"{ref['reward']:.3f}, the top reward {ref['top_reward']:.3f} (KL "
            f"{ref['max_kl']:.2f} nats away).",
            "",
            "![frontier](frontier.png)",
            "",
        ]
    if fixed:
        lines += [
            "## Fixed beta: where each KL placement and estimator ends",
            "",
            "| run | algorithm | KL placement | estimator | beta | KL(pi‖pi*) | of the start "
            "| half-way | exact-gradient end point | KL(pi‖ref) | E[R] | frontier E[R] at that KL "
            "| gap | entropy per token | at the optimum |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, g in fixed.items():
            lines.append(
                f"| `{name}` | {g['algorithm']} | {g['placement']} | {g['estimator']} | "
                f"{g['init_kl_coef']:g} | {_cell(g['kl_to_optimum'], '.3f')} | "
                f"{g['fraction_left']:.0%} | {_cell(g['kl_to_optimum_halfway'], '.3f')} | "
                f"{g['end_point']['kl_to_optimum']:.3f} (KL {g['end_point']['kl_to_ref']:.2f}, "
                f"E[R] {g['end_point']['reward']:.3f}) | {_cell(g['kl_to_ref'], '.3f')} | "
                f"{_cell(g['reward'], '.3f')} | {_cell(g['frontier_reward'], '.3f')} | "
                f"{_cell(g['reward_gap'], '.3f')} | {_cell(g['entropy'], '.3f')} | "
                f"{'yes' if g['at_optimum'] else 'no'} |"
            )
        betas = sorted({g["init_kl_coef"] for g in fixed.values()})
        for beta in betas:
            o = next(g["optimum"] for g in fixed.values() if g["init_kl_coef"] == beta)
            lines += [
                "",
                f"pi* at beta {beta:g}: KL(pi*‖ref) {o['kl']:.3f} nats, E[R] {o['reward']:.3f}; "
                f"every run starts at the reference, KL(ref‖pi*) {o['start_kl_to_optimum']:.3f}.",
            ]
        at = [n for n, g in fixed.items() if g["at_optimum"]]
        off = sorted((n for n in fixed if n not in at), key=lambda n: fixed[n]["fraction_left"])
        lines += [
            "",
            f"At the optimum (final KL(pi‖pi*) below {AT_OPTIMUM:.0%} of KL(ref‖pi*)): "
            + (", ".join(f"`{n}`" for n in at) or "none")
            + ". Elsewhere: "
            + (
                "; ".join(
                    f"`{n}` {fixed[n]['kl_to_optimum']['mean']:.3f} nats "
                    f"({fixed[n]['fraction_left']:.0%} of the start)"
                    for n in off
                )
                or "none"
            )
            + ".",
            "",
        ]
    if laws:
        lines += [
            "## KL target: each control law's final beta against the exact one",
            "",
            "| run | law | target KL | final beta | exact beta for the target | ratio "
            "| KL(pi‖ref) reached | E[R] | frontier E[R] at that KL | gap "
            "| settle batch (per seed) | overshoot |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, g in laws.items():
            t = g["target_optimum"]
            per_seed = g["settle_batch"]["per_seed"]
            settle = ", ".join("never" if b is None else str(b) for b in per_seed)
            lines.append(
                f"| `{name}` | {g['law']} | {g['target']:g} | {_cell(g['kl_coef'], '.3f')} | "
                f"{t['beta']:.3f} | {g['beta_ratio']:.2f} | {_cell(g['kl_to_ref'], '.3f')} | "
                f"{_cell(g['reward'], '.3f')} | {_cell(g['frontier_reward'], '.3f')} | "
                f"{_cell(g['reward_gap'], '.3f')} | {settle} | {_cell(g['overshoot'], '.2f')} |"
            )
        lines.append("")
    lines += [
        " ".join(
            [
                "KL(pi‖pi*): to the optimum at the run's beta (a law's: at its final beta);",
                "of the start: its mean as a fraction of KL(ref‖pi*); half-way: KL(pi‖pi*) at",
                "the evaluation nearest to half the run (is it still moving?); exact-gradient",
                "end point: where the placement's exact expected gradient takes a tabular",
                f"policy from the reference ({summary['end_steps']} Adam steps, no sampling,",
                "no whitening; `placement_end_point`): its KL(·‖pi*), KL to the reference and",
                "E[R]; entropy: the policy's, per response token, on the last batch (near 0:",
                "collapsed onto one response, where a sampled gradient vanishes); frontier",
                "E[R]: the largest expected reward of any policy at the final KL (the top",
                "reward beyond the largest reachable KL); gap: frontier minus E[R]. Per seed:",
                "`summary.json`.",
            ]
        ),
        "",
    ]
    return "\n".join(lines)


def plot_frontier(groups: dict[str, dict[str, Any]], world: Any, out: Path) -> None:
    """The exact frontier and every run's final (KL, reward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    betas = np.geomspace(0.002, 20, 120)
    points = [world.optimum(float(b)) for b in betas]
    fig, ax = plt.subplots(figsize=(8.5, 5.5), constrained_layout=True)
    kls, rewards = [p.kl for p in points], [p.reward for p in points]
    ax.plot(kls, rewards, "-", color="black", label="frontier")
    colors = plt.get_cmap("tab20")
    for i, (name, g) in enumerate(groups.items()):
        law = g["law"] != "fixed"
        ax.scatter(
            g["kl_to_ref"]["per_seed"],
            g["reward"]["per_seed"],
            marker="*" if law else ("o" if g["placement"] == "reward" else "s"),
            s=90 if law else 30,
            color=colors(i % 20),
            label=name,
        )
    xmax = max(max(g["kl_to_ref"]["per_seed"]) for g in groups.values())
    ax.set_xlim(0, max(xmax * 1.1, 1.0) if math.isfinite(xmax) else 10)
    title = "final policies: KL in the reward (o), in the loss (s), a KL target (*)"
    ax.set(xlabel="KL(pi‖ref), nats per sequence", ylabel="E[R]", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
