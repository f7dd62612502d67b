"""The study end to end on a tiny local model: files, keys, and numbers that match the events."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.cli_runs import tiny_cli_config

from rlkl_lightning.compare import StudyConfig, main, parse_args

ROOT = Path(__file__).resolve().parents[2]
METRIC_KEYS = {"final_score", "kl_tracking_error", "in_band_fraction", "drift_warnings"}
METRIC_KEYS |= {"final_perplexity", "settle_batch", "overshoot"}


def run_quick_study(tiny_lm_dir, tmp_path_factory):
    """`--quick` on configs/compare.yaml with a tiny model: 2 controllers x 2 seeds x 3 batches."""
    tmp = tmp_path_factory.mktemp("study")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"] * 8))
    overrides = {
        "model": {
            "init_args": {
                "policy": str(tiny_lm_dir),
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 6},
            }
        },
        "data": {"init_args": {"prompts": str(prompts), "heldout": str(prompts), "batch_size": 8}},
        "kl": {"target": 0.05, "window": 2},
    }
    adaptive = {  # beta visibly moves in 3 batches
        "config": "configs/ppo_adaptive.yaml",
        "overrides": {"kl": {"controller": {"init_args": {"horizon": 16}}}},
    }
    runs = {"fixed": "configs/ppo_fixed.yaml", "adaptive": adaptive}
    extra = tmp / "tiny.yaml"
    extra.write_text(yaml.safe_dump({"overrides": overrides, "runs": runs}))
    out = tmp / "out"
    argv = ["--config", str(ROOT / "configs" / "compare.yaml"), "--config", str(extra)]
    argv += ["--quick", "--seeds", "2", "--batches", "3", "--val_every", "3", "--out", str(out)]
    summary = main(argv)
    return out, summary, argv


def events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.mark.slow  # a study: make test-slow
def test_quick_study_end_to_end(tiny_lm_dir, tmp_path_factory, capsys):
    """One study, several checks (one test, so `pytest -n` runs the study once)."""
    *study, argv = run_quick_study(tiny_lm_dir, tmp_path_factory)
    printed = capsys.readouterr().out  # not a terminal: a line per run as it starts and ends
    for run in ("fixed-seed0", "adaptive-seed0", "fixed-seed1", "adaptive-seed1"):
        assert f"] start {run} (run " in printed
        # Each run's own CPU time: a process that imports torch and trains takes seconds.
        (cpu,) = re.findall(rf"\] done {run} in \d+ s \(CPU (\d+) s; ", printed)
        assert int(cpu) >= 1
    assert "4 of 4 runs done)" in printed
    check_files_and_keys(*study)
    check_numbers_agree_with_the_event_files(*study)
    check_each_run_is_a_reproducible_train_config(*study)
    check_the_same_study_again_keeps_its_finished_runs(*study, argv, capsys)


def check_the_same_study_again_keeps_its_finished_runs(out, summary, argv, capsys):
    """Run again into its `out`, the study trains nothing: the same runs, the same numbers."""
    events_before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("events.*")}
    again = main(argv)
    printed = capsys.readouterr().out
    assert "compare: kept 4 of 4 runs that an earlier study" in printed
    assert "] start " not in printed
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("events.*")} == events_before
    kept = sorted(again["runs_kept"])
    assert kept == ["adaptive-seed0", "adaptive-seed1", "fixed-seed0", "fixed-seed1"]
    drop = {"elapsed_s", "runs_kept"}
    assert {k: v for k, v in again.items() if k not in drop} == {
        k: v for k, v in summary.items() if k not in drop
    }
    assert "4 of 4 runs were kept from an earlier study" in (out / "report.md").read_text()


def check_files_and_keys(out, summary):
    for name in ("curves.png", "report.md", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "frontier.png").exists()  # --quick runs no sweep
    assert json.loads((out / "summary.json").read_text()) == summary
    for key in ("reference_perplexity", "target_kl", "kl_unit", "seeds"):
        assert key in summary
    assert summary["target_kl"] == 0.05 and summary["kl_unit"] == "sequence"
    assert summary["seeds"] == [0, 1]
    assert summary["quick"] is True  # and the report says first that it is no result
    title, _, rest = (out / "report.md").read_text().partition("\n\n")
    assert title.startswith("# Study: ") and rest.startswith("> A `--quick` study (2 seed(s) x 3 ")
    for group in ("fixed", "adaptive"):
        assert METRIC_KEYS <= summary[group].keys()
        assert summary[group]["seeds"] == [0, 1]
        assert all(len(v) == 2 for v in summary[group]["per_seed"].values())
    report = (out / "report.md").read_text()
    assert "| `adaptive` |" in report and "| `fixed` |" in report
    assert "Adaptive reached similar or better score with KL closer to target:" in report
    # The configs log the world's gold score (compare/gold.py is tested in test_gold_analysis.py).
    assert (out / "gold_proxy.png").stat().st_size > 0 and "## Gold vs proxy" in report
    assert set(summary["gold"]["runs"]) == {"fixed", "adaptive"}
    assert all(len(summary[g]["per_seed"]["final_gold"]) == 2 for g in ("fixed", "adaptive"))


def check_numbers_agree_with_the_event_files(out, summary):
    """Recompute every number from the raw events, independently of the study's own reader."""
    target, n = 0.05, 3
    for group in ("fixed", "adaptive"):
        per_seed = summary[group]["per_seed"]
        for i, seed in enumerate((0, 1)):
            ev = events(out / "runs" / group / f"seed{seed}")
            score = [v for _, v in ev["objective/score"]]
            kl = [v for _, v in ev["objective/kl"]]
            assert len(score) == len(kl) == n  # one event per batch, no skipped batch here
            assert per_seed["final_score"][i] == pytest.approx(score[-1], rel=1e-6)  # 20% of 3
            err = np.mean([abs(k - target) / target for k in kl[1:]])  # second half: batches 2-3
            assert per_seed["kl_tracking_error"][i] == pytest.approx(err, rel=1e-6)
            band = np.mean([0.5 * target <= k <= 2 * target for k in kl])
            assert per_seed["in_band_fraction"][i] == pytest.approx(band, abs=1e-12)
            warnings = ev.get("kl_monitor/warnings", [(0, 0.0)])[-1][1]
            assert per_seed["drift_warnings"][i] == warnings
            ppl = ev["val/perplexity"][-1][1]
            assert per_seed["final_perplexity"][i] == pytest.approx(ppl, rel=1e-6)
            # Fewer batches than the 10-batch window: one mean, of all 3, at the last batch.
            mean = np.mean(kl)
            assert per_seed["overshoot"][i] == pytest.approx(max(0.0, mean - target), rel=1e-6)
            settled = abs(mean - target) <= 0.25 * target
            assert per_seed["settle_batch"][i] == (3 if settled else None)
            beta = ev["objective/kl_coef"][-1][1]
            assert per_seed["final_kl_coef"][i] == pytest.approx(beta, rel=1e-6)
            samples = ev["progress/samples"][-1][1]
            assert samples == n * 8
        assert summary[group]["final_score"] == pytest.approx(np.mean(per_seed["final_score"]))
        ref = events(out / "runs" / group / "seed0")["val/perplexity_ref"][-1][1]
        assert summary["reference_perplexity"] == pytest.approx(ref, rel=1e-6)
    # The pair differs only in the controller: same initial beta, only adaptive's moves.
    assert summary["fixed"]["per_seed"]["final_kl_coef"] == pytest.approx([0.1, 0.1])
    assert all(
        b != pytest.approx(0.1, rel=1e-3) for b in summary["adaptive"]["per_seed"]["final_kl_coef"]
    )


