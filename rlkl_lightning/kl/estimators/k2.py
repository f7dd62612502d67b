"""``k2 = l**2 / 2``: a second-order approximation of the KL (biased; close only near ref).

Its mean on samples from pi is ``E_pi[(log r)**2] / 2``. As a loss it follows the per-token
KL's gradient (docs/kl.md, "Where the KL goes").
"""

from __future__ import annotations

from torch import Tensor

from rlkl_lightning.kl.estimators.registry import ESTIMATORS, Estimator


def k2(log_ratio: Tensor) -> Tensor:
    """``l**2 / 2``."""
    return 0.5 * log_ratio.square()


K2 = ESTIMATORS.register("k2")(Estimator("k2", k2, loss=True))
