"""Checks that join the options and the loaded models: context window, vocabulary."""

from __future__ import annotations

from typing import Any

from torch import nn


def context_of(model: nn.Module) -> int | None:
    """The model's context length in tokens (``n_positions`` or ``max_position_embeddings``)."""
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_vocabulary(owner: str, policy: nn.Module, reference: Any) -> None:
    """The reference must score the policy's tokens: the same vocabulary size."""
    vocab = [getattr(m.config, "vocab_size", None) for m in (reference, policy)]
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"{owner}: `reference` must share the policy's vocabulary: vocab_size "
            f"{vocab[0]} != the policy's {vocab[1]}"
        )


def check_context(owner: str, policy: nn.Module, max_prompt_tokens: int, max_new_tokens: int):
    """Prompt plus response must fit the policy's context window."""
    context = context_of(policy)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"{owner}: `sampling.max_prompt_tokens` ({max_prompt_tokens}) + "
            f"`sampling.max_new_tokens` "
            f"({max_new_tokens}) = {max_prompt_tokens + max_new_tokens} tokens do not fit "
            f"the policy's context of {context} positions; lower them so that their sum is "
            f"<= {context}"
        )