def check_each_run_is_a_reproducible_train_config(out, _summary):
    config = yaml.safe_load((out / "configs" / "adaptive-seed1.yaml").read_text())
    assert config["seed_everything"] == 1 and config["data"]["init_args"]["seed"] == 1
    assert config["trainer"]["max_steps"] == 3 * 4 * 4  # batches x ppo_epochs x minibatches
    law = config["kl"]["controller"]  # the config's law, with the study's gain merged in
    assert law == {"class_path": "AdaptiveKLController", "init_args": {"horizon": 16}}
    assert config["trainer"]["logger"]["init_args"]["version"] == "seed1"


def test_a_failing_run_stops_the_study_and_quotes_its_log(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the film was\nthis book is\n")
    bad = {
        "model": {"init_args": {"policy": str(tmp_path / "missing")}},
        "data": {"init_args": {"prompts": str(prompts), "heldout": None}},
    }
    extra = tmp_path / "bad.yaml"
    extra.write_text(yaml.safe_dump({"overrides": bad}))
    argv = ["--config", str(ROOT / "configs" / "compare.yaml"), "--config", str(extra)]
    argv += ["--quick", "--seeds", "1", "--out", str(tmp_path / "out")]
    argv += ["--runs", json.dumps({"fixed": str(ROOT / "configs" / "ppo_fixed.yaml")})]
    with pytest.raises(RuntimeError, match=r"(?s)run fixed-seed0 failed .*does not exist"):
        main(argv)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"seeds": 0}, "`seeds` must be an integer >= 1"),
        ({"batches": -1}, "`batches` must be an integer >= 1"),
        ({"runs": {}}, "`runs` must name at least one"),
        ({"sweep_kl_coefs": [0.0]}, "`sweep_kl_coefs` must be > 0"),
        ({"runs": {"adaptive": "x.yaml"}, "sweep_kl_coefs": [0.1]}, "needs a `fixed` entry"),
        ({"quick_settings": {"sedes": 1}}, r"unknown `quick_settings` \['sedes'\]"),
    ],
)
def test_bad_settings_name_the_option(settings, message):
    with pytest.raises(ValueError, match=message):
        StudyConfig(**settings)


