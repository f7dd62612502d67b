"""``scripts/budget_odds.py``: plants fitted to a study's runs, and the law's odds on them.

The fits are checked on data made from known plants (noise-free: the plant comes back to
rounding), the closed loop on its two ends (a perfect law without noise holds the budget
exactly; the law on a quiet plant meets the criteria), and the whole script on a run that a
closed loop of the law writes as a study would.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from rlkl_lightning import metric_keys as keys

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
_spec = importlib.util.spec_from_file_location("budget_odds", ROOT / "scripts/budget_odds.py")
budget_odds = importlib.util.module_from_spec(_spec)
sys.modules["budget_odds"] = budget_odds
_spec.loader.exec_module(budget_odds)

STEPS_PER_BATCH = 4  # optimizer steps per batch: the logged step is not the batch
PLANT = (0.06, 0.03, 0.05, 80)  # c, f, g, L


def _lag(values, lag, start):
    """A first-order lag, one step a batch, written out here as the plant's definition."""
    out, level = [], start
    for v in values:
        level = level + (1 - math.exp(-1 / lag)) * (v - level)
        out.append(level)
    return out


def _targets(batches=300):
    """A target that steps up and back down, as a budget's does."""
    return [1.0 if t < 40 else 3.0 if t < 150 else 2.0 for t in range(1, batches + 1)]


def _plant_ratio(kls, batch, plant=PLANT):
    c, f, g, lag = plant
    k5 = _lag(kls[:batch], 5, 0.05)[-1]
    slow = _lag(kls[:batch], lag, 0.05)[-1]
    return math.exp(c * min(1.0, k5 / 0.3) + f * k5 + g * slow)


def test_a_noise_free_plant_and_kl_law_are_fitted_back():
    targets = _targets()
    kls = _lag(targets, 12, 0.5)  # the KL follows the target with a 12-batch lag
    evaluations = [(t, _plant_ratio(kls, t)) for t in range(5, 301, 5)]
    c, f, g, lag, residuals = budget_odds.fit_plant(kls, evaluations)
    assert lag == PLANT[3]
    np.testing.assert_allclose([c, f, g], PLANT[:3], rtol=1e-6)
    assert residuals.std() < 1e-9
    # a plant with another slow lag is told apart
    other = [(t, _plant_ratio(kls, t, (0.06, 0.03, 0.05, 200))) for t, _ in evaluations]
    assert budget_odds.fit_plant(kls, other)[3] == 200

    logged = dict(enumerate(targets, start=1))  # the target in force during each batch
    before = [0.5] + kls[:-1]  # the KL of batch t follows the target of the batches before it
    follow, sd = budget_odds.fit_follow(before, logged)
    assert follow == 12 and sd < 1e-9


def _quiet(**changes):
    plant = dict(
        c=0.06, fast=0.03, slow=0.05, lag=80, sd=0.0, rho=0.0, offset=0.0, split_sd=0.0,
        follow=15, kl_sd=0.1, kl_start=1.0,
    )  # fmt: skip
    return budget_odds.Plant(**{**plant, **changes})


@pytest.mark.parametrize("offset", [0.0, -0.01])
def test_a_perfect_law_without_noise_holds_the_budget_at_every_evaluation(offset):
    out = budget_odds.simulate(_quiet(offset=offset), {"budget": 1.3}, 1.0, 5, 100, seed=0)
    out_perfect = budget_odds.simulate(
        _quiet(offset=offset), {"budget": 1.3}, 1.0, 5, 100, seed=0, perfect=True
    )
    assert [t for t, _ in out_perfect] == list(range(5, 101, 5))
    np.testing.assert_allclose([r for _, r in out_perfect], 1.3 * math.exp(offset), rtol=1e-12)
    assert [t for t, _ in out] == [t for t, _ in out_perfect]
    assert out != out_perfect  # the law's ratio climbs from the reference's


def test_the_simulated_ratio_is_the_plant_of_the_kl_it_ran_at():
    kls = []
    plant = _quiet(kl_sd=0.3, offset=0.02)
    out = budget_odds.simulate(plant, {"budget": 1.3}, 1.0, 5, 150, seed=1, kls=kls)
    assert len(kls) == 150
    expected = [(t, _plant_ratio(kls, t) * math.exp(0.02)) for t in range(5, 151, 5)]
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    # ... and with a creep, the excess grows by exp(creep K / 1.5) a batch, K the KL it starts at
    kls = []
    out = budget_odds.simulate(plant, {"budget": 1.3}, 1.0, 5, 150, 1, creep=0.002, kls=kls)
    grown = np.cumsum([0.002 * k / 1.5 for k in [plant.kl_start, *kls[:-1]]])
    expected = [
        math.exp(math.log(_plant_ratio(kls, t)) * math.exp(grown[t - 1]) + 0.02) for t, _ in out
    ]
    np.testing.assert_allclose([r for _, r in out], expected, rtol=1e-12)


