"""KL divergence between the policy and the reference: per-token estimators and reductions.

Responses are sampled from the policy ``pi``. For response token ``y_t`` in state ``s_t`` let
``l_t = log pi(y_t|s_t) - log ref(y_t|s_t)`` and ``r_t = exp(l_t)``. All values are in nats.

* ``k1 = l``: unbiased for KL(pi‖ref), can be negative.
* ``k2 = l**2 / 2``: mean ``E_pi[(log r)**2] / 2``, a second-order approximation of the KL
  (biased; close to it only while pi stays near ref).
* ``k3 = exp(-l) - 1 + l``: unbiased for KL(pi‖ref) and never negative.
* ``exact = sum_a pi(a|s_t) (log pi(a|s_t) - log ref(a|s_t))``: the exact KL of the two
  next-token distributions, from full logits (no sampling noise over the token).

The estimators ``k1``, ``k2``, ``k3`` follow J. Schulman, "Approximating KL divergence"
(http://joschu.net/blog/kl-approx.html). ``k3`` is unbiased because ``E_pi[1/r] = sum ref = 1``,
so ``E_pi[1/r - 1 + log r] = KL(pi‖ref)``; it is non-negative because ``x - 1 - log x >= 0``.

Two other formulas are **not** unbiased for samples from ``pi``:

* ``exp(l) * l = r log r``: ``E_ref[r log r] = KL(pi‖ref)``, so it estimates the KL only for
  samples drawn from the *reference*. Under ``pi`` its mean is ``E_pi[r log r]``, which is
  larger than the KL whenever the two distributions differ.
* ``exp(l) - 1 - l = r - 1 - log r``: under ``pi`` its mean is
  ``E_pi[r] - 1 - KL = chi²(pi‖ref) - KL(pi‖ref)``; it is the ``k3`` form for samples from the
  reference, where it estimates the reverse KL(ref‖pi).

Units: :func:`per_token_kl` and :func:`exact_kl` give nats per token position.
:func:`sequence_kl` sums the valid tokens of each response (nats per sequence, the unit of
Ziegler et al. 2019, whose target of 6 nats means this); :func:`token_mean_kl` divides the
sum over all valid tokens by their number (nats per token). Both reductions are local to the
process; reducing across ranks is the caller's job.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlkl_lightning.masked import valid_mask, zero_padding

__all__ = [
    "KL_ESTIMATORS",
    "KL_UNITS",
    "exact_kl",
    "per_token_kl",
    "sequence_kl",
    "token_mean_kl",
]

KL_ESTIMATORS = ("k1", "k2", "k3", "exact")
KL_UNITS = ("sequence", "token")

_SAMPLE_ESTIMATORS = ("k1", "k2", "k3")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """Floating dtype for the math: the inputs' promoted dtype, at least float32."""
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"expected floating-point tensors, got dtype {dtype}")
    return torch.promote_types(dtype, torch.float32)


def per_token_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate from the log-probabilities of the sampled tokens.

    Args:
        logprobs: ``log pi(y_t|s_t)`` of the sampled tokens under the policy, any shape.
        ref_logprobs: ``log ref(y_t|s_t)`` under the reference, same shape.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring). ``"exact"`` needs
            full logits: use :func:`exact_kl`.

    Returns:
        A tensor of the same shape, in nats, in the inputs' dtype promoted to at least float32.

    Raises:
        ValueError: For an unknown estimator or mismatched shapes.
    """
    if estimator == "exact":
        raise ValueError(
            "per_token_kl: estimator 'exact' is not sample-based; compute it from full logits "
            f"with exact_kl(logits, ref_logits). Sample-based estimators: {_SAMPLE_ESTIMATORS}"
        )
    if estimator not in _SAMPLE_ESTIMATORS:
        raise ValueError(
            f"per_token_kl: `estimator` must be one of {_SAMPLE_ESTIMATORS}, got {estimator!r}"
        )
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            "per_token_kl: `logprobs` and `ref_logprobs` must have the same shape, got "
            f"{tuple(logprobs.shape)} and {tuple(ref_logprobs.shape)}"
        )
    dtype = _compute_dtype(logprobs, ref_logprobs)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    # k3 = exp(-l) - 1 + l (http://joschu.net/blog/kl-approx.html); expm1 keeps precision for
    # small |l|, and the clamp removes rounding below the true minimum of 0. At l = -inf (a
    # token the policy gives probability 0) exp(-l) dominates: +inf, not inf - inf = nan.
    k3 = torch.clamp_min(torch.expm1(-log_ratio) + log_ratio, 0.0)
    return torch.where(log_ratio == -math.inf, math.inf, k3)


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
    dtype = _compute_dtype(logits, ref_logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    logq = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    p = logp.exp()
    terms = zero_padding(p * (logp - logq), p > 0)
    return torch.clamp_min(terms.sum(dim=-1), 0.0)


def sequence_kl(per_token: Tensor, mask: Tensor | None = None) -> Tensor:
    """KL per sequence: the sum of ``per_token`` over the valid tokens of each row.

    Padding positions never contribute, whatever they hold (even nan or inf).

    Args:
        per_token: ``[B, T]`` per-token KL (nats).
        mask: Optional ``[B, T]`` mask of valid response tokens (bool or 0/1); ``None`` means
            all tokens are valid.

    Returns:
        ``[B]`` KL in nats per sequence (0 for a row without valid tokens).
    """
    valid = valid_mask(
        per_token, mask, "sequence_kl", name="per_token", batch_by_time=True, zero_one=True
    )
    if valid is None:
        return per_token.sum(dim=-1)
    return zero_padding(per_token, valid).sum(dim=-1)


def token_mean_kl(per_token: Tensor, mask: Tensor | None = None) -> Tensor:
    """KL per token: the sum over all valid tokens divided by the number of valid tokens.

    Long responses weigh more than in the mean of :func:`sequence_kl` divided by lengths.
    Padding positions never contribute, whatever they hold.

    Args:
        per_token: ``[B, T]`` per-token KL (nats).
        mask: Optional ``[B, T]`` mask of valid response tokens (bool or 0/1); ``None`` means
            all tokens are valid.

    Returns:
        Scalar KL in nats per token; nan when there is no valid token.
    """
    valid = valid_mask(
        per_token, mask, "token_mean_kl", name="per_token", batch_by_time=True, zero_one=True
    )
    if valid is None:
        return per_token.sum() / per_token.numel()
    return zero_padding(per_token, valid).sum() / valid.sum()
