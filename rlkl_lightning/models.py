"""Loading the policy, reference, value function and tokenizer from Hugging Face names or paths.

The policy is any ``AutoModelForCausalLM``. By default the value function is a linear head on
the policy's last hidden state (one trunk for both); a separate value model (a causal LM trunk
with its own head) is optional. The reference is a frozen copy of the initial policy unless
another model is given.
"""

from __future__ import annotations

import copy
import os
from typing import NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn


def resolve_model_path(name_or_path: str, option: str = "policy") -> str:
    """Map ``"default"`` to the default world's SFT model (built on first use); else pass through.

    Anything that is not an existing directory and does not look like a path (``.``, ``/``,
    ``~``) is taken as a Hugging Face hub name.

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        option: Name of the option that gave ``name_or_path``, for error messages.

    Raises:
        ValueError: if a path-like name does not exist.
    """
    if name_or_path == "default":
        from rlkl_lightning.world import default_model_dir

        return str(default_model_dir())
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        return expanded
    if name_or_path.startswith((".", "/", "~")):
        raise ValueError(
            f"`{option}`: model path {name_or_path!r} does not exist; allowed: a local directory "
            "saved with `save_pretrained`, a Hugging Face model name, or 'default' for the "
            "default world"
        )
    return expanded


def load_tokenizer(name_or_path: str, option: str = "tokenizer"):
    """Load a tokenizer for generation: left padding, and a pad token (warns when one is added).

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        option: Name of the option that gave ``name_or_path``, for messages.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path, option)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"`{option}`: could not load a tokenizer from {name_or_path!r}: {err}"
        ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"`{option}`: tokenizer {name_or_path!r} has neither a pad nor an eos token; "
                "add a pad token to it (tokenizer.pad_token = ...; save_pretrained) before training"
            )
        rank_zero_warn(
            f"`{option}`: tokenizer {name_or_path!r} has no pad token; using its eos token "
            f"{tokenizer.eos_token!r} as pad (padding is masked out everywhere)",
            category=RuntimeWarning,
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    name_or_path: str, dtype: torch.dtype | None = None, option: str = "policy"
) -> nn.Module:
    """Load a causal LM with dropout switched off (PPO ratios must be 1 before the first update).

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        dtype: Weight dtype (None: as saved).
        option: Name of the option that gave ``name_or_path``, for error messages.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path, option)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"`{option}`: could not load a causal LM from {name_or_path!r}: {err}"
        ) from err
    disable_dropout(model)
    return model


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to zero, in place."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def freeze(model: nn.Module) -> nn.Module:
    """Put a model in eval mode with no gradients; returns it."""
    model.eval()
    model.requires_grad_(False)
    return model


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0. Shape ``[B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class LMOutput(NamedTuple):
    """Outputs of one forward pass over ``[B, T]`` tokens, restricted to the last ``K`` positions.

    Attributes:
        logits: ``[B, K, V]`` next-token logits at the kept positions.
        hidden: ``[B, K, H]`` last hidden state at the kept positions.
    """

    logits: Tensor
    hidden: Tensor


def lm_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, keep: int) -> LMOutput:
    """Run a causal LM and keep only the last ``keep`` positions of logits and hidden states."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=keep,
        output_hidden_states=True,
        use_cache=False,
    )
    return LMOutput(out.logits[:, -keep:], out.hidden_states[-1][:, -keep:])


class ValueHead(nn.Module):
    """A scalar value per position from a hidden state: ``Linear(H, 1)``, zero-initialised bias."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[B, T, H] -> [B, T]``."""
        return self.linear(hidden).squeeze(-1)


def hidden_size_of(model: nn.Module) -> int:
    """The width of a transformers model's last hidden state."""
    config = model.config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"cannot find the hidden size of {type(model).__name__}'s config")


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy (the default reference model)."""
    return freeze(copy.deepcopy(model))
