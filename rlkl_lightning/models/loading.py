"""Loading the policy, reference, value function and tokenizer from Hugging Face names or paths.

The policy is any ``AutoModelForCausalLM``. By default the value function is a linear head on
the policy's last hidden state (one trunk for both); a separate value model (a causal LM trunk
with its own head) is optional. The reference is a frozen copy of the initial policy unless
another model is given, or the policy's LoRA adapters switched off
(:mod:`rlkl_lightning.models.lora`).
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from rlkl_lightning.models.named import resolve_named_model
from rlkl_lightning.models.tokenizer import pretrained_tokenizer


def resolve_model_path(name_or_path: str, option: str = "policy") -> str:
    """Map a registered model name to its model (built on first use); a path passes through.

    The names are those of :mod:`rlkl_lightning.models.named`: the world registers
    ``"default"``, the default world's SFT model, and ``"exact"``, the exact world's reference
    (:mod:`rlkl_lightning.world.names`); anything else passes through.

    Anything that is not an existing directory and does not look like a path (``.``, ``/``,
    ``~``) is taken as a Hugging Face hub name: one that is not cached while the hub cannot be
    reached fails here, in seconds, instead of after the hub client's retries.

    Args:
        name_or_path: ``"default"``, ``"exact"``, a local directory or a hub name.
        option: Name of the option that gave ``name_or_path``, for error messages.

    Raises:
        ValueError: if a path-like name does not exist, or a hub name is neither cached nor
            reachable.
    """
    named = resolve_named_model(name_or_path)
    if named is not None:
        return named
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        return expanded
    if name_or_path.startswith((".", "/", "~")):
        raise ValueError(
            f"`{option}`: model path {name_or_path!r} does not exist; allowed: a local directory "
            "saved with `save_pretrained`, a Hugging Face model name, or 'default' for the "
            "default world"
        )
    if not _in_hub_cache(name_or_path) and (reason := _hub_unreachable()) is not None:
        raise ValueError(
            f"`{option}`: {name_or_path!r} is not a local directory, not in the Hugging Face "
            f"cache, and {reason}; allowed: a local directory saved with `save_pretrained`, a "
            "Hugging Face model name (cached, or with the hub reachable), or 'default' for the "
            "default world"
        )
    return expanded


_HUB_REACHABLE: dict[str, str | None] = {}  # endpoint -> why it cannot be reached, or None


def _in_hub_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds a config of the hub repository ``name``."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(name, filename), str):
                return True
        except Exception:  # an invalid repository name: the hub's own error says so later
            return False
    return False


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (offline mode, no route), or None; probed once a process.

    The hub client would retry five times with back-off (about a minute) before failing.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "the hub is off (HF_HUB_OFFLINE is set)"
    endpoint = constants.ENDPOINT
    if endpoint not in _HUB_REACHABLE:
        url = urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            _HUB_REACHABLE[endpoint] = None
        except OSError as error:
            _HUB_REACHABLE[endpoint] = f"the hub ({endpoint}) cannot be reached: {error}"
    return _HUB_REACHABLE[endpoint]


def load_tokenizer(name_or_path: str, option: str = "tokenizer", trust_remote_code: bool = False):
    """Load a tokenizer for generation: left padding, and a pad token (warns when one is added).

    Loaded with :func:`rlkl_lightning.models.tokenizer.pretrained_tokenizer`, the loader the
    world's SFT uses too.

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        option: Name of the option that gave ``name_or_path``, for messages.
        trust_remote_code: Run tokenizer code shipped with the model (off: refused).
    """
    path = resolve_model_path(name_or_path, option)
    tokenizer = pretrained_tokenizer(path, option, trust_remote_code)
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


def encode(
    tokenizer, texts: list[str], truncation_side: str, max_length: int, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask`` of ``texts``, padded, cut to ``max_length`` tokens.

    Each caller names the side it cuts (prompts keep their end, ``"left"``; held-out texts
    their start, ``"right"``): the tokenizer is shared, and its own setting is put back after.
    """
    saved, tokenizer.truncation_side = tokenizer.truncation_side, truncation_side
    try:
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=max_length,
            **kwargs,
        )
    finally:
        tokenizer.truncation_side = saved
    return enc["input_ids"], enc["attention_mask"]


