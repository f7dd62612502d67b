"""Failed rewards are masked, never scored zero: out of the advantages, baselines, losses and
logged score and of the KL the controller reads (logged apart); too many skip the batch; a
silent server stops the run in one line.
"""

import math

import pytest
import torch
from helpers.fault_server import FaultServer
from helpers.tiny_ppo import PROMPTS, fit, good_fraction, module_args
from lightning.pytorch import Callback

from rlkl_lightning.algorithms import pipeline as pipeline_module
from rlkl_lightning.algorithms.advantage_estimators import gae_advantages, on_scored_rows
from rlkl_lightning.algorithms.advantages import group_advantages, scored_groups
from rlkl_lightning.algorithms.options import PPOOptions
from rlkl_lightning.algorithms.ppo import PPOModule
from rlkl_lightning.algorithms.rloo import RLOOModule
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import AdaptiveKLController
from rlkl_lightning.rewards import RemoteReward
from rlkl_lightning.trajectory import Trajectory


class FlakyReward:
    """``good_fraction``, ``nan`` (failed) for the samples whose index ``fails(i)`` picks."""

    marks_failures = True

    def __init__(self, fails):
        self.fails = fails
        self.last_stats = {"retries": 3, "latency_ms": [10.0, 20.0, 30.0], "errors": ["HTTP 500"]}

    def __call__(self, prompts, responses):
        return torch.tensor(
            [
                math.nan if self.fails(i) else good_fraction(p, r)
                for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
            ]
        )


class Seen(Callback):
    """Every batch's logged metrics."""

    def __init__(self):
        self.history = []

    def on_train_batch_end(self, trainer, *args):
        self.history.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@pytest.fixture
def spied(monkeypatch):
    """The trajectories scoring returned and the ones the update trained on, per batch."""
    seen = {"scored": [], "trained": []}
    score, run_update = pipeline_module.RLPipeline.score, pipeline_module.run_update

    def spy_score(self, *args):
        out = score(self, *args)
        seen["scored"].append(out)
        return out

    def spy_update(module, traj):
        seen["trained"].append(traj)
        return run_update(module, traj)

    monkeypatch.setattr(pipeline_module.RLPipeline, "score", spy_score)
    monkeypatch.setattr(pipeline_module, "run_update", spy_update)
    return seen


# ---- the math ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rloo", "grpo"])
def test_group_baselines_use_the_scored_members_alone(method):
    returns = torch.tensor([1.0, 3.0, math.nan, 2.0, math.nan, 5.0, math.nan, math.nan, 4.0])
    scored = torch.isfinite(returns)
    kept = scored_groups(scored, 3)
    assert kept.tolist() == [True, True, False, True, False, True, False, False, False]
    advantages = group_advantages(returns, 3, method, scored=kept)
    for rows, values in (([0, 1], [1.0, 3.0]), ([3, 5], [2.0, 5.0])):
        by_hand = group_advantages(torch.tensor(values), 2, method)
        torch.testing.assert_close(advantages[rows], by_hand, rtol=0, atol=1e-6)
    assert torch.equal(advantages[[2, 4, 6, 7, 8]], torch.zeros(5))  # failed, or no baseline


def test_a_token_estimator_runs_on_the_scored_rows_and_leaves_the_others_at_zero():
    torch.manual_seed(0)
    b, t = 6, 5
    mask = (torch.arange(t) < torch.tensor([5, 3, 4, 5, 2, 5])[:, None]).float()
    traj = Trajectory(
        input_ids=torch.zeros(b, t, dtype=torch.long),
        attention_mask=torch.ones(b, t),
        response_ids=torch.zeros(b, t, dtype=torch.long),
        response_mask=mask,
        kl=torch.rand(b, t),
        scores=torch.tensor([1.0, math.nan, 0.5, -1.0, math.nan, 2.0]),
        values=torch.randn(b, t),
        sample_mask=torch.tensor([True, False, True, True, False, True]),
    )
    options = PPOOptions()
    out = on_scored_rows(gae_advantages, traj, 0.1, options, lambda x: x)
    rows = torch.tensor([0, 2, 3, 5])
    alone = gae_advantages(traj.select(rows), 0.1, options, lambda x: x)
    assert torch.equal(out.advantages[rows], alone.advantages)
    assert torch.equal(out.returns[rows], alone.returns)
    assert torch.equal(out.advantages[[1, 4]], torch.zeros(2, t))
    assert torch.isfinite(out.advantages).all()


# ---- in the pipeline ---------------------------------------------------------------------------


