"""``k3 = exp(-l) - 1 + l``: unbiased for KL(pi‖ref) on samples from pi and never negative.

Unbiased because ``E_pi[1/r] = sum ref = 1`` (``r = exp(l)``), so ``E_pi[1/r - 1 + log r] =
KL(pi‖ref)``; non-negative because ``x - 1 - log x >= 0`` (J. Schulman, "Approximating KL
divergence", http://joschu.net/blog/kl-approx.html). As a loss it follows a forward-KL-like
gradient (docs/kl.md, "Where the KL goes").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlkl_lightning.kl.estimators.registry import ESTIMATORS, Estimator


def k3(log_ratio: Tensor) -> Tensor:
    """``exp(-l) - 1 + l``, at least 0; ``+inf`` at ``l = -inf``."""
    # expm1 keeps precision for small |l|, and the clamp removes rounding below the true
    # minimum of 0. At l = -inf (a token the policy gives probability 0) exp(-l) dominates:
    # +inf, not inf - inf = nan.
    value = torch.clamp_min(torch.expm1(-log_ratio) + log_ratio, 0.0)
    return torch.where(log_ratio == -math.inf, math.inf, value)


K3 = ESTIMATORS.register("k3")(Estimator("k3", k3, loss=True))
