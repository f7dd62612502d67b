"""Log-probabilities of response tokens under a causal LM, and the fused head the update uses.

The logits at position ``P - 1 + t`` predict response token ``t``, so a forward pass over the
whole sequence keeps its last ``R + 1`` positions and drops the final one. Logits are divided
by the sampling temperature, so the log-probabilities are those of the distribution actually
sampled. Log-softmax is always taken in float32, whatever the model's dtype.

The PPO update needs ``log softmax(h W^T / T)[y]`` per response token, and its gradient, but
never the ``[N, V]`` logits themselves. Through autograd the logits tensor is copied for the
temperature, reduced, gathered, and its gradient is assembled from several ``[N, V]`` pieces.
With ``p = softmax(z)`` and ``z = h W^T / T`` the gradient is simply::

    d log p_y / d z = onehot(y) - p          (times the incoming gradient g, divided by T)

so :class:`TokenLogProbs` keeps one ``[N, V]`` buffer, turns it into ``-g p / T`` in place,
adds ``g / T`` at the chosen tokens, and multiplies by ``W`` and ``h`` for the two input
gradients. ``tests/perf/test_fast_path.py`` compares values and gradients with autograd's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from rlkl_lightning.models.forward import (
    HeadProducts,
    head_products,
    lm_forward,
    plain_lm_head_weight,
    trunk_forward,
)
from rlkl_lightning.models.packing import PackedRows, packed_lm_forward, packed_trunk_forward
from rlkl_lightning.trajectory import Trajectory

#: ``defer(weight, fn, *args)``: either returns ``fn(*args)``, the gradient for ``weight``, or
#: arranges for it to be computed elsewhere and added to ``weight.grad`` before the backward
#: pass counts as done, and returns None (value_thread.py: the helper thread computes it).
Defer = Callable[..., Tensor | None]


class TokenScores(NamedTuple):
    """Per-token quantities of the responses under one model.

    Attributes:
        logits: ``[B, R, V]`` float32 temperature-scaled next-token logits at each response
            position (None where they were not needed).
        logprobs: ``[B, R]`` float32 log-probability of each sampled token.
        hidden: ``[B, R, H]`` last hidden state at the positions that predict each token.
    """

    logits: Tensor | None
    logprobs: Tensor
    hidden: Tensor


def gather_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)[token]`` per position: ``[B, R, V], [B, R] -> [B, R]``."""
    logz = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz


def score_tokens(
    model: nn.Module,
    traj: Trajectory,
    temperature: float,
    logits: bool = True,
    defer: Defer | None = None,
    rows: PackedRows | None = None,
) -> TokenScores:
    """Forward the whole sequences once and read the response positions off.

    Args:
        model: A causal LM.
        traj: Supplies ``input_ids``, ``attention_mask`` and ``response_ids``.
        temperature: Sampling temperature; logits are divided by it.
        logits: Also return the ``[B, R, V]`` logits. Without them, a model whose logits are
            ``hidden @ W.T`` gets its log-probs from :func:`token_logprobs` (no logits
            tensor, a cheaper backward).
        defer: Where the fused head may hand its weight gradient off (:data:`Defer`).
        rows: ``traj``'s sequences packed (:func:`~rlkl_lightning.models.packing.pack`):
            forward those instead of the padded rows; off the response mask the hidden states
            (and logits) are then zeros.
    """
    keep = traj.response_ids.shape[1] + 1
    weight = None if logits else plain_lm_head_weight(model)
    if weight is not None:
        if rows is None:
            hidden = trunk_forward(model, traj.input_ids, traj.attention_mask, keep)[:, :-1]
        else:
            hidden = packed_trunk_forward(model, rows)
        products = head_products(model)
        logprobs = token_logprobs(hidden, weight, traj.response_ids, temperature, products, defer)
        return TokenScores(None, logprobs, hidden)
    if rows is None:
        out = lm_forward(model, traj.input_ids, traj.attention_mask, keep)
        out = out._replace(logits=out.logits[:, :-1], hidden=out.hidden[:, :-1])
    else:
        out = packed_lm_forward(model, rows)
    scaled = out.logits.float()
    # In place where no gradient flows: one [B, R, V] float32 tensor fewer at the peak.
    scaled = scaled / temperature if scaled.requires_grad else scaled.div_(temperature)
    return TokenScores(scaled, gather_logprobs(scaled, traj.response_ids), out.hidden)


