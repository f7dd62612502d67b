"""The exact KL-regularised optimum over an enumerable response space, and its frontier.

With the reward ``R`` and beta fixed, the policy that maximises ``E_pi[R] - beta KL(pi‖ref)``
is ``pi*(y) = ref(y) exp(R(y) / beta) / Z(beta)`` (the Gibbs policy; e.g. Korbak et al. 2022,
arXiv 2205.11275, and arXiv 2510.20817), with ``KL(pi*‖ref) = E_pi*[R] / beta - log Z``.
Where every response can be listed, these give the exact reward–KL frontier, the beta that
reaches a KL target, and a trained policy's exact distance from the optimum: the yardstick for
KL placements and control laws. Every function takes the log-probabilities of all ``N``
responses (a ``[N]`` tensor that sums to 1 after ``exp``) and their rewards ``[N]``; float64 is
advised.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class Optimum(NamedTuple):
    """The optimum at one beta.

    Attributes:
        logprobs: ``[N]`` log pi*(y).
        kl: KL(pi*‖ref), nats per sequence.
        reward: E_pi*[R].
        log_z: log Z(beta).
    """

    logprobs: Tensor
    kl: float
    reward: float
    log_z: float


def optimum(ref_logprobs: Tensor, rewards: Tensor, beta: float) -> Optimum:
    """``pi* ∝ ref exp(R / beta)``, its KL to ``ref`` and its expected reward (``beta > 0``)."""
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"optimum: `beta` must be a finite number > 0, got {beta!r}")
    scores = ref_logprobs + rewards / beta
    log_z = torch.logsumexp(scores, dim=0)
    logprobs = scores - log_z
    reward = float((logprobs.exp() * rewards).sum())
    return Optimum(logprobs, reward / beta - float(log_z), reward, float(log_z))


def kl(logprobs: Tensor, other_logprobs: Tensor) -> float:
    """``KL(p‖q) = sum_y p(y) (log p(y) - log q(y))``, exactly; terms with ``p(y) = 0`` are 0."""
    p = logprobs.exp()
    terms = torch.where(p == 0, torch.zeros_like(p), p * (logprobs - other_logprobs))
    return float(terms.sum())


def expected(logprobs: Tensor, values: Tensor) -> float:
    """``E_p[values]`` for ``p = exp(logprobs)``."""
    return float((logprobs.exp() * values).sum())


def max_kl(ref_logprobs: Tensor, rewards: Tensor) -> float:
    """The KL of the optimum as beta -> 0: ``-log ref(argmax R)`` (the top responses' mass)."""
    top = rewards == rewards.max()
    return float(-torch.logsumexp(ref_logprobs[top], dim=0))


def beta_for_kl(ref_logprobs: Tensor, rewards: Tensor, target: float, tol: float = 1e-12) -> float:
    """The beta whose optimum has ``KL(pi*‖ref) = target`` nats per sequence.

    ``KL(pi*_beta‖ref)`` falls strictly from :func:`max_kl` (beta -> 0) to 0 (beta -> inf)
    unless the reward is constant, so bisection on ``log beta`` finds it.
    """
    top = max_kl(ref_logprobs, rewards)
    if not (0 < target < top):
        raise ValueError(
            f"beta_for_kl: `target` must be in (0, {top:.6g}) nats for this reward and "
            f"reference (the optimum's KL as beta -> 0), got {target!r}"
        )
    lo, hi = -30.0, 30.0  # log beta; KL(e^-30) ~ max_kl, KL(e^30) ~ 0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if optimum(ref_logprobs, rewards, math.exp(mid)).kl > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def frontier(
    ref_logprobs: Tensor, rewards: Tensor, betas: list[float]
) -> list[tuple[float, float]]:
    """The exact (KL, expected reward) of the optimum at each beta: the best any policy reaches.

    No policy has a larger expected reward at the same KL to ``ref`` (the optimum maximises
    ``E[R] - beta KL``, and the frontier is concave in KL).
    """
    return [(o.kl, o.reward) for o in (optimum(ref_logprobs, rewards, b) for b in betas)]
