"""Where the KL penalty goes, and the KL term of the loss when it goes there.

``beta * KL(pi‖ref)`` can enter the update in two places (``penalty.placement``):

* ``"reward"`` (the default): the per-token estimate ``kl_t`` (``penalty.estimator``) is detached
  and subtracted from the reward, so it reaches the policy through the policy-gradient term
  (Ziegler et al. 2019, arXiv 1909.08593); the loss has no KL term.
* ``"loss"`` (GRPO style, Shao et al. 2024, arXiv 2402.03300): the reward has no KL term, and
  the loss adds ``beta * kl_loss(...)`` (divided by PPO's whitening scale), an estimator
  (``penalty.loss_estimator``) that is differentiated through the policy's log-probabilities.

Which gradient each choice follows, on-policy (``y ~ pi``), with ``l_t = log pi(y_t|s_t) -
log ref(y_t|s_t)`` and ``KL_t(s) = KL(pi(.|s)‖ref(.|s))`` (Tang & Munos 2025, arXiv 2506.09477;
Liu et al. 2025, arXiv 2510.01555; each line is proven by exact enumeration in
``tests/kl/test_gradients.py``)::

    reward, k1:  E[sum_t grad log pi(y_t|s_t) * sum_{t'>=t} l_t'] = grad KL(pi‖ref) of the
                 sequence, exactly (the score-function identity removes E[grad sum_t l_t]).
    loss,   k2:  E[sum_t l_t grad log pi(y_t|s_t)] = E_s[sum_t grad KL_t(s_t)], states held
                 fixed: the per-token KL's gradient. It equals the sequence gradient when later
                 tokens' KL does not depend on earlier tokens (one action, Liu et al.'s
                 equivalence with k1 in the reward); otherwise it misses the term through
                 which early tokens change later ones (Tang & Munos).
    loss,   k1:  E[sum_t grad log pi(y_t|s_t)] = 0: no gradient at all in expectation.
    loss,   k3:  E[sum_t (1 - ref/pi) grad log pi] = -E_s[sum_t sum_a ref(a|s_t) grad log
                 pi(a|s_t)] = E_s[sum_t grad KL(ref(.|s_t)‖pi(.|s_t))]: the gradient of the
                 *forward* KL, which agrees with the reverse KL's only to first order near ref.

After the first optimizer step of a batch the samples come from ``pi_old``, not ``pi``: the
loss weights each token by ``w_t = pi(y_t|s_t) / pi_old(y_t|s_t)``, detached and capped at
``weight_clip`` (Liu et al. 2025 on off-policy use). It corrects the token's
distribution given its prefix, not the prefix's (as PPO's own ratio does); a cap that binds
trades a bias for bounded variance. With ``old_logprobs == logprobs`` (on-policy), ``w = 1``
exactly.

Where an algorithm divided its advantages by a scale (PPO's whitening), each sequence's term is
divided by the same scale (``scale``), so that beta weighs the KL in the raw reward's units
(docs/kl.md, "What beta means in the loss").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlkl_lightning.kl.estimators import Estimator, estimator_names, kl_estimator
from rlkl_lightning.masked import masked_mean

__all__ = ["KL_LOSS_ESTIMATORS", "KL_PLACEMENTS", "kl_loss", "kl_loss_weights"]

KL_PLACEMENTS = ("reward", "loss")
#: The registered estimators that declare ``loss=True`` (rlkl_lightning.kl.estimators).
KL_LOSS_ESTIMATORS = estimator_names("loss")


def kl_loss_weights(logprobs: Tensor, old_logprobs: Tensor, weight_clip: float | None) -> Tensor:
    """Detached importance weights ``min(exp(logprobs - old_logprobs), weight_clip)``.

    Args:
        logprobs: ``[B, T]`` log-probabilities of the sampled tokens under the current policy.
        old_logprobs: ``[B, T]`` the same under the policy that sampled them.
        weight_clip: Cap of the weights (``>= 1``); None: no cap.
    """
    weights = torch.exp((logprobs - old_logprobs).detach())
    return weights if weight_clip is None else weights.clamp(max=weight_clip)


def kl_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str | Estimator,
    weight_clip: float | None,
    reduce: Callable[[Tensor, Tensor], Tensor] = masked_mean,
    trust_region: float | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """The KL term of the loss: ``masked_mean(w_t * k(l_t))``, differentiated through ``logprobs``.

    ``l_t = logprobs_t - ref_logprobs_t`` and ``k`` is ``estimator``'s per-token formula
    (:class:`~rlkl_lightning.kl.estimators.Estimator`, from the registry); ``w_t`` are
    :func:`kl_loss_weights`.
    The mean is
    over all valid tokens, like the policy loss it is added to (times ``kl_coef``).

    Args:
        logprobs: ``[B, T]`` log-probabilities under the current policy (carries the gradient).
        old_logprobs: ``[B, T]`` the same at rollout time (detached).
        ref_logprobs: ``[B, T]`` the same under the reference (detached).
        mask: ``[B, T]``, nonzero on valid response tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring for the gradient
            each follows), or any registered or plugged estimator (a dotted path) that
            declares ``loss=True``.
        weight_clip: Cap of the importance weights, ``>= 1``; None: no cap.
        reduce: ``reduce(per_token, valid)`` to a scalar in place of the mean (the policy
            loss's aggregation, so the two terms are aggregated alike).
        trust_region: Tokens whose current ``|l_t|`` exceeds this add nothing to the term
            (still counted in the mean); None: every token. This biases the gradient
            (``tests/kl/test_gradients.py``; docs/kl.md, "A per-token trust region").
        scale: ``[B]`` each sequence's term is divided by it (detached): the scale its
            advantages were divided by (``Trajectory.kl_scale``; PPO's whitening), so that
            beta weighs the KL in the reward's units; None: no scale.

    Returns:
        The scalar loss (nats per token, weighted).

    Raises:
        ValueError: For an unknown estimator, a cap below 1, mismatched shapes, or no valid
            token.
    """
    found = kl_estimator(estimator, "estimator", role="loss", owner="kl_loss")
    if weight_clip is not None and not (math.isfinite(weight_clip) and weight_clip >= 1):
        raise ValueError(f"kl_loss: `weight_clip` must be None or a number >= 1, got {weight_clip}")
    for name, other in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if other.shape != logprobs.shape:
            raise ValueError(
                f"kl_loss: `{name}` must have the shape {tuple(logprobs.shape)} of `logprobs`, "
                f"got {tuple(other.shape)}"
            )
    valid = mask.to(device=logprobs.device, dtype=torch.bool)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padding is zeroed before exp(): garbage there can neither overflow nor send nan gradients.
    new, old, ref = (torch.where(valid, x, zero) for x in (logprobs, old_logprobs, ref_logprobs))
    per_token = found.per_token(new, ref.detach())
    if trust_region is not None:
        per_token = per_token * within_trust_region(new - ref, trust_region)
    weights = kl_loss_weights(new, old.detach(), weight_clip)
    if scale is not None:
        if scale.shape != logprobs.shape[:1]:
            raise ValueError(
                f"kl_loss: `scale` must have the shape {tuple(logprobs.shape[:1])} (one per "
                f"sequence), got {tuple(scale.shape)}"
            )
        weights = weights / scale.detach().to(weights)[:, None]
    return reduce(weights * per_token, valid)


def within_trust_region(log_ratio: Tensor, trust_region: float) -> Tensor:
    """``[B, T]`` 1 where ``|log pi - log pi_ref| <= trust_region``, else 0 (detached).

    The tokens outside are left out of the KL term, as TorchRL's ``kl_mask_threshold`` does: a
    few extreme tokens can no longer dominate it, at the price of a biased gradient.
    """
    return (log_ratio.detach().abs() <= trust_region).to(log_ratio.dtype)
