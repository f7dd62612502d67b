"""PPO losses on padded token batches: clipped surrogate, clipped value loss, entropy.

Tensors are ``[B, T]`` over response tokens with ``mask[b, t]`` nonzero on valid tokens.
Losses are means over all valid tokens of the (mini)batch, or what ``reduce`` makes of the
per-token terms (the loss aggregation). Padded positions never
affect a loss, a statistic or a gradient, whatever they hold (even ``nan``/``inf``).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from rlkl_lightning.masked import masked_mean, valid_mask, zero_padding

__all__ = ["IMPORTANCE_RATIOS", "PolicyStats", "entropy_from_logits", "policy_loss", "value_loss"]

#: ``importance_ratio``: one ratio per token (PPO) or per sequence (GSPO, arXiv 2507.18071).
IMPORTANCE_RATIOS = ("token", "sequence")


class PolicyStats(NamedTuple):
    """Diagnostics of one :func:`policy_loss` call, detached scalar tensors.

    Attributes:
        clipfrac: Scalar, fraction of valid tokens whose clipped term is the active one
            (their gradient is zero). Logged as ``policy/clipfrac``.
        approx_kl: Scalar, ``KL(pi_old || pi_theta)`` per token, estimated with k3 on
            tokens sampled from ``pi_old``. Logged as ``policy/approx_kl``: it is the
            old-vs-new drift inside the PPO epochs, **not** the KL to the reference
            policy (that is ``objective/kl``).
    """

    clipfrac: Tensor
    approx_kl: Tensor


def _check_cliprange(name: str, value: float) -> None:
    if not (value > 0 and not math.isnan(value)):
        raise ValueError(f"{name} must be > 0, got {value}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    reduce: Callable[[Tensor, Tensor], Tensor] = masked_mean,
    cliprange_high: float | None = None,
    importance_ratio: str = "token",
) -> tuple[Tensor, PolicyStats]:
    """PPO clipped surrogate loss (Schulman et al. 2017, arXiv 1707.06347, eqn. 7).

    With ``ratio_t = exp(logprobs_t - old_logprobs_t)``, ``eps = cliprange`` and ``eps_high =
    cliprange_high`` (``eps`` if None), eqn. 7 maximizes ``min(ratio * A, clip(ratio, 1 - eps,
    1 + eps_high) * A)``; as a loss::

        loss = reduce(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)))

    A larger ``eps_high`` is DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476): tokens the
    policy makes more likely keep their gradient longer. With ``importance_ratio="sequence"``
    every token of response ``b`` gets GSPO's sequence ratio (Zheng et al. 2025, arXiv
    2507.18071), the geometric mean of its token ratios, with its gradient::

        ratio_b = exp(sum_t m[b, t] (logprobs - old_logprobs)[b, t] / sum_t m[b, t])

    Args:
        logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the current
            policy (carries the gradient).
        old_logprobs: ``[B, T]`` the same under the policy that sampled them (detached).
        advantages: ``[B, T]`` advantage estimates (detached; usually whitened).
        mask: ``[B, T]``, nonzero on valid response tokens.
        cliprange: Clip range ``eps > 0`` (0.2 in the paper), below 1 (and above, by default).
        reduce: ``reduce(per_token, valid)`` to a scalar (the loss aggregation,
            :mod:`~rlkl_lightning.algorithms.aggregation`); the mean over valid tokens.
        cliprange_high: Clip range above 1, ``> 0``; None: ``cliprange``.
        importance_ratio: ``token`` or ``sequence``.

    Returns:
        ``(loss, stats)``: the scalar loss and :class:`PolicyStats`.

    Raises:
        ValueError: On shape mismatches, clip ranges ``<= 0``, an unknown
            ``importance_ratio``, or no valid token.
    """
    _check_cliprange("cliprange", cliprange)
    high = cliprange if cliprange_high is None else cliprange_high
    _check_cliprange("cliprange_high", high)
    if importance_ratio not in IMPORTANCE_RATIOS:
        raise ValueError(
            f"policy_loss: `importance_ratio` must be one of {IMPORTANCE_RATIOS}, "
            f"got {importance_ratio!r}"
        )
    others = [("old_logprobs", old_logprobs), ("advantages", advantages)]
    valid = valid_mask(logprobs, mask, "policy_loss", name="logprobs", others=others)
    # Zero padding before exp(): garbage there can neither overflow nor send nan grads.
    token_log_ratio = zero_padding(logprobs - old_logprobs.detach(), valid)
    adv = zero_padding(advantages.detach(), valid)
    log_ratio = token_log_ratio
    if importance_ratio == "sequence":
        lengths = valid.sum(dim=1, keepdim=True).clamp(min=1).to(token_log_ratio.dtype)
        log_ratio = zero_padding(token_log_ratio.sum(dim=1, keepdim=True) / lengths, valid)
    with torch.no_grad():
        raw = torch.exp(log_ratio)
        clip_active = -adv * torch.clamp(raw, 1.0 - cliprange, 1.0 + high) > -adv * raw
        # A zero advantage contributes 0 whatever the ratio: no gradient, and no 0 x inf.
        clip_active |= adv == 0
    # Where the clipped term is active the gradient is 0; cut the graph there, or an overflowed
    # ratio (log-ratio > ~88.7 in float32) turns that 0 into 0 * inf = nan in exp's backward.
    ratio = torch.exp(torch.where(clip_active, log_ratio.detach(), log_ratio))
    unclipped = torch.where(adv == 0, torch.zeros_like(ratio), -adv * ratio)
    clipped = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    loss = reduce(torch.maximum(unclipped, clipped), valid)

    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), valid)
        # k3 with samples from pi_old: r - 1 - log r, r = pi_theta / pi_old; never negative.
        token_ratio = torch.exp(token_log_ratio)
        approx_kl = masked_mean(token_ratio - 1.0 - token_log_ratio, valid)
    return loss, PolicyStats(clipfrac=clipfrac, approx_kl=approx_kl)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float,
    reduce: Callable[[Tensor, Tensor], Tensor] = masked_mean,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO value clipping).

    The value-function analogue of the clipped surrogate, part of the PPO2 reference
    setup that Ziegler et al. 2019 (arXiv 1909.08593) fine-tune language models with;
    Engstrom et al. 2020 (arXiv 2005.12729) write it out as "value function clipping".
    The new value may move at most ``c = cliprange_value`` away from the value at
    rollout time before its error stops being reduced::

        v_clip = old_values + clip(values - old_values, -c, c)
        loss   = 0.5 * masked_mean(max((values - R)^2, (v_clip - R)^2))

    Args:
        values: ``[B, T]`` current value predictions (carries the gradient).
        old_values: ``[B, T]`` value predictions at rollout time (detached).
        returns: ``[B, T]`` value targets ``R`` (GAE returns).
        mask: ``[B, T]``, nonzero on valid response tokens.
        cliprange_value: ``c > 0``; ``float("inf")`` disables clipping.
        reduce: ``reduce(per_token, valid)`` to a scalar (the loss aggregation); the mean.

    Returns:
        ``(loss, clipfrac)``: scalar loss and the detached scalar fraction of valid
        tokens where the clipped error is the larger one (zero gradient there).

    Raises:
        ValueError: On shape mismatches, ``cliprange_value <= 0``, or no valid token.
    """
    _check_cliprange("cliprange_value", cliprange_value)
    others = [("old_values", old_values), ("returns", returns)]
    valid = valid_mask(values, mask, "value_loss", name="values", others=others)
    v = zero_padding(values, valid)
    v_old = zero_padding(old_values.detach(), valid)
    target = zero_padding(returns.detach(), valid)
    delta = v - v_old
    # Inside the range use v itself, not v_old + delta, which can differ by a rounding.
    v_clipped = torch.where(
        delta.abs() > cliprange_value,
        v_old + torch.clamp(delta, -cliprange_value, cliprange_value),
        v,
    )
    unclipped = (v - target) ** 2
    clipped = (v_clipped - target) ** 2
    loss = 0.5 * reduce(torch.maximum(unclipped, clipped), valid)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(v.dtype), valid)
    return loss, clipfrac


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distributions given by ``logits``, in nats.

    ``H = logsumexp(z) - sum_a softmax(z)_a * z_a``, which never forms ``log(p)`` and so
    stays finite for peaked distributions. Entries of ``-inf`` (masked-out actions) have
    probability 0 and contribute nothing. Half-precision logits are computed in float32.

    Args:
        logits: ``[B, T, V]`` (or any ``[..., V]``) unnormalized log-probabilities.

    Returns:
        ``[B, T]`` (``logits.shape[:-1]``) entropies, float32 at least.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(z, dim=-1)
    # -inf logits have probability 0; replace them so 0 * -inf cannot make a nan.
    finite_z = zero_padding(z, ~torch.isneginf(z))
    return torch.logsumexp(z, dim=-1) - (probs * finite_z).sum(dim=-1)
