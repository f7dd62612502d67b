"""The exact world: enumeration against the sampler, the reward table, the callback in a run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlkl_lightning.kl import optimum as opt
from rlkl_lightning.world.exact import (
    ExactDataModule,
    ExactMetrics,
    ExactWorld,
    ExactWorldConfig,
    TableReward,
    all_responses,
    build_exact_world,
    make_tokenizer,
    placement_end_point,
    prefix_rows,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return ExactWorld(root=tmp_path_factory.mktemp("exact"))


def reference_of(world):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(world.model_dir, weights_only=True)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"vocab_size": 9}, r"`vocab_size` must be an integer in \[2, 8\]"),
        ({"length": 0}, "`length` must be an integer >= 1"),
        ({"vocab_size": 8, "length": 5}, r"<= 4096 responses, got 8\^5 = 32768"),
        ({"prompt": "z"}, r"`prompt` must be one of \['a', 'b'"),
        ({"init_scale": math.nan}, "`init_scale` must be a finite number > 0"),
    ],
)
def test_bad_settings_name_the_option(settings, message):
    with pytest.raises(ValueError, match=message):
        ExactWorldConfig(**settings)


def test_the_enumeration_is_a_distribution_and_matches_the_samplers_log_probs(world):
    """Every sampled response's log-prob from the KV-cache sampler equals its enumerated one,
    and the sampled frequencies agree with the enumerated probabilities."""
    from rlkl_lightning.algorithms.rollout import sample_and_score

    assert world.ref_logprobs.shape == (6**4,)
    assert float(world.ref_logprobs.exp().sum()) == pytest.approx(1.0, abs=1e-9)
    torch.manual_seed(0)
    n = 20_000
    prompt = world.prompt_ids.expand(n, 1)
    traj, _ = sample_and_score(
        reference_of(world),
        prompt,
        torch.ones_like(prompt),
        max_new_tokens=4,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=6,
        stop_at_eos=False,
    )
    index = (traj.response_ids * torch.tensor([216, 36, 6, 1])).sum(-1)
    torch.testing.assert_close(
        traj.logprobs.sum(-1).double(), world.ref_logprobs[index], atol=1e-4, rtol=0
    )
    # Means of the reward and of a bounded function: within 4 standard errors of the exact ones.
    p = world.ref_logprobs.exp()
    for values in (world.rewards, (world.responses[:, 0] == world.responses[:, 1]).double()):
        exact = float((p * values).sum())
        sd = math.sqrt(float((p * (values - exact) ** 2).sum()))
        assert abs(float(values[index].mean()) - exact) < 4 * sd / math.sqrt(n)


def test_the_reference_depends_on_the_prefix(world):
    """A uniform or prefix-free reference would hide the per-token vs sequence difference."""
    logp = world.ref_logprobs.view(6, 6, 6, 6)
    second = torch.logsumexp(logp, dim=(2, 3))  # log p(y1, y2)
    conditional = second - torch.logsumexp(second, dim=1, keepdim=True)  # log p(y2 | y1)
    assert float((conditional.max(0).values - conditional.min(0).values).max()) > 0.5
    assert float(-(logp.exp() * logp).sum()) < math.log(6**4) - 1  # far from uniform


def test_the_reward_reads_every_decoded_response_back_to_its_ids(world):
    """Through the pipeline's decode (special tokens skipped), every response keeps its words."""
    tokenizer = make_tokenizer(world.config)
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in world.responses.tolist()]
    assert texts == world.texts()
    assert [tokenizer(t)["input_ids"] for t in texts[:50]] == world.responses[:50].tolist()
    reward = TableReward()
    torch.testing.assert_close(reward(["a"] * len(texts), texts), world.rewards.float())
    with pytest.raises(ValueError, match="must be 4 words of"):
        reward(["a"], ["a b"])


def test_a_build_is_deterministic(world, tmp_path):
    again = ExactWorld(root=tmp_path)
    assert again.model_dir != world.model_dir
    torch.testing.assert_close(again.ref_logprobs, world.ref_logprobs, atol=0, rtol=0)
    assert build_exact_world(root=tmp_path) == again.model_dir  # found, not rebuilt