def step_logits(model: nn.Module, hidden: Tensor, step: int, temperature: float) -> Tensor:
    """The float32 ``logits / temperature`` of response step ``step``, ``[B, V]``, again.

    ``hidden``: the ``[B, R, H]`` last hidden states a rollout kept. For a model whose
    :func:`~rlkl_lightning.models.forward.plain_lm_head_weight` is not None, its head module
    applied to one step's ``[B, 1, H]`` is the product the sampling loop computed, with the
    same shapes, so the logits are those it drew from (bit for bit on a CPU).
    """
    head = model.get_output_embeddings()
    return head(hidden[:, step : step + 1]).float()[:, 0] / temperature


class TokenLogProbs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)`` gathered at ``tokens``: ``[N]``."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        tokens: Tensor,
        temperature: float,
        products: type[HeadProducts],
        defer: Defer | None = None,
    ) -> Tensor:
        """``hidden [N, H]``, ``weight [V, H]``, ``tokens [N]`` -> log-probabilities ``[N]``.

        ``products``: the head's matrix products (:func:`head_products`). ``defer``: where the
        weight gradient may be handed off (:data:`Defer`; None: computed here).
        """
        logits = products.times_t(hidden, weight).float()  # log-probs always in float32
        logits.mul_(1.0 / temperature)
        logz = torch.logsumexp(logits, dim=-1)
        out = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
        ctx.save_for_backward(hidden, weight, tokens, logits, logz)
        ctx.temperature, ctx.products, ctx.defer = temperature, products, defer
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        """Gradients for ``hidden`` and ``weight`` (the saved logits buffer is reused)."""
        hidden, weight, tokens, logits, logz = ctx.saved_tensors
        scale = grad_out.unsqueeze(-1) / ctx.temperature  # [N, 1]
        grad_logits = logits.sub_(logz.unsqueeze(-1)).exp_().mul_(-scale)  # -g p / T
        grad_logits.scatter_add_(-1, tokens.unsqueeze(-1), scale)  # + g / T at y
        # Under autocast the forward product ran in bf16 while ``weight`` (and maybe ``hidden``)
        # are float32: each gradient is computed in, and returned as, its input's dtype.
        grad_logits = grad_logits.to(weight.dtype)
        grad_hidden = grad_weight = None
        products = ctx.products
        if ctx.needs_input_grad[0]:  # grad_logits @ weight
            grad_hidden = products.times_t(grad_logits, weight.t()).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            args = (grad_logits, hidden.to(weight.dtype), products)
            if ctx.defer is None:
                grad_weight = _weight_gradient(*args)
            else:
                grad_weight = ctx.defer(weight, _weight_gradient, *args)
        return grad_hidden, grad_weight, None, None, None, None


def _weight_gradient(grad_logits: Tensor, hidden: Tensor, products: type[HeadProducts]) -> Tensor:
    """``grad_logits [N, V].T @ hidden [N, H]``: the head weight's gradient ``[V, H]``."""
    return products.weight_gradient(grad_logits, hidden)


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float,
    products: type[HeadProducts] = HeadProducts,
    defer: Defer | None = None,
) -> Tensor:
    """Log-probabilities of ``tokens [B, R]`` under ``softmax(hidden [B, R, H] @ weight.T / T)``.

    Equal to ``gather_logprobs((hidden @ weight.T).float() / T, tokens)``, float32.
    ``products``: the head's matrix products (:func:`head_products`). ``defer``: where the
    weight gradient may be handed off (:data:`Defer`).
    """
    flat = TokenLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        tokens.reshape(-1),
        float(temperature),
        products,
        defer,
    )
    return flat.view(tokens.shape)