def test_flags_win_over_quick_settings_and_missing_configs_are_named(tmp_path):
    config = str(ROOT / "configs" / "compare.yaml")
    study, quick = parse_args(["--config", config, "--quick", "--seeds", "2"])
    assert quick and study.seeds == 2 and study.batches == 4 and study.sweep_kl_coefs == []
    study, quick = parse_args(["--config", config])
    assert not quick and study.seeds == 3 and not math.isnan(study.batches)
    from rlkl_lightning.compare.runs import plan_runs

    with pytest.raises(ValueError, match=r"`runs.fixed` config not found: 'nope.yaml'"):
        plan_runs(StudyConfig(runs={"fixed": "nope.yaml"}), tmp_path)


def test_an_out_that_is_a_file_or_under_one_is_named_in_one_line(tmp_path):
    from rlkl_lightning.compare.runs import plan_runs

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    runs = {"fixed": str(ROOT / "configs" / "ppo_fixed.yaml")}
    for out in (a_file, a_file / "study"):
        with pytest.raises(
            ValueError, match=rf"`out` '{out}' cannot hold the study: '{a_file}' is a file"
        ):
            plan_runs(StudyConfig(runs=runs, seeds=1, batches=1), out)
    assert a_file.read_text() == "mine"


def test_a_finished_run_is_kept_only_with_its_config_and_an_out_of_other_files_is_refused(
    tmp_path, monkeypatch
):
    from rlkl_lightning.compare import runs as study_runs

    started = []
    monkeypatch.setattr(study_runs, "_start", lambda _c, run, *_: started.append(run.name) or 1 / 0)
    monkeypatch.setattr(study_runs, "_run_context", lambda env: None)
    monkeypatch.setattr(study_runs, "uses_default_world", lambda config: False)
    study = StudyConfig(runs={"fixed": str(ROOT / "configs" / "ppo_fixed.yaml")}, seeds=2)
    out = tmp_path / "out"
    runs = study_runs.plan_runs(study, out)
    for run in runs:  # as a run's process leaves it when it ends well
        run.log_dir.mkdir(parents=True)
        run.done_file.write_text(study_runs.run_key(run))
    assert study_runs.run_all(runs, study) == runs and started == []
    # Another config (more batches), a marker of other code, or keep_finished off: run again.
    runs = study_runs.plan_runs(replace(study, batches=study.batches + 1), out)
    runs[1].done_file.write_text(study_runs.run_key(runs[1]))
    with pytest.raises(ZeroDivisionError):
        study_runs.run_all(runs, study)
    assert started == ["fixed-seed0"]
    runs[0].done_file.write_text(study_runs.run_key(runs[0]).replace("a", "b", 1) + "0")
    with pytest.raises(ZeroDivisionError):
        study_runs.run_all(runs, study)
    assert started == ["fixed-seed0"] * 2
    with pytest.raises(ZeroDivisionError):
        study_runs.run_all(runs[1:], replace(study, keep_finished=False))
    assert started[-1] == "fixed-seed1"
    # An out of other files, not a study's, is not written into.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    with pytest.raises(ValueError, match=r"`out` '.*mine' holds other files and no study"):
        study_runs.plan_runs(study, mine)
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_the_reports_command_to_repeat_a_run_quotes_a_path_with_spaces():
    import shlex

    from rlkl_lightning.compare.report import rerun_command

    config = Path("my studies") / "configs" / "fixed-seed0.yaml"
    assert shlex.split(rerun_command(config))[-2:] == ["--config", str(config)]


