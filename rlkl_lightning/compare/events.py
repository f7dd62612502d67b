"""Read a run's TensorBoard event files back and compute the study's numbers from them.

The metrics of one run (``n`` training batches, KL target ``T``, monitor band ``[low, high]``):

- ``final_score``: mean ``objective/score`` over the last 20% of batches (at least one);
- ``final_kl``: mean ``objective/kl`` over the same batches;
- ``kl_tracking_error``: mean ``|objective/kl - T| / T`` over the second half of the batches;
- ``in_band_fraction``: fraction of all batches with ``low * T <= objective/kl <= high * T``;
- ``drift_warnings``: excursions the drift monitor warned about (``kl_monitor/warnings``);
- ``final_kl_coef``: beta after the last batch (``objective/kl_coef``);
- ``final_perplexity``: the last ``val/perplexity``;
- ``settle_batch``: the first batch after which the ``SETTLE_WINDOW``-batch mean KL (the mean
  of that batch and the 9 before it) stays within ``SETTLE_TOLERANCE`` (25%) of ``T``: from
  which on every such mean lies in ``[0.75 T, 1.25 T]``; None (never) when the last one lies
  outside. The first mean is the one at batch ``SETTLE_WINDOW`` (a run shorter than that has
  one mean, of all its batches, at its last batch);
- ``overshoot``: the largest excursion of those means above ``T``, in the KL's unit (nats per
  sequence or per token); 0 when they never exceed ``T``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlkl_lightning import metric_keys as keys

FINAL_FRACTION = 0.2
SETTLE_WINDOW = 10  # batches in the mean KL that settle_batch and overshoot judge
SETTLE_TOLERANCE = 0.25  # settled: that mean within +-25% of the target
METRICS = (
    "final_score",
    "kl_tracking_error",
    "in_band_fraction",
    "drift_warnings",
    "final_perplexity",
    "final_kl",
    "final_kl_coef",
    "settle_batch",
    "overshoot",
)


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a run: ``{tag: {step: value}}``.

    When a tag has several values at one step (a skipped PPO batch takes no optimizer step, so
    the next batch logs at the same step), the later one is kept.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(Path(log_dir).glob("events.out.tfevents.*")):
        raise FileNotFoundError(f"compare: no TensorBoard event file in {log_dir}")
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@dataclass
class Curves:
    """A run's per-batch and per-validation series.

    Attributes:
        samples: ``[n]`` samples seen after each training batch.
        score: ``[n]`` ``objective/score``.
        kl: ``[n]`` ``objective/kl``.
        kl_coef: ``[n]`` ``objective/kl_coef``.
        warnings: ``[n]`` cumulative drift warnings (``kl_monitor/warnings``; 0 before any).
        val_samples: ``[m]`` samples seen at each validation.
        perplexity: ``[m]`` ``val/perplexity``.
        reference_perplexity: ``val/perplexity_ref`` (None without validation).
    """

    samples: np.ndarray
    score: np.ndarray
    kl: np.ndarray
    kl_coef: np.ndarray
    warnings: np.ndarray
    val_samples: np.ndarray
    perplexity: np.ndarray
    reference_perplexity: float | None


def read_curves(log_dir: Path) -> Curves:
    """The :class:`Curves` of the run logged in ``log_dir``."""
    scalars = read_scalars(log_dir)

    def tag(name: str) -> dict[int, float]:
        return scalars.get(name, {})

    steps = sorted(tag(keys.SCORE))  # one per trained batch (skipped batches log none)
    if not steps:
        raise ValueError(f"compare: {log_dir} holds no trained batch (`objective/score`)")
    warnings, count = [], 0.0
    for step in steps:
        count = tag(keys.MONITOR_WARNINGS).get(step, count)
        warnings.append(count)
    val_steps = sorted(tag(keys.PERPLEXITY))
    ref = tag(keys.PERPLEXITY_REF)
    return Curves(
        samples=np.array([tag(keys.SAMPLES)[s] for s in steps]),
        score=np.array([tag(keys.SCORE)[s] for s in steps]),
        kl=np.array([tag(keys.KL)[s] for s in steps]),
        kl_coef=np.array([tag(keys.KL_COEF)[s] for s in steps]),
        warnings=np.array(warnings),
        val_samples=np.array([tag(keys.SAMPLES_AT_VAL)[s] for s in val_steps]),
        perplexity=np.array([tag(keys.PERPLEXITY)[s] for s in val_steps]),
        reference_perplexity=ref[max(ref)] if ref else None,
    )


def window_means(kl: np.ndarray, window: int = SETTLE_WINDOW) -> np.ndarray:
    """Trailing means of ``window`` batches: entry ``i`` is the mean of ``kl[i : i + window]``.

    So entry ``i`` belongs to batch ``i + window`` (1-based). A series shorter than ``window``
    has one mean, of all its values.
    """
    w = min(window, len(kl))
    c = np.cumsum(np.insert(np.asarray(kl, dtype=float), 0, 0.0))
    return (c[w:] - c[:-w]) / w


def settle_batch(kl: np.ndarray, target: float, window: int = SETTLE_WINDOW) -> int | None:
    """The first batch (1-based) from which every ``window``-batch mean KL stays settled.

    Settled: within ``SETTLE_TOLERANCE * target`` of ``target``. None if the last mean is not.
    """
    means = window_means(kl, window)
    outside = np.flatnonzero(np.abs(means - target) > SETTLE_TOLERANCE * target)
    first_batch = len(kl) - len(means) + 1  # the batch of the first mean
    if not len(outside):
        return first_batch
    if outside[-1] == len(means) - 1:
        return None
    return int(first_batch + outside[-1] + 1)


def overshoot(kl: np.ndarray, target: float, window: int = SETTLE_WINDOW) -> float:
    """The largest excursion of the ``window``-batch mean KL above ``target`` (0 if none)."""
    return max(0.0, float(window_means(kl, window).max()) - target)


def run_metrics(
    curves: Curves, target: float, low: float, high: float
) -> dict[str, float | int | None]:
    """The numbers of one run, defined in the module docstring."""
    n = len(curves.score)
    last = max(1, math.ceil(FINAL_FRACTION * n))
    kl = curves.kl
    return {
        "final_score": float(curves.score[-last:].mean()),
        "kl_tracking_error": float(np.abs(kl[n // 2 :] - target).mean() / target),
        "in_band_fraction": float(((kl >= low * target) & (kl <= high * target)).mean()),
        "drift_warnings": float(curves.warnings[-1]),
        "final_perplexity": float(curves.perplexity[-1]) if len(curves.perplexity) else math.nan,
        "final_kl": float(kl[-last:].mean()),
        "final_kl_coef": float(curves.kl_coef[-1]),
        "settle_batch": settle_batch(kl, target),
        "overshoot": overshoot(kl, target),
    }