def load_causal_lm(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    option: str = "policy",
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM with dropout switched off (PPO ratios must be 1 before the first update).

    A model directory is not trusted (docs/checkpoints.md): code shipped with the model runs
    only with ``trust_remote_code``, weights come from ``*.safetensors`` where the directory has
    them, and a pickled ``*.bin`` is opened with ``weights_only=True`` (no code runs).

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        dtype: Weight dtype (None: as saved).
        option: Name of the option that gave ``name_or_path``, for error messages.
        trust_remote_code: Run modelling code shipped with the model (off: such models are
            refused with an error; never a prompt).
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path, option)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, weights_only=True
        )
    except Exception as err:  # OSError, ValueError, UnpicklingError, SafetensorError, ...
        raise ValueError(
            f"`{option}`: could not load a causal LM from {name_or_path!r}: "
            f"{type(err).__name__}: {err}"
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


def enable_gradient_checkpointing(model: nn.Module, option: str = "gradient_checkpointing") -> None:
    """Recompute each layer's activations in the backward pass instead of storing them.

    Uses transformers' own checkpointing (non-reentrant ``torch.utils.checkpoint``), active
    only in training mode, so the model is put in it: the KV-cache rollout switches to eval
    mode and keeps its cache. Losses
    and gradients are those of the plain forward (``tests/models/test_precision.py``).

    Raises:
        ValueError: If the model does not support gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"`{option}`: {type(model).__name__} does not support gradient checkpointing; "
            "allowed: a transformers model with `supports_gradient_checkpointing`, or "
            f"`{option}: false`"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers checkpoints only in training mode, and `from_pretrained` returns a model in
    # eval mode (which Lightning keeps); dropout is off either way (`disable_dropout`).
    model.train()


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy (the default reference model)."""
    return freeze(copy.deepcopy(model))


def policy_and_reference(
    policy: str,
    reference: str | None = None,
    peft: Any = None,
    gradient_checkpointing: bool = False,
    prepare: Callable[[nn.Module], Any] | None = None,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, Any]:
    """Load the policy and build its reference.

    The reference is the model ``reference`` names (frozen); else, with ``peft``, the policy
    with its adapters off (:class:`~rlkl_lightning.models.lora.AdaptersOff`, no copy); else a frozen
    copy of the policy.

    Args:
        policy: ``"default"``, a local directory or a hub name.
        reference: Same forms, or None.
        peft: Adapters to train instead of the policy's weights
            (:func:`~rlkl_lightning.models.lora.attach_adapters`), or None.
        gradient_checkpointing: Recompute the policy's activations in the backward pass
            (:func:`enable_gradient_checkpointing`).
        prepare: Called on each loaded model before anything else is built from it (the
            pipeline's speed-ups: a frozen copy and adapters inherit them).
        trust_remote_code: Run modelling code shipped with the models (off: refused).
    """
    trust = {"trust_remote_code": trust_remote_code}
    prepare = prepare or (lambda model: None)
    model = load_causal_lm(policy, option="policy", **trust)
    prepare(model)  # before the copy and the adapters
    if peft is not None:
        from rlkl_lightning.models.lora import AdaptersOff, attach_adapters

        own_reference = AdaptersOff(attach_adapters(model, peft, "models.peft"))
    else:
        own_reference = None if reference else frozen_copy(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, "models.gradient_checkpointing")
    if reference:
        frozen = freeze(load_causal_lm(reference, option="reference", **trust))
        prepare(frozen)
        return model, frozen
    return model, own_reference