def _group(scores, errors):
    from rlkl_lightning.compare.events import METRICS
    from rlkl_lightning.compare.report import aggregate

    metrics = [
        dict.fromkeys(METRICS, 0.0) | {"final_score": s, "kl_tracking_error": e}
        for s, e in zip(scores, errors, strict=True)
    ]
    return aggregate(metrics)


def test_verdict_follows_the_two_standard_error_rule():
    from rlkl_lightning.compare.report import verdict

    fixed = _group([0.60, 0.62, 0.64], [0.4, 0.4, 0.4])  # mean 0.62, sd 0.02
    # Adaptive 0.58 (sd 0.02): difference -0.04, 2 SE = 2 * sqrt(2 * 0.02**2 / 3) = 0.0327.
    lower = verdict({"fixed": fixed, "adaptive": _group([0.56, 0.58, 0.60], [0.1, 0.1, 0.1])})
    assert lower["score_difference"] == pytest.approx(-0.04)
    assert lower["score_difference_2se"] == pytest.approx(2 * math.sqrt(2 * 0.02**2 / 3))
    assert not lower["similar_or_better_score"] and lower["kl_closer_to_target"]
    similar = verdict({"fixed": fixed, "adaptive": _group([0.58, 0.60, 0.62], [0.5, 0.5, 0.5])})
    assert similar["similar_or_better_score"] and not similar["kl_closer_to_target"]
    one_seed = verdict({"fixed": _group([0.6], [0.4]), "adaptive": _group([0.599], [0.1])})
    assert one_seed["score_difference_2se"] is None and not one_seed["similar_or_better_score"]
    assert verdict({"fixed": fixed}) is None


def test_a_one_seed_verdict_says_in_bold_that_it_has_no_error_estimate():
    """The --quick study's case: one seed, a score 0.003 lower, and a bold "no"."""
    from rlkl_lightning.compare.report import _statement, verdict

    kl = {"target": 6.0, "unit": "sequence"}
    one = {"fixed": _group([0.340], [0.95]), "adaptive": _group([0.337], [0.94])}
    text = _statement(verdict(one), one, kl)
    bold = text.split("**")[1]
    assert bold.startswith("Adaptive reached similar or better score with KL closer to target: no")
    assert "one seed's point values alone: no error estimate" in bold
    three = {
        "fixed": _group([0.60, 0.62, 0.64], [0.4] * 3),
        "adaptive": _group([0.70, 0.72, 0.74], [0.1] * 3),
    }
    bold = _statement(verdict(three), three, kl).split("**")[1]
    assert bold == "Adaptive reached similar or better score with KL closer to target: yes."


