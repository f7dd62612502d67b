"""KLControllerCallback: adapts the KL coefficient beta of any LightningModule.

The callback talks to the module only through Lightning's own channels:

* the module logs its batch KL with ``self.log("objective/kl", kl)`` in ``training_step``
  and the callback reads ``trainer.callback_metrics["objective/kl"]``;
* the callback writes beta to a module attribute (default ``kl_coef``), which the module
  reads when it shapes rewards, and logs it as ``objective/kl_coef``.

The helpers below (reading the monitored KL, counting the samples of a batch, the
sample-weighted mean over ranks, the check of a target's unit) are shared with
:class:`~rlkl_lightning.KLDriftMonitor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from rlkl_lightning.controllers import KLController

#: The key each KL unit is logged under by default (see the README's metric table).
MONITOR_BY_UNIT: dict[str, str] = {
    "sequence": "objective/kl",
    "token": "objective/kl_per_token",
}
#: How messages name the unit of the monitored value.
UNIT_NAMES: dict[str, str] = {"sequence": "nats per sequence", "token": "nats per token"}

#: A per-sequence target below this many nats per response token, or a per-token target above
#: this many nats per token, looks like a target written in the other unit.
SEQUENCE_TARGET_MIN_PER_TOKEN = 0.005
TOKEN_TARGET_MAX = 1.0
#: Key the unit check reads the mean response length (tokens) from.
LENGTH_KEY = "objective/response_tokens"


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


def batch_size_of(batch: Any, batch_size_fn: Callable[[Any], int] | None, owner: str) -> int:
    """Number of samples in this rank's batch, from ``batch_size_fn`` or :func:`infer_batch_size`.

    Raises:
        ValueError: If the count is not a non-negative integer.
    """
    n = batch_size_fn(batch) if batch_size_fn is not None else infer_batch_size(batch)
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point():
        n = int(n.item())
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{owner}: the batch size must be a non-negative int, got {n!r}")
    return n


class BatchKLReader:
    """Read the global batch KL of the current training batch (shared by both callbacks).

    ``read`` takes this rank's logged value and sample count and returns the sample-weighted
    mean over all ranks with the global sample count (:func:`global_mean`). A value the module
    did not log again in this batch (``callback_metrics`` still holds the tensor read after an
    earlier batch) is stale: that rank contributes no samples, and it warns once. Every rank
    takes part in the reduction whatever it read, so no rank can be left waiting.

    Args:
        monitor: Key of the batch KL in ``trainer.callback_metrics``.
        batch_size_fn: ``batch -> int`` for this rank's sample count, or ``None`` for
            :func:`infer_batch_size`.
        owner: Name of the callback, used in messages.
    """

    def __init__(self, monitor: str, batch_size_fn: Callable[[Any], int] | None, owner: str):
        self.monitor = monitor
        self.batch_size_fn = batch_size_fn
        self.owner = owner
        self._last: Any = None
        self._warned_stale = False

    def read(self, trainer: pl.Trainer, batch: Any) -> tuple[float, int]:
        """Return ``(kl, n_samples)`` of the global batch; ``n_samples == 0`` if none was fresh."""
        value = read_monitored(trainer, self.monitor, self.owner)
        # Each self.log call stores a new tensor and callback_metrics hands out detached views
        # of it, so a view of the storage read last time means nothing new was logged. Holding
        # on to that view keeps its storage alive: a new tensor cannot reuse the address.
        fresh = not (
            isinstance(value, torch.Tensor)
            and isinstance(self._last, torch.Tensor)
            and value.data_ptr() == self._last.data_ptr()
        )
        self._last = value
        n = batch_size_of(batch, self.batch_size_fn, self.owner) if fresh else 0
        if not fresh and not self._warned_stale:
            self._warned_stale = True
            rank_zero_warn(
                f"{self.owner}: {self.monitor!r} was not logged in this training batch; the "
                "value in trainer.callback_metrics is from an earlier batch and is ignored. "
                "Log the KL in every training batch.",
                category=RuntimeWarning,
            )
        local = float(value.item() if isinstance(value, torch.Tensor) else value)
        return global_mean(trainer, local, n)


def check_target_unit(metrics: Mapping[str, Any], target: float, unit: str, owner: str) -> None:
    """Warn once if a KL target looks like it was written in the other unit.

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
        per_sequence, per_token = number("objective/kl"), number("objective/kl_per_token")
        if per_sequence is None or per_token is None or per_sequence <= 0 or per_token <= 1e-12:
            return None
        length = per_sequence / per_token
    return length if length >= 1 else None


def _check_name(value: Any, option: str, owner: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}: {option} must be a non-empty string, got {value!r}")


