"""The native loop with a static KV cache and one compiled decode step (``engine.compiled_decode``).

Why: per token, the eager loop (:func:`~rlkl_lightning.algorithms.rollout.sample_and_score`)
launches every operator of the model and of the sampler from Python, and a KV cache that grows
changes the shapes at every token, so nothing can be captured once and replayed. Here the keys
and values live in transformers' ``StaticCache`` (``[B, H, L, D]`` per layer, written in place),
the attention mask has the fixed length ``L`` and hides the columns not yet written, and one
function (the forward of one token, the logits, the filtering and the softmax) is compiled with
``torch.compile`` for fixed shapes: once per batch size and cache length ``L``
(``P`` rounded up to :data:`CAPACITY_STEP`, plus ``R``), never per token. On CUDA it is
compiled with ``mode="reduce-overhead"``, so every token replays one CUDA graph. The
inverse-CDF draw runs eagerly after it (a float64 scan over the vocabulary, which torch 2.11's
inductor failed to generate for CUDA). After a rollout's first step, dynamo checks only the
guards that tell compiled steps apart (:func:`guards_checked`).

What stays as in the eager loop, so a run samples what it would have sampled:

- the prompt's forward (the prefill) is the eager loop's own, then its keys and values are
  copied into the static cache; the first token is drawn from it exactly as there;
- every uniform number is drawn by ``torch.rand`` outside the compiled code, in the eager
  loop's order and from the same generator, so the random stream is the same; the stopping
  rule (a row stops at EOS, every row checked every ``every`` tokens, the generator put back
  after the last row's stop) is the eager loop's own
  (:func:`~rlkl_lightning.algorithms.decoding.all_stopped` and
  :func:`~rlkl_lightning.algorithms.decoding.steps_kept`);
- the log-probs, logits and hidden states are those of the same model on the same tokens:
  they differ from the eager loop's by float rounding only (the compiled kernels add in
  another order), which can flip a draw only where a uniform number falls within rounding of
  a boundary of the CDF.

The cache, and the compiled code and CUDA graphs that read its addresses, are kept per policy
between rollouts (a new buffer would make CUDA graphs record again): it holds ``2 x layers x B x
H x L x D`` values of the model's dtype while training runs.

Limits, refused by name (:func:`check`): a model whose attention implementation is not
``sdpa``, whose head is not a plain product (``plain_lm_head_weight``), an FSDP unit, a cache
with layers other than full attention; on a CPU, inductor needs a C++ compiler.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
from torch import Tensor, nn

from rlkl_lightning.algorithms.decoding import (
    all_stopped,
    draw,
    filter_logits,
    invert_cdf,
    kv_cache,
    picked_scores,
    steps_kept,
)
from rlkl_lightning.models.forward import plain_lm_head_weight, position_ids_from_mask

OPTION = "engine.compiled_decode"
#: The static cache holds the prompt's length rounded up to a multiple of this, plus ``R``: a
#: batch padded to another prompt length reuses the compiled step (and a longer cache is kept).
CAPACITY_STEP = 16
#: Compiled steps kept for one process (batch sizes x cache lengths x sampling settings x
#: models); one more raises instead of silently decoding eagerly.
RECOMPILE_LIMIT = 32


@functools.cache
def cpu_compiler_missing() -> str | None:
    """Why inductor cannot compile for the CPU here (no C++ compiler), or None if it can."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:  # InvalidCxxCompiler, or a broken configuration
        return f"{type(err).__name__}: {err}".strip()
    return None


