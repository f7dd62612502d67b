"""``exact``: the exact KL of the two next-token distributions, from the full logits.

``sum_a pi(a|s_t) (log pi(a|s_t) - log ref(a|s_t))`` has no sampling noise over the token. It
has no formula of the sampled tokens' log-ratio, so the pipeline computes it from the logits
(:func:`exact_kl`) and it cannot be differentiated as a loss term here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlkl_lightning.kl.estimators.registry import ESTIMATORS, Estimator, compute_dtype
from rlkl_lightning.masked import zero_padding


def exact_kl(logits: Tensor, ref_logits: Tensor) -> Tensor:
    """Exact KL(pi‖ref) of the next-token distributions given by two sets of logits.

    ``sum_a pi(a) (log pi(a) - log ref(a))`` with both log-probabilities from ``log_softmax``,
    so it is invariant to adding a constant to either set of logits and stable for large
    logits. Actions with ``pi(a) = 0`` (logit ``-inf``) contribute 0.

    Args:
        logits: Policy logits ``[..., V]`` (e.g. ``[B, T, V]``).
        ref_logits: Reference logits, same shape.

    Returns:
        ``[...]``: the KL in nats per position, ``>= 0``, in the inputs' dtype promoted to at
        least float32.

    Raises:
        ValueError: For mismatched shapes or a 0-dimensional input.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(
            "exact_kl: `logits` and `ref_logits` must have the same shape [..., V], got "
            f"{tuple(logits.shape)} and {tuple(ref_logits.shape)}"
        )
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(
            f"exact_kl: logits need a non-empty vocabulary dimension, got {tuple(logits.shape)}"
        )
    dtype = compute_dtype(logits, ref_logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    logq = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    p = logp.exp()
    terms = zero_padding(p * (logp - logq), p > 0)
    return torch.clamp_min(terms.sum(dim=-1), 0.0)


EXACT = ESTIMATORS.register("exact")(Estimator("exact", None, loss=False))
