"""How a minibatch's per-token loss terms become one number: the ``loss_aggregation`` option.

With ``x[b, t]`` a per-token loss term, ``m[b, t]`` the response mask, ``|y_b| = sum_t m[b, t]``,
``n`` the responses of the minibatch, ``L = max_new_tokens`` and ``N`` the response tokens of the
whole batch (every minibatch, every rank), one optimizer step's loss is::

    token_mean:        sum_{b,t} m x / sum_{b,t} m              (TRL's "bnpo"; the default)
    sequence_mean:     1/n sum_b (sum_t m x / |y_b|)            (TRL's "grpo"; Shao et al. 2024)
    fixed_length:      sum_{b,t} m x / (n L)                    (Dr. GRPO, arXiv 2503.20783)
    batch_token_mean:  sum_{b,t in minibatch} m x / N           (DAPO, arXiv 2503.14476)

``token_mean`` weighs every token of a minibatch alike, but a token of a minibatch with few
tokens more than one of a minibatch with many; ``sequence_mean`` gives every response the same
weight, so a long response's tokens count less; ``batch_token_mean`` weighs every token of the
batch alike, and so does ``fixed_length`` where the minibatches hold equal numbers of responses
(with ``n`` responses in a minibatch, a token weighs ``1/(n L)``: of 5 responses split 3 and 2,
``1/(3L)`` against ``1/(2L)``; leaving responses out, ``group.drop_zero_std_groups``, makes the
split uneven). With ``batch_token_mean`` the normaliser ``N`` counts the tokens of the batch
the update trains on (the rows left after such options), so each of ``num_minibatches`` steps
carries about ``1/num_minibatches`` of a token mean's gradient (as TRL's ``dapo`` over its
generation batch).

Under DDP, DDP averages the ranks' gradients. ``batch_token_mean`` divides by
``N / world_size`` with ``N`` summed over the ranks, so that average is its formula over the
global minibatch whatever each rank holds. ``sequence_mean`` and ``fixed_length`` divide by
the rank's own ``n``: the average is the global formula when the ranks hold equal numbers of
responses (the data module's even split). ``token_mean`` divides by the rank's own tokens, so
the average is the mean of the ranks' token means, **not** the global token mean, whenever the
ranks' token counts differ (docs/pipeline.md says the same).

:func:`token_weights` gives each micro-batch's token weights ``w`` so that its share of the
loss is ``sum w x`` (:func:`weighted_sum`); the shares of a minibatch's micro-batches add up to
the formula. ``token_mean`` keeps its original form (each micro-batch's mean, weighted by its
share of the tokens) and has no weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkl_lightning.masked import zero_padding

__all__ = ["LOSS_AGGREGATIONS", "token_weights", "weighted_sum"]

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "fixed_length", "batch_token_mean")


def token_weights(
    mask: Tensor,
    aggregation: str,
    minibatch_size: int,
    max_new_tokens: int,
    tokens_per_rank: float,
) -> Tensor:
    """``[b, T]`` weights of a micro-batch's tokens in its minibatch's loss (not ``token_mean``).

    Args:
        mask: ``[b, T]`` the micro-batch's response mask.
        aggregation: ``sequence_mean``, ``fixed_length`` or ``batch_token_mean``.
        minibatch_size: ``n``, responses in the minibatch on this rank.
        max_new_tokens: ``L``, the response length limit.
        tokens_per_rank: ``N / world_size``, response tokens of the whole batch over all ranks
            divided by the number of ranks.

    Returns:
        float32 (or ``mask``'s float dtype, if wider) weights, 0 on padding.

    Raises:
        ValueError: For ``token_mean`` or an unknown aggregation.
    """
    m = mask.to(torch.promote_types(mask.dtype, torch.float32))
    if aggregation == "sequence_mean":
        lengths = m.sum(dim=1, keepdim=True).clamp(min=1)
        return m / (lengths * minibatch_size)
    if aggregation == "fixed_length":
        return m / (minibatch_size * max_new_tokens)
    if aggregation == "batch_token_mean":
        return m / max(tokens_per_rank, 1e-12)
    allowed = LOSS_AGGREGATIONS[1:]
    raise ValueError(f"token_weights: `aggregation` must be one of {allowed}, got {aggregation!r}")


def weighted_sum(x: Tensor, valid: Tensor, weights: Tensor) -> Tensor:
    """``sum(weights * x)`` over the valid entries (padding selected away, never multiplied)."""
    return (zero_padding(x, valid.bool()) * weights.to(x.dtype)).sum()
