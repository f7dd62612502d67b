"""``k1 = l``: unbiased for KL(pi‖ref) on samples from pi, can be negative.

In the reward it follows the gradient of the sequence KL; as a loss its expected gradient is 0
(docs/kl.md, "Where the KL goes").
"""

from __future__ import annotations

from torch import Tensor

from rlkl_lightning.kl.estimators.registry import ESTIMATORS, Estimator


def k1(log_ratio: Tensor) -> Tensor:
    """``l``, the log-ratio itself."""
    return log_ratio


K1 = ESTIMATORS.register("k1")(Estimator("k1", k1, loss=True))
