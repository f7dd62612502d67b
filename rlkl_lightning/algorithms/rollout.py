"""Rollouts: one KV-cache sampling loop that also scores the policy's own samples.

The policy's log-probabilities, full logits and last hidden states at the response positions
are computed while sampling: the logits that sample response token ``t`` are the policy's
next-token logits at position ``P - 1 + t``, and a causal model gives the same values whether
it sees the sequence token by token with a KV cache or all at once (up to float rounding).
:func:`sample_and_score` keeps them (the logits optionally: ``keep_logits``), so no second
policy pass is needed, and it drives the model directly instead of through ``generate``,
whose per-step bookkeeping costs more than the forward itself for small models.
``tests/perf/test_fast_path.py`` checks it against ``generate`` followed by a scoring pass
(``tests/helpers/generate_reference.py``).

Shapes: ``B`` prompts, ``P`` prompt tokens (left padded), ``R`` response tokens (right
padded after the first EOS), ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from rlkl_lightning.algorithms.decoding import (
    all_stopped,
    draw,
    filter_logits,
    kv_cache,
    picked_scores,
    steps_kept,
)
from rlkl_lightning.models.forward import position_ids_from_mask
from rlkl_lightning.models.logprobs import TokenScores, gather_logprobs
from rlkl_lightning.trajectory import Trajectory


def response_mask_after_eos(response_ids: Tensor, eos_token_id: int | None) -> Tensor:
    """Mask of valid response tokens: everything up to and including the first EOS.

    Args:
        response_ids: ``[B, R]`` sampled tokens.
        eos_token_id: the end-of-sequence id, or None when generation never stops early.

    Returns:
        ``[B, R]`` float mask.
    """
    if eos_token_id is None:
        return torch.ones_like(response_ids, dtype=torch.float32)
    is_eos = response_ids == eos_token_id
    # Number of EOS strictly before each position; a token is valid while that count is 0.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).float()


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator that ``torch.rand(..., device=device)`` draws from (None if unknown)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    return generators[device.index if device.index is not None else module.current_device()]


def _decode_masks(policy: nn.Module, mask: Tensor):
    """``length -> attention mask`` of a decoding step over the first ``length`` positions.

    ``mask [B, P + R]`` holds the prompts' padding and ones for the responses. For an SDPA
    model the mask is handed over as the boolean ``[B, 1, 1, length]`` tensor that
    transformers would build from it (a view: nothing is allocated per token), so no check
    of the padding runs on the host at every token (on a GPU each such check waits for the
    device). Other attention implementations get the plain 2D mask.
    """
    if getattr(getattr(policy, "config", None), "_attn_implementation", None) == "sdpa":
        allowed = mask.bool()[:, None, None, :]
        return lambda length: allowed[..., :length]
    return lambda length: mask[:, :length]


@contextlib.contextmanager
def _weight_casts_kept(device_type: str):
    """Under autocast, cast each weight to the low precision once for the whole loop.

    Lightning's mixed precision autocasts with its cache off, which is right across optimizer
    steps (a cached cast would outlive the weight's update) but casts every weight again at
    every token of the rollout, where the weights never change. Here the cache is on for the
    loop and emptied after it: the same low-precision values, computed once.
    """
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    dtype = torch.get_autocast_dtype(device_type)
    try:
        with torch.autocast(device_type, dtype=dtype, cache_enabled=True):
            yield
    finally:
        torch.clear_autocast_cache()


@torch.no_grad()
def sample_and_score(
    policy: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_token_id: int | None,
    pad_token_id: int,
    stop_at_eos: bool = True,
    stop_check_every: int | None = None,
    keep_logits: bool = True,
    compiled: bool = False,
) -> tuple[Trajectory, TokenScores]:
    """Sample responses with a KV cache and keep the policy's scores of them.

    Tokens are drawn from ``softmax(filter(logits / temperature))``; the returned scores use
    the unfiltered ``logits / temperature``, exactly like
    :func:`~rlkl_lightning.models.logprobs.score_tokens`.

    Nothing in the loop reads a tensor back to the host except the check whether every row
    has stopped, once every ``stop_check_every`` tokens. Checking less often changes nothing
    in the result: the steps sampled after the last row stopped are dropped, and the random
    generator is put back to its state after that row's last step, as if the loop had
    stopped there.

    Args:
        policy: A causal LM.
        prompt_ids: ``[B, P]`` left-padded prompt tokens.
        prompt_mask: ``[B, P]`` attention mask of the prompts.
        max_new_tokens: Response length limit.
        temperature: Sampling temperature (> 0).
        top_k: Keep the ``top_k`` most likely tokens (0 keeps all).
        top_p: Nucleus sampling mass (1.0 keeps all).
        eos_token_id: A row stops at this token.
        pad_token_id: Filler after EOS.
        stop_at_eos: If False, always generate exactly ``max_new_tokens`` (benchmarks).
        stop_check_every: Tokens between two checks whether every row has stopped (each check
            waits for the device); None: every token on the CPU, where a check costs nothing,
            every 8 tokens elsewhere.
        keep_logits: Keep the ``[B, R, V]`` float32 logits in the scores. False: the scores'
            ``logits`` are None (the log-probs are the same, bit for bit on a CPU); where the
            head is plain, :func:`~rlkl_lightning.models.logprobs.step_logits` computes them
            again from the kept hidden states, one step at a time, as the loop did.
        compiled: Decode with a static KV cache and one compiled step
            (:mod:`~rlkl_lightning.algorithms.compiled_decode`, the ``engine.compiled_decode``
            option): the same tokens and random stream, scores equal to float rounding.

    Returns:
        ``(trajectory, scores)``: a :class:`Trajectory` with ids, masks and the policy's
        log-probs (``R`` may be shorter than ``max_new_tokens`` if every row stopped early),
        and the policy's :class:`TokenScores` at its response positions (float32 logits, or
        None).
    """
    eos = eos_token_id if stop_at_eos else None
    device = prompt_ids.device
    every = stop_check_every or (1 if device.type == "cpu" else 8)
    generator = _default_generator(device) if eos is not None and every > 1 else None
    was_training = policy.training
    policy.eval()
    decode = _decode
    if compiled:
        from rlkl_lightning.algorithms.compiled_decode import decode
    try:
        with _weight_casts_kept(device.type):
            response_ids, logits, hidden, picked = decode(
                policy,
                prompt_ids,
                prompt_mask,
                max_new_tokens,
                (temperature, top_k, top_p),
                eos,
                every if generator is not None else 1,  # no state: stopping late is final
                generator,
                keep_logits,
                pad_token_id,
            )
    finally:
        policy.train(was_training)
    response_mask = response_mask_after_eos(response_ids, eos)
    # Tokens after EOS are filler: make them pad so no model ever conditions on them.
    response_ids = torch.where(response_mask.bool(), response_ids, pad_token_id)
    attention_mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1).long()
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    if logits is not None:
        logprobs = gather_logprobs(logits, response_ids)
    else:  # gather_logprobs' own values: the logit of the token kept (or of pad) minus logz
        sampled, pad, logz = picked.unbind(-1)
        logprobs = torch.where(response_mask.bool(), sampled, pad) - logz
    traj = Trajectory(input_ids, attention_mask, response_ids, response_mask, logprobs)
    return traj, TokenScores(logits, logprobs, hidden)


def _decode(
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
    """The KV-cache loop: ``[B, R]`` tokens, ``[B, R, V]`` float32 logits / T, ``[B, R, H]``.

    ``sampling``: temperature, top-k and top-p. Stops once every row has drawn ``eos``,
    looking every ``every`` tokens; steps drawn after that are dropped and ``generator`` is
    put back to its state after the last one kept. Without ``keep_logits`` the logits are
    None; instead, per step, the logits of the sampled token and of ``pad`` and the
    log-sum-exp of the row: ``[B, R, 3]`` (else None).
    """
    temperature, top_k, top_p = sampling
    batch, prompt_len = prompt_ids.shape
    mask = prompt_mask.long()
    positions = position_ids_from_mask(mask)
    cache = kv_cache(policy, prompt_len + max_new_tokens)
    decode_mask = _decode_masks(policy, torch.cat([mask, mask.new_ones(batch, max_new_tokens)], 1))

    def forward(ids: Tensor, attention: Tensor, position_ids: Tensor, **extra):
        return policy(
            input_ids=ids,
            attention_mask=attention,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
            **extra,
        )

    out = forward(prompt_ids, mask, positions, logits_to_keep=1)
    next_position = positions[:, -1:] + 1
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens: list[Tensor] = []
    all_logits: Tensor | None = None  # [B, R, V], written step by step (no list to stack)
    picked: list[Tensor] = []  # without the logits: [B, 3] per step
    hidden_steps: list[Tensor] = []
    states: list[Tensor] = []  # the generator's state after each step
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float() / temperature
        if keep_logits:
            if all_logits is None:
                all_logits = logits.new_empty(batch, max_new_tokens, logits.shape[-1])
            all_logits[:, step] = logits
        hidden_steps.append(out.hidden_states[-1][:, -1])
        token = draw(torch.softmax(filter_logits(logits, top_k, top_p), dim=-1))
        tokens.append(token)
        if not keep_logits:
            picked.append(picked_scores(logits, token, eos, pad))
        if all_stopped(finished, token, step, every, eos, generator, states):
            break
        if step + 1 == max_new_tokens:
            break  # the last token's own logits are never needed
        out = forward(token, decode_mask(prompt_len + step + 1), next_position)
        next_position = next_position + 1
    return steps_kept(tokens, all_logits, hidden_steps, picked, states, every, eos, generator)
