"""Steer simulated KL plants with every law: the settle batch and overshoot each would reach.

The plants are the shapes the fixed-beta runs of docs/controllers.md ("The log-PID law") showed:
the batch KL is a fast part ``cf (beta / 0.1)^-af`` (lag ``tau_f`` batches) plus a learnt part
``p F1 (beta / 0.1)^-a`` (lag ``tau``), where ``p``, the share of the reward the policy has
found, grows logistically at ``r1 (0.1 / beta)^c`` per batch from ``p0``: the KL sits on a
plateau until the policy finds the reward, sooner at a lower beta, and then takes off. Every
law sees that KL ``theta`` batches late, with a scatter of ``noise`` times its level. Besides the
five named worlds, ``--holdout`` draws 30 plants around them (each parameter within a factor
e^0.5, the elasticity within e^0.3, a dead time of 1-5 batches), and ``--search`` grids the
log-PID law's gains over the named worlds, a 12-plant holdout and two noise levels.

    python scripts/law_sim.py              # each law on the five worlds, 8 seeds, 150 batches
    python scripts/law_sim.py --holdout    # ... and the 30 drawn plants
    python scripts/law_sim.py --search     # the log-PID grid (about a minute)
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TARGET = 6.0
WORLDS = {
    # default: a lag with the learning well under way from the start
    "default": dict(cf=0.5, af=0.3, F1=3.4, a=0.7, r1=0.15, c=0.5, p0=0.3, tau=8.0),
    # docstrings: KL 0.7 at beta 0.1 for 100 batches; at 0.03 a take-off near batch 50
    "docstrings": dict(cf=0.7, af=0.3, F1=2.4, a=1.0, r1=0.032, c=1.0, p0=0.005, tau=4.0),
    # code: a fast 2 nats at 0.1, then a slow climb; at 0.03 a take-off near batch 40
    "code": dict(cf=2.0, af=0.45, F1=3.0, a=0.9, r1=0.04, c=0.9, p0=0.03, tau=5.0),
    # an easy reward: beta 0.1 already over-spends the target
    "fast": dict(cf=1.0, af=0.4, F1=8.0, a=0.8, r1=0.2, c=0.5, p0=0.1, tau=5.0),
    # a slow learner, steep once found, seen late
    "slowlearn": dict(cf=1.0, af=0.4, F1=3.0, a=1.3, r1=0.02, c=0.7, p0=0.05, tau=8.0, theta=4),
}


def simulate(controller, seed, batches=150, noise=0.15, cf=1.0, af=0.4, F1=4.0, a=1.0, r1=0.05,
             c=0.7, p0=0.05, tau_f=2.0, tau=6.0, theta=2):  # fmt: skip
    """The batch KL of ``controller`` steering one plant (module docstring), one per batch."""
    rng = np.random.default_rng(seed)
    betas, fast, learnt, found, kls = [controller.value], 0.0, 0.0, p0, []
    for _ in range(batches):
        beta = betas[max(0, len(betas) - 1 - theta)]
        found = min(1.0, found + r1 * (0.1 / beta) ** c * found * (1 - found))
        fast += (cf * (beta / 0.1) ** (-af) - fast) / tau_f
        learnt += (found * F1 * (beta / 0.1) ** (-a) - learnt) / tau
        kl = fast + learnt
        kls.append(max(0.0, kl + noise * max(kl, 0.5) * rng.standard_normal()))
        betas.append(controller.update(kls[-1], 32))
    return np.array(kls)


def holdout(n=30, seed=123):
    """``n`` plants drawn around the named worlds."""
    rng = np.random.default_rng(seed)
    plants = []
    for i in range(n):
        plant = dict(list(WORLDS.values())[i % len(WORLDS)])
        for key in ("cf", "F1", "r1", "tau"):
            plant[key] *= float(np.exp(rng.uniform(-0.5, 0.5)))
        plant["a"] *= float(np.exp(rng.uniform(-0.3, 0.3)))
        plant["theta"] = int(rng.integers(1, 6))
        plants.append(plant)
    return plants


def judge(make, plants, seeds, noise=0.15):
    """Per plant: (median settle batch, 150 for never; mean overshoot) over ``seeds``."""
    from rlkl_lightning.compare.events import overshoot, settle_batch

    out = []
    for plant in plants:
        settle, over = [], []
        for seed in seeds:
            kl = simulate(make(), seed, noise=noise, **plant)
            settle.append(settle_batch(kl, TARGET) or 150)
            over.append(overshoot(kl, TARGET))
        out.append((float(np.median(settle)), float(np.mean(over))))
    return out


def laws():
    """Every law with its config's settings, starting at the configs' beta 0.1."""
    from rlkl_lightning.config_files import compose
    from rlkl_lightning.kl.laws import KL_LAWS
    from rlkl_lightning.kl.settings import KLSettings

    for law in KL_LAWS:
        kl = compose(ROOT / "configs" / f"ppo_{law}.yaml")["kl"]
        yield law, lambda kl=kl: KLSettings(**kl).kl_controller(0.1)


def search() -> None:
    """Grid the log-PID gains and print the ten best.

    The cost punishes a settle after batch 40 and an overshoot above 1.5 nats (25% of the
    target), and adds a little of each so that ties go to the faster, calmer gains.
    """
    from rlkl_lightning.kl.controllers import LogPIDKLController

    plants = list(WORLDS.values()) + holdout(12, seed=7)
    grid = dict(
        alpha=[0.3, 0.5], gamma=[0.1, 0.2], lead=[4.0, 6.0, 8.0], kp=[0.3, 0.6],
        ki=[0.1, 0.15, 0.2], max_fall=[0.05, 0.07], dead_zone=[0.0, 0.2, 0.4],
    )  # fmt: skip
    rows = []
    for values in itertools.product(*grid.values()):
        gains = dict(zip(grid, values, strict=True))
        res = [
            r
            for noise in (0.15, 0.25)
            for r in judge(
                lambda g=gains: LogPIDKLController(0.1, TARGET, **g), plants, (0, 1), noise
            )
        ]
        cost = sum(max(0, s - 40) / 10 + max(0, o - 1.5) * 2 + s / 100 + o / 5 for s, o in res)
        fails = sum(s > 40 or o > 1.5 for s, o in res)
        rows.append((cost, fails, len(res), gains))
    for cost, fails, n, gains in sorted(rows, key=lambda r: r[0])[:10]:
        print(f"cost {cost:6.1f}  fails {fails:2d}/{n}  {gains}")


def main() -> None:
    """Print each law's predicted settle batch and overshoot per world."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--holdout", action="store_true", help="also the 30 drawn plants")
    parser.add_argument("--search", action="store_true", help="grid the log-PID gains")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.search:
        search()
        return
    print("settle batch (median of 8 seeds; 150: never) / overshoot (nats, mean)")
    print(f"{'law':12s}" + "".join(f"{w:>17s}" for w in WORLDS))
    for law, make in laws():
        res = judge(make, WORLDS.values(), range(8))
        print(f"{law:12s}" + "".join(f"{s:>10.0f} / {o:4.1f}" for s, o in res))
    if args.holdout:
        for law, make in laws():
            for noise in (0.15, 0.25):
                res = judge(make, holdout(), (100, 101), noise)
                fails = sum(s > 40 or o > 1.5 for s, o in res)
                print(
                    f"holdout, noise {noise:.2f}: {law:12s} {fails:2d} of 30 plants miss settle "
                    f"<= 40 or overshoot <= 1.5; median settle {np.median([s for s, _ in res]):.0f}"
                    f", mean overshoot {np.mean([o for _, o in res]):.2f}"
                )


if __name__ == "__main__":
    main()
