"""KLCallbackBase and the batch-KL helpers: what every KL callback gets from the base."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from helpers.kl_callbacks import fake_trainer, fit
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning.kl.callback_base import KLCallbackBase
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import AdaptiveKLController
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor
from rlkl_lightning.kl.estimators import KL_UNITS
from rlkl_lightning.kl.reading import MONITOR_BY_UNIT, global_mean, infer_batch_size


class Recorder(KLCallbackBase):
    """A third KL callback in a few lines: it only records the KLs it is given."""

    def __init__(self, target=None, **kwargs):
        super().__init__(**kwargs)
        self.target, self.kls = target, []

    def on_kl(self, trainer, pl_module, kl, n_samples):
        self.kls.append((kl, n_samples))


class LogsKL(pl.LightningModule):
    """Logs kls[i] as the batch KL of batch i, or nothing where it is None."""

    def __init__(self, kls):
        super().__init__()
        self.layer, self.kls = torch.nn.Linear(1, 1), kls

    def training_step(self, batch, batch_idx):
        if self.kls[batch_idx] is not None:
            self.log("objective/kl", self.kls[batch_idx])
        return self.layer(batch[0]).sum()

    def train_dataloader(self):  # 3 samples per batch, 2 in the last one
        return DataLoader(TensorDataset(torch.zeros(3 * len(self.kls) - 1, 1)), batch_size=3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_stale_kl_is_reported_as_stale_not_as_non_finite():
    """The first skipped batch holds a value not logged again: the warning says stale."""
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(LogsKL([1.0, None, None, math.nan, 2.0]), [recorder])
    ours = [str(w.message) for w in record if str(w.message).startswith("Recorder:")]
    assert not any("no finite KL for batch 2" in m for m in ours), ours
    assert len(ours) == 2, ours
    assert "'objective/kl' was not logged in this training batch (batch 2)" in ours[0]
    assert "stale" in ours[0] and "no finite KL" not in ours[0]
    assert ours[1].startswith("Recorder: no finite KL for batch 4 (nan); it is ignored.")
    assert recorder.kls == [(1.0, 3), (2.0, 2)] and recorder.n_skipped == 3


class LogsKLOnStepAndEpoch(pl.LightningModule):
    """Logs kls[epoch][i] with on_step and on_epoch (Lightning's usual pair), or nothing."""

    def __init__(self, kls):
        super().__init__()
        self.layer, self.kls = torch.nn.Linear(1, 1), kls

    def training_step(self, batch, batch_idx):
        kl = self.kls[self.current_epoch][batch_idx]
        if kl is not None:
            self.log("objective/kl", kl, on_step=True, on_epoch=True)
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(len(self.kls[0]), 1)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_the_last_epochs_mean_is_not_taken_for_a_kl_the_batch_did_not_log():
    """With on_epoch=True the epoch's mean replaces the step value in callback_metrics at the
    epoch's end: a first batch of the next epoch that logs no KL is stale, not a KL of 1.5."""
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(LogsKLOnStepAndEpoch([[1.0, 2.0], [None, 4.0]]), [recorder], max_epochs=2)
    assert [kl for kl, _ in recorder.kls] == [1.0, 2.0, 4.0]
    assert recorder.n_skipped == 1
    ours = [str(w.message) for w in record if str(w.message).startswith("Recorder:")]
    assert len(ours) == 1 and "was not logged in this training batch (batch 3)" in ours[0], ours


def test_a_minimal_subclass_gets_counting_skips_and_state_for_free():
    kls = [1.0, math.nan, None, 2.0, math.inf, 4.0]
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(LogsKL(kls), [recorder])
    messages = [str(w.message) for w in record if w.category is RuntimeWarning]
    assert recorder.kls == [(1.0, 3), (2.0, 3), (4.0, 2)]  # the last batch holds 2 samples
    assert (recorder.n_batches, recorder.n_samples, recorder.n_skipped) == (6, 14, 3)
    assert recorder.unit_checked and recorder.monitor == "objective/kl"
    ours = [m for m in messages if m.startswith("Recorder:")]
    assert len(ours) == 2  # one for the non-finite KLs, one for the stale one
    assert ours[0].startswith("Recorder: no finite KL for batch 2 (nan); it is ignored.")
    assert "'objective/kl' was not logged in this training batch" in ours[1]
    other = Recorder()
    other.load_state_dict(recorder.state_dict())
    assert (
        other.state_dict()
        == recorder.state_dict()
        == {
            "n_batches": 6,
            "n_samples": 14,
            "n_skipped": 3,
            "unit_checked": True,
            "n_refreshes": 0,  # the module logs no reference/refreshes
        }
    )
    old = Recorder()
    old.load_state_dict({"n_batches": 2})  # a checkpoint without the newer fields
    assert (old.n_samples, old.n_skipped, old.unit_checked) == (0, 0, True)


def test_the_base_cannot_be_used_without_a_decision():
    with pytest.raises(TypeError, match="abstract"):
        KLCallbackBase()


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"unit": "bits"}, r"Recorder: unit='bits'.*\['sequence', 'token'\]"),
        ({"monitor": ""}, "Recorder: monitor"),
        ({"batch_size_fn": 3}, "Recorder: batch_size_fn"),
    ],
)
def test_shared_arguments_are_validated_for_every_subclass(kwargs, option):
    with pytest.raises(ValueError, match=option):
        Recorder(**kwargs)


