"""vLLM as the rollout engine, on the default world's model: samples, weight pushes, LoRA.

* With fixed seeds, the first token vLLM draws after a prompt follows the native loop's
  distribution (a two-sample chi-square test, p > 1e-3), and vLLM at temperature 1.2 fails
  the same test (the test can tell);
* after a few updates the engine's log-probs of fixed sequences equal the trainer's to float
  rounding, and the gap of every trained batch is tiny; with the push switched off they differ;
* a LoRA policy is pushed merged: the same equality, and its base weights (its reference)
  unchanged bit for bit after every push;
* the prefix cache is reset after each push: a prompt sent before and after a push is scored
  with the new weights. vLLM's CPU backend caches blocks of 128 tokens (16 is refused for
  this model), so at these lengths (40 tokens) nothing is ever cached and a missing reset
  could not show here; the test checks that the push resets it.
"""

from __future__ import annotations

import torch
from conftest import ENGINE, PROMPTS, SAMPLING
from helpers.trainers import fit_on_prompts

from rlkl_lightning import PPOModule, RLOOModule
from rlkl_lightning.algorithms.engines.vllm import request_seed
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.rewards import FunctionReward

DRAWS = 600  # first tokens per engine


def positive(prompt: str, response: str) -> float:
    return sum(w in {"great", "good", "amazing", "best"} for w in response.split()) / 4


def make(world_dir, cls=PPOModule, **options):
    args = dict(
        policy=str(world_dir),
        reward=FunctionReward(positive),
        sampling=SAMPLING,
        engine=ENGINE,
        logging={"log_samples_every": 0},
        optimization={"lr": 3e-3, "ppo_epochs": 1, "num_minibatches": 2},
    )
    return cls(**{**args, **options})


def synced(module):
    """The process's vLLM ``LLM`` wrapper, started, with the module's weights if they changed."""
    module.rollout_engine.push(module)
    return module.rollout_engine.llm_engine


def chi_square_p(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """p-value of a two-sample chi-square test that ``a`` and ``b`` share a distribution.

    Tokens with fewer than 10 draws in both samples together are pooled into one bin.
    """
    ca = torch.bincount(a, minlength=vocab).double()
    cb = torch.bincount(b, minlength=vocab).double()
    rare = (ca + cb) < 10
    ca = torch.cat([ca[~rare], ca[rare].sum(0, keepdim=True)])
    cb = torch.cat([cb[~rare], cb[rare].sum(0, keepdim=True)])
    keep = (ca + cb) > 0
    table = torch.stack([ca[keep], cb[keep]])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def first_tokens_native(module, prompt: str, n: int) -> torch.Tensor:
    ids, mask = module._encode_prompts([prompt] * n)
    torch.manual_seed(0)
    traj, _ = sample_and_score(
        module.policy,
        ids,
        mask,
        max_new_tokens=1,
        temperature=module.sampling.temperature,
        top_k=0,
        top_p=1.0,
        eos_token_id=module.tokenizer.eos_token_id,
        pad_token_id=module.tokenizer.pad_token_id,
    )
    return traj.response_ids[:, 0]


def first_tokens_engine(module, prompt: str, n: int, temperature: float) -> torch.Tensor:
    engine = synced(module)
    ids, mask = module._encode_prompts([prompt] * n)
    seeds = [request_seed(0, 0, 0, row) for row in range(n)]
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "max_new_tokens": 1}
    tokens, _ = engine.sample(ids, mask, seeds, sampling, None, module.tokenizer.pad_token_id)
    return tokens[:, 0]


def test_first_token_follows_the_native_distribution_and_a_hotter_engine_does_not(world_dir):
    module = make(world_dir)
    vocab = module.policy.config.vocab_size
    # Openings whose first token is fairly sure: a 20% hotter engine moves most of the mass.
    for prompt in ("This hotel is", "I would not"):
        native = first_tokens_native(module, prompt, DRAWS)
        same = first_tokens_engine(module, prompt, DRAWS, temperature=1.0)
        hotter = first_tokens_engine(module, prompt, DRAWS, temperature=1.2)
        assert chi_square_p(same, native, vocab) > 1e-3
        assert chi_square_p(hotter, native, vocab) < 1e-3  # the negative control


def engine_logprobs(module, traj) -> torch.Tensor:
    """The engine's ``[B, R]`` log-probs of the trajectory's responses (teacher forced)."""
    from vllm import SamplingParams

    engine = synced(module)
    prompt_len = traj.input_ids.shape[1] - traj.response_ids.shape[1]
    requests, starts = [], []
    for ids, mask in zip(traj.input_ids, traj.attention_mask, strict=True):
        keep = mask.bool()
        requests.append({"prompt_token_ids": ids[keep].tolist()})
        starts.append(int(keep[:prompt_len].sum()))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    out = torch.zeros(traj.response_ids.shape)
    for i, (output, start) in enumerate(zip(outputs, starts, strict=True)):
        tokens = requests[i]["prompt_token_ids"]
        for t in range(start, len(tokens)):
            out[i, t - start] = output.prompt_logprobs[t][tokens[t]].logprob
    return out * traj.response_mask


