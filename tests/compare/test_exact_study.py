"""The exact-world study: its config, the runs it plans, and its report's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.compare import StudyConfig, parse_args
from rlkl_lightning.compare.exact import AT_OPTIMUM, run_settings, write_exact_report
from rlkl_lightning.compare.runs import plan_runs
from rlkl_lightning.config_files import compose
from rlkl_lightning.kl.laws import law_name

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "compare_exact.yaml")


def planned(tmp_path, monkeypatch, quick=False):
    monkeypatch.chdir(ROOT)  # the study's config paths are relative to the repository
    argv = ["--config", CONFIG, "--out", str(tmp_path / "out")] + (["--quick"] if quick else [])
    study, is_quick = parse_args(argv)
    assert is_quick == quick
    return study, plan_runs(study, tmp_path / "out")


def test_the_quick_study_is_three_of_the_runs_for_two_batches(tmp_path, monkeypatch):
    full, _ = planned(tmp_path, monkeypatch)
    study, runs = planned(tmp_path, monkeypatch, quick=True)
    assert study.report == "exact" and study.seeds == 1 and study.batches == 2
    assert study.runs == {
        k: full.runs[k] for k in ("ppo_reward_k1", "rloo_loss_k2", "ppo_adaptive")
    }
    assert [r.name for r in runs] == [f"{k}-seed0" for k in study.runs]


def test_the_study_plans_every_placement_estimator_and_law(tmp_path, monkeypatch):
    study, runs = planned(tmp_path, monkeypatch)
    assert study.report == "exact" and study.seeds == 3 and study.batches == 200
    runs = [r for r in runs if r.seed == 0]
    seen = {}
    for run in runs:
        config = yaml.safe_load(run.config.read_text())
        s = run_settings(config)
        seen[run.group] = (s["algorithm"], s["placement"], s["estimator"], s["law"])
        assert config["model"]["init_args"]["policy"] == "exact"
        assert config["model"]["init_args"]["sampling"]["stop_at_eos"] is False
    expected = {
        f"{a.lower()}_{p}_{e}": (a, p, e, "fixed")
        for a in ("PPO", "RLOO")
        for p in ("reward", "loss")
        for e in ("k1", "k2", "k3")
    }
    expected |= {f"ppo_{law}": ("PPO", "reward", "k1", law) for law in ("adaptive", "exponential")}
    expected |= {f"ppo_{law}": ("PPO", "reward", "k1", law) for law in ("pi", "logpid")}
    assert seen == expected


def test_the_laws_keep_the_gains_of_their_configs(tmp_path, monkeypatch):
    """The study's control laws are those of configs/ppo_*.yaml, with the world's target."""
    _, runs = planned(tmp_path, monkeypatch)
    for law in ("adaptive", "exponential", "pi"):
        mine = yaml.safe_load(next(r for r in runs if r.group == f"ppo_{law}").config.read_text())
        theirs = compose(ROOT / "configs" / f"ppo_{law}.yaml")["kl"]
        gains = theirs["controller"]["init_args"]  # the law's own arguments
        assert gains and mine["kl"]["controller"]["init_args"] == gains
        assert law_name(mine["kl"]["controller"]) == law and mine["kl"]["target"] == 3.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"runs": {"x": {"conf": "a.yaml"}}}, r"`runs.x` must be a config path or"),
        ({"runs": {"x": {"config": "a.yaml", "overrides": 3}}}, r"`runs.x` must be"),
        ({"report": "nope"}, r"`report` must be one of \('default', 'exact', 'budget'\)"),
    ],
)
def test_bad_entries_name_the_option(settings, message):
    with pytest.raises(ValueError, match=message):
        StudyConfig(**settings)


def write_events(log_dir: Path, values: dict[str, float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))
    for tag, value in values.items():
        writer.add_scalar(tag, value + 7.0, 0)  # an earlier evaluation, not the final one
        writer.add_scalar(tag, value, 9)
    writer.close()


def test_the_report_reads_the_final_numbers_and_judges_them_exactly(tmp_path, monkeypatch):
    from rlkl_lightning.kl import optimum as opt
    from rlkl_lightning.world.exact import ExactWorld

    monkeypatch.setenv("RLKL_CACHE", str(tmp_path / "cache"))
    _, runs = planned(tmp_path, monkeypatch)
    runs = [
        r for r in runs if r.seed == 0 and r.group in ("ppo_reward_k1", "rloo_loss_k2", "ppo_pi")
    ]
    world = ExactWorld()
    start = opt.kl(world.ref_logprobs, world.optimum(0.5).logprobs)
    finals = {
        "ppo_reward_k1": (1.5, 2.0, 0.5 * AT_OPTIMUM * start, 0.5, 0.7),
        "rloo_loss_k2": (3.0, 2.5, 2.0 * AT_OPTIMUM * start, 0.5, 0.01),
        "ppo_pi": (2.9, 2.6, 0.3, 0.25, 0.5),
    }
    names = (keys.EXACT_KL_TO_REF, keys.EXACT_REWARD, keys.EXACT_KL_TO_OPTIMUM, keys.KL_COEF)
    for run in runs:
        write_events(run.log_dir, dict(zip((*names, keys.ENTROPY), finals[run.group], strict=True)))
    # The law's batch KL: 6 nats for 5 batches, then the target 3. The 10-batch means are 4.5,
    # 4.2, 3.9 (outside 3 +- 25%), then 3.6 at batch 13 and inside from there: settled at 13,
    # overshoot 4.5 - 3.
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(next(r for r in runs if r.group == "ppo_pi").log_dir))
    for step in range(30):
        writer.add_scalar(keys.KL, 6.0 if step < 5 else 3.0, step)
    writer.close()
    study, _ = parse_args(["--config", CONFIG])
    summary = write_exact_report(runs, study, tmp_path, elapsed=1.0, end_steps=2)
    groups = summary["groups"]
    assert groups["ppo_reward_k1"]["at_optimum"] and not groups["rloo_loss_k2"]["at_optimum"]
    for name, (kl, reward, *_) in finals.items():
        g = groups[name]
        assert g["kl_to_ref"]["per_seed"] == pytest.approx([kl])
        assert g["frontier_reward"]["mean"] == pytest.approx(world.frontier_reward(kl), rel=1e-6)
        assert g["reward_gap"]["mean"] == pytest.approx(world.frontier_reward(kl) - reward, 1e-5)
    assert groups["rloo_loss_k2"]["entropy"]["mean"] == pytest.approx(0.01)
    pi = groups["ppo_pi"]
    assert pi["target_optimum"]["beta"] == pytest.approx(world.beta_for_kl(3.0))
    assert pi["beta_ratio"] == pytest.approx(0.25 / world.beta_for_kl(3.0), rel=1e-6)
    assert pi["settle_batch"]["per_seed"] == [13] and pi["settle_batch"]["never"] == 0
    assert pi["overshoot"]["mean"] == pytest.approx(1.5)
    assert json.loads((tmp_path / "summary.json").read_text())["groups"].keys() == groups.keys()
    report = (tmp_path / "report.md").read_text()
    assert "| `ppo_reward_k1` | PPO | reward | k1 | 0.5 |" in report
    assert "At the optimum (final KL(pi‖pi*) below 10% of KL(ref‖pi*)): `ppo_reward_k1`." in report
    assert (tmp_path / "frontier.png").stat().st_size > 0
