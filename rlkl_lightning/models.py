"""Loading the policy, reference, value function and tokenizer from Hugging Face names or paths.

The policy is any ``AutoModelForCausalLM``. By default the value function is a linear head on
the policy's last hidden state (one trunk for both); a separate value model (a causal LM trunk
with its own head) is optional. The reference is a frozen copy of the initial policy unless
another model is given, or the policy's LoRA adapters switched off (:mod:`rlkl_lightning.lora`).
"""

from __future__ import annotations

import copy
import os
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from rlkl_lightning.matmul import OneDNNLinear, head_uses_onednn, use_onednn
from rlkl_lightning.matmul import linear as onednn_linear


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


def load_tokenizer(name_or_path: str, option: str = "tokenizer", trust_remote_code: bool = False):
    """Load a tokenizer for generation: left padding, and a pad token (warns when one is added).

    Loaded with :func:`rlkl_lightning.world.tokenizer.pretrained_tokenizer`, the loader the
    SFT uses too.

    Args:
        name_or_path: ``"default"``, a local directory or a hub name.
        option: Name of the option that gave ``name_or_path``, for messages.
        trust_remote_code: Run tokenizer code shipped with the model (off: refused).
    """
    from rlkl_lightning.world.tokenizer import pretrained_tokenizer

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


def load_causal_lm(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    option: str = "policy",
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM with dropout switched off (PPO ratios must be 1 before the first update).

    A model directory is not trusted (README, "Security"): code shipped with the model runs
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
    fuse_tanh_gelu(model)
    return model


class TanhGELU(nn.Module):
    """The tanh approximation of GELU in PyTorch's fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        """Element-wise ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
        return nn.functional.gelu(x, approximate="tanh")


def fuse_tanh_gelu(model: nn.Module) -> int:
    """Compute the tanh-approximated GELU with PyTorch's one fused kernel, in place.

    GPT-2's ``gelu_new`` (and ``gelu_fast``) evaluate
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (Hendrycks & Gimpel 2016,
    arXiv 1606.08415) as about eight element-wise operations, each a pass over the MLP
    activations forward and again backward. :class:`TanhGELU` evaluates the same formula with
    ``torch.nn.functional.gelu(x, approximate="tanh")``, one kernel; the results agree to float
    rounding (``tests/test_fast_path.py``).

    Returns:
        The number of activation modules replaced.
    """
    from transformers.activations import FastGELUActivation, NewGELUActivation

    replaced = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) in (NewGELUActivation, FastGELUActivation):
                setattr(module, name, TanhGELU())
                replaced += 1
    return replaced


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


def is_fsdp(model: Any) -> bool:
    """True if ``model`` is a ``FullyShardedDataParallel`` unit (:mod:`rlkl_lightning.sharding`)."""
    return hasattr(model, "_fsdp_wrapped_module")


def no_grad(model: Any):
    """A context for a pass that needs no gradients: ``torch.inference_mode``, or ``no_grad``.

    An FSDP unit gets ``torch.no_grad``: FSDP reuses the buffers it gathers weights into, and a
    buffer made in inference mode cannot be written outside it.
    """
    return torch.no_grad() if is_fsdp(model) else torch.inference_mode()


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
    """Run a causal LM and keep only the last ``keep`` positions of logits and hidden states.

    With a plain LM head (:func:`plain_lm_head_weight`) the head is applied here, as one
    ``[B * keep, H] x [H, V]`` matrix product: transformers applies it to a strided slice of the
    hidden states, which PyTorch runs as a batched product several times slower on CPU.
    """
    weight = plain_lm_head_weight(model)
    if weight is not None:
        hidden = trunk_forward(model, input_ids, attention_mask, keep)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if head_uses_onednn(model):  # cpu_matmul="onednn"
            logits = onednn_linear(flat, weight)
        else:
            logits = flat @ weight.t()
        return LMOutput(logits.view(*hidden.shape[:2], -1), hidden)
    return _own_forward(model, input_ids, attention_mask, keep)


def _own_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, keep: int
) -> LMOutput:
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=keep,
        output_hidden_states=True,
        use_cache=False,
    )
    return LMOutput(out.logits[:, -keep:], out.hidden_states[-1][:, -keep:])


def trunk_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, keep: int) -> Tensor:
    """Last hidden states ``[B, keep, H]`` of a causal LM's trunk, without its LM head.

    ``model.base_model`` (e.g. ``GPT2Model`` inside ``GPT2LMHeadModel``) ends with the final
    normalization, so this equals ``lm_forward(...).hidden`` without computing any logits. An
    FSDP unit is called through its own forward, which gathers its weights
    (:mod:`rlkl_lightning.sharding`).
    """
    if is_fsdp(model):
        return _own_forward(model, input_ids, attention_mask, keep).hidden
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, -keep:]


