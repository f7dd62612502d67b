"""The gap between the engine that sampled and the trainer, measured and corrected.

With ``engine.kind="vllm"`` the responses come from the engine's distribution ``mu`` while the
update differentiates the trainer's ``pi`` (docs/mismatch.md). Per response token, with
``delta_t = log pi(y_t|s_t) - log mu(y_t|s_t)`` (the trainer's behaviour log-prob minus the
engine's), the corrections weight each token's policy-gradient (surrogate) term by a detached
``w_t``:

* ``token_tis``, truncated importance sampling per token (Yao, Liu, Zhang, Dong, Shang and Gao
  2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  https://fengyao.notion.site/off-policy-rl)::

      w_t = min(exp(delta_t), C)

* ``sequence_mis``, masked importance sampling per sequence (Liu, Li, Fu, Wang, Liu and Shen
  2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
  Mismatch", https://richardli.xyz/rl-collapse): with the sequence's ratio
  ``rho = exp(sum_t delta_t)``, every token of the sequence gets::

      w_t = rho  if 1/C <= rho <= C,  else 0   (the sequence is left out)

The entropy bonus, the KL term of the loss and every KL the controller reads are left as they
are: the weights touch the surrogate only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.masked import zero_padding
from rlkl_lightning.trajectory import Trajectory

__all__ = [
    "mismatch_metrics",
    "mismatch_weights",
    "sequence_mis_weights",
    "token_tis_weights",
    "weighted",
]

Reduce = Callable[[Tensor, Tensor], Tensor]


def token_log_ratio(logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B, R]`` float32 ``log pi - log mu`` of the sampled tokens, 0 on padding."""
    delta = logprobs.detach().float() - sampler_logprobs.detach().float()
    return zero_padding(delta, mask.bool())


def token_tis_weights(delta: Tensor, mask: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """``min(exp(delta_t), C)`` per token, 0 on padding, and where the cap cut it.

    Args:
        delta: ``[B, R]`` per-token ``log pi - log mu``.
        mask: ``[B, R]``, nonzero on response tokens.
        threshold: The cap ``C > 1``.

    Returns:
        ``([B, R] weights, [B, R] bool: valid tokens whose ratio was above C)``.
    """
    valid = mask.bool()
    log_cap = math.log(threshold)
    # exp of the clamped log-ratio: the same minimum without overflowing for a huge ratio.
    weights = zero_padding(torch.exp(torch.clamp(delta, max=log_cap)), valid)
    return weights, valid & (delta > log_cap)


def sequence_mis_weights(delta: Tensor, mask: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """The sequence ratio ``rho`` on each of its tokens, 0 where ``rho`` is outside [1/C, C].

    Args:
        delta: ``[B, R]`` per-token ``log pi - log mu``.
        mask: ``[B, R]``, nonzero on response tokens.
        threshold: The bound ``C > 1``.

    Returns:
        ``([B, R] weights, [B] bool: the sequences left out)``.
    """
    valid = mask.bool()
    log_rho = zero_padding(delta, valid).sum(dim=1)  # compared in log space: no overflow
    masked = log_rho.abs() > math.log(threshold)
    rho = torch.exp(torch.where(masked, torch.zeros_like(log_rho), log_rho))  # at most C
    kept = torch.where(masked, torch.zeros_like(rho), rho)
    weights = zero_padding(kept[:, None].expand_as(delta), valid)
    return weights, masked


def mismatch_weights(
    traj: Trajectory, correction: str, threshold: float
) -> tuple[Tensor | None, Tensor | None]:
    """The ``[B, R]`` weights of ``correction`` and what it cut (None, None: no correction).

    Args:
        traj: Its ``logprobs`` (the trainer's), ``sampler_logprobs`` and ``response_mask``.
        correction: ``none``, ``token_tis`` or ``sequence_mis`` (``engine.correction``).
        threshold: ``engine.correction_threshold``.

    Returns:
        The weights, and a bool tensor: ``[B, R]`` tokens capped (``token_tis``) or ``[B]``
        sequences masked (``sequence_mis``).
    """
    if correction == "none" or traj.sampler_logprobs is None:
        return None, None
    delta = token_log_ratio(traj.logprobs, traj.sampler_logprobs, traj.response_mask)
    if correction == "token_tis":
        return token_tis_weights(delta, traj.response_mask, threshold)
    if correction == "sequence_mis":
        return sequence_mis_weights(delta, traj.response_mask, threshold)
    raise ValueError(
        "mismatch_weights: `engine.correction` must be one of ('none', 'token_tis', "
        f"'sequence_mis'), got {correction!r}"
    )


def mismatch_metrics(
    traj: Trajectory,
    corrected: Tensor | None,
    global_sum: Callable[[Tensor], Tensor],
    global_max: Callable[[Tensor], Tensor],
) -> dict[str, Tensor]:
    """The ``mismatch/*`` metrics of the global batch (docs/metrics.md); collectives under DDP.

    Args:
        traj: Its ``logprobs``, ``sampler_logprobs`` (not None) and ``response_mask``.
        corrected: What the correction cut (:func:`mismatch_weights`): ``[B, R]`` tokens or
            ``[B]`` sequences; None without a correction (no ``mismatch/corrected_fraction``).
        global_sum: Sums a tensor over all ranks (identity on one process).
        global_max: Maximises a tensor over all ranks (identity on one process).
    """
    mask = traj.response_mask
    valid = mask.bool()
    delta = token_log_ratio(traj.logprobs, traj.sampler_logprobs, mask)
    abs_delta = delta.abs()
    log_rho = delta.sum(dim=1)
    # Maxima of a rank with no token (or no sequence) are -inf, which any other rank's beat.
    low = torch.tensor(-math.inf, dtype=delta.dtype, device=delta.device)
    token_max = abs_delta[valid].max() if bool(valid.any()) else low
    seq_max = log_rho.max() if log_rho.numel() else low
    seq_neg_max = (-log_rho).max() if log_rho.numel() else low
    top = global_max(torch.stack([token_max, seq_max, seq_neg_max]))
    counts = [abs_delta.sum(), valid.sum()]
    if corrected is not None:  # tokens capped of all tokens, or sequences masked of all
        total = valid.sum() if corrected.dim() == 2 else torch.tensor(corrected.numel())
        counts += [corrected.sum(), total.to(delta.device)]
    sums = global_sum(torch.stack([c.double() for c in counts]))
    metrics = {
        keys.MISMATCH_TOKEN_ABS_MEAN: (sums[0] / sums[1]).float(),
        keys.MISMATCH_TOKEN_ABS_MAX: top[0],
        keys.MISMATCH_SEQ_LOG_RATIO_MIN: -top[2],
        keys.MISMATCH_SEQ_LOG_RATIO_MAX: top[1],
    }
    if corrected is not None:
        metrics[keys.MISMATCH_CORRECTED_FRACTION] = (sums[2] / sums[3]).float()
    return metrics


def weighted(reduce: Reduce, weights: Tensor | None) -> Reduce:
    """``reduce`` of the per-token terms multiplied by ``weights`` (``reduce`` itself if None)."""
    if weights is None:
        return reduce

    def reduce_weighted(per_token: Tensor, valid: Tensor) -> Tensor:
        return reduce(per_token * weights.to(per_token.dtype), valid)

    return reduce_weighted
