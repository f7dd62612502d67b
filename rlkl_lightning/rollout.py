"""Rollouts: sample responses with the policy, then score them token by token.

Shapes: ``B`` prompts, ``P`` prompt tokens (left padded), ``R`` response tokens (right
padded after the first EOS), ``V`` vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from rlkl_lightning.models import lm_forward


class Rollout(NamedTuple):
    """Sampled token ids of one batch.

    Attributes:
        input_ids: ``[B, P + R]`` prompt and response tokens.
        attention_mask: ``[B, P + R]`` 1 on real prompt tokens and valid response tokens.
        response_ids: ``[B, R]`` the sampled tokens (``input_ids[:, P:]``).
        response_mask: ``[B, R]`` float, 1 up to and including the first EOS, 0 after it.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor


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


@torch.no_grad()
def sample(
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
) -> Rollout:
    """Sample up to ``max_new_tokens`` per prompt with the KV cache.

    Args:
        policy: a causal LM with ``generate``.
        prompt_ids: ``[B, P]`` left-padded prompt tokens.
        prompt_mask: ``[B, P]`` attention mask of the prompts.
        max_new_tokens: response length limit.
        temperature: sampling temperature (> 0).
        top_k: keep the ``top_k`` most likely tokens (0 keeps all).
        top_p: nucleus sampling mass (1.0 keeps all).
        eos_token_id: generation of a row stops at this token.
        pad_token_id: filler after EOS.
        stop_at_eos: if False, always generate exactly ``max_new_tokens`` (benchmarks).

    Returns:
        The rollout; ``R`` may be shorter than ``max_new_tokens`` if every row stopped early.
    """
    was_training = policy.training
    policy.eval()
    # A fresh GenerationConfig: nothing from the model's own defaults (repetition penalty,
    # top-k 50, ...) may change the distribution we sample, or the KL estimates are biased.
    config = GenerationConfig(
        do_sample=True,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0 if stop_at_eos else max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_token_id=eos_token_id if stop_at_eos else None,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    out = policy.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
    )
    policy.train(was_training)
    response_ids = out[:, prompt_ids.shape[1] :]
    response_mask = response_mask_after_eos(response_ids, eos_token_id if stop_at_eos else None)
    attention_mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1).long()
    # Tokens after EOS are filler: make them pad so no model ever conditions on them.
    response_ids = torch.where(response_mask.bool(), response_ids, pad_token_id)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    return Rollout(input_ids, attention_mask, response_ids, response_mask)


class TokenScores(NamedTuple):
    """Per-token quantities of the responses under one model.

    Attributes:
        logits: ``[B, R, V]`` temperature-scaled next-token logits for each response position.
        logprobs: ``[B, R]`` log-probability of each sampled token.
        hidden: ``[B, R, H]`` last hidden state at the positions that predict each token.
    """

    logits: Tensor
    logprobs: Tensor
    hidden: Tensor


def score_tokens(model: nn.Module, rollout: Rollout, temperature: float) -> TokenScores:
    """Forward the whole sequence once and read off the response positions.

    The logits at position ``P - 1 + t`` predict response token ``t``, so the last ``R + 1``
    positions are kept and the final one dropped. Logits are divided by the sampling
    temperature, so the log-probabilities are those of the distribution actually sampled.
    """
    response_len = rollout.response_ids.shape[1]
    out = lm_forward(model, rollout.input_ids, rollout.attention_mask, keep=response_len + 1)
    logits = out.logits[:, :-1].float() / temperature
    logprobs = gather_logprobs(logits, rollout.response_ids)
    return TokenScores(logits, logprobs, out.hidden[:, :-1])


def gather_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[token]`` per position: ``[B, R, V], [B, R] -> [B, R]``."""
    logz = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