def test_ppo_masks_failed_samples_out_of_the_kl_the_controller_reads(tiny_lm_dir, spied):
    seen = Seen()
    module = PPOModule(**module_args(tiny_lm_dir, reward=FlakyReward(lambda i: i % 4 == 0)))
    with pytest.warns(RuntimeWarning, match="samples failed") as warned:
        fit(module, batches=2, batch_size=8, callbacks=[seen])
    # Once a run, not once a batch: the metric counts every batch's failures.
    assert sum("samples failed" in str(w.message) for w in warned) == 1
    for (traj, _, diagnostics), trained, logged in zip(
        spied["scored"], spied["trained"], seen.history, strict=True
    ):
        failed = diagnostics["failed"]
        assert failed.tolist() == [i % 4 == 0 for i in range(8)]
        assert trained.response_ids.shape[0] == 6  # the update: the scored samples alone
        assert torch.equal(trained.scores, traj.scores[~failed])
        kl = diagnostics["kl_k1"]
        assert logged["objective/kl"] == pytest.approx(float(kl[~failed].mean()), rel=1e-6)
        assert logged["objective/kl"] != pytest.approx(float(kl.mean()), rel=1e-6)
        assert logged["reward/failed_kl"] == pytest.approx(float(kl[failed].mean()), rel=1e-6)
        assert logged["objective/score"] == pytest.approx(float(traj.scores[~failed].mean()))
        assert logged["reward/failed_fraction"] == 0.25
        assert logged["reward/retries"] == 3
        assert logged["reward/latency_ms_p50"] == 20.0
    assert module.skipped_batches == 0


def test_rloo_drops_a_group_with_fewer_than_two_scored(tiny_lm_dir, spied):
    # k = 2: samples 0 and 1 form the first group; sample 0 fails, so the group is dropped.
    module = RLOOModule(
        **module_args(
            tiny_lm_dir, reward=FlakyReward(lambda i: i == 0), group={"responses_per_prompt": 2}
        )
    )
    fit(module, batches=1, batch_size=4)
    trained = spied["trained"][0]
    assert trained.response_ids.shape[0] == 6  # 8 responses less the group of the failed one
    assert torch.isfinite(trained.scores).all()


def test_too_many_failures_skip_the_batch_with_beta_unchanged(tiny_lm_dir):
    law = AdaptiveKLController(init_kl_coef=0.2, target=1.0, horizon=10)
    module = PPOModule(
        **module_args(tiny_lm_dir, reward=FlakyReward(lambda i: i < 5), penalty={"init_coef": 0.2})
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    with pytest.warns(RuntimeWarning, match=r"5 of 8 samples failed \(HTTP 500\), more than "):
        fit(module, batches=1, batch_size=8, callbacks=[KLControllerCallback(law)])
    assert module.skipped_batches == 1 and module.kl_coef == 0.2
    assert all(torch.equal(v, module.policy.state_dict()[k]) for k, v in before.items())


def test_in_process_rewards_log_no_reward_metrics(tiny_lm_dir):
    seen = Seen()
    fit(PPOModule(**module_args(tiny_lm_dir)), batches=1, batch_size=4, callbacks=[seen])
    assert not [k for k in seen.history[0] if k.startswith("reward/")]


def test_a_server_silent_past_the_deadline_stops_the_run_in_one_line(tiny_lm_dir):
    with FaultServer(rule=lambda n, body: "hang") as server:
        reward = RemoteReward(server.url, timeout_s=0.2, deadline_s=0.5, backoff_s=0.01)
        module = PPOModule(**module_args(tiny_lm_dir, reward=reward))
        with pytest.raises(RuntimeError) as err:
            fit(module, batches=1, batch_size=4)
    message = str(err.value)
    assert "\n" not in message
    assert f"the reward server at {server.url} answered nothing" in message
    assert "`--ckpt_path last`" in message
    assert PROMPTS  # the prompts the run was given


def test_a_rank_with_no_scored_sample_skips_the_batch_whatever_the_limit(tiny_lm_dir):
    module = PPOModule(
        **module_args(
            tiny_lm_dir, reward=FlakyReward(lambda i: True), safeguards={"max_failed_fraction": 1.0}
        )
    )
    with pytest.warns(RuntimeWarning, match=r"the rewards of every sample of a rank failed"):
        fit(module, batches=1, batch_size=4)
    assert module.skipped_batches == 1


def test_a_skipped_batch_logs_its_reward_metrics_and_batches_count_from_the_skip(tiny_lm_dir):
    """The batches with the most failures are the skipped ones: they log `reward/*` too, and
    the next batch's warning names it batch 2 (skipped batches were not counted)."""
    calls = []

    def fails(i):
        return i < 5 if len(calls) == 1 else i == 0  # batch 1: 5 of 8 fail; batch 2: 1 of 8

    class Counting(FlakyReward):
        def __call__(self, prompts, responses):
            calls.append(len(prompts))
            return super().__call__(prompts, responses)

    seen = Seen()
    module = PPOModule(**module_args(tiny_lm_dir, reward=Counting(fails)))
    with pytest.warns(RuntimeWarning) as warned:
        fit(module, batches=2, batch_size=8, callbacks=[seen])
    said = [str(w.message) for w in warned]
    assert any("skipping batch 1: the rewards of 5 of 8 samples failed" in m for m in said)
    assert any("the rewards of 1 of 8 samples failed at batch 2 " in m for m in said), said
    skipped, trained = seen.history
    assert skipped["reward/failed_fraction"] == 5 / 8 and skipped["reward/retries"] == 3
    assert skipped["reward/latency_ms_p50"] == 20.0 and math.isnan(skipped["objective/kl"])
    assert trained["reward/failed_fraction"] == 1 / 8
    assert module.skipped_batches == 1 and module.batches_seen == 1
