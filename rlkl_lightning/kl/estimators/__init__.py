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

Each estimator is one file of this package that registers an :class:`Estimator` (its name,
its per-token formula of ``l_t``, whether it may be a loss term and the measured KL) with
``ESTIMATORS.register(name)``; the package imports every file in it, so a new estimator is one
new file (:mod:`~rlkl_lightning.kl.estimators.registry`, docs/extending.md). Options name an
estimator as any component (:mod:`rlkl_lightning.components`): by its registered name, by the
dotted import path of a user's own :class:`Estimator`, or as a ``{class_path, init_args}``
block of a class or function that makes one (:func:`kl_estimator`).

Units: :func:`per_token_kl` and :func:`exact_kl` give nats per token position.
:func:`sequence_kl` sums the valid tokens of each response (nats per sequence, the unit of
Ziegler et al. 2019, whose target of 6 nats means this); :func:`token_mean_kl` divides the
sum over all valid tokens by their number (nats per token). Both reductions are local to the
process; reducing across ranks is the caller's job.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import Tensor

from rlkl_lightning.kl.estimators.exact import exact_kl
from rlkl_lightning.kl.estimators.registry import (
    ESTIMATORS,
    Estimator,
    estimator_names,
    estimator_spec,
    kl_estimator,
    per_token_kl,
    sample_estimators,
)
from rlkl_lightning.masked import valid_mask, zero_padding

__all__ = [
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_UNITS",
    "Estimator",
    "estimator_names",
    "estimator_spec",
    "exact_kl",
    "kl_estimator",
    "per_token_kl",
    "sample_estimators",
    "sequence_kl",
    "token_mean_kl",
]

KL_UNITS = ("sequence", "token")

# Every file of the package registers its estimator when imported: a new one is one new file.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: The registered names once the package's files are imported (formula ones first, then
#: ``exact``); :func:`estimator_names` reads the registry afresh.
KL_ESTIMATORS = estimator_names()


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
