"""The plain pipeline that the fast sampling loop is checked against: ``generate``, then score.

``rlkl_lightning.algorithms.rollout.sample_and_score`` samples with its own KV-cache loop and
keeps the policy's scores of its samples. The tests compare it with this straightforward version:
Hugging Face ``generate`` with a fresh ``GenerationConfig``, then a second forward pass for the
log-probs. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from rlkl_lightning.algorithms.rollout import response_mask_after_eos
from rlkl_lightning.models.logprobs import score_tokens
from rlkl_lightning.trajectory import Trajectory


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
) -> Trajectory:
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
        The trajectory's ids, masks and policy log-probs (from a second, full pass); ``R``
        may be shorter than ``max_new_tokens`` if every row stopped early.
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
    # The policy's log-probs come from a second, full-sequence pass: the plain pipeline.
    logprobs = score_tokens(
        policy,
        Trajectory(input_ids, attention_mask, response_ids, response_mask, None),
        temperature,
    ).logprobs
    return Trajectory(input_ids, attention_mask, response_ids, response_mask, logprobs)
