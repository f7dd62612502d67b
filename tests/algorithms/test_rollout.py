"""The sampling loop reads nothing back from the device per token, and stays exact.

On a GPU every read of a tensor's value by the host (``bool(t)``, ``t.item()``, ...) waits
for the device to finish its queue. The test counts such reads on the CPU with a
``TorchFunctionMode`` and shows that they do not grow with the number of tokens, and that
checking for the end of every row less often, or handing transformers a prepared mask,
changes no number.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlkl_lightning.algorithms import rollout as rollout_module
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.loading import load_causal_lm, load_tokenizer
from rlkl_lightning.models.logprobs import score_tokens, step_logits

PROMPTS = ["the film was", "this book is really very", "the food", "a"]  # left padding
HOST_READS = {
    "__bool__",
    "__contains__",
    "__float__",
    "__index__",
    "__int__",
    "allclose",
    "cpu",
    "equal",
    "item",
    "masked_select",
    "nonzero",
    "numpy",
    "tolist",
    "unique",
}


class HostReads(TorchFunctionMode):
    """Counts the torch calls that read a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir):
    policy = load_causal_lm(str(tiny_lm_dir))
    tokenizer = load_tokenizer(str(tiny_lm_dir))
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return policy, tokenizer, enc["input_ids"], enc["attention_mask"]


