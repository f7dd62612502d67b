"""The exact world: enumeration against the sampler, the reward table, the callback in a run."""

from __future__ import annotations

import math

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
)


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
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # random tilts of the reference, sharp and flat
        q = torch.log_softmax(ref + 3 * torch.randn(len(ref), generator=gen), dim=0)
        m = world.policy_metrics(q, None)
        assert "kl_to_optimum" not in m
        assert m["reward"] <= world.frontier_reward(m["kl_to_ref"]) + 1e-6


def test_exact_metrics_log_a_runs_policy_exactly(world, tmp_path, monkeypatch):
    """Two PPO batches on the world: the callback's numbers are those of the final policy."""
    from helpers.trainers import cpu_trainer
    from lightning.pytorch.loggers import CSVLogger

    from rlkl_lightning import PPOModule
    from rlkl_lightning import metric_keys as keys

    monkeypatch.setenv("RLKL_CACHE", str(world.model_dir.parent))
    torch.manual_seed(0)
    module = PPOModule(
        policy="exact",
        reward=TableReward(),
        init_kl_coef=0.5,
        max_prompt_tokens=1,
        max_new_tokens=4,
        stop_at_eos=False,
        lr=1e-2,
        ppo_epochs=2,
        num_minibatches=2,
        log_samples_every=0,
    )
    callback = ExactMetrics(every=1)
    trainer = cpu_trainer(
        [callback], max_steps=8, logger=CSVLogger(tmp_path), max_epochs=-1
    )  # 2 batches of 4 optimizer steps
    trainer.fit(module, ExactDataModule(batch_size=16, batches_per_epoch=5))
    assert [step for step, _ in callback.history] == [0, 1]
    final = world.policy_metrics(world.logprobs(module.policy), 0.5)
    last = callback.history[-1][1]
    assert last[keys.EXACT_KL_TO_REF] == pytest.approx(final["kl_to_ref"], rel=1e-9)
    assert last[keys.EXACT_KL_TO_OPTIMUM] == pytest.approx(final["kl_to_optimum"], rel=1e-9)
    assert last[keys.EXACT_KL_TO_REF] > 1e-4  # the policy moved
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert keys.EXACT_KL_TO_OPTIMUM in logged.splitlines()[0]


def test_bad_callback_and_data_settings_name_the_option():
    with pytest.raises(ValueError, match="`every` must be an integer >= 1"):
        ExactMetrics(every=0)
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1"):
        ExactDataModule(batch_size=0)
    assert all_responses(2, 3).tolist()[:3] == [[0, 0, 0], [0, 0, 1], [0, 1, 0]]
