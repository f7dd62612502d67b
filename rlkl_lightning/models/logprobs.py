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

With a large vocabulary (Qwen's 151,936 words) that buffer is the update's largest tensor.
Above :data:`HEAD_CHUNK_ABOVE` elements the head keeps only ``logz`` (``[N]``) and computes
the logits a chunk of rows at a time, in the forward pass and again in the backward pass: one
more head product for a peak of one chunk's logits instead of all of them.
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


#: Above this many elements (1 GiB of float32) the fused head's ``[N, V]`` logits are not kept
#: for the backward pass: they are computed a chunk of rows at a time, twice
#: (docs/bigger-models.md).
HEAD_CHUNK_ABOVE = 1 << 28
#: Elements of one chunk of those logits (256 MiB of float32), at least one row.
HEAD_CHUNK_ELEMENTS = 1 << 26


def head_chunk_rows(rows: int, vocab: int) -> int | None:
    """Rows per chunk of the fused head's logits: None (all at once) up to the threshold.

    Below :data:`HEAD_CHUNK_ABOVE` elements the logits are kept for the backward pass (one
    head product fewer); above it, chunks of at most :data:`HEAD_CHUNK_ELEMENTS` bound the
    head's memory at the cost of a second head product in the backward pass.
    """
    if rows * vocab <= HEAD_CHUNK_ABOVE:
        return None
    return max(1, HEAD_CHUNK_ELEMENTS // vocab)


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
        chunk: int | None = None,
    ) -> Tensor:
        """``hidden [N, H]``, ``weight [V, H]``, ``tokens [N]`` -> log-probabilities ``[N]``.

        ``products``: the head's matrix products (:func:`head_products`). ``defer``: where the
        weight gradient may be handed off (:data:`Defer`; None: computed here). ``chunk``: rows
        of logits at a time, none of them kept (None: all at once, kept for the backward).
        """
        ctx.temperature, ctx.products, ctx.defer = temperature, products, defer
        if chunk is not None and chunk < hidden.shape[0]:
            ctx.chunk, ctx.autocast = chunk, _autocast_state(hidden.device.type)
            out, logz = [], []
            for h, y in zip(hidden.split(chunk), tokens.split(chunk), strict=True):
                logits = _chunk_logits(h, weight, temperature, products)
                logz.append(torch.logsumexp(logits, dim=-1))
                out.append(logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - logz[-1])
                del logits  # one chunk's logits at a time
            ctx.save_for_backward(hidden, weight, tokens, torch.cat(logz))
            return torch.cat(out)
        ctx.chunk = None
        logits = products.times_t(hidden, weight).float()  # log-probs always in float32
        logits.mul_(1.0 / temperature)
        logz = torch.logsumexp(logits, dim=-1)
        out = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz
        ctx.save_for_backward(hidden, weight, tokens, logits, logz)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        """Gradients for ``hidden`` and ``weight`` (the saved logits buffer is reused)."""
        if ctx.chunk is not None:
            return _chunked_backward(ctx, grad_out)
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
        return grad_hidden, grad_weight, None, None, None, None, None


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The autocast state of ``device_type`` now: the backward's recomputation enters it again."""
    enabled = torch.is_autocast_enabled(device_type)
    return device_type, enabled, torch.get_autocast_dtype(device_type)


def _chunk_logits(h: Tensor, weight: Tensor, temperature: float, products) -> Tensor:
    """One chunk's float32 ``h @ weight.T / T``, as the unchunked forward computes them."""
    logits = products.times_t(h, weight).float()
    return logits.mul_(1.0 / temperature)


def _chunk_gradients(
    ctx_values: tuple, grad_out: Tensor, hidden_grad: bool, weight_grad: bool
) -> tuple[Tensor | None, Tensor | None]:
    """The hidden and/or weight gradients, the logits recomputed a chunk of rows at a time.

    Each chunk's ``grad_logits`` is the unchunked backward's (``-g p / T``, ``+ g / T`` at the
    chosen token); the weight gradient is the sum of the chunks' products.
    """
    hidden, weight, tokens, logz, temperature, products, chunk, autocast = ctx_values
    device_type, enabled, dtype = autocast
    grad_hidden = torch.empty_like(hidden) if hidden_grad else None
    grad_weight = None
    if not (hidden_grad or weight_grad):
        return grad_hidden, grad_weight
    scale = grad_out.unsqueeze(-1) / temperature  # [N, 1]
    start = 0
    for h, y, z, s in zip(*(t.split(chunk) for t in (hidden, tokens, logz, scale)), strict=True):
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # the forward's logits
            logits = _chunk_logits(h, weight, temperature, products)
        grad_logits = logits.sub_(z.unsqueeze(-1)).exp_().mul_(-s)
        grad_logits.scatter_add_(-1, y.unsqueeze(-1), s)
        grad_logits = grad_logits.to(weight.dtype)
        if hidden_grad:
            part = products.times_t(grad_logits, weight.t())
            grad_hidden[start : start + h.shape[0]] = part.to(hidden.dtype)
        if weight_grad:
            part = _weight_gradient(grad_logits, h.to(weight.dtype), products)
            grad_weight = part if grad_weight is None else grad_weight.add_(part)
        start += h.shape[0]
    return grad_hidden, grad_weight


def _chunked_backward(ctx, grad_out: Tensor):
    """:meth:`TokenLogProbs.backward` without kept logits.

    A deferred weight gradient recomputes its chunks' logits where it is computed.
    """
    hidden, weight, tokens, logz = ctx.saved_tensors
    values = (hidden, weight, tokens, logz, ctx.temperature, ctx.products, ctx.chunk, ctx.autocast)
    want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_weight = None
    if want_weight and ctx.defer is not None:
        grad_weight = ctx.defer(weight, _deferred_chunk_gradient, values, grad_out)
        want_weight = False
    grad_hidden, own_weight = _chunk_gradients(values, grad_out, want_hidden, want_weight)
    if own_weight is not None:
        grad_weight = own_weight
    return grad_hidden, grad_weight, None, None, None, None, None


def _deferred_chunk_gradient(values: tuple, grad_out: Tensor) -> Tensor:
    """The weight gradient alone (:func:`_chunk_gradients`), for :data:`Defer`."""
    return _chunk_gradients(values, grad_out, False, True)[1]


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
    chunk_rows: int | None = None,
) -> Tensor:
    """Log-probabilities of ``tokens [B, R]`` under ``softmax(hidden [B, R, H] @ weight.T / T)``.

    Equal to ``gather_logprobs((hidden @ weight.T).float() / T, tokens)``, float32.
    ``products``: the head's matrix products (:func:`head_products`). ``defer``: where the
    weight gradient may be handed off (:data:`Defer`). ``chunk_rows``: rows of logits computed
    at a time, and again in the backward pass (None: :func:`head_chunk_rows`'s choice).
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if chunk_rows is None:
        chunk_rows = head_chunk_rows(flat_hidden.shape[0], weight.shape[0])
    flat = TokenLogProbs.apply(
        flat_hidden, weight, tokens.reshape(-1), float(temperature), products, defer, chunk_rows
    )
    return flat.view(tokens.shape)
