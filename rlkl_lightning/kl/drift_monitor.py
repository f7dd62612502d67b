"""KLDriftMonitor: warn when the moving-average KL leaves a band around its target.

A policy whose KL to the reference runs far above target is drifting (reward hacking,
degenerate text); one far below target is barely learning. The monitor keeps the mean of the
last ``window`` batch KLs and reports each excursion out of ``[low * target, high * target]``.
It works with any LightningModule that logs its batch KL; reading, counting and skipping are
:class:`~rlkl_lightning.kl.callback_base.KLCallbackBase`'s work.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.kl.callback_base import KLCallbackBase
from rlkl_lightning.kl.reading import UNIT_NAMES, check_name

#: Values of ``kl_monitor/state``.
LOW, IN_BAND, HIGH = -1, 0, 1
#: The default warm-up judges first a window that holds none of the first batches: ``2 *
#: window`` of them, but at most this many (the KL's rise from 0 took up to 20-30 batches in
#: the study, whatever the window).
RISE_BATCHES = 20


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


class KLDriftMonitor(KLCallbackBase):
    r"""Watch the moving average of the batch KL and warn once per excursion from its band.

    After each training batch the monitor reads the KL the module logged under ``monitor``,
    averages it over the samples of the global batch (all ranks, as every
    :class:`~rlkl_lightning.kl.callback_base.KLCallbackBase` does) and appends it to a window
    of the last ``window`` batches. Once ``min_batches`` values have come in, the window mean
    ``avg`` gives the state: ``+1`` if ``avg > high * target``, ``-1`` if
    ``avg < low * target``, else ``0``. Entering ``+1`` or ``-1`` warns (``RuntimeWarning``)
    once; the monitor warns again only after the average has changed state again (e.g. back into
    the band and out once more). With a hysteresis ``h`` an excursion ends only once the average
    is back inside by a margin, below ``(1 - h) * high * target`` or above
    ``(1 + h) * low * target``, so an average hovering at a band edge is one excursion.

    Logged every training batch: ``kl_monitor/avg_kl`` (window mean), ``kl_monitor/target`` and,
    after the first ``min_batches`` values, ``kl_monitor/state`` and ``kl_monitor/warnings`` (the
    number of excursions so far). Non-finite KL values are left out of the window (the first one
    warns; all are counted in ``n_skipped``). The window, state and counters are saved in
    checkpoints. Sanity checking is skipped.

    The target is public: a :class:`~rlkl_lightning.kl.capability_budget.CapabilityBudget`
    sets it whenever it moves the controller's, and the band follows from the next batch on
    ("too high" and "too low" are judged against the target in force). The target in force is
    saved in checkpoints and restored when the configured one is unchanged.

    Args:
        target: Target KL, in the unit given by ``unit``; must be positive and finite.
        window: Number of most recent batches averaged.
        high: Warn when the average exceeds ``high * target``; ``> 1`` (``math.inf`` disables).
        low: Warn when the average falls below ``low * target``; in ``[0, 1)`` (``0`` disables).
        unit: ``"sequence"`` (nats per sequence) or ``"token"`` (nats per token); picks the
            default ``monitor`` and names the unit in messages.
        monitor: Key the module logs the batch KL under. Defaults to ``"objective/kl"`` for
            ``unit="sequence"`` and ``"objective/kl_per_token"`` for ``unit="token"``.
        strict: Stop training (``trainer.should_stop = True``) on an excursion instead of only
            warning; the batch that caused it is the last one trained.
        verbose: Warn on excursions and report the return into the band. With ``False`` the
            monitor only counts and logs (a strict stop is always reported).
        min_batches: Warm-up: the number of batches with a usable KL before the state is first
            evaluated, an int >= 1. A policy starts at its reference, so its KL starts at 0 and
            rises over the first batches, and the window average lags it by up to a window. The
            default ``window + min(2 * window, 20)`` (``3 * window`` up to a window of 10; 120
            batches with the default window of 100) judges first a window that holds none of
            the batches of that rise, so it alone does not warn "too low" (docs/callbacks.md,
            "The drift monitor", has the measurement).
        hysteresis: Fraction ``h`` in ``[0, 1)`` of a band edge by which the average must come
            back inside before an excursion ends (``0``: at the edge itself).
        batch_size_fn: ``batch -> int``, the number of samples in this rank's batch, used to
            weight the mean over ranks. Defaults to
            :func:`~rlkl_lightning.kl.reading.infer_batch_size`.
        refresh_key: Key the module logs its running count of reference refreshes under.
            After a refresh "too low" is suspended until the mean of the KLs measured since
            the refresh (the last ``min(window, batches since it)``) has reached
            ``low * target``: after a hard reset the KL climbs back from zero, which is the
            reset working, not a policy that stopped learning. Nothing else changes: the
            window keeps its values, the warm-up is the run's first ``min_batches`` only, and
            "too high" is judged across refreshes, however often they come (with a refresh
            every batch, an exponential moving average of the policy, too). A
            ``ReferenceRefresh`` callback announces its period at set-up
            (:meth:`expect_refreshes`) and the monitor says then what it suspends.
        log_prefix: What the logged keys start with (``kl_monitor/avg_kl``, ...). Two monitors
            of one trainer (on different KL keys) need different prefixes (refused at fit
            start): Lightning keeps only the last value logged under a key.

    Attributes:
        state: Current state (``-1``, ``0``, ``+1``).
        n_warnings_high: Number of excursions above the band.
        n_warnings_low: Number of excursions below the band.
        n_batches: Training batches seen.
        n_samples: Samples of the global batches with a freshly logged KL.
        n_skipped: Batches left out of the window (non-finite KL, or KL not logged again).
        stopped_batch: Batch (1-based count) at which strict mode stopped training, else ``None``.
    """

    def __init__(
        self,
        target: float,
        window: int = 100,
        high: float = 2.0,
        low: float = 0.5,
        unit: str = "sequence",
        monitor: str | None = None,
        strict: bool = False,
        verbose: bool = True,
        min_batches: int | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        hysteresis: float = 0.1,
        refresh_key: str | None = keys.REFERENCE_REFRESHES,
        log_prefix: str = "kl_monitor",
    ) -> None:
        owner = type(self).__name__
        check_name(log_prefix, "log_prefix", owner)
        if not _is_real(target) or not 0 < target < math.inf:
            raise ValueError(f"{owner}: target must be a positive finite number, got {target!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{owner}: window must be an int >= 1, got {window!r}")
        if not _is_real(high) or not high > 1:
            raise ValueError(f"{owner}: high must be > 1 (math.inf disables it), got {high!r}")
        if not _is_real(low) or not 0 <= low < 1:
            raise ValueError(f"{owner}: low must lie in [0, 1) (0 disables it), got {low!r}")
        if not _is_real(hysteresis) or not 0 <= hysteresis < 1:
            raise ValueError(f"{owner}: hysteresis must lie in [0, 1), got {hysteresis!r}")
        if low * (1 + hysteresis) >= high * (1 - hysteresis):
            raise ValueError(
                f"{owner}: with hysteresis={hysteresis!r} the band's exits cross: low x "
                f"(1 + hysteresis) must stay below high x (1 - hysteresis) (low={low!r}, "
                f"high={high!r})"
            )
        super().__init__(
            unit=unit, monitor=monitor, batch_size_fn=batch_size_fn, refresh_key=refresh_key
        )
        if min_batches is None:
            min_batches = window + min(2 * window, RISE_BATCHES)
        if isinstance(min_batches, bool) or not isinstance(min_batches, int) or min_batches < 1:
            raise ValueError(
                f"{owner}: min_batches must be an int >= 1 (None: window + min(2 x window, "
                f"{RISE_BATCHES})), got {min_batches!r}"
            )
        self.target = float(target)  # another callback (a CapabilityBudget) may move it
        self.initial_target = self.target  # the configured one
        self.steered = False  # another callback (a CapabilityBudget) sets the target in force
        self.window = window
        self.high = float(high)
        self.low = float(low)
        self.strict = strict
        self.verbose = verbose
        self.min_batches = min_batches
        self.hysteresis = float(hysteresis)
        self.log_prefix = log_prefix
        self.log_keys = {  # kl_monitor/avg_kl, ... under this monitor's prefix
            key: f"{log_prefix}/{key.partition('/')[2]}"
            for key in (
                keys.MONITOR_AVG_KL,
                keys.MONITOR_TARGET,
                keys.MONITOR_STATE,
                keys.MONITOR_WARNINGS,
            )
        }
        self.values: deque[float] = deque(maxlen=window)
        self.state = IN_BAND
        self.n_warnings_high = 0
        self.n_warnings_low = 0
        self.stopped_batch: int | None = None
        self.since_refresh = 0  # usable KLs since the last refresh (in the window: the newest)
        self.low_armed = True  # False from a refresh until the KL since it reaches the band

    @property
    @override
    def state_key(self) -> str:
        # Not the target: a resume with another target (a deliberate change, see
        # rlkl_lightning/run_settings.py) carries the window over instead of dropping it.
        return self._generate_state_key(monitor=self.monitor)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Read a state saved under the older key, which held the target too."""
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict) or self.state_key in states:
            return
        old = self._generate_state_key(monitor=self.monitor, target=0.0).partition(", 'target'")
        found = [k for k in states if isinstance(k, str) and k.startswith(old[0] + ", 'target'")]
        if len(found) == 1:
            states[self.state_key] = states[found[0]]

    @property
    def avg_kl(self) -> float:
        """Mean of the values in the window (``nan`` while it is empty)."""
        return sum(self.values) / len(self.values) if self.values else math.nan

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        other = self.earlier_sharing(trainer, KLDriftMonitor, "log_prefix")
        if other is not None:
            raise ValueError(
                f"{type(self).__name__}: the monitors of {other.monitor!r} and "
                f"{self.monitor!r} both log under log_prefix {self.log_prefix!r}, and only "
                "the last value logged under a key is kept; pass another log_prefix=... to "
                "one of them"
            )
        # TensorBoard's "Custom Scalars" tab: the KL, its window mean and the band in one chart.
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_custom_scalars"):
                title = f"KL ({UNIT_NAMES[self.unit]}) and its target"
                curves = [
                    self.monitor,
                    self.log_keys[keys.MONITOR_AVG_KL],
                    self.log_keys[keys.MONITOR_TARGET],
                ]
                experiment.add_custom_scalars({"KL control": {title: ["Multiline", curves]}})

    def _classify(self, avg: float) -> int:
        # An excursion lasts until the average is back inside by the hysteresis margin.
        if self.state == HIGH and avg > (1 - self.hysteresis) * self.high * self.target:
            return HIGH
        if self.state == LOW and avg < (1 + self.hysteresis) * self.low * self.target:
            return LOW
        if avg > self.high * self.target:
            return HIGH
        if self.low > 0 and avg < self.low * self.target:
            return LOW
        return IN_BAND

    def _message(self, state: int, avg: float) -> str:
        unit = UNIT_NAMES[self.unit]
        span = f"over the last {len(self.values)} batches (batch {self.n_batches})"
        if state == HIGH:
            return (
                f"KL divergence too high, policy drifting: avg {avg:.4g} > {self.high:g} x "
                f"target {self.target:g} ({unit}) {span}."
            )
        return (
            f"KL divergence too low, not learning enough: avg {avg:.4g} < {self.low:g} x "
            f"target {self.target:g} ({unit}) {span}."
        )

    @override
    def on_kl(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, kl: float, n_samples: int
    ) -> None:
        self.values.append(kl)
        self.since_refresh += 1

    @override
    def skip_effect(self) -> str:
        return "it is left out of the window"

    @override
    def expect_refreshes(self, every: int) -> None:
        super().expect_refreshes(every)
        if self.low == 0 or not self.verbose:
            return
        rank_zero_info(
            f"{type(self).__name__}: the reference is refreshed every {every} batch"
            f'{"es" if every != 1 else ""}. After each refresh "too low" is suspended until '
            f"the mean KL measured since the refresh reaches {self.low:g} x target "
            f'{self.target:g} ({UNIT_NAMES[self.unit]}); "too high" is judged across '
            "refreshes on the window of the last "
            f"{self.window} batches, as without them."
        )

    @override
    def on_refresh(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only "too low" waits: the KL against the refreshed reference climbs back from about
        # zero. The window keeps its values, so "too high" is judged as without the refresh.
        if self.low > 0:
            self.low_armed = False
            if self.state == LOW:
                self.state = IN_BAND
        self.since_refresh = 0

    @override
    def after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log(self.log_keys[keys.MONITOR_TARGET], self.target, on_step=True, on_epoch=False)
        if not self.values:
            return
        avg = self.avg_kl
        pl_module.log(self.log_keys[keys.MONITOR_AVG_KL], avg, on_step=True, on_epoch=False)
        if self.n_batches - self.n_skipped < self.min_batches:  # the run's warm-up
            return
        self._update_state(trainer, avg)
        pl_module.log(
            self.log_keys[keys.MONITOR_STATE], float(self.state), on_step=True, on_epoch=False
        )
        warnings = float(self.n_warnings_high + self.n_warnings_low)
        pl_module.log(self.log_keys[keys.MONITOR_WARNINGS], warnings, on_step=True, on_epoch=False)

    def _update_state(self, trainer: pl.Trainer, avg: float) -> None:
        if not self.low_armed and self.since_refresh > 0:  # "too low" waits for the band
            recent = list(self.values)[-min(self.since_refresh, len(self.values)) :]
            self.low_armed = sum(recent) / len(recent) >= self.low * self.target
        new = self._classify(avg)
        if not self.low_armed and new == LOW:
            new = IN_BAND
        if new == self.state:
            return
        if new == IN_BAND:
            if self.verbose:
                rank_zero_info(
                    f"{type(self).__name__}: KL back in band: avg {avg:.4g} "
                    f"({UNIT_NAMES[self.unit]}) at batch {self.n_batches}."
                )
            self.state = new
            return
        self.state = new
        if new == HIGH:
            self.n_warnings_high += 1
        else:
            self.n_warnings_low += 1
        message = self._message(new, avg)
        if self.strict:
            # Every rank sees the same reduced average, so all ranks take the same decision.
            trainer.should_stop = True
            self.stopped_batch = self.n_batches
            rank_zero_warn(message + " Stopping training (strict=True).", category=RuntimeWarning)
        elif self.verbose:
            rank_zero_warn(message, category=RuntimeWarning)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "values": list(self.values),
            "state": self.state,
            "n_warnings_high": self.n_warnings_high,
            "n_warnings_low": self.n_warnings_low,
            "stopped_batch": self.stopped_batch,
            "target": self.target,
            "initial_target": self.initial_target,
            "since_refresh": self.since_refresh,
            "low_armed": self.low_armed,
            **super().state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_target = state_dict.get("initial_target", state_dict.get("target", self.target))
        if saved_target != self.initial_target and self.steered:
            self.target = float(state_dict.get("target", self.target))  # the steering one's
        elif saved_target != self.initial_target:  # refused without --resume_with_changes
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint's target was {saved_target:g}, this "
                f"monitor's is {self.target:g}: its window of KL values is carried over and "
                f"judged against {self.target:g}",
                category=RuntimeWarning,
            )
        else:  # the same configuration: the target as it was, moved or not
            self.target = float(state_dict.get("target", self.target))
        self.values = deque(state_dict.get("values", []), maxlen=self.window)
        self.state = state_dict.get("state", IN_BAND)
        self.n_warnings_high = state_dict.get("n_warnings_high", 0)
        self.n_warnings_low = state_dict.get("n_warnings_low", 0)
        self.stopped_batch = state_dict.get("stopped_batch")
        # An older state (whose refresh emptied the window) has no count: the window's values.
        self.since_refresh = state_dict.get("since_refresh", len(self.values))
        self.low_armed = state_dict.get("low_armed", True)
        super().load_state_dict(state_dict)
