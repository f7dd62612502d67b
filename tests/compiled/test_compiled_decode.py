"""The compiled decode step against the eager loop, on the CPU.

Each rollout runs twice from one seed, eagerly and compiled: the tokens, masks and random
stream must be identical and the log-probs, logits and hidden states equal to float rounding
(the compiled kernels add in another order), with and without stopping at EOS, with the
logits kept or not, on the default world's GPT-2 as the pipeline prepares it and on tiny
GPT-2 and Qwen2 models.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from rlkl_lightning.algorithms import compiled_decode
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.models.forward import trunk_forward
from rlkl_lightning.models.loading import load_causal_lm, load_tokenizer
from rlkl_lightning.perf.gelu import fuse_tanh_gelu
from rlkl_lightning.perf.onednn import resolve, use_onednn

PROMPTS = [
    "the film was",
    "this book is really very",
    "the food",
    "a",
    "i did not like",
    "the acting",
    "what a",
    "the ending was",
]
TINY_PROMPTS = ["the film was", "this book is really very", "the food", "a"]
SEEDS = range(5)
LOGPROB_TOL = dict(rtol=0.0, atol=1e-5)
TIGHT = dict(rtol=1e-5, atol=1e-5)


def _encode(tokenizer, prompts):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)  # left padded
    return enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def default_world():
    """The default world's GPT-2 with the pipeline's speed-ups (oneDNN products where the
    library picks them: the compiled step leaves them to inductor)."""
    policy, tokenizer = load_causal_lm("default"), load_tokenizer("default")
    fuse_tanh_gelu(policy)
    if resolve("auto") == "onednn":
        use_onednn(policy)
    return policy, tokenizer, *_encode(tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir):
    tokenizer = load_tokenizer(str(tiny_lm_dir))
    return load_causal_lm(str(tiny_lm_dir)), tokenizer, *_encode(tokenizer, TINY_PROMPTS)


def _rollout(policy, tokenizer, ids, mask, *, compiled, seed=0, **kw):
    args = dict(
        max_new_tokens=12,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    out = sample_and_score(policy, ids, mask, compiled=compiled, **{**args, **kw})
    return out, torch.get_rng_state()


def _both(policy, tokenizer, ids, mask, **kw):
    eager = _rollout(policy, tokenizer, ids, mask, compiled=False, **kw)
    return eager, _rollout(policy, tokenizer, ids, mask, compiled=True, **kw)


def _assert_same(eager, compiled):
    (traj_e, scores_e), rng_e = eager
    (traj_c, scores_c), rng_c = compiled
    for name in ("input_ids", "attention_mask", "response_ids", "response_mask"):
        assert torch.equal(getattr(traj_c, name), getattr(traj_e, name)), name
    for name in traj_e._fields[4:]:
        assert (getattr(traj_c, name) is None) == (getattr(traj_e, name) is None), name
    torch.testing.assert_close(traj_c.logprobs, traj_e.logprobs, **LOGPROB_TOL)
    torch.testing.assert_close(scores_c.logprobs, scores_e.logprobs, **LOGPROB_TOL)
    torch.testing.assert_close(scores_c.hidden, scores_e.hidden, **TIGHT)
    assert (scores_c.logits is None) == (scores_e.logits is None)
    if scores_e.logits is not None:
        torch.testing.assert_close(scores_c.logits, scores_e.logits, **TIGHT)
    assert torch.equal(rng_c, rng_e)  # the random stream goes on identically


def _eos_likely(policy, eos, ids, mask):
    """A copy whose EOS logit follows the mean hidden state: rows stop within a few tokens."""
    policy = copy.deepcopy(policy)
    with torch.no_grad():
        mean = trunk_forward(policy, ids, mask, ids.shape[1]).reshape(-1, policy.config.n_embd)
        mean = mean.mean(0)
        policy.lm_head.weight[eos] = 4 * mean / mean.norm() ** 2
    return policy


@pytest.mark.parametrize("stop_at_eos", [True, False])
@pytest.mark.parametrize("keep_logits", [True, False])
def test_default_world_samples_the_same_on_fixed_seeds(default_world, stop_at_eos, keep_logits):
    policy, tokenizer, ids, mask = default_world
    stopped_early = 0
    for seed in SEEDS:
        kw = dict(max_new_tokens=48, temperature=1.0, stop_at_eos=stop_at_eos)
        eager, compiled = _both(
            policy, tokenizer, ids, mask, seed=seed, keep_logits=keep_logits, **kw
        )
        _assert_same(eager, compiled)
        traj = eager[0][0]
        stopped_early += traj.response_ids.shape[1] < 48
        if stop_at_eos:  # rows stopped apart: positions after an EOS are padding
            assert bool((traj.response_mask == 0).any())
    # With EOS every row stopped before 48 tokens on some seeds (the loop ended early there).
    assert stopped_early > 0 if stop_at_eos else stopped_early == 0


def test_default_world_checking_for_the_stop_every_8_tokens(default_world):
    """Rows stop between two checks: the steps after the last stop are dropped, and the
    generator is put back to its state after that stop, as if every token were checked."""
    policy, tokenizer, ids, mask = default_world
    put_back = 0
    for seed in SEEDS:
        kw = dict(max_new_tokens=48, temperature=1.0, seed=seed)
        compiled = _rollout(policy, tokenizer, ids, mask, compiled=True, stop_check_every=8, **kw)
        for every in (1, 8):
            eager = _rollout(
                policy, tokenizer, ids, mask, compiled=False, stop_check_every=every, **kw
            )
            _assert_same(eager, compiled)
        put_back += compiled[0][0].response_ids.shape[1] % 8 != 0
    assert put_back > 0


def test_default_world_greedy_tokens_are_identical(default_world):
    policy, tokenizer, ids, mask = default_world
    for keep_logits in (True, False):
        kw = dict(max_new_tokens=48, temperature=1.0, top_k=1, keep_logits=keep_logits)
        eager, compiled = _both(policy, tokenizer, ids, mask, **kw)
        _assert_same(eager, compiled)


def test_tiny_model_greedy_truncated_and_stopping_apart(tiny):
    policy, tokenizer, ids, mask = tiny
    eos_first = _eos_likely(policy, tokenizer.eos_token_id, ids, mask)
    stopped_apart = put_back = 0
    for seed in SEEDS:
        for kw in (dict(top_k=1), dict(top_k=5, top_p=0.8)):
            _assert_same(*_both(policy, tokenizer, ids, mask, seed=seed, **kw))
        for every in (1, 3, 8):
            kw = dict(max_new_tokens=20, stop_check_every=every, keep_logits=every != 3)
            eager, compiled = _both(eos_first, tokenizer, ids, mask, seed=seed, **kw)
            _assert_same(eager, compiled)
            traj = eager[0][0]
            length = traj.response_ids.shape[1]
            stopped_apart += bool((traj.response_mask == 0).any())
            put_back += length < 20 and length % every != 0  # every row stopped between checks
    assert stopped_apart > 0 and put_back > 0


def test_grouped_query_qwen2(tiny, tmp_path):
    """Rotary positions and grouped-query attention (the 0.5B preset's architecture)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tokenizer, ids, mask = tiny
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
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    qwen = load_causal_lm(str(tmp_path))
    for seed in SEEDS:
        _assert_same(*_both(qwen, tokenizer, ids, mask, seed=seed, keep_logits=seed % 2 == 0))


def test_lora_policy_samples_with_its_adapters(tiny):
    """A PEFT policy (``peft``'s LoRA, as the pipeline attaches it) decodes with the adapters on."""
    from rlkl_lightning.models.lora import attach_adapters

    policy, tokenizer, ids, mask = tiny
    spec = dict(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False)
    lora = attach_adapters(copy.deepcopy(policy), spec)
    for seed in SEEDS[:2]:
        _assert_same(*_both(lora, tokenizer, ids, mask, seed=seed))
    (adapted, _), _ = _rollout(lora, tokenizer, ids, mask, compiled=True)
    (base, _), _ = _rollout(policy, tokenizer, ids, mask, compiled=True)
    assert not torch.allclose(adapted.logprobs, base.logprobs, rtol=0, atol=1e-3)


def test_weights_changed_in_place_are_read_by_the_compiled_step(tiny):
    """An optimizer step changes the weights in place: the next rollout must use them."""
    policy, tokenizer, ids, mask = tiny
    policy = copy.deepcopy(policy)
    before = _rollout(policy, tokenizer, ids, mask, compiled=True)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.5 * torch.randn_like(param))
    after = _both(policy, tokenizer, ids, mask)
    _assert_same(*after)
    assert not torch.equal(before[0][0].response_ids, after[1][0][0].response_ids)