def _model(policy: nn.Module) -> nn.Module:
    """The transformers model that computes ``policy``'s forward: a PEFT policy's, adapters in."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


def check(policy: nn.Module, device: torch.device) -> None:
    """Raise ``ValueError`` naming the option unless the compiled step can run ``policy`` here."""
    policy = _model(policy)
    attention = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    if attention != "sdpa":
        raise ValueError(
            f"`{OPTION}` needs the policy's attention implementation `sdpa`, got {attention!r}"
        )
    if plain_lm_head_weight(policy) is None:
        raise ValueError(
            f"`{OPTION}` needs a policy whose logits are its head's product of the last hidden "
            "state (no bias, scale or soft-capping; not an FSDP unit)"
        )
    if device.type == "cpu":
        missing = cpu_compiler_missing()
        if missing is not None:
            raise ValueError(
                f"`{OPTION}` on a CPU needs a C++ compiler for torch.compile's inductor "
                f"(g++, or one named by CXX): {missing}"
            )


def _step(
    policy: nn.Module,
    cache,
    token: Tensor,
    index: Tensor,
    shift: Tensor,
    allowed: Tensor,
    sampling: tuple[float, int, float],
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward ``token [B, 1]`` at cache column ``index``: the next token's distribution.

    ``shift [B, 1]``: position minus column; ``allowed [B, 1, 1, L]``: the prompt's padding
    (False) and the response columns (True). Returns the float32 ``logits / T [B, V]``, hidden
    state ``[B, H]`` and the filtered probabilities ``[B, V]``. The draw runs outside the graph:
    its float64 CDF over the vocabulary is a scan that torch 2.11's inductor could not generate
    for CUDA (first seen on an H200).
    """
    temperature, top_k, top_p = sampling
    policy = _model(policy)
    columns = torch.arange(allowed.shape[-1], device=allowed.device)
    out = policy.base_model(
        input_ids=token,
        attention_mask=allowed & (columns <= index),
        position_ids=shift + index,
        past_key_values=cache,
        use_cache=True,
    )
    hidden = out.last_hidden_state
    logits = policy.get_output_embeddings()(hidden).float()[:, -1] / temperature
    return logits, hidden[:, -1], torch.softmax(filter_logits(logits, top_k, top_p), dim=-1)


_COMPILED: dict[str | None, object] = {}


def guards_checked() -> contextlib.AbstractContextManager:
    """For a rollout's later steps: dynamo checks only the guards telling compiled steps apart.

    Each later step's inputs have the first step's shapes, dtypes and devices. Why: checking
    every guard on the policy's parameters at every token can take longer than a replayed CUDA
    graph of the step. Where torch lacks the stance, or the user has set another stance
    (``force_eager``, say), every guard is checked and the user's stance is kept.
    """
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None or "skip_guard_eval_unsafe" not in inspect.signature(stance).parameters:
        return contextlib.nullcontext()
    current = getattr(torch._dynamo.eval_frame, "_stance", None)
    if getattr(current, "stance", None) != "default" or current.backend is not None:
        return contextlib.nullcontext()
    return stance("default", skip_guard_eval_unsafe=True)


def compile_fixed(fn, limit: int, mode: str | None = None):
    """``torch.compile`` for fixed shapes, one graph, at most ``limit`` recompilations.

    Before torch 2.12 ``torch.compile`` takes no ``recompile_limit``: there dynamo's global
    setting is raised to ``limit`` instead (never lowered).
    """
    kwargs = {"mode": mode, "dynamic": False, "fullgraph": True}
    try:
        return torch.compile(fn, recompile_limit=limit, **kwargs)
    except TypeError as error:
        if "recompile_limit" not in str(error):
            raise
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
    return torch.compile(fn, **kwargs)