def test_the_law_meets_the_criteria_on_a_quiet_plant_and_a_perfect_law_not_in_loud_noise():
    shares = {}
    for name, plant in (("quiet", _quiet(sd=0.005)), ("loud", _quiet(sd=0.08))):
        for perfect in (False, True):
            met = 0
            for seed in range(5):
                out = budget_odds.simulate(plant, {"budget": 1.3}, 1.0, 5, 300, seed, 0.0, perfect)
                met += not budget_odds.settling(out, 1.3, 120)["failures"]
            shares[name, perfect] = met
    assert shares["quiet", False] == 5 and shares["quiet", True] == 5
    assert shares["loud", True] == 0  # noise of 0.08 in log ratio: out of the ±25% band


def _write_run(run: Path, batches=200, seed=0) -> None:
    """A run of the law on PLANT, logged as a study's run: KL, target, both ratios, config."""
    rng = random.Random(seed)
    budget, ctl = budget_odds.wired({"budget": 1.3}, 1.0)
    run.mkdir(parents=True)
    callback = {"class_path": "rlkl_lightning.CapabilityBudget", "init_args": {"budget": 1.3}}
    (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    writer = SummaryWriter(str(run))
    kl, kls = 0.5, []
    for t in range(1, batches + 1):
        step = t * STEPS_PER_BATCH
        writer.add_scalar(keys.KL_TARGET, budget.target, step)
        kl += (1 - math.exp(-1 / 12)) * (budget.target - kl)
        kls.append(kl * math.exp(rng.gauss(0, 0.05)))
        writer.add_scalar(keys.KL, kls[-1], step)
        ctl.n_batches, ctl.kl_sum, ctl.kl_count = t, ctl.kl_sum + kls[-1], t
        if t % 5 == 0:
            ratio = _plant_ratio(kls, t) * math.exp(rng.gauss(0, 0.002))
            budget.step(ratio)
            writer.add_scalar(keys.PERPLEXITY, 10.0 * ratio, step)
            writer.add_scalar(keys.TEST_PERPLEXITY, 20.0 * ratio * 1.01, step)
    writer.add_scalar(keys.PERPLEXITY_REF, 10.0, STEPS_PER_BATCH)
    writer.add_scalar(keys.TEST_PERPLEXITY_REF, 20.0, STEPS_PER_BATCH)
    writer.close()


def test_a_studys_runs_are_fitted_and_their_odds_printed(tmp_path, capsys):
    study = tmp_path / "study"
    _write_run(study / "runs" / "budget_1.3" / "seed0")
    plant, law, start, interval, batches = budget_odds.fit_run(study / "runs/budget_1.3/seed0")
    assert (law, start, interval, batches) == ({"budget": 1.3}, 1.0, 5, 200)
    assert plant.lag == PLANT[3]
    assert plant.c == pytest.approx(PLANT[0], abs=0.01)
    assert plant.fast + plant.slow == pytest.approx(PLANT[1] + PLANT[2], abs=0.01)
    assert plant.offset == pytest.approx(math.log(1.01), abs=1e-6)  # test 1% over validation
    assert plant.split_sd < 1e-6 and plant.sd < 0.004
    assert plant.follow == 12

    assert budget_odds.main([str(study), "--seeds", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{study}/runs/budget_1.3/seed0: ")
    assert lines[0].endswith("the law 1.00, a perfect law 1.00")
    assert lines[1] == (
        "the law: 1.0 of 1 runs expected to meet every criterion; all of them with probability"
        " 1.000"
    )
    with pytest.raises(SystemExit):
        budget_odds.main([str(study), "--seeds", "0"])
    config = study / "runs/budget_1.3/seed0/config.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["trainer"]["callbacks"][0]["init_args"] = {"budget": 0.9, "mode": "max"}
    config.write_text(yaml.safe_dump(settings))
    with pytest.raises(SystemExit, match="mode 'max'"):
        budget_odds.main([str(study), "--seeds", "1"])