class KLControllerCallback(Callback):
    r"""Update the KL coefficient of a LightningModule after every training batch.

    After each training batch the callback reads the batch KL the module logged under
    ``monitor``, averages it over the samples of the global batch (all ranks), calls
    ``controller.update(kl, n_samples)`` with the number of samples in the global batch,
    writes the new beta to ``pl_module.<attribute>`` and logs it under ``log_key``. The module
    therefore uses the updated beta from the next batch on. Every rank computes the same beta.

    The module must log the KL every training batch with ``on_step=True`` (the default in
    ``training_step``) and expose the attribute, e.g. ``self.kl_coef = 0.1`` in ``__init__``.
    A tensor attribute (e.g. a registered buffer) is updated in place.

    Batches and samples are counted here (``n_batches``, ``n_samples``): ``trainer.global_step``
    counts optimizer steps, of which PPO takes several per batch. A batch without a usable KL
    (non-finite, or not logged again since the last batch) skips the update: beta stays, the
    first such batch warns, and all are counted in ``n_skipped``.

    The controller state and the counters are saved in checkpoints, so a resumed fit continues
    the same beta trajectory.

    After the first batch with a finite KL, a controller ``target`` that looks like the other
    unit (:func:`check_target_unit`, e.g. 0.05 "per sequence" with 30-token responses) warns.

    Args:
        controller: A KL controller (``value``, ``update(current_kl, n_steps)``, ``state_dict``,
            ``load_state_dict``), e.g. ``AdaptiveKLController(0.1, target=6.0, horizon=10_000)``.
            Its ``n_steps`` are samples of the global batch.
        unit: Unit of the controlled KL, ``"sequence"`` (nats per sequence) or ``"token"`` (nats
            per token); picks the default ``monitor``. The controller's target is in this unit.
        monitor: Key the module logs the batch KL under. Defaults to ``"objective/kl"`` for
            ``unit="sequence"`` and ``"objective/kl_per_token"`` for ``unit="token"``.
        attribute: Name of the module attribute that holds beta.
        log_key: Key beta is logged under after each update; ``None`` disables logging.
        batch_size_fn: ``batch -> int``, the number of samples in this rank's batch. Defaults to
            :func:`infer_batch_size` (leading size of the batch's first field).
        prog_bar: Also show beta in the progress bar.

    Example::

        controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
        trainer = Trainer(callbacks=[KLControllerCallback(controller)])
    """

    def __init__(
        self,
        controller: KLController,
        unit: str = "sequence",
        monitor: str | None = None,
        attribute: str = "kl_coef",
        log_key: str | None = "objective/kl_coef",
        batch_size_fn: Callable[[Any], int] | None = None,
        prog_bar: bool = False,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        missing = [
            name
            for name in ("value", "update", "state_dict", "load_state_dict")
            if not hasattr(controller, name)
        ]
        if missing:
            raise TypeError(
                f"{owner}: controller must implement the KLController protocol (value, update, "
                f"state_dict, load_state_dict); {type(controller).__name__} lacks {missing}"
            )
        default = default_monitor(unit, owner)
        _check_name(monitor, "monitor", owner, optional=True)
        _check_name(attribute, "attribute", owner)
        _check_name(log_key, "log_key", owner, optional=True)
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise ValueError(f"{owner}: batch_size_fn must be callable, got {batch_size_fn!r}")
        self.controller = controller
        self.unit = unit
        self.monitor = monitor if monitor is not None else default
        self.attribute = attribute
        self.log_key = log_key
        self.batch_size_fn = batch_size_fn
        self.prog_bar = prog_bar
        self.n_batches = 0
        self.n_samples = 0
        self.n_skipped = 0
        self.unit_checked = False
        self._reader = BatchKLReader(self.monitor, batch_size_fn, owner)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, attribute=self.attribute)

    @property
    def target(self) -> float | None:
        """The controller's target KL (in ``unit``), or None for a law without one."""
        target = getattr(self.controller, "target", None)
        return float(target) if isinstance(target, (int, float)) else None

    @property
    def value(self) -> float:
        """The current beta."""
        return float(self.controller.value)

    def _write(self, pl_module: pl.LightningModule) -> None:
        if not hasattr(pl_module, self.attribute):
            raise AttributeError(
                f"{type(self).__name__}: LightningModule {type(pl_module).__name__} has no "
                f"attribute `{self.attribute}`; add `self.{self.attribute} = ...` in __init__ "
                "or pass attribute=..."
            )
        current = getattr(pl_module, self.attribute)
        if isinstance(current, torch.Tensor):
            with torch.no_grad():
                current.fill_(self.value)
        else:
            setattr(pl_module, self.attribute, self.value)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Fails early on a missing attribute and gives the sanity-check validation the initial
        # beta. With most strategies callback states are already restored here; FSDP, DeepSpeed
        # and ModelParallel restore them later, hence the write again in on_train_start.
        self._write(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs after every checkpoint restore, whatever the strategy, and before the first batch.
        self._write(pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.sanity_checking:
            return
        kl, n_samples = self._reader.read(trainer, batch)
        self.n_batches += 1
        self.n_samples += n_samples
        if math.isfinite(kl) and n_samples > 0:
            self.controller.update(kl, n_samples)
            if not self.unit_checked:
                self.unit_checked = True
                if self.target is not None:
                    check_target_unit(
                        trainer.callback_metrics, self.target, self.unit, type(self).__name__
                    )
        else:
            self.n_skipped += 1
            if self.n_skipped == 1:
                rank_zero_warn(
                    f"{type(self).__name__}: no finite KL for batch {self.n_batches} ({kl}); "
                    f"beta stays {self.value:.6g}. Further skipped updates are counted in "
                    "`n_skipped` without a warning.",
                    category=RuntimeWarning,
                )
        self._write(pl_module)
        if self.log_key is not None:
            pl_module.log(
                self.log_key, self.value, on_step=True, on_epoch=False, prog_bar=self.prog_bar
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "controller": self.controller.state_dict(),
            "n_batches": self.n_batches,
            "n_samples": self.n_samples,
            "n_skipped": self.n_skipped,
            "unit_checked": self.unit_checked,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict["controller"])
        self.n_batches = state_dict.get("n_batches", 0)
        self.n_samples = state_dict.get("n_samples", 0)
        self.n_skipped = state_dict.get("n_skipped", 0)
        self.unit_checked = state_dict.get("unit_checked", self.n_batches > 0)