def plain_lm_head_weight(model: nn.Module) -> Tensor | None:
    """``W`` if the model's logits are exactly ``trunk_hidden @ W.T``, else None.

    True of GPT-2, Llama, Mistral, Qwen and most causal LMs; not of heads with a bias, a logit
    scale or soft-capping. Checked once per model on a short input (the answer is cached on the
    model), so an unusual head falls back to the model's own forward instead of being wrong.
    None for an FSDP unit: its weights exist in full only inside its own forward.
    """
    if is_fsdp(model):
        return None
    cached = getattr(model, "_rlkl_plain_head", None)
    if cached is None:
        cached = _check_plain_head(model)
        model._rlkl_plain_head = cached
    head = model.get_output_embeddings() if cached else None
    return head.weight if head is not None else None


@torch.no_grad()
def _check_plain_head(model: nn.Module) -> bool:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = type(head) in (nn.Linear, OneDNNLinear) and head.bias is None  # OneDNN: matmul.py
    if not plain or not hasattr(model, "base_model"):
        return False
    device = head.weight.device
    ids = torch.arange(1, 6, device=device).remainder(head.weight.shape[0]).unsqueeze(0)
    mask = torch.ones_like(ids)
    try:
        hidden = trunk_forward(model, ids, mask, ids.shape[1])
        logits = _own_forward(model, ids, mask, ids.shape[1]).logits
    except (TypeError, ValueError, AttributeError):
        return False
    ours = hidden.to(head.weight.dtype) @ head.weight.t()
    return bool(torch.allclose(ours.float(), logits.float(), rtol=1e-4, atol=1e-4))


def enable_gradient_checkpointing(model: nn.Module, option: str = "gradient_checkpointing") -> None:
    """Recompute each layer's activations in the backward pass instead of storing them.

    Uses transformers' own checkpointing (non-reentrant ``torch.utils.checkpoint``), active
    only in training mode, so the model is put in it: the KV-cache rollout switches to eval
    mode and keeps its cache. Losses
    and gradients are those of the plain forward (``tests/test_precision.py``).

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


class ValueHead(nn.Module):
    """A scalar value per position from a hidden state: ``Linear(H, 1)``, zero-initialised bias.

    The product is taken in float32 whatever the dtype of the hidden states and of the stored
    weights (bf16 under ``bf16-true``), and outside autocast, so values, returns and the value
    loss are float32 numbers.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[B, T, H] -> [B, T]``, float32."""
        weight, bias = self.linear.weight, self.linear.bias
        with torch.autocast(hidden.device.type, enabled=False):
            out = nn.functional.linear(hidden.float(), weight.float(), bias.float())
        return out.squeeze(-1)


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


def policy_and_reference(
    policy: str,
    reference: str | None = None,
    peft: Any = None,
    gradient_checkpointing: bool = False,
    cpu_matmul: str = "default",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, Any]:
    """Load the policy and build its reference.

    The reference is the model ``reference`` names (frozen); else, with ``peft``, the policy
    with its adapters off (:class:`~rlkl_lightning.lora.AdaptersOff`, no copy); else a frozen
    copy of the policy.

    Args:
        policy: ``"default"``, a local directory or a hub name.
        reference: Same forms, or None.
        peft: Adapters to train instead of the policy's weights
            (:func:`~rlkl_lightning.lora.attach_adapters`), or None.
        gradient_checkpointing: Recompute the policy's activations in the backward pass
            (:func:`enable_gradient_checkpointing`).
        cpu_matmul: ``onednn``: float32 CPU products of both through oneDNN
            (:func:`~rlkl_lightning.matmul.use_onednn`); ``default``: PyTorch's.
        trust_remote_code: Run modelling code shipped with the models (off: refused).
    """
    trust = {"trust_remote_code": trust_remote_code}
    model = load_causal_lm(policy, option="policy", **trust)
    if cpu_matmul == "onednn":  # before the copy: a frozen copy is switched with it
        use_onednn(model)
    if peft is not None:
        from rlkl_lightning.lora import AdaptersOff, attach_adapters

        own_reference = AdaptersOff(attach_adapters(model, peft))
    else:
        own_reference = None if reference else frozen_copy(model)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if reference:
        frozen = freeze(load_causal_lm(reference, option="reference", **trust))
        if cpu_matmul == "onednn":
            use_onednn(frozen)
        return model, frozen
    return model, own_reference