# ---- the one-time check of the target's unit ---------------------------------------------


def unit_warnings(callbacks, listed=None):
    """Run one batch in which a target of 0.05 nats per sequence is 0.0017 per token."""
    metrics = {"objective/kl": torch.tensor(0.04), "objective/response_tokens": torch.tensor(30.0)}
    trainer = fake_trainer([], metrics)
    trainer.callbacks = callbacks if listed is None else listed
    module = SimpleNamespace(kl_coef=0.1, log=lambda *args, **kwargs: None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for callback in callbacks:
            callback.on_train_batch_end(trainer, module, None, torch.zeros(2), 0)
    return [str(w.message).split(":")[0] for w in record if "with unit=" in str(w.message)]


def test_only_the_first_callback_with_the_same_unit_and_target_checks_it():
    controller = KLControllerCallback(AdaptiveKLController(0.1, target=0.05, horizon=10))
    assert unit_warnings([controller, KLDriftMonitor(0.05)]) == ["KLControllerCallback"]
    assert unit_warnings([KLDriftMonitor(0.05), Recorder(0.05)]) == ["KLDriftMonitor"]
    # Another target or unit is checked on its own; so is a callback the trainer does not list.
    assert unit_warnings([Recorder(0.05), Recorder(0.06)]) == ["Recorder", "Recorder"]
    assert unit_warnings([Recorder(0.05)], listed=[]) == ["Recorder"]
    # Checked once: later batches do not warn again. Without a target nothing is checked.
    twice = Recorder(0.05)
    assert unit_warnings([twice]) == ["Recorder"] and unit_warnings([twice]) == []
    assert unit_warnings([Recorder()]) == []


# ---- samples per batch and the reduction over ranks ----------------------------------------


def test_units_match_the_estimator_module():
    assert set(MONITOR_BY_UNIT) == set(KL_UNITS)


@pytest.mark.parametrize(
    ("batch", "n"),
    [
        (torch.zeros(5, 3), 5),
        (torch.tensor(1.0), 1),
        ({"prompt": ["a", "b", "c"]}, 3),
        ({"input_ids": torch.zeros(6, 2), "mask": torch.zeros(6, 2)}, 6),
        ([torch.zeros(7, 2), torch.zeros(7)], 7),  # default_collate of (x, y) samples
        ((["a", "b"], torch.zeros(2)), 2),  # default_collate of (str, y) samples
        (["a", "b", "c", "d"], 4),
        ([{"prompt": "a"}, {"prompt": "b"}], 2),  # uncollated dict samples
    ],
)
def test_infer_batch_size(batch, n):
    assert infer_batch_size(batch) == n


def test_infer_batch_size_rejects_what_it_cannot_count():
    with pytest.raises(TypeError, match="batch_size_fn"):
        infer_batch_size(3.0)


def test_global_mean_weights_each_rank_by_its_samples():
    trainer = fake_trainer([(5.0, 6), (1.0, 1)])
    kl, n = global_mean(trainer, 2.0, 3)
    assert n == 10
    assert kl == pytest.approx((2.0 * 3 + 5.0 * 6 + 1.0 * 1) / 10, rel=1e-15)
    assert trainer.strategy.calls == ["sum"]  # one collective, a sum of (kl * n, n)


def test_global_mean_ignores_empty_ranks_and_propagates_nonfinite():
    kl, n = global_mean(fake_trainer([(4.0, 2)]), math.nan, 0)
    assert (kl, n) == (4.0, 2)
    kl, n = global_mean(fake_trainer([(math.nan, 2)]), 1.0, 2)
    assert math.isnan(kl) and n == 4
    kl, n = global_mean(fake_trainer([]), 3.0, 0)
    assert math.isnan(kl) and n == 0
