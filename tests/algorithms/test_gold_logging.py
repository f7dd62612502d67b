"""`gold_reward`: logged as objective/gold_score beside the score, and changing nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.recorders import K, RecordingPPO, RecordingRLOO
from helpers.tiny_ppo import fit, module_args
from lightning.pytorch import seed_everything

from rlkl_lightning.algorithms.metrics import samples_table
from rlkl_lightning.rewards import FunctionReward
from rlkl_lightning.world.gold import GoldSentimentReward


class Lengths:
    """A gold reward that remembers what it scored: the length of each response."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, prompts, responses):
        self.calls.append(list(responses))
        return torch.tensor([float(len(r)) for r in responses])


def run(cls, path, gold, **overrides):
    seed_everything(7)
    extra = {"group": {"responses_per_prompt": K}} if cls is RecordingRLOO else {}
    module = cls(**module_args(path, gold_reward=gold, **extra, **overrides))
    fit(module, batches=2, batch_size=4)
    return module


@pytest.mark.parametrize("cls", [RecordingPPO, RecordingRLOO], ids=["ppo", "rloo"])
def test_the_gold_score_is_logged_and_no_training_number_changes(tiny_lm_dir, cls):
    gold = Lengths()
    with_gold, without = run(cls, tiny_lm_dir, gold), run(cls, tiny_lm_dir, None)
    assert without.betas_used == with_gold.betas_used
    for logged, plain in zip(with_gold.history, without.history, strict=True):
        assert "objective/gold_score" not in plain
        timings = {k for k in logged if k.startswith("perf/")}
        assert set(logged) - timings - {"objective/gold_score"} == set(plain) - timings
        for key in set(plain) - timings:
            assert logged[key] == plain[key] or (math.isnan(logged[key]) and math.isnan(plain[key]))
    # The logged value is the batch mean of what the gold reward returned for its responses.
    assert len(gold.calls) == 2 and len(gold.calls[-1]) == (4 * K if cls is RecordingRLOO else 4)
    mean = sum(len(r) for r in gold.calls[-1]) / len(gold.calls[-1])
    assert with_gold.history[-1]["objective/gold_score"] == pytest.approx(mean, rel=1e-6)
    assert mean > 0  # the check is not vacuous


def test_the_scoring_phase_gives_the_world_s_gold_of_the_decoded_reviews(tiny_lm_dir):
    """Phases 1 and 2 without a trainer: the gold scores are the reward's of the responses."""
    module = RecordingPPO(**module_args(tiny_lm_dir, gold_reward=GoldSentimentReward()))
    prompts = ["the film was", "this book is"]
    traj, policy_scores = module.rollout(prompts)
    _, responses, diagnostics = module.score(prompts, traj, policy_scores)
    assert torch.equal(diagnostics["gold"], GoldSentimentReward()(prompts, responses))


def test_a_broken_gold_reward_stops_and_a_nan_one_trains_on(tiny_lm_dir):
    wrong = FunctionReward(lambda prompts, responses: [0.0], batched=True)
    with pytest.raises(ValueError, match=r"PPOModule: `gold_reward` must return one score per"):
        run(RecordingPPO, tiny_lm_dir, wrong)
    nan = FunctionReward(lambda prompt, response: float("nan"))
    module = run(RecordingPPO, tiny_lm_dir, nan)
    assert math.isnan(module.history[-1]["objective/gold_score"])
    assert module.history[-1]["progress/skipped_batches"] == 0  # never trained on: no skip


def test_the_samples_table_shows_the_gold_score_beside_the_score():
    table = samples_table(["a|b", "c"], ["x", "y\nz"], torch.tensor([0.5, -1.0]), 1)
    assert table.splitlines() == [
        "| prompt | response | score |",
        "|---|---|---|",
        "| a\\|b | x | 0.500 |",
    ]
    gold = torch.tensor([0.25, 0.0])
    table = samples_table(["a", "c"], ["x", "y\nz"], torch.tensor([0.5, -1.0]), 2, gold)
    assert table.splitlines() == [
        "| prompt | response | score | gold score |",
        "|---|---|---|---|",
        "| a | x | 0.500 | 0.250 |",
        "| c | y z | -1.000 | 0.000 |",
    ]