@pytest.mark.slow  # a study: make test-slow
def test_quick_algorithm_study_runs_rloo_as_another_entry(tiny_lm_dir, tmp_path):
    """configs/compare_algorithms.yaml, --quick, 1 seed x 2 batches: PPO, both RLOO runs, GRPO."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"] * 8))
    overrides = {
        "model": {
            "init_args": {
                "policy": str(tiny_lm_dir),
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 6},
            }
        },
        "data": {"init_args": {"prompts": str(prompts), "heldout": str(prompts), "batch_size": 4}},
    }
    extra = tmp_path / "tiny.yaml"
    extra.write_text(yaml.safe_dump({"overrides": overrides}))
    out = tmp_path / "out"
    argv = ["--config", str(ROOT / "configs" / "compare_algorithms.yaml"), "--config", str(extra)]
    summary = main(argv + ["--quick", "--batches", "2", "--val_every", "2", "--out", str(out)])
    groups = ("ppo", "rloo", "rloo_kl_loss", "grpo")
    for group in groups:
        assert METRIC_KEYS <= summary[group].keys()
    # The runs count responses: PPO one per prompt, RLOO and GRPO 4 (2 batches of 4 prompts).
    for group, per_prompt in zip(groups, (1, 4, 4, 4), strict=True):
        samples = events(out / "runs" / group / "seed0")["progress/samples"]
        assert [v for _, v in samples] == [4 * per_prompt, 8 * per_prompt]
    assert "loss/kl" in events(out / "runs" / "rloo_kl_loss" / "seed0")
    assert "objective/frac_reward_zero_std" in events(out / "runs" / "grpo" / "seed0")
    assert [d["second"] for d in summary["differences"]] == ["rloo", "rloo_kl_loss", "grpo"]
    assert summary["verdict"] is None
    report = (out / "report.md").read_text()
    assert report.startswith("# Study: ppo vs rloo vs rloo_kl_loss vs grpo")
    assert "Difference `rloo` - `ppo`" in report
    assert "| settle batch | overshoot |" in report
    assert "KL tracking error, best first: `" in report  # more than two runs: ranked


@pytest.mark.parametrize(
    ("kl", "target", "settle", "over"),
    [
        # On target throughout: settled at the first 10-batch mean, batch 10; no overshoot.
        ([6.0] * 20, 6.0, 10, 0.0),
        # 10 batches at 0, then on target: the mean at batch b is T (b - 10) / 10 for b <= 20,
        # first >= 0.75 T at b = 18 (0.8 T; b = 17 gives 0.7 T).
        ([0.0] * 10 + [6.0] * 30, 6.0, 18, 0.0),
        # 5 batches at 2T, then T: the mean at batch b <= 15 is T (1 + (15 - b) / 10), first
        # <= 1.25 T at b = 13 (1.2 T); the largest mean is 1.5 T at batch 10: overshoot 0.5 T.
        ([8.0] * 5 + [4.0] * 25, 4.0, 13, 2.0),
        # Exactly on the edge, 1.25 T, counts as settled; the overshoot is 0.25 T.
        ([5.0] * 12, 4.0, 10, 1.0),
        # Drops to 0.5 T for the last 10 batches: the last mean is outside, never settled.
        ([6.0] * 20 + [3.0] * 10, 6.0, None, 0.0),
        # In band at the last batch only: the mean at batch 30 is 0.75 T exactly.
        ([0.0] * 20 + [4.5] * 10, 6.0, 30, 0.0),
        # A run shorter than the window has one mean, of all its batches, at its last batch.
        ([1.0, 2.0, 3.0, 4.0], 2.5, 4, 0.0),
        ([4.0, 4.0, 4.0, 4.0], 2.5, None, 1.5),
    ],
)
def test_settle_batch_and_overshoot_in_closed_cases(kl, target, settle, over):
    from rlkl_lightning.compare.events import overshoot, settle_batch

    assert settle_batch(np.array(kl), target) == settle
    assert overshoot(np.array(kl), target) == pytest.approx(over, abs=1e-12)


def test_settle_batch_and_overshoot_match_their_definition_on_random_curves():
    """A second computation: every batch's 10-batch mean, and the definition word for word."""
    from rlkl_lightning.compare.events import overshoot, settle_batch

    rng = np.random.default_rng(0)
    outcomes = set()
    for _ in range(200):
        n, target = int(rng.integers(10, 40)), 6.0
        kl = target * (1 + 0.3 * rng.standard_normal(n)).clip(0) * rng.choice([0.8, 1.0, 1.2])
        means = {b: kl[b - 10 : b].mean() for b in range(10, n + 1)}  # batch b (1-based)
        settled = [b for b in means if all(abs(means[j] - target) <= 1.5 for j in means if j >= b)]
        expected = min(settled) if settled else None
        assert settle_batch(kl, target) == expected
        assert overshoot(kl, target) == pytest.approx(max(0.0, max(means.values()) - target))
        outcomes.add(expected is None)
    assert outcomes == {True, False}  # both settled and never-settled curves were drawn


