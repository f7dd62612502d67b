"""Forward passes of a causal LM that keep only the positions a phase needs.

Position ids follow the attention mask (left-padded prompts), and with a plain LM head the
head is applied here as one matrix product over the kept positions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from rlkl_lightning.models.sharding import is_fsdp


class HeadProducts:
    """The matrix products of an LM head ``W [V, H]``, as PyTorch computes them.

    A head module may carry its own (``head_products``: a speed-up's, such as
    :class:`rlkl_lightning.perf.onednn.OneDNNHeadProducts`); :func:`head_products` finds them.
    """

    @staticmethod
    def linear(x: Tensor, weight: Tensor) -> Tensor:
        """``x @ weight.T`` with autograd: the logits."""
        return x @ weight.t()

    @staticmethod
    def times_t(a: Tensor, b: Tensor) -> Tensor:
        """``a [N, K] @ b [M, K].T`` (used without autograd)."""
        return a @ b.t()

    @staticmethod
    def weight_gradient(grad: Tensor, x: Tensor) -> Tensor:
        """``grad [N, V].T @ x [N, H]``: the head weight's gradient ``[V, H]``."""
        return grad.t() @ x


def head_products(model: nn.Module) -> type[HeadProducts]:
    """The products of ``model``'s LM head: its own ``head_products``, else PyTorch's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "head_products", HeadProducts)


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
    hidden states, which PyTorch runs as a slower batched product on a CPU.
    """
    weight = plain_lm_head_weight(model)
    if weight is not None:
        hidden = trunk_forward(model, input_ids, attention_mask, keep)
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = head_products(model).linear(flat, weight)
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
    (:mod:`rlkl_lightning.models.sharding`).
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
    linear = type(head) is nn.Linear or hasattr(head, "head_products")
    plain = linear and head.bias is None
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


def no_grad(model: Any):
    """A context for a pass that needs no gradients: ``torch.inference_mode``, or ``no_grad``.

    An FSDP unit gets ``torch.no_grad``: FSDP reuses the buffers it gathers weights into, and a
    buffer made in inference mode cannot be written outside it.
    """
    return torch.no_grad() if is_fsdp(model) else torch.inference_mode()
