"""The batch KL a module logs, as the KL callbacks read it.

Its unit and the key it is logged under, the number of samples behind it in a batch, its
sample-weighted mean over ranks, and a check that a KL target is written in the unit it names.
:class:`~rlkl_lightning.kl.callback_base.KLCallbackBase` reads the KL with these.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from rlkl_lightning import metric_keys as keys

#: The key each KL unit is logged under by default (see docs/metrics.md).
MONITOR_BY_UNIT: dict[str, str] = {
    "sequence": keys.KL,
    "token": keys.KL_PER_TOKEN,
}
#: How messages name the unit of the monitored value.
UNIT_NAMES: dict[str, str] = {"sequence": "nats per sequence", "token": "nats per token"}

#: A per-sequence target below this many nats per response token, or a per-token target above
#: this many nats per token, looks like a target written in the other unit.
SEQUENCE_TARGET_MIN_PER_TOKEN = 0.005
TOKEN_TARGET_MAX = 1.0
#: Key the unit check reads the mean response length (tokens) from.
LENGTH_KEY = keys.RESPONSE_TOKENS


def default_monitor(unit: str, owner: str) -> str:
    """Validate ``unit`` and return the key its KL is logged under by default.

    Args:
        unit: ``"sequence"`` (KL summed over response tokens, averaged over the batch) or
            ``"token"`` (mean KL per response token).
        owner: Name of the caller, used in the error message.

    Raises:
        ValueError: If ``unit`` is not one of the allowed values.
    """
    if unit not in MONITOR_BY_UNIT:
        raise ValueError(
            f"{owner}: unit={unit!r} is not supported; allowed: {sorted(MONITOR_BY_UNIT)}"
        )
    return MONITOR_BY_UNIT[unit]


def check_name(value: Any, option: str, owner: str, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``option`` unless ``value`` is a non-empty string (or None)."""
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}: {option} must be a non-empty string, got {value!r}")


def infer_batch_size(batch: Any) -> int:
    """Count the samples in one (per-rank) batch: the leading size of its first field.

    The rule, which covers the usual collated batches:

    * a ``Tensor`` has ``size(0)`` samples (a 0-d tensor counts as one);
    * a ``Mapping`` (e.g. ``{"prompt": list[str]}``) has as many as its first value;
    * a list/tuple whose first element is a ``Tensor``, list or tuple is a collection of
      fields (what ``default_collate`` makes of ``(x, y)`` samples): as many as that element;
    * any other list/tuple (strings, numbers, uncollated dict samples) holds one sample per
      element.

    Pass ``batch_size_fn`` to the callbacks when this rule does not fit (e.g. several
    responses generated per prompt).

    Args:
        batch: The batch given to ``training_step``.

    Raises:
        TypeError: If the batch has none of the shapes above.
    """
    if isinstance(batch, torch.Tensor):
        return 1 if batch.ndim == 0 else int(batch.size(0))
    if isinstance(batch, Mapping) and batch:
        return infer_batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        if batch and isinstance(batch[0], (torch.Tensor, list, tuple)):
            return infer_batch_size(batch[0])
        return len(batch)
    raise TypeError(
        f"Cannot infer the number of samples from a batch of type {type(batch).__name__}; "
        "pass batch_size_fn=lambda batch: <number of samples> to the KL callbacks."
    )


def batch_size_of(batch: Any, batch_size_fn: Callable[[Any], int] | None, owner: str) -> int:
    """Number of samples in this rank's batch, from ``batch_size_fn`` or :func:`infer_batch_size`.

    Raises:
        ValueError: If the count is not a non-negative integer.
    """
    n = batch_size_fn(batch) if batch_size_fn is not None else infer_batch_size(batch)
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
        n = int(n.item())
    elif not isinstance(n, (bool, int)) and hasattr(n, "__index__"):
        n = operator.index(n)  # an integer of another library's, such as numpy's int64
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{owner}: the batch size must be a non-negative int, got {n!r}")
    return n


