"""KLDriftMonitor driven through a real Trainer.fit by a small module that is not PPO."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from helpers.kl_callbacks import fit as fit_quietly
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import AdaptiveKLController
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor

# target 1, band [0.5, 2], window 3. Window means by batch (state once 3 values are in):
#  0-4: 1 1 1 1 2.0 (2.0 is not > 2: in band)   5-9: 3 4 4 3 2 -> high, warns at 5 only (2
#  is not back below (1 - 0.1) x 2 = 1.8, the default hysteresis)
#  10-11: 1 0.7 -> back in band                  12-14: 0.4 0.1 0.4 -> low, warns at 12 only
#  15-17: 0.7 1 2 -> in band                     18-19: 3 4 -> high again, warns at 18
KLS = [1, 1, 1, 1, 4, 4, 4, 4, 1, 1, 1, 0.1, 0.1, 0.1, 1, 1, 1, 4, 4, 4]
HIGH_AT, LOW_AT = [5, 18], [12]


def window_means(kls, window):
    return [
        sum(kls[max(0, i - window + 1) : i + 1]) / len(kls[max(0, i - window + 1) : i + 1])
        for i in range(len(kls))
    ]


def f32(x):
    """self.log stores a float as a float32 tensor: the monitor reads that value."""
    return float(torch.tensor(x, dtype=torch.float32))


class KLModule(pl.LightningModule):
    """Fits a linear layer to random data and logs a predetermined KL per batch.

    Records, per global batch index, what the monitor logged (``logged``) and which drift
    warnings were raised during that batch (``warned``).
    """

    def __init__(self, kls, key="objective/kl"):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.kls, self.key = kls, key
        self.kl_coef = 0.1
        self.logged: dict[int, dict[str, float]] = {}
        self.seen: list[int] = []

    @property
    def index(self):
        return self.trainer.fit_loop.epoch_loop.total_batch_idx  # global, survives a resume

    def training_step(self, batch, batch_idx):
        self.seen.append(self.index)
        self.log(self.key, self.kls[self.index])
        return (self.layer(batch[0]) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # runs after the callbacks' hook
        metrics = self.trainer.callback_metrics
        self.logged[self.index] = {
            k: float(v) for k, v in metrics.items() if k.startswith("kl_monitor/")
        }

    def train_dataloader(self):
        data = torch.randn(2 * len(self.kls), 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(module, callbacks, ckpt_path=None):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = fit_quietly(module, callbacks, ckpt_path)
    ours = [w for w in record if "KL divergence" in str(w.message) or "KLDrift" in str(w.message)]
    assert all(w.category is RuntimeWarning for w in ours)
    return trainer, [str(w.message) for w in ours if "KL divergence" in str(w.message)], ours


class WarnRecorder(pl.Callback):
    """Notes the global batch index at which each excursion was counted."""

    def __init__(self):
        self.at: list[tuple[int, str]] = []

    @staticmethod
    def _counts(trainer):
        mon = next(c for c in trainer.callbacks if isinstance(c, KLDriftMonitor))
        return mon.n_warnings_high, mon.n_warnings_low

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = self._counts(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        high, low = self._counts(trainer)
        self.at += [(pl_module.index, "high")] * (high - self._before[0])
        self.at += [(pl_module.index, "low")] * (low - self._before[1])


def monitor(**kwargs):
    return KLDriftMonitor(target=1.0, window=3, min_batches=3, **kwargs)


def test_warns_exactly_once_per_excursion_at_the_right_batches():
    module, mon, rec = KLModule(KLS), monitor(), WarnRecorder()
    _, messages, _ = fit(module, [mon, rec])
    assert rec.at == [(5, "high"), (12, "low"), (18, "high")]
    assert (mon.n_warnings_high, mon.n_warnings_low) == (2, 1)
    assert len(messages) == 3
    assert messages[0].startswith("KL divergence too high, policy drifting: avg 3 > 2 x target 1")
    assert "(nats per sequence)" in messages[0] and "batch 6" in messages[0]
    assert messages[1].startswith("KL divergence too low, not learning enough: avg 0.4 < 0.5 x")


def test_logs_window_average_state_and_target_every_batch():
    module, mon = KLModule(KLS), monitor()
    fit(module, [mon])
    means = window_means([f32(k) for k in KLS], 3)
    states = [0] * 5 + [1] * 5 + [0] * 2 + [-1] * 3 + [0] * 3 + [1] * 2
    for i, logged in module.logged.items():
        assert logged["kl_monitor/avg_kl"] == pytest.approx(means[i], rel=1e-6, abs=0)
        assert logged["kl_monitor/target"] == 1.0
        if i >= 2:  # min_batches = 3 values in the window
            assert logged["kl_monitor/state"] == states[i], i
            # Excursions start at batches 5 (high), 12 (low) and 18 (high); the count is cumulative.
            assert logged["kl_monitor/warnings"] == sum(i >= b for b in (5, 12, 18)), i
        else:
            assert "kl_monitor/state" not in logged and "kl_monitor/warnings" not in logged
    assert mon.state == 1 and list(mon.values) == [f32(4)] * 3
    assert mon.n_batches == len(KLS)


def test_high_to_low_directly_is_a_new_excursion_and_min_batches_delays_the_first_check():
    kls = [9.0, 9.0, 0.1, 9.0, 1.0]
    module, mon, rec = KLModule(kls), KLDriftMonitor(1.0, window=1, min_batches=1), WarnRecorder()
    fit(module, [mon, rec])
    assert rec.at == [(0, "high"), (2, "low"), (3, "high")]
    # The default min_batches = 3 x window: batches before it never warn.
    module, mon = KLModule([9.0] * 17), KLDriftMonitor(1.0, window=5)
    assert mon.min_batches == 15
    rec = WarnRecorder()
    fit(module, [mon, rec])
    assert rec.at == [(14, "high")]
    # The warm-up counts the values that came in (not skipped batches), and may exceed the window.
    kls = [9.0, math.nan, 9.0, 9.0, 9.0]
    module, mon, rec = KLModule(kls), KLDriftMonitor(1.0, window=1, min_batches=3), WarnRecorder()
    fit(module, [mon, rec])
    assert rec.at == [(3, "high")] and mon.n_skipped == 1


@pytest.mark.parametrize(
    ("kls", "hysteresis", "warned_at"),
    [
        # hovering at 2 x target: 1.9 is not back below 1.8, 1.5 is
        ([2.5, 1.9, 2.5, 1.9, 2.5, 1.5, 2.5], None, [(0, "high"), (6, "high")]),
        (
            [2.5, 1.9, 2.5, 1.9, 2.5, 1.5, 2.5],
            0.0,
            [(0, "high"), (2, "high"), (4, "high"), (6, "high")],
        ),
        # hovering at 0.5 x target: 0.52 is not back above 0.55, 0.6 is
        ([0.4, 0.52, 0.4, 0.52, 0.4, 0.6, 0.4], None, [(0, "low"), (6, "low")]),
        ([0.4, 0.52, 0.4, 0.52, 0.4, 0.6, 0.4], 0.0, [(i, "low") for i in (0, 2, 4, 6)]),
        # straight from high to low is a new excursion whatever the hysteresis
        ([3.0, 0.1, 3.0], None, [(0, "high"), (1, "low"), (2, "high")]),
    ],
)
def test_hysteresis_makes_an_average_hovering_at_a_band_edge_one_excursion(
    kls, hysteresis, warned_at
):
    extra = {} if hysteresis is None else {"hysteresis": hysteresis}
    mon = KLDriftMonitor(1.0, window=1, min_batches=1, **extra)
    assert mon.hysteresis == (0.1 if hysteresis is None else hysteresis)
    module, rec = KLModule(kls), WarnRecorder()
    _, messages, _ = fit(module, [mon, rec])
    assert rec.at == warned_at
    assert len(messages) == len(warned_at)


def test_default_warm_up_in_batches():
    """3 x window up to a window of 10 (as measured), then window + 20: 120 batches, not 300,
    with the default window of 100."""
    assert [KLDriftMonitor(1.0, window=w).min_batches for w in (1, 5, 10, 11, 100)] == [
        3,
        15,
        30,
        31,
        120,
    ]
    assert KLDriftMonitor(1.0).min_batches == 120


# objective/kl of the first 40 batches of the study's `adaptive` run with seed 2 (nats per
# sequence; target 6, band [3, 12], window 10): it starts at 0 and rises, the slowest of the
# study's runs that ends in the band.
SLOW_RISE = [0.0, 0.34, 0.27, 0.7, 0.75, 1.26, 1.4, 1.91, 2.11, 1.65, 2.44, 2.06, 2.41, 3.02]
SLOW_RISE += [2.53, 2.2, 3.75, 2.5, 2.57, 5.17, 7.54, 4.96, 3.09, 4.05, 3.14, 3.48, 3.75, 4.7]
SLOW_RISE += [4.62, 4.09, 5.34, 3.15, 3.44, 4.91, 7.27, 4.15, 5.75, 5.09, 4.19, 4.83]


@pytest.mark.parametrize(("min_batches", "warned_at"), [(None, []), (20, [19]), (10, [9])])
def test_the_default_warm_up_does_not_warn_on_the_kls_rise_from_zero(min_batches, warned_at):
    monitor = KLDriftMonitor(6.0, window=10, min_batches=min_batches)
    module, rec = KLModule(SLOW_RISE), WarnRecorder()
    fit(module, [monitor, rec])
    # The default (3 x window = 30) judges batches 30-40, all in band; judging the window at
    # batch 20 (2 x window) or 10 (the earlier default) calls the rise "too low".
    assert rec.at == [(i, "low") for i in warned_at]
    assert module.logged[39]["kl_monitor/state"] == 0
    if min_batches is None:
        assert "kl_monitor/state" not in module.logged[28]  # not judged before batch 30


def test_strict_stops_training_at_the_first_excursion():
    module, mon = KLModule(KLS), monitor(strict=True)
    trainer, messages, _ = fit(module, [mon])
    assert module.seen == list(range(6))  # batch 5 (the 6th) caused it and was the last
    assert mon.stopped_batch == 6 and trainer.should_stop
    assert len(messages) == 1 and messages[0].endswith("Stopping training (strict=True).")


def test_verbose_false_counts_without_warning_and_token_unit():
    module = KLModule(KLS, key="objective/kl_per_token")
    mon = monitor(verbose=False, unit="token")
    assert mon.monitor == "objective/kl_per_token"
    _, messages, _ = fit(module, [mon])
    assert messages == []
    assert (mon.n_warnings_high, mon.n_warnings_low) == (2, 1)


def test_disabled_sides():
    mon = KLDriftMonitor(1.0, window=1, min_batches=1, high=math.inf, low=0.0)
    module = KLModule([1e30, -5.0, 0.0])
    _, messages, _ = fit(module, [mon])
    assert messages == [] and mon.state == 0


def test_nonfinite_values_stay_out_of_the_window():
    kls = [1.0, math.nan, 2.0, math.inf, 3.0]
    module, mon = KLModule(kls), KLDriftMonitor(1.0, window=10, min_batches=1, high=100.0)
    _, _, record = fit(module, [mon])
    assert [str(w.message)[:40] for w in record] == ["KLDriftMonitor: no finite KL for batch 2"]
    assert list(mon.values) == [1.0, 2.0, 3.0]
    assert (mon.n_batches, mon.n_skipped) == (5, 2)
    assert module.logged[1]["kl_monitor/avg_kl"] == 1.0


def test_resume_inside_an_excursion_does_not_warn_again(tmp_path):
    full, full_mon, full_rec = KLModule(KLS), monitor(), WarnRecorder()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1)
    fit(full, [full_mon, full_rec, saver])
    assert full_rec.at == [(5, "high"), (12, "low"), (18, "high")]
    ckpt = tmp_path / "epoch=0-step=7.ckpt"  # after batch 6, inside the first high excursion
    saved = torch.load(ckpt, weights_only=True)["callbacks"][full_mon.state_key]
    assert saved["state"] == 1 and saved["n_warnings_high"] == 1
    assert saved["values"] == [f32(4)] * 3

    module, mon, rec = KLModule(KLS), monitor(), WarnRecorder()
    _, messages, _ = fit(module, [mon, rec], ckpt_path=ckpt)
    assert module.seen[0] == 7
    assert rec.at == [(12, "low"), (18, "high")]  # no second warning for the ongoing excursion
    assert len(messages) == 2
    assert mon.state_dict() == full_mon.state_dict()
    assert {i: module.logged[i] for i in module.logged} == {
        i: full.logged[i] for i in module.logged
    }


def test_state_dict_loads_into_a_smaller_window_and_from_old_checkpoints():
    mon = monitor()
    mon.values.extend([1.0, 2.0, 3.0])
    mon.state, mon.n_warnings_high, mon.n_batches = 1, 1, 3
    small = KLDriftMonitor(target=1.0, window=2, min_batches=1)
    small.load_state_dict(mon.state_dict())
    assert list(small.values) == [2.0, 3.0] and small.state == 1 and small.n_batches == 3
    old = monitor()
    old.load_state_dict({"values": [5.0]})
    assert list(old.values) == [5.0] and old.n_warnings_low == 0 and old.stopped_batch is None


def test_works_next_to_the_controller_callback_with_distinct_state_keys():
    controller = AdaptiveKLController(0.1, target=1.0, horizon=100)
    module = KLModule(KLS)
    kl_cb, mon = KLControllerCallback(controller), monitor()
    fit(module, [kl_cb, mon])
    assert kl_cb.state_key != mon.state_key
    assert mon.state_key == "KLDriftMonitor{'monitor': 'objective/kl'}"  # no target: a resume
    # with another target carries the window over (tests/system/test_resume_changes.py)
    assert kl_cb.n_batches == mon.n_batches == len(KLS)
    assert module.kl_coef == kl_cb.value != 0.1


class TwoKLs(KLModule):
    """Logs a second KL, 10 times the first, under ``objective/kl_per_token``."""

    def training_step(self, batch, batch_idx):
        self.log("objective/kl_per_token", 10.0 * self.kls[self.index])
        return super().training_step(batch, batch_idx)


def test_two_monitors_log_under_their_own_prefixes_and_a_shared_one_is_refused():
    """Lightning keeps the last value logged under a key: one window would vanish."""
    module = TwoKLs(KLS)
    with pytest.raises(ValueError, match=r"log_prefix 'kl_monitor'.*log_prefix="):
        fit(module, [monitor(), monitor(unit="token")])
    assert module.seen == []  # refused before any batch
    module = TwoKLs(KLS)
    sequence, token = monitor(), monitor(unit="token", log_prefix="kl_monitor_token")
    trainer, _, _ = fit(module, [sequence, token])
    metrics = trainer.callback_metrics
    assert float(metrics["kl_monitor/avg_kl"]) == pytest.approx(sequence.avg_kl)
    assert float(metrics["kl_monitor_token/avg_kl"]) == pytest.approx(token.avg_kl)
    assert token.avg_kl == pytest.approx(10 * sequence.avg_kl)
    assert float(metrics["kl_monitor_token/warnings"]) == token.n_warnings_high + (
        token.n_warnings_low
    )


def test_skips_sanity_checking():
    mon = monitor()
    trainer = SimpleNamespace(sanity_checking=True, callback_metrics={})  # no KL: would raise
    mon.on_train_batch_end(trainer, None, None, None, 0)
    assert mon.n_batches == 0


def test_error_when_the_monitored_key_was_never_logged():
    with pytest.raises(RuntimeError, match=r"KLDriftMonitor.*'objective/kl'.*\['kl/other'\]"):
        fit(KLModule(KLS, key="kl/other"), [monitor()])


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"target": 0.0}, "target"),
        ({"target": -1.0}, "target"),
        ({"target": math.inf}, "target"),
        ({"target": math.nan}, "target"),
        ({"target": 1.0, "window": 0}, "window"),
        ({"target": 1.0, "window": 2.5}, "window"),
        ({"target": 1.0, "high": 1.0}, "high"),
        ({"target": 1.0, "high": math.nan}, "high"),
        ({"target": 1.0, "low": 1.0}, "low"),
        ({"target": 1.0, "low": -0.1}, "low"),
        ({"target": 1.0, "unit": "bits"}, r"unit='bits'.*\['sequence', 'token'\]"),
        ({"target": 1.0, "monitor": ""}, "monitor"),
        ({"target": 1.0, "min_batches": 2.5}, r"min_batches must be an int >= 1"),
        ({"target": 1.0, "min_batches": True}, "min_batches"),
        ({"target": 1.0, "min_batches": 0}, "min_batches"),
        ({"target": 1.0, "hysteresis": 1.0}, r"hysteresis must lie in \[0, 1\)"),
        ({"target": 1.0, "hysteresis": math.nan}, "hysteresis"),
        ({"target": 1.0, "low": 0.9, "high": 1.05}, "the band's exits cross"),
        ({"target": 1.0, "batch_size_fn": 3}, "batch_size_fn"),
    ],
)
def test_bad_arguments_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        KLDriftMonitor(**kwargs)


def test_tensorboard_gets_a_chart_of_the_kl_with_its_band(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    monitor = KLDriftMonitor(target=1.0, window=3, unit="token")
    fit_quietly(KLModule([0.1] * 4, key="objective/kl_per_token"), [monitor], logger=logger)
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    acc.Reload()
    (event,) = [e for e in acc.Tensors("custom_scalars__config__")]
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    (chart,) = layout.category[0].chart
    assert chart.title == "KL (nats per token) and its target"
    assert list(chart.multiline.tag) == [
        "objective/kl_per_token",
        "kl_monitor/avg_kl",
        "kl_monitor/target",
    ]


class RefreshingKLModule(KLModule):
    """Also logs a running count of reference refreshes: +1 at each batch of ``refreshed_at``."""

    def __init__(self, kls, refreshed_at):
        super().__init__(kls)
        self.refreshed_at = refreshed_at

    def training_step(self, batch, batch_idx):
        count = sum(i <= self.index for i in self.refreshed_at)
        self.log("reference/refreshes", float(count))
        return super().training_step(batch, batch_idx)


def test_after_a_refresh_low_waits_for_the_band_and_high_is_judged_as_usual():
    """After a reset the KL climbs back from 0: no "too low" until it has been in band once.

    The same KLs without the refresh count warn "too low" at batch 7; with it, the monitor only
    warns once the KL since the refresh has reached the band and fallen out again (batch 14),
    and "too high" is judged as usual.
    """
    kls = [1.0] * 6 + [0.0, 0.1, 0.2, 0.3, 0.6, 1.0, 1.0, 0.1, 0.1, 0.1] + [5.0] * 4
    rec = WarnRecorder()
    fit(KLModule(kls), [monitor(), rec])
    assert rec.at[0] == (7, "low")  # without the refresh count: the climb back warns
    mon, rec = monitor(), WarnRecorder()
    module = RefreshingKLModule(kls, refreshed_at=[6])
    fit(module, [mon, rec])
    assert mon.n_refreshes == 1 and mon.since_refresh == len(kls) - 6
    # The KLs since the refresh reach 0.5 at batch 11 (mean of 0.3, 0.6, 1.0); out at 14;
    # high at 17.
    assert rec.at == [(14, "low"), (17, "high")]


@pytest.mark.parametrize(
    ("every", "kls"),
    [
        (1, [10.0] * 40),  # an EMA reference: refreshed after every batch
        (20, ([0.0] + [10.0] * 19) * 2),  # a hard reset every 20 batches, window 10
    ],
)
def test_refreshes_do_not_silence_too_high(every, kls):
    """A KL 10x its target warns "too high" however often the reference is refreshed.

    Each refresh restarted the warm-up (3 x window = 30 batches with the window of 10), so a
    refresh every batch, or every 20, muted the monitor for the whole run (issue 37, item 2).
    """
    mon, rec = KLDriftMonitor(target=1.0, window=10), WarnRecorder()
    refreshed_at = list(range(1, len(kls), every))
    _, messages, _ = fit(RefreshingKLModule(kls, refreshed_at=refreshed_at), [mon, rec])
    assert mon.n_refreshes == len(refreshed_at)
    assert rec.at == [(29, "high")]  # at the end of the run's warm-up of 30 batches
    assert messages[0].startswith("KL divergence too high")


def test_the_monitor_says_at_set_up_what_a_refresh_suspends(caplog):
    from rlkl_lightning.algorithms.reference_refresh import ReferenceRefresh

    mon = KLDriftMonitor(target=6.0, window=10)
    trainer = SimpleNamespace(callbacks=[mon], strategy=None)
    with caplog.at_level("INFO"):
        ReferenceRefresh(every=1).setup(trainer, SimpleNamespace(refresh_reference=id), "fit")
    assert mon.refresh_every == 1
    (said,) = [r.getMessage() for r in caplog.records if "KLDriftMonitor" in r.getMessage()]
    assert 'every 1 batch. After each refresh "too low" is suspended until' in said
    assert '0.5 x target 6 (nats per sequence); "too high" is judged across refreshes' in said