def _compiled_step(device: torch.device):
    """``_step`` compiled for fixed shapes; on CUDA replayed as CUDA graphs."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    if mode not in _COMPILED:
        _COMPILED[mode] = compile_fixed(_step, RECOMPILE_LIMIT, mode)
    return _COMPILED[mode]


class _StaticCaches:
    """Each policy's static cache, kept for its next rollouts while the policy lives."""

    def __init__(self):
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def filled(self, policy: nn.Module, prefill, batch: int, new_tokens: int):
        """``(cache, L)``: a ``StaticCache`` with room for ``new_tokens`` after ``prefill``'s.

        The columns after the prompt are zeroed: they are hidden until written, and a value
        from an earlier rollout never meets a weight of exactly 0 (``0 x inf``).
        """
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        first = prefill.layers[0].keys
        key = (batch, first.dtype, first.device)
        kept = self._kept.get(policy)
        prompt_len = first.shape[-2]
        if kept is None or kept[0] != key or kept[1] < prompt_len + new_tokens:
            capacity = -(-prompt_len // CAPACITY_STEP) * CAPACITY_STEP + new_tokens
            cache = StaticCache(config=policy.config, max_cache_len=capacity)
            if len(cache.layers) != len(prefill.layers) or any(
                type(layer) is not StaticLayer for layer in cache.layers
            ):
                raise ValueError(f"`{OPTION}` needs a model whose layers all attend in full")
            for layer, source in zip(cache.layers, prefill.layers, strict=True):
                layer.lazy_initialization(source.keys, source.values)
            kept = self._kept[policy] = (key, capacity, cache)
        _, capacity, cache = kept
        for layer, source in zip(cache.layers, prefill.layers, strict=True):
            for static, new in ((layer.keys, source.keys), (layer.values, source.values)):
                static[:, :, :prompt_len].copy_(new)
                static[:, :, prompt_len:].zero_()
            layer.cumulative_length.fill_(prompt_len)
        return cache, capacity


_CACHES = _StaticCaches()


def decode(
    policy: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    sampling: tuple[float, int, float],
    eos: int | None,
    every: int,
    generator: torch.Generator | None,
    keep_logits: bool = True,
    pad: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """The eager loop of :func:`~rlkl_lightning.algorithms.rollout.sample_and_score`, compiled.

    Arguments and results as there: ``[B, R]`` tokens, ``[B, R, V]`` float32 logits / T (or
    None), ``[B, R, H]`` hidden states and, without the logits, ``[B, R, 3]`` picked scores.
    """
    device = prompt_ids.device
    check(policy, device)
    temperature, top_k, top_p = sampling
    batch, prompt_len = prompt_ids.shape
    mask = prompt_mask.long()
    positions = position_ids_from_mask(mask)
    prefill = kv_cache(policy, prompt_len)
    out = policy(
        input_ids=prompt_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=prefill,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    cache, capacity = _CACHES.filled(policy, prefill, batch, max_new_tokens)
    del prefill
    allowed = torch.cat([mask.bool(), mask.new_ones(batch, capacity - prompt_len).bool()], 1)
    allowed = allowed[:, None, None, :]
    shift = positions[:, -1:] + 1 - prompt_len  # a token's position minus its column
    columns = torch.arange(prompt_len, prompt_len + max_new_tokens, device=device)
    step_fn = _compiled_step(device)

    logits = out.logits[:, -1].float() / temperature
    hidden = out.hidden_states[-1][:, -1]
    token = draw(torch.softmax(filter_logits(logits, top_k, top_p), dim=-1))
    picked_now = picked_scores(logits, token, eos, pad) if not keep_logits else None
    del out
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens: list[Tensor] = []
    all_logits: Tensor | None = None
    if keep_logits:
        all_logits = logits.new_empty(batch, max_new_tokens, logits.shape[-1])
    picked: list[Tensor] = []
    hidden_steps: list[Tensor] = []
    states: list[Tensor] = []
    with contextlib.ExitStack() as later_steps:
        for step in range(max_new_tokens):
            if step > 0:
                uniform = torch.rand(batch, 1, dtype=torch.float64, device=device)
                torch.compiler.cudagraph_mark_step_begin()
                logits, hidden, probs = step_fn(
                    policy, cache, tokens[-1], columns[step - 1], shift, allowed,
                    (temperature, top_k, top_p),
                )  # fmt: skip
                if step == 1:  # every guard was checked for this step: the next ones match it
                    later_steps.enter_context(guards_checked())
                token = invert_cdf(probs, uniform)
                picked_now = picked_scores(logits, token, eos, pad) if not keep_logits else None
                # A CUDA graph's outputs are overwritten by its next replay: keep a copy.
                hidden = hidden.clone()
            if all_logits is not None:
                all_logits[:, step] = logits
            hidden_steps.append(hidden)
            tokens.append(token)
            if picked_now is not None:
                picked.append(picked_now)
            if all_stopped(finished, token, step, every, eos, generator, states):
                break
    return steps_kept(tokens, all_logits, hidden_steps, picked, states, every, eos, generator)