def read_monitored(trainer: pl.Trainer, monitor: str, owner: str) -> Any:
    """Return the entry ``monitor`` of ``trainer.callback_metrics`` (a tensor or a number).

    Raises:
        RuntimeError: If the key was never logged, listing the keys that were.
    """
    metrics = trainer.callback_metrics
    if monitor not in metrics:
        raise RuntimeError(
            f"{owner}: the monitored key {monitor!r} is not in trainer.callback_metrics; "
            f"available keys: {sorted(metrics)}. Log the batch KL in training_step with "
            f"`self.log({monitor!r}, kl)` (on_step=True, the default there) or pass monitor=..."
        )
    return metrics[monitor]


def global_mean(trainer: pl.Trainer, value: float, n_samples: int) -> tuple[float, int]:
    """Sample-weighted mean of a per-rank batch mean over all ranks, and the global sample count.

    Every rank contributes ``value * n_samples`` and ``n_samples``; one all-reduce (sum, through
    ``trainer.strategy.reduce``) gives ``sum(value_r * n_r) / sum(n_r)``, the mean over the
    samples of the global batch, and ``sum(n_r)``. All ranks get the same result. A rank with no
    samples contributes nothing; a non-finite value on any rank makes the result non-finite.

    Args:
        trainer: The trainer, whose strategy performs the reduction.
        value: This rank's batch mean.
        n_samples: Number of samples behind ``value`` on this rank.
    """
    if trainer.world_size == 1:
        return (value if n_samples > 0 else math.nan), n_samples
    weighted = value * n_samples if n_samples > 0 else 0.0
    local = torch.tensor(
        [weighted, float(n_samples)], dtype=torch.float64, device=trainer.strategy.root_device
    )
    total = trainer.strategy.reduce(local, reduce_op="sum")
    total_weighted, total_samples = (float(x) for x in total.cpu())
    n = int(round(total_samples))
    return (total_weighted / n if n > 0 else math.nan), n


def check_target_unit(metrics: Mapping[str, Any], target: float, unit: str, owner: str) -> None:
    """Warn if a KL target looks like it was written in the other unit.

    The mean response length ``L`` comes from ``objective/response_tokens`` or, failing that,
    from the ratio of ``objective/kl`` to ``objective/kl_per_token``; without it nothing is
    checked. A per-sequence target below ``0.005 * L`` nats (e.g. 0.05 with 30-token responses:
    0.0017 nats per token) or a per-token target above 1 nat per token is most likely in the
    wrong unit. The run goes on: a target can be unusual on purpose.

    Args:
        metrics: ``trainer.callback_metrics`` after a training batch.
        target: The target KL.
        unit: ``"sequence"`` or ``"token"``: the unit ``target`` is meant in.
        owner: Name of the caller, used in the message.
    """
    length = _mean_length(metrics)
    if length is None:
        return
    if unit == "sequence" and target < SEQUENCE_TARGET_MIN_PER_TOKEN * length:
        rank_zero_warn(
            f"{owner}: target={target:g} with unit='sequence' is {target / length:.2g} nats per "
            f"token over responses of ~{length:.0f} tokens, far below any usual KL target; if it "
            "is a per-token target, set unit='token' (allowed units: 'sequence', 'token').",
            category=RuntimeWarning,
        )
    elif unit == "token" and target > TOKEN_TARGET_MAX:
        rank_zero_warn(
            f"{owner}: target={target:g} with unit='token' is {target * length:.3g} nats per "
            f"sequence over responses of ~{length:.0f} tokens, far above any usual KL target; if "
            "it is a per-sequence target, set unit='sequence' (allowed units: 'sequence', "
            "'token').",
            category=RuntimeWarning,
        )


def _mean_length(metrics: Mapping[str, Any]) -> float | None:
    """Mean response length in tokens from the logged metrics, or None if it cannot be told."""

    def number(key: str) -> float | None:
        value = metrics.get(key)
        if value is None:
            return None
        value = float(value)
        return value if math.isfinite(value) else None

    length = number(LENGTH_KEY)
    if length is None:
        per_sequence, per_token = number(keys.KL), number(keys.KL_PER_TOKEN)
        if per_sequence is None or per_token is None or per_sequence <= 0 or per_token <= 1e-12:
            return None
        length = per_sequence / per_token
    return length if length >= 1 else None
