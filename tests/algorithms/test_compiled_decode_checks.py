"""``sample_and_score(compiled=True)`` refuses by name what its compiled step cannot run.

These checks compile nothing; the compiled step itself is tested in tests/compiled/
(``make test-compiled``).
"""

from __future__ import annotations

import pytest
import torch

from rlkl_lightning.algorithms import compiled_decode
from rlkl_lightning.algorithms.rollout import sample_and_score
from rlkl_lightning.models.loading import load_causal_lm, load_tokenizer


def _sample(policy, tokenizer):
    enc = tokenizer(["the film was", "a"], return_tensors="pt", padding=True)
    return sample_and_score(
        policy,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=4,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        compiled=True,
    )


def test_refused_by_name_attention_head_and_missing_compiler(tiny_lm_dir, monkeypatch):
    tokenizer = load_tokenizer(str(tiny_lm_dir))
    eager = load_causal_lm(str(tiny_lm_dir))
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"`engine.compiled_decode` needs .* `sdpa`, got 'eager'"):
        _sample(eager, tokenizer)
    biased = load_causal_lm(str(tiny_lm_dir))
    biased.lm_head.bias = torch.nn.Parameter(torch.ones(biased.config.vocab_size))
    with pytest.raises(ValueError, match=r"`engine.compiled_decode` needs a policy whose logits"):
        _sample(biased, tokenizer)
    monkeypatch.setattr(compiled_decode, "cpu_compiler_missing", lambda: "InvalidCxxCompiler")
    policy = load_causal_lm(str(tiny_lm_dir))
    with pytest.raises(ValueError, match=r"`engine.compiled_decode` on a CPU needs a C\+\+"):
        _sample(policy, tokenizer)


def test_compile_fixed_sets_dynamo_s_limit_where_torch_compile_takes_no_recompile_limit(
    monkeypatch,
):
    """torch 2.11 (the GPU machine's) has no ``recompile_limit`` argument: the config carries it."""
    calls = []

    def old_compile(fn, **kwargs):  # torch.compile before 2.12, as far as this argument goes
        if "recompile_limit" in kwargs:
            raise TypeError("compile() got an unexpected keyword argument 'recompile_limit'")
        calls.append(kwargs)
        return fn

    config = torch._dynamo.config
    monkeypatch.setattr(torch, "compile", old_compile)
    monkeypatch.setattr(config, "recompile_limit", 8)
    step = compiled_decode.compile_fixed(len, 40, "reduce-overhead")
    assert step is len
    assert calls == [{"mode": "reduce-overhead", "dynamic": False, "fullgraph": True}]
    assert config.recompile_limit == 40
    compiled_decode.compile_fixed(len, 20)  # never lowered
    assert config.recompile_limit == 40


def test_compile_fixed_passes_on_other_type_errors(monkeypatch):
    def broken(fn, **kwargs):
        raise TypeError("something else")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(TypeError, match="something else"):
        compiled_decode.compile_fixed(len, 40)