def _sample(policy, tokenizer, ids, mask, seed=0, **kw):
    args = dict(
        max_new_tokens=12,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    out = sample_and_score(policy, ids, mask, **{**args, **kw})
    return out, torch.get_rng_state()


def _eos_likely(policy, eos, ids, mask):
    """A copy whose EOS logit follows the mean hidden state: rows stop within a few tokens."""
    policy = copy.deepcopy(policy)
    with torch.no_grad():
        mean = trunk_forward(policy, ids, mask, ids.shape[1]).reshape(-1, policy.config.n_embd)
        mean = mean.mean(0)
        policy.lm_head.weight[eos] = 4 * mean / mean.norm() ** 2
    return policy


def _assert_same(a, b):
    (traj_a, scores_a), rng_a = a
    (traj_b, scores_b), rng_b = b
    for x, y in zip((*traj_a, *scores_a), (*traj_b, *scores_b), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    assert torch.equal(rng_a, rng_b)  # the random stream goes on identically


def test_host_reads_do_not_grow_with_the_tokens(tiny):
    policy, tokenizer, ids, mask = tiny
    counts = {}
    for every in (1, 8):
        for tokens in (8, 32):
            kw = dict(max_new_tokens=tokens, stop_check_every=every, eos_token_id=10**6)
            with HostReads() as reads:  # an EOS that is never drawn: no row stops
                _sample(policy, tokenizer, ids, mask, **kw)
            counts[every, tokens] = reads.names
    # Checking every token reads once per token; every 8 tokens, once per 8 tokens: the
    # 24 more tokens add 24 and 3 reads, all of them the stop check (`bool`).
    for every, extra in ((1, 24), (8, 3)):
        short, long = counts[every, 8], counts[every, 32]
        assert len(long) - len(short) == extra and set(long) == {"__bool__"}
    # transformers' 2 padding checks of the prefill, 4 stop checks, 1 after the loop
    assert len(counts[8, 32]) == 7


def test_checking_less_often_gives_the_same_rollout_and_random_stream(tiny):
    policy, tokenizer, ids, mask = tiny
    policy = _eos_likely(policy, tokenizer.eos_token_id, ids, mask)
    every_token = _sample(policy, tokenizer, ids, mask, max_new_tokens=20, stop_check_every=1)
    traj = every_token[0][0]
    assert traj.response_ids.shape[1] < 8  # every row stopped before the first check at 8
    assert bool((traj.response_mask == 0).any())  # and at different tokens
    for every in (3, 8, 50):
        _assert_same(
            every_token,
            _sample(policy, tokenizer, ids, mask, max_new_tokens=20, stop_check_every=every),
        )


def test_checking_less_often_without_early_stop(tiny):
    policy, tokenizer, ids, mask = tiny
    for stop_at_eos in (True, False):
        kw = dict(max_new_tokens=10, stop_at_eos=stop_at_eos)
        _assert_same(
            _sample(policy, tokenizer, ids, mask, stop_check_every=1, **kw),
            _sample(policy, tokenizer, ids, mask, stop_check_every=4, **kw),
        )


def test_prepared_masks_give_the_numbers_of_transformers_own(tiny, monkeypatch):
    """The boolean 4D masks of SDPA models equal transformers' masks built from the 2D one."""
    policy, tokenizer, ids, mask = tiny
    prepared = _sample(policy, tokenizer, ids, mask, max_new_tokens=10)
    monkeypatch.setattr(
        rollout_module, "_decode_masks", lambda policy, full: lambda n: full[:, :n].clone()
    )
    _assert_same(prepared, _sample(policy, tokenizer, ids, mask, max_new_tokens=10))


def _grouped_query_model(tokenizer, path):
    """A tiny Qwen2 (grouped-query attention) with ``tokenizer``'s vocabulary, saved and loaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return load_causal_lm(str(path))


def test_eager_attention_and_grouped_query_models(tiny_lm_dir, tmp_path):
    """The 2D-mask path (eager attention) and a grouped-query model score like a full pass."""
    tokenizer = load_tokenizer(str(tiny_lm_dir))
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    eager = load_causal_lm(str(tiny_lm_dir))
    eager.config._attn_implementation = "eager"
    for policy in (eager, _grouped_query_model(tokenizer, tmp_path)):
        (traj, scores), _ = _sample(
            policy, tokenizer, enc["input_ids"], enc["attention_mask"], stop_check_every=4
        )
        plain = score_tokens(policy, traj, 0.7)
        valid = traj.response_mask.bool()
        torch.testing.assert_close(scores.logits[valid], plain.logits[valid], rtol=1e-5, atol=1e-5)


def test_weights_are_cast_once_per_rollout_and_never_after(tiny, monkeypatch):
    """Under bf16 autocast (Lightning's: cache off) the loop casts each weight once."""
    policy, tokenizer, ids, mask = tiny
    policy = copy.deepcopy(policy)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        kept = _sample(policy, tokenizer, ids, mask)
        assert kept[0][1].logits.dtype == torch.float32
        with monkeypatch.context() as patch:  # a cast at every use, as without the cache
            patch.setattr(rollout_module, "_weight_casts_kept", lambda device: nullcontext())
            _assert_same(kept, _sample(policy, tokenizer, ids, mask))
        # No cast outlives the rollout: after a change of the weights in place, even a
        # cached autocast region computes with the new ones.
        x = torch.randn(3, policy.config.n_embd)
        with torch.no_grad():
            policy.lm_head.weight.mul_(2.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            cached = policy.lm_head(x)
        torch.testing.assert_close(cached, policy.lm_head(x), rtol=0, atol=0)
        assert not torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("autocast", [False, True])
def test_without_the_logits_the_rollout_is_the_same_and_its_logits_come_back(
    tiny, tmp_path, autocast
):
    """``keep_logits=False``: the same tokens, log-probs, hidden states and random stream,
    and ``step_logits`` gives back, bit for bit, the logits the loop drew each token from."""
    policy, tokenizer, ids, mask = tiny
    eos_first = _eos_likely(policy, tokenizer.eos_token_id, ids, mask)  # rows stop apart
    qwen = _grouped_query_model(tokenizer, tmp_path)
    context = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    for model, every in ((policy, 1), (eos_first, 1), (eos_first, 8), (qwen, 4)):
        with context if autocast else nullcontext():
            kw = dict(max_new_tokens=20, stop_check_every=every)
            (traj, kept), rng = _sample(model, tokenizer, ids, mask, **kw)
            (traj_d, dropped), rng_d = _sample(model, tokenizer, ids, mask, keep_logits=False, **kw)
            assert dropped.logits is None and torch.equal(rng, rng_d)
            for x, y in zip(
                (*traj, kept.logprobs, kept.hidden), (*traj_d, *dropped[1:]), strict=True
            ):
                assert (x is None and y is None) or torch.equal(x, y)
            for step in range(traj.response_ids.shape[1]):
                again = step_logits(model, dropped.hidden, step, 0.7)
                assert torch.equal(again, kept.logits[:, step])
            if model is eos_first:  # rows stopped apart: positions after an EOS are padding
                assert bool((traj.response_mask == 0).any())


def test_scoring_without_the_rollout_logits_logs_the_same_kl_and_entropy(tiny_lm_dir):
    """Large logits of a plain head are not kept (always off the CPU); scoring gives the same."""
    from rlkl_lightning import PPOModule
    from rlkl_lightning.algorithms.pipeline import CPU_KEPT_LOGITS_BYTES, keep_rollout_logits
    from rlkl_lightning.rewards import FunctionReward

    module = PPOModule(
        policy=str(tiny_lm_dir),
        reward=FunctionReward(lambda p, r: float(len(r))),
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 6},
        logging={"log_samples_every": 0},
    )
    hp = module.sampling
    rollouts = []
    for keep in (True, False):
        torch.manual_seed(0)
        rollouts.append(
            sample_and_score(
                module.policy,
                *module._encode_prompts(PROMPTS),
                max_new_tokens=6,
                temperature=hp.temperature,
                top_k=hp.top_k,
                top_p=hp.top_p,
                eos_token_id=module.tokenizer.eos_token_id,
                pad_token_id=module.tokenizer.pad_token_id,
                keep_logits=keep,
            )
        )
    (traj, kept), (_, scores) = rollouts
    ref = score_tokens(module.reference, traj, hp.temperature)
    for again, plain in zip(
        module._logit_diagnostics(scores, ref.logits),
        module._logit_diagnostics(kept, ref.logits),
        strict=True,
    ):
        assert torch.equal(again, plain)
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # the choice, not a computation
    vocab = len(module.tokenizer)
    most = CPU_KEPT_LOGITS_BYTES // (4 * vocab * 32)  # rows of 32 tokens a CPU keeps
    assert keep_rollout_logits(module.policy, cpu, most, 32)
    assert not keep_rollout_logits(module.policy, cpu, most + 1, 32)
    assert not keep_rollout_logits(module.policy, gpu, 1, 1)
    assert module.rollout(PROMPTS)[1].logits is not None  # small: this CPU keeps them
    module.policy.lm_head.bias = torch.nn.Parameter(torch.zeros(vocab))
    module.policy._rlkl_plain_head = None  # checked again: a head with a bias is not plain
    assert keep_rollout_logits(module.policy, gpu, most + 1, 32)