def test_seeds_that_never_settled_have_no_mean_and_show_as_never():
    from rlkl_lightning.compare.events import METRICS
    from rlkl_lightning.compare.report import _cell, aggregate, differences

    runs = [dict.fromkeys(METRICS, 1.0) | {"settle_batch": b} for b in (37, None, 52)]
    mixed = aggregate(runs)
    assert mixed["settle_batch"] is None and mixed["std"]["settle_batch"] is None
    assert mixed["per_seed"]["settle_batch"] == [37.0, None, 52.0]
    assert _cell(mixed, "settle_batch", ".0f") == "37, never, 52"
    settled = aggregate([dict.fromkeys(METRICS, 1.0) | {"settle_batch": b} for b in (30, 40)])
    assert settled["settle_batch"] == 35.0
    assert _cell(settled, "settle_batch", ".0f") == f"35 ± {math.sqrt(50):.0f}"
    d = differences({"a": settled, "b": mixed}, "a", "b")
    assert d["settle_batch"] == {"difference": None, "two_se": None, "beyond_two_se": False}
    assert d["final_score"]["difference"] == 0.0


def test_progress_lines_off_a_terminal_say_each_start_end_and_every_period():
    """Not a terminal (a StringIO, like a log file): plain lines, on a fake clock."""
    import io

    from rlkl_lightning.compare.progress import ProgressLines, study_progress

    now = [100.0]
    out = io.StringIO()
    lines = ProgressLines(runs=3, batches=10, stream=out, every=30.0, clock=lambda: now[0])
    lines.started("fixed-seed0")
    lines.started("adaptive-seed0")
    now[0] += 29.0
    lines.update({"fixed-seed0": 4, "adaptive-seed0": 2})  # 29 s: not yet a period
    now[0] += 1.0
    lines.update({"fixed-seed0": 4, "adaptive-seed0": 2})  # 30 s: 6 of 30 batches
    lines.update({"fixed-seed0": 5, "adaptive-seed0": 2})  # the same second: no line
    now[0] += 20.0
    lines.finished("fixed-seed0", 41.6)  # 50 s after its start
    lines.started("fixed-seed1")
    now[0] += 10.0
    lines.update({"adaptive-seed0": 9, "fixed-seed1": 0})  # 60 s: 19 of 30, 11 left at 19/60 s
    assert out.getvalue().splitlines() == [
        "[   0:00] start fixed-seed0 (run 1 of 3)",
        "[   0:00] start adaptive-seed0 (run 2 of 3)",
        "[   0:30] 6/30 batches (20%); running: fixed-seed0 4/10, adaptive-seed0 2/10; "
        "0 of 3 runs done; about 2:00 left",
        "[   0:50] done fixed-seed0 in 50 s (CPU 42 s; 1 of 3 runs done)",
        "[   0:50] start fixed-seed1 (run 3 of 3)",
        "[   1:00] 19/30 batches (63%); running: adaptive-seed0 9/10, fixed-seed1 0/10; "
        "1 of 3 runs done; about 0:35 left",
    ]
    with study_progress(3, 10, stream=io.StringIO()) as chosen:
        assert isinstance(chosen, ProgressLines)  # a StringIO is not a terminal