def test_no_policy_lies_above_the_frontier_and_the_reference_is_measured_exactly(world):
    ref = world.ref_logprobs
    at_ref = world.policy_metrics(ref, 0.5)
    assert at_ref["kl_to_ref"] == pytest.approx(0.0, abs=1e-12)
    assert at_ref["reward"] == pytest.approx(opt.expected(ref, world.rewards))
    best = world.optimum(0.5)
    assert at_ref["kl_to_optimum"] == pytest.approx(opt.kl(ref, best.logprobs))
    assert world.policy_metrics(best.logprobs, 0.5)["kl_to_optimum"] == pytest.approx(0, abs=1e-9)
    assert world.frontier_reward(best.kl) == pytest.approx(best.reward, abs=1e-6)
    assert world.frontier([0.5]) == [pytest.approx((best.kl, best.reward))]
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # random tilts of the reference, sharp and flat
        q = torch.log_softmax(ref + 3 * torch.randn(len(ref), generator=gen), dim=0)
        m = world.policy_metrics(q, None)
        assert "kl_to_optimum" not in m
        assert m["reward"] <= world.frontier_reward(m["kl_to_ref"]) + 1e-6


def test_the_reference_table_per_prefix_rebuilds_every_sequences_log_prob(world):
    rows = prefix_rows(world.responses, 6)
    assert int(rows.max()) + 1 == (6**4 - 1) // (6 - 1)  # every prefix shorter than 4 tokens
    assert rows[:, 0].eq(0).all() and rows[:, 1].eq(1 + world.responses[:, 0]).all()
    table = world.reference_table()
    torch.testing.assert_close(table.exp().sum(-1), torch.ones(len(table), dtype=table.dtype))
    rebuilt = table[rows, world.responses].sum(-1)  # a second computation of log ref(y)
    torch.testing.assert_close(rebuilt, world.ref_logprobs, atol=1e-9, rtol=0)


def test_only_k1_in_the_reward_has_its_exact_end_point_at_the_optimum(world):
    beta = 0.5
    k1 = world.policy_metrics(placement_end_point(world, beta, "reward", "k1", steps=400), beta)
    assert k1["kl_to_optimum"] < 1e-3  # from 1.93 at the reference
    k2_loss = world.policy_metrics(placement_end_point(world, beta, "loss", "k2", 400), beta)
    assert k2_loss["kl_to_optimum"] > 0.02  # its tokens depend on their prefix: G_future missed
    whitened = placement_end_point(world, beta, "reward", "k1", 400, whiten=True)
    assert world.policy_metrics(whitened, beta)["kl_to_optimum"] < 1e-3  # a scale: the same
    k1_loss = world.policy_metrics(placement_end_point(world, beta, "loss", "k1", 400), beta)
    assert k1_loss["reward"] > world.optimum(beta).reward  # no KL gradient: reward ascent
    with pytest.raises(ValueError, match="`estimator` must be one of"):
        placement_end_point(world, beta, "loss", "exact")


