"""``scripts/budget_replay.py``: a logged budget run replayed through the law is the run.

A closed loop on a synthetic plant (the KL follows the target, the log excess answers the KL
through a lag and creeps at a constant KL) drives a ``CapabilityBudget`` and writes what a run
logs: the batches' KL, the monitored perplexity and its reference, the target after each
evaluation, and the callback's arguments in ``config.yaml``. The script, reading only those
files, must give every logged target back; without the trend, some must differ.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.capability_budget import CapabilityBudget

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("budget_replay", ROOT / "scripts/budget_replay.py")
budget_replay = importlib.util.module_from_spec(_spec)
sys.modules["budget_replay"] = budget_replay
_spec.loader.exec_module(budget_replay)

REF = 40.0  # the reference's perplexity
STEPS_PER_BATCH = 4  # optimizer steps per batch: the logged step is not the batch
ARGS = {"budget": 1.3, "raise_per_batch": 0.04, "fall_per_batch": 0.04, "follow": 0.7}


def _closed_loop(batches: int = 150, interval: int = 5, seed: int = 0):
    """What the run logs: per batch ``(KL, target logged)``, per evaluation ``(batch, ppl)``."""
    rng = random.Random(seed)
    budget = CapabilityBudget(**ARGS)
    ctl = budget_replay._Controller(n_batches=0, kl_sum=0.0, kl_count=0, target=1.0)
    budget._controller, budget.target, budget.reference = ctl, 1.0, REF
    kl, slow, creep = 0.3, 0.3, 0.0
    per_batch, evaluations = [], []
    for t in range(1, batches + 1):
        kl += (1 - math.exp(-1 / 10)) * (budget.target * math.exp(0.1 * rng.gauss(0, 1)) - kl)
        slow += (1 - math.exp(-1 / 40)) * (kl - slow)
        creep += 0.003 * kl
        ctl.n_batches += 1
        ctl.kl_sum += kl
        ctl.kl_count += 1
        per_batch.append((kl, budget.target))  # the target in force during batch t
        if t % interval == 0:
            excess = 0.1 * slow * math.exp(creep) + rng.gauss(0, 0.003)
            ppl = REF * math.exp(excess)
            budget.step(ppl)
            evaluations.append((t, ppl))
    return per_batch, evaluations


def _write_run(run: Path, per_batch, evaluations) -> None:
    callback = {"class_path": budget_replay.BUDGET_CLASS, "init_args": {**ARGS, "mode": "min"}}
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    writer = SummaryWriter(str(run))
    for i, (kl, target) in enumerate(per_batch):
        step = (i + 1) * STEPS_PER_BATCH
        writer.add_scalar(keys.KL, kl, step)
        writer.add_scalar(keys.KL_TARGET, target, step)
    for batch, ppl in evaluations:
        writer.add_scalar("val/perplexity", ppl, batch * STEPS_PER_BATCH)
    writer.add_scalar("val/perplexity_ref", REF, STEPS_PER_BATCH)
    writer.close()


def test_a_replayed_run_gives_every_logged_target_back(tmp_path, capsys):
    per_batch, evaluations = _closed_loop()
    run = tmp_path / "runs" / "budget_1.3" / "seed0"
    _write_run(run, per_batch, evaluations)
    kls, read_evaluations, law, logged = budget_replay.read_run(run)
    assert len(kls) == 150 and len(read_evaluations) == 30
    assert law == ARGS | {"mode": "min"}
    assert budget_replay.main([str(run), "--no-trend"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "replayed targets equal to the logged ones: 29 of 29"
    # the run moved its target, so the check is not vacuous
    assert len({round(t, 6) for _, t in per_batch}) > 10

    with_trend = budget_replay.replay(kls, read_evaluations, law, 1.0)
    without = budget_replay.replay(kls, read_evaluations, law, 1.0, trend=False)
    assert max(r["trend"] for r in with_trend) > 0  # the plant creeps: a trend is carried
    assert all(r["trend"] == 0 for r in without)
    lower = [a["target"] < b["target"] for a, b in zip(with_trend, without, strict=True)]
    assert any(lower)  # a rising trend asks for less KL than the same data without it


def test_a_study_is_surveyed_run_by_run_naming_the_first_target_that_differs(tmp_path, capsys):
    study = tmp_path / "study"
    per_batch, evaluations = _closed_loop(batches=60)
    _write_run(study / "runs" / "budget_1.3" / "seed0", per_batch, evaluations)
    # a run whose law asked otherwise from batch 30 on (batch i + 1 ran at per_batch[i])
    changed = [
        (kl, target * 1.1 if i >= 30 else target) for i, (kl, target) in enumerate(per_batch)
    ]
    _write_run(study / "runs" / "budget_1.3" / "seed1", changed, evaluations)
    fixed = study / "runs" / "target_1" / "seed0"  # a fixed-target run: not the budget's
    fixed.mkdir(parents=True)
    (fixed / "config.yaml").write_text(yaml.safe_dump({"trainer": {"callbacks": []}}))

    assert budget_replay.budget_runs(study) == [
        study / "runs" / "budget_1.3" / "seed0",
        study / "runs" / "budget_1.3" / "seed1",
    ]
    assert budget_replay.main([str(study)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("seed0: 11 of 11 targets given back")
    # the target logged at batch 31's end is the one the evaluation after batch 30 set
    assert "seed1: 5 of 11 targets given back; first differs after batch 30 (logged" in lines[1]
    assert lines[-1] == "runs whose every target comes back: 1 of 2"

    assert budget_replay.main([str(study / "runs" / "budget_1.3" / "seed0"), str(study)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "runs whose every target comes back: 2 of 3"
    with pytest.raises(SystemExit, match="no budget run in"):
        budget_replay.main([str(tmp_path / "empty")])