def test_compiled_once_per_shape_never_per_token(tiny):
    """One compilation for a new batch size; none for the tokens, nor for prompts padded to
    another length whose cache fits in the same :data:`CAPACITY_STEP` bucket."""
    policy, tokenizer, _, _ = tiny
    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    ids, mask = _encode(tokenizer, TINY_PROMPTS[:3])  # a batch size no other test uses
    start = graphs()
    _rollout(policy, tokenizer, ids, mask, compiled=True, max_new_tokens=16, stop_at_eos=False)
    assert graphs() == start + 1
    longer, longer_mask = _encode(tokenizer, ["the film was really very good and", "a", "the"])
    assert longer.shape[1] != ids.shape[1]
    assert longer.shape[1] <= compiled_decode.CAPACITY_STEP  # one bucket of prompt lengths
    again = _both(policy, tokenizer, longer, longer_mask, max_new_tokens=16, stop_at_eos=False)
    _assert_same(*again)
    assert graphs() == start + 1


def test_only_the_first_step_of_a_rollout_checks_every_guard(tiny, monkeypatch):
    """Later steps run under the stance that checks only the guards telling compiled steps
    apart; each rollout's first step, and everything after the rollout, under the full check.
    The tokens are the eager loop's (the tests above) and those of a loop checking every guard;
    a stance the user set (``force_eager``) is kept for every step.
    """
    from torch._dynamo import eval_frame

    if "skip_guard_eval_unsafe" not in str(eval_frame._stance):
        pytest.skip("this torch has no stance that skips guards")
    policy, tokenizer, ids, mask = tiny
    real = compiled_decode._compiled_step(torch.device("cpu"))
    seen = []

    def spy(*args):
        seen.append((eval_frame._stance.stance, eval_frame._stance.skip_guard_eval_unsafe))
        return real(*args)

    monkeypatch.setattr(compiled_decode, "_compiled_step", lambda device: spy)
    kw = dict(max_new_tokens=6, stop_at_eos=False)
    skipped = _rollout(policy, tokenizer, ids, mask, compiled=True, **kw)
    _rollout(policy, tokenizer, ids, mask, compiled=True, **kw)
    first, later = ("default", False), ("default", True)
    assert seen == [first, later, later, later, later] * 2  # step 0 is the prefill's draw
    assert eval_frame._stance.skip_guard_eval_unsafe is False
    with torch.compiler.set_stance("force_eager"):
        _rollout(policy, tokenizer, ids, mask, compiled=True, **kw)
    assert seen[10:] == [("force_eager", False)] * 5
    monkeypatch.setattr(compiled_decode, "guards_checked", contextlib.nullcontext)
    every = _rollout(policy, tokenizer, ids, mask, compiled=True, **kw)
    assert seen[15:] == [first] * 5
    assert torch.equal(every[0][0].response_ids, skipped[0][0].response_ids)
    torch.testing.assert_close(every[0][0].logprobs, skipped[0][0].logprobs, rtol=0, atol=0)


