"""The study's gold vs proxy analysis, on synthetic curves and event files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rlkl_lightning.compare.gold import GoldCurve, analyse, gold_report, run_sentence
from rlkl_lightning.compare.report import aggregate
from rlkl_lightning.compare.runs import Run

E = 0.01  # half the spread of the two batches of a block around its mean


def two_per_block(block_means: list[float]) -> np.ndarray:
    """Two batches per block, ``mean + E`` and ``mean - E``: residual s.d. exactly E*sqrt(2)."""
    return np.repeat(block_means, 2) + np.tile([E, -E], len(block_means))


# Gold rises to block 4, then falls; the proxy and the KL rise throughout.
GOLD_PEAKS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25]
RISING = [0.1 * k for k in range(10)]
KL = np.arange(20) * 0.5
PROXY = np.linspace(0.0, 0.9, 20)


def test_a_gold_peak_followed_by_a_fall_beyond_two_standard_errors():
    a = analyse(GoldCurve(KL, PROXY, two_per_block(GOLD_PEAKS)))
    assert a["peak_block"] == 4
    assert a["peak_kl"] == pytest.approx((KL[8] + KL[9]) / 2)  # batches 8 and 9
    assert a["peak_gold"] == pytest.approx(0.5) and a["last_gold"] == pytest.approx(0.25)
    assert a["peak_proxy"] == pytest.approx(PROXY[8:10].mean())
    # s = sqrt(20 E^2 / (20 - 10)); 2 SE = 2 s sqrt(1/2 + 1/2).
    assert a["gold_drop_two_se"] == pytest.approx(2 * math.sqrt(2) * E)
    assert a["gold_drop"] == pytest.approx(0.25) and a["gold_fell"] and a["verdict"] == "fell"
    assert a["final_gold"] == pytest.approx(two_per_block(GOLD_PEAKS)[-4:].mean())  # last 20%
    assert "stopped paying off at KL 4.25" in run_sentence(a)


def test_gold_still_rising_stopped_improving_or_too_short():
    rising = analyse(GoldCurve(KL, PROXY, two_per_block(RISING)))
    assert rising["verdict"] == "rising" and rising["peak_block"] == rising["plateau_block"] == 9
    assert run_sentence(rising).startswith("gold still improving at the end: the last block")
    # Gold levels off at block 4 (0.4) within 0.01 < 2 SE = 0.028, while the proxy rises.
    level = analyse(GoldCurve(KL, PROXY, two_per_block([*RISING[:4], *[0.4, 0.41, 0.39] * 2])))
    assert level["verdict"] == "plateau" and level["plateau_block"] == 4
    assert level["plateau_kl"] == pytest.approx(KL[8:10].mean())
    assert level["plateau_proxy"] == pytest.approx(PROXY[8:10].mean())
    assert f"stopped improving at KL {KL[8:10].mean():.2f} (block 5 of 10" in run_sentence(level)
    # A later block 0.03 > 2 SE above block 4: gold levels off at block 5 instead.
    later = analyse(
        GoldCurve(KL, PROXY, two_per_block([*RISING[:4], 0.4, 0.41, 0.43, 0.42, 0.43, 0.42]))
    )
    assert later["verdict"] == "plateau" and later["plateau_block"] == 5
    # A last block 0.02 below the peak (less than 2 SE) did not fall; 0.03 below did.
    near = analyse(GoldCurve(KL, PROXY, two_per_block([*RISING[:9], 0.78])))
    assert near["peak_block"] == 8 and near["gold_drop"] == pytest.approx(0.02)
    assert near["verdict"] == "plateau" and near["plateau_block"] == 8
    assert analyse(GoldCurve(KL, PROXY, two_per_block([*RISING[:9], 0.77])))["gold_fell"]
    # One batch per block leaves no spread to judge by.
    short = analyse(GoldCurve(KL[:4], PROXY[:4], np.array([0.1, 0.3, 0.2, 0.1])))
    assert short["gold_drop_two_se"] is None and short["verdict"] == "short"
    assert run_sentence(short).startswith("too few batches")


def write_run(log_dir: Path, kl, proxy, gold) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    for step, values in enumerate(zip(kl, proxy, *([gold] if gold is not None else []))):
        writer.add_scalar("objective/kl", values[0], step)
        writer.add_scalar("objective/score", values[1], step)
        if gold is not None:
            writer.add_scalar("objective/gold_score", values[2], step)
    writer.close()


def group(per_seed_metrics):
    names = ("in_band_fraction", "drift_warnings", "final_perplexity", "final_kl_coef")
    names += ("kl_tracking_error", "settle_batch", "overshoot")
    return aggregate([dict.fromkeys(names, 0.0) | m for m in per_seed_metrics])


def test_the_report_section_from_event_files(tmp_path):
    """`low` (2 seeds): gold still rising; `high`: spends more KL, proxy up, gold down."""
    runs = {}
    shapes = {"low": (RISING, 0.5), "high": (GOLD_PEAKS, 1.0)}
    for name, (gold_blocks, kl_scale) in shapes.items():
        for seed in (0, 1):
            log_dir = tmp_path / "runs" / name / f"seed{seed}"
            gold = two_per_block(gold_blocks) + 0.01 * seed
            write_run(log_dir, KL * kl_scale, PROXY * kl_scale, gold)
            runs.setdefault(name, []).append(Run(name, seed, 0.1, tmp_path, log_dir, tmp_path))
    groups = {
        name: group([{"final_kl": KL[-4:].mean() * s, "final_score": PROXY[-4:].mean() * s}] * 2)
        for name, (_, s) in shapes.items()
    }
    (tmp_path / "gold_proxy.png").write_bytes(b"stale")
    summary, lines = gold_report(runs, groups, tmp_path)
    json.dumps(summary)  # JSON-ready
    assert (tmp_path / "gold_proxy.png").read_bytes()[:4] == b"\x89PNG"
    final = {n: two_per_block(g)[-4:].mean() for n, (g, _) in shapes.items()}
    for name in shapes:
        assert groups[name]["per_seed"]["final_gold"] == pytest.approx(
            [final[name], final[name] + 0.01]
        )
        assert groups[name]["final_gold"] == pytest.approx(final[name] + 0.005)
        assert groups[name]["std"]["final_gold"] == pytest.approx(0.01 / math.sqrt(2))
    assert summary["runs"]["high"]["0"]["gold_fell"] and summary["runs"]["high"]["1"]["gold_fell"]
    assert not summary["runs"]["low"]["0"]["gold_fell"]
    statement = summary["statement"]
    peak_kl = (KL[8] + KL[9]) / 2  # block 4 of `high`, KL scale 1
    fell = f"gold peaked and then fell in 2 runs (at the peak: `high` seed 0: KL {peak_kl:.2f}"
    assert statement.startswith(f"Within runs, {fell}, `high` seed 1: KL {peak_kl:.2f}); gold was")
    assert (
        f"still improving at the end in 2 runs (`low` seed 0: KL {KL[-2:].mean() / 2:.2f}"
        in statement
    )
    kl, proxy = KL[-4:].mean(), PROXY[-4:].mean()  # the groups' final KL and score at scale 1
    best = f"`low`'s ({final['low'] + 0.005:.3f} at final KL {kl / 2:.2f}, proxy {proxy / 2:.3f})"
    assert f"the best final gold is {best}" in statement
    high = f"`high` (KL {kl:.2f}, proxy {proxy:.3f}, gold {final['high'] + 0.005:.3f})"
    assert f"higher proxy but a lower gold (beyond 2 SE): {high}." in statement
    text = "\n".join(lines)
    row = f"| `low` | {proxy / 2:.3f} ± 0.000 | {final['low'] + 0.005:.3f} ± 0.007 |"
    assert row in text
    assert f"**{statement}**" in text and "![gold and proxy against KL](gold_proxy.png)" in text


def test_runs_without_a_gold_score_give_no_section(tmp_path):
    log_dir = tmp_path / "runs" / "fixed" / "seed0"
    write_run(log_dir, KL, PROXY, None)
    (tmp_path / "gold_proxy.png").write_bytes(b"stale")
    groups = {"fixed": group([{"final_kl": 1.0, "final_score": 0.5}])}
    summary, lines = gold_report(
        {"fixed": [Run("fixed", 0, 0.1, tmp_path, log_dir, tmp_path)]}, groups, tmp_path
    )
    assert summary is None and "no `gold_reward`" in lines[0]
    assert not (tmp_path / "gold_proxy.png").exists() and "final_gold" not in groups["fixed"]


def test_runs_too_short_to_judge_are_said_to_be():
    from rlkl_lightning.compare.gold import overall_statement

    short = analyse(GoldCurve(KL[:4], PROXY[:4], np.array([0.1, 0.3, 0.2, 0.1])))
    groups = {"fixed": group([{"final_kl": 1.0, "final_score": 0.5}]) | {"final_gold": 0.2}}
    statement = overall_statement({"fixed": {0: short}}, groups)
    assert statement.startswith("Within runs, 1 run too short to judge.")
    level = analyse(GoldCurve(KL, PROXY, two_per_block([*RISING[:4], *[0.4, 0.41, 0.39] * 2])))
    statement = overall_statement({"fixed": {0: short, 1: level}}, groups)
    kl = KL[8:10].mean()
    plateau = f"gold stopped improving without falling in 1 run (from: `fixed` seed 1: KL {kl:.2f})"
    assert statement.startswith(f"Within runs, {plateau}; 1 run too short to judge.")


def test_a_lower_gold_within_two_standard_errors_is_not_called_lower():
    """The laws study's case: 0.304 against the best 0.305, seeds' sd 0.02-0.05."""
    from rlkl_lightning.compare.gold import overall_statement

    level = analyse(GoldCurve(KL, PROXY, two_per_block([*RISING[:4], *[0.4, 0.41, 0.39] * 2])))

    def with_gold(kl, score, golds):
        g = group([{"final_kl": kl, "final_score": score}] * len(golds))
        v = np.array(golds)
        std = float(v.std(ddof=1)) if len(v) > 1 else None
        return (
            g
            | {"final_gold": float(v.mean()), "std": g["std"] | {"final_gold": std}}
            | {"per_seed": g["per_seed"] | {"final_gold": golds}}
        )

    groups = {
        "best": with_gold(6.0, 0.73, [0.25, 0.31, 0.355]),
        "near": with_gold(6.4, 0.74, [0.293, 0.315]),
        "far": with_gold(9.0, 0.81, [0.100, 0.102]),
        "single": with_gold(8.0, 0.80, [0.29]),
    }
    runs = {g: {0: level} for g in groups}
    statement = overall_statement(runs, groups)
    assert "the best final gold is `best`'s" in statement
    tied = "(not above these beyond 2 SE, or with one seed and no error estimate: `near` 0.304"
    assert tied in statement
    lower, unsure = statement.split("lower gold (beyond 2 SE): ")[1].split("; runs that")
    assert "`far`" in lower and "`near`" not in lower and "`single`" not in lower
    assert "not beyond 2 SE" in unsure and "`near`" in unsure and "`single`" in unsure