def test_a_terminal_gets_the_bar():
    import io

    from rlkl_lightning.compare.progress import ProgressBar, study_progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with study_progress(2, 10, stream=out) as chosen:
        assert isinstance(chosen, ProgressBar)
        chosen.started("fixed-seed0")
        chosen.finished("fixed-seed0", 1.0)
        chosen.update({"fixed-seed1": 5})
        assert chosen.progress.tasks[0].completed == 15
    assert "15/20" in out.getvalue() and "1/2 runs" in out.getvalue()


def test_run_progress_replaces_its_count_file_whole(tmp_path):
    from types import SimpleNamespace

    from rlkl_lightning.compare.runs import Run, RunProgress

    run = Run("fixed", 0, 0.1, tmp_path / "c.yaml", tmp_path / "log", tmp_path)
    (tmp_path / "progress").mkdir()
    assert run.batches_done() == 0  # before the first batch: no file
    callback = RunProgress(str(run.progress_file))
    for _ in range(3):
        callback.on_train_batch_end(SimpleNamespace(is_global_zero=True), None, None, None, 0)
    assert run.batches_done() == 3
    assert [p.name for p in (tmp_path / "progress").iterdir()] == ["fixed-seed0.txt"]


@pytest.mark.slow  # a study: make test-slow
def test_each_run_takes_the_study_environment_and_directory_at_its_start(
    tiny_lm_dir, tmp_path, monkeypatch
):
    """The run server outlives a study; what changed since it started still reaches a run."""
    from rlkl_lightning.compare.runs import Run, _run_context, _start

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    context = _run_context(env)
    seen = []
    for k, value in enumerate(["first", "second"]):
        work = tmp_path / f"cwd{k}"
        work.mkdir()
        monkeypatch.chdir(work)
        monkeypatch.setenv("RLKL_PROBE", value)
        probe = tmp_path / f"seen{k}.json"
        callback = {
            "class_path": "helpers.run_probe.RecordStart",
            "init_args": {"path": str(probe), "variable": "RLKL_PROBE"},
        }
        config = tiny_cli_config(
            tiny_lm_dir, tmp_path, name=f"run{k}.yaml", trainer={"callbacks": [callback]}
        )
        out = tmp_path / f"out{k}"
        for sub in ("logs", "progress"):
            (out / sub).mkdir(parents=True)
        run = Run("fixed", k, 0.2, config, out / "runs", out)
        proc = _start(context, run, env, threads=1)
        proc.join(timeout=120)
        assert proc.exitcode == 0, run.log_file.read_text()[-2000:]
        seen.append(json.loads(probe.read_text()))
        assert seen[-1]["value"] == value and seen[-1]["cwd"] == str(work)
        assert seen[-1]["threads"] == 1 and run.cpu_s() > 0
    assert seen[0]["pid"] != seen[1]["pid"]  # a fresh process per run


@pytest.mark.slow  # a study: make test-slow
def test_a_script_that_starts_the_study_without_the_main_guard_is_told_so(tiny_lm_dir, tmp_path):
    """Each run's process imports the calling script again; unguarded, it never starts its run."""
    import subprocess
    import sys

    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    out = tmp_path / "study"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "fixed-seed0.log").write_text("an earlier study's log\n")  # must not be quoted
    script = tmp_path / "study_script.py"
    script.write_text(
        "from rlkl_lightning.compare import main\n"
        f"main(['--runs', '{{\"fixed\": \"{config}\"}}', '--seeds', '1', '--batches', '1',"
        f" '--out', '{out}'])\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert "process ended (exit 1) before its run started" in last_line, done.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in last_line
    assert "an earlier study's log" not in done.stderr