def trainer_logprobs(module, traj) -> torch.Tensor:
    with torch.no_grad():
        scores = score_tokens(module.policy, traj, module.sampling.temperature)
    return scores.logprobs * traj.response_mask


class GapRecorder:
    """Wraps a module's engine's ``sample``: the per-token gap of every batch it sampled."""

    def __init__(self, module):
        self.inner, self.gaps = module.rollout_engine.sample, []
        module.rollout_engine.sample = self

    def __call__(self, *args):
        traj, scores = self.inner(*args)
        gap = (traj.logprobs - traj.sampler_logprobs).abs() * traj.response_mask
        self.gaps.append((float(gap.sum() / traj.response_mask.sum()), float(gap.max())))
        return traj, scores


def test_pushed_weights_give_the_trainers_logprobs_and_unpushed_ones_do_not(world_dir):
    module = make(world_dir)
    torch.manual_seed(0)
    fixed, _ = module.rollout(PROMPTS)  # sequences of the untrained policy
    before = trainer_logprobs(module, fixed)
    recorder = GapRecorder(module)
    fit_on_prompts(module, PROMPTS * 3, batch_size=8)  # 3 batches, 6 optimizer steps
    assert len(recorder.gaps) == 3
    assert all(mean < 1e-5 and top < 1e-4 for mean, top in recorder.gaps), recorder.gaps
    engine = synced(module)  # the last update's weights
    after = trainer_logprobs(module, fixed)
    assert (after - before).abs().max() > 0.05  # the policy moved
    torch.testing.assert_close(engine_logprobs(module, fixed), after, rtol=0, atol=1e-4)
    engine.push_enabled = False  # from here on the engine keeps these weights
    try:
        fit_on_prompts(module, PROMPTS * 3, batch_size=8)
        moved = trainer_logprobs(module, fixed)
        stale = engine_logprobs(module, fixed)
        assert (stale - moved).abs().max() > 0.05  # without the push they differ
        torch.testing.assert_close(stale, after, rtol=0, atol=1e-4)  # the old weights
        assert max(mean for mean, _ in recorder.gaps[3:]) > 1e-3  # and so does every batch
    finally:
        engine.push_enabled = True
    synced(module)
    torch.testing.assert_close(engine_logprobs(module, fixed), moved, rtol=0, atol=1e-4)


def test_a_lora_policy_is_pushed_merged_and_its_base_weights_stay(world_dir):
    lora = {"r": 4, "lora_alpha": 16, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
    module = make(world_dir, models={"peft": lora}, optimization={"lr": 3e-2, "ppo_epochs": 1})
    base = {k: v.clone() for k, v in module.policy.state_dict().items() if "lora_" not in k}
    torch.manual_seed(0)
    fixed, _ = module.rollout(PROMPTS)
    before = trainer_logprobs(module, fixed)
    engine = synced(module)
    pushes = engine.pushes
    fit_on_prompts(module, PROMPTS * 3, batch_size=8)
    synced(module)
    assert engine.pushes - pushes == 3  # before batches 2 and 3, and now
    after = trainer_logprobs(module, fixed)
    assert (after - before).abs().max() > 0.05  # the adapters moved the policy
    torch.testing.assert_close(engine_logprobs(module, fixed), after, rtol=0, atol=1e-4)
    state = module.policy.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the reference, untouched


def test_a_push_resets_the_prefix_cache(world_dir):
    """A group's prompt, sent before a push and again after it, is scored with new weights."""
    module = make(world_dir, cls=RLOOModule)
    engine = synced(module)
    torch.manual_seed(0)
    fixed, _ = module.rollout([PROMPTS[2]] * 4)
    engine_logprobs(module, fixed)  # cached keys and values of the old weights, if any
    with torch.no_grad():
        for param in module.policy.parameters():
            param.mul_(1.05)
    module.weights_version += 1  # as an update does
    resets = []
    reset = engine.llm.reset_prefix_cache
    engine.llm.reset_prefix_cache = lambda *a, **k: resets.append(1) or reset(*a, **k)
    try:
        synced(module)
    finally:
        engine.llm.reset_prefix_cache = reset
    assert resets == [1]
    torch.testing.assert_close(
        engine_logprobs(module, fixed), trainer_logprobs(module, fixed), rtol=0, atol=1e-4
    )