def test_benchmark_runs_tiny_with_the_gpu_tables_qwen2_architecture(tmp_path, monkeypatch, capsys):
    """benchmarks/compiled_rollout.py, as benchmarks/gpu_table.sh runs it, at smoke-test size."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import compiled_rollout

    args = ["--shape", "grpo", "--preset", "qwen2-0.5b", "--tiny", "--iters", "1"]
    extra = ["--warmup", "1", "--threads", "1", "--profile", "--every-guard"]
    results = compiled_rollout.main(args + extra)
    grpo = results["grpo"]
    assert grpo["rows"] == 4 and grpo["median_steps"] == 8  # the tiny preset, no early stop
    assert grpo["token_mismatch_fraction"] == 0.0
    assert grpo["compiled_median_s"] > 0 and grpo["eager_median_s"] > 0
    profiled = grpo["profile"]  # on a CPU: no device time, no launches
    assert profiled["wall_s"] > 0 and profiled["device_busy_s"] == 0 and profiled["launches"] == 0
    cpu = [op["self_cpu_ms"] for op in profiled["top"]]
    assert len(cpu) == 12 and cpu == sorted(cpu, reverse=True) and cpu[0] > 0
    assert cpu[0] <= profiled["wall_s"] * 1e3  # one thread: no operator's own time exceeds it
    out = capsys.readouterr().out
    assert "grpo qwen2-0.5b tiny (4 rows, 8 of 8 tokens)" in out
    assert "profiled compiled rollout: wall" in out
    assert grpo["every_guard_median_s"] > 0  # its tokens equal the compiled side's, or it exits
    assert "compiled, every guard checked at every step" in out


def test_engine_compiled_decode_trains_through_the_cli(tiny_lm_dir, tmp_path, monkeypatch):
    """``engine.compiled_decode: true`` in a config samples every batch with the compiled step."""
    from helpers.cli_runs import tiny_cli_config

    from rlkl_lightning.cli import main

    calls = []
    decode = compiled_decode.decode
    monkeypatch.setattr(
        compiled_decode, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k)
    )
    config = tiny_cli_config(tiny_lm_dir, tmp_path)
    main(["fit", "--config", str(config), "--model.init_args.engine.compiled_decode=true"])
    assert len(calls) == 2  # the config's 2 batches