@pytest.mark.slow  # six exact end points, up to 3,000 steps each: make test-slow
def test_whitening_without_scaling_the_kl_term_runs_away_with_k2_in_the_loss(world):
    """Issue 37's cause, by exact gradients: PPO whitened its advantages, not its KL term.

    The advantages divided by their standard deviation ``sigma`` and the KL term not: beta
    weighs ``beta x sigma`` of KL against the raw reward. ``k2``'s per-token reverse KL lets the
    policy sharpen, which shrinks ``sigma``, which weakens the KL: the policy runs to the top
    response (KL 10.87 of the 10.92 it has). ``k3``'s forward KL keeps the policy spread, so
    ``sigma`` stays near 1 and it settles (KL 2.83, near its unwhitened 2.76). Dividing the KL
    term by ``sigma`` too (PPO since the fix) gives the unwhitened end point again.
    """
    beta = 0.5
    point = {}
    for estimator in ("k2", "k3"):
        for whiten, scale in ((False, False), (True, False), (True, True)):
            # k2 whitened alone needs the steps to run away; the others settle by 600.
            steps = 3000 if (estimator, whiten, scale) == ("k2", True, False) else 600
            logprobs = placement_end_point(
                world, beta, "loss", estimator, steps, whiten=whiten, scale_kl=scale
            )
            point[estimator, whiten, scale] = world.policy_metrics(logprobs, beta)
    top = -float(world.ref_logprobs[world.rewards.argmax()])  # 10.92: one response, the best
    assert point["k2", True, False]["kl_to_ref"] > 0.95 * top
    assert point["k2", True, False]["kl_to_optimum"] > 5  # from 1.93 at the reference
    assert point["k3", True, False]["kl_to_ref"] < 3.0  # k3 whitened alike settles
    for estimator in ("k2", "k3"):
        raw, fixed = point[estimator, False, False], point[estimator, True, True]
        assert fixed["kl_to_optimum"] == pytest.approx(raw["kl_to_optimum"], abs=1e-3)
        assert fixed["kl_to_ref"] == pytest.approx(raw["kl_to_ref"], abs=1e-2)
    assert point["k2", False, False]["kl_to_optimum"] < 0.07  # k2's own end point: 0.058


def test_the_world_is_the_same_whatever_the_default_dtype(world, tmp_path):
    """A world first built under another default dtype (Lightning's ``64-true`` sets it) is
    built in float32 all the same: the cache holds one world per name."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        path = build_exact_world(root=tmp_path)
    finally:
        torch.set_default_dtype(before)
    again = ExactWorld(root=tmp_path)
    assert again.model_dir == path
    torch.testing.assert_close(again.ref_logprobs, world.ref_logprobs, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["exact_ppo.yaml", "exact_rloo.yaml"])
def test_the_configs_train_and_exact_metrics_log_the_final_policy_exactly(
    name, world, tmp_path, monkeypatch
):
    """Two batches of each config: the callback's numbers are those of the final policy."""
    from rlkl_lightning import metric_keys as keys
    from rlkl_lightning.cli import main

    monkeypatch.setenv("RLKL_CACHE", str(world.model_dir.parent))
    monkeypatch.chdir(tmp_path)
    cli = main(
        ["fit", "--config", str(ROOT / "configs" / name), "--trainer.max_steps=32"]
        + ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    )
    module = cli.model
    assert module.batches_seen == 2 and isinstance(module.reward, TableReward)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, ExactMetrics)]
    assert [step for step, _ in callback.history] == [1]  # every 10 batches, and at the end
    final = world.policy_metrics(world.logprobs(module.policy), module.kl_coef)
    logged = callback.history[-1][1]
    for key, name in ((keys.EXACT_KL_TO_REF, "kl_to_ref"), (keys.EXACT_REWARD, "reward")):
        assert logged[key] == pytest.approx(final[name], rel=1e-9)
    assert logged[keys.EXACT_KL_TO_OPTIMUM] == pytest.approx(final["kl_to_optimum"], rel=1e-9)
    assert 1e-5 < logged[keys.EXACT_KL_TO_REF] < 1  # the policy moved, a little
    (version,) = (tmp_path / "runs").glob("*/version_*")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(version))
    events.Reload()
    assert keys.EXACT_KL_TO_OPTIMUM in events.Tags()["scalars"]


def test_bad_callback_and_data_settings_name_the_option():
    with pytest.raises(ValueError, match="`every` must be an integer >= 1"):
        ExactMetrics(every=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        ExactDataModule(batch_size=0)
    assert all_responses(2, 3).tolist()[:3] == [[0, 0, 0], [0, 0, 1], [0, 1, 0]]


def test_a_build_inside_a_run_leaves_the_runs_random_draws_as_they_were(tmp_path):
    """The same command is the same run whether or not it had to build the world first."""
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_exact_world(root=tmp_path)
    assert torch.equal(torch.rand(3), expected)
