"""KLControllerCallback driven through a real Trainer.fit by a small module that is not PPO."""

from __future__ import annotations

import json
import math
import multiprocessing
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.kl_callbacks import fake_trainer, fit
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
)

BATCH = 4
INIT, TARGET, HORIZON = 0.5, 2.0, 20.0
# Below, inside, above and far from the target, so the ±0.2 clip is exercised both ways.
KLS = [0.5, 1.0, 2.0, 2.2, 3.0, 9.0, 1.9, 0.0, 2.4, 5.0, 1.2, 2.0]


class KLModule(pl.LightningModule):
    """Fits a linear layer to random data; logs a predetermined KL per batch, exposes kl_coef.

    Records the kl_coef it reads in each training_step (``seen``) and the beta the callback
    logged after that batch (``logged``), keyed by the global batch index.
    """

    def __init__(self, kls, key="objective/kl", n_samples=BATCH * len(KLS) - 2, log_every=1):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.kls, self.key, self.n_samples, self.log_every = kls, key, n_samples, log_every
        self.kl_coef = 123.0  # overwritten by the callback at fit start
        self.seen: dict[int, float] = {}
        self.logged: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        i = self.trainer.fit_loop.epoch_loop.total_batch_idx  # global, survives a resume
        self.seen[i] = float(self.kl_coef)
        if i % self.log_every == 0:
            self.log(self.key, self.kls[i])
        return (self.layer(batch[0]) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # runs after the callbacks' hook
        metrics = self.trainer.callback_metrics
        if "objective/kl_coef" in metrics:
            self.logged[self.trainer.fit_loop.epoch_loop.total_batch_idx] = float(
                metrics["objective/kl_coef"]
            )

    def train_dataloader(self):
        # The last batch is short (2 samples) unless n_samples is a multiple of BATCH.
        data = torch.randn(self.n_samples, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def batch_sizes(n_samples=BATCH * len(KLS) - 2):
    return [min(BATCH, n_samples - i) for i in range(0, n_samples, BATCH)]


def f32(x):
    """self.log stores a float as a float32 tensor: the callback reads that value."""
    return float(torch.tensor(x, dtype=torch.float32))


def expected_betas(kls, sizes, init=INIT, target=TARGET, horizon=HORIZON):
    """Ziegler et al. 2019 §2.2 written out independently: beta before each batch, then final."""
    betas = [init]
    for kl, n in zip(kls, sizes):
        error = f32(kl) / target - 1
        error = 0.2 if error > 0.2 else -0.2 if error < -0.2 else error
        betas.append(betas[-1] * (1 + error * n / horizon))
    return betas


def adaptive():
    return AdaptiveKLController(init_kl_coef=INIT, target=TARGET, horizon=HORIZON)


# ---- the beta trajectory ---------------------------------------------------------------


def test_beta_follows_the_adaptive_formula_batch_by_batch():
    module, callback = KLModule(KLS), KLControllerCallback(adaptive())
    fit(module, [callback])
    sizes = batch_sizes()
    assert sizes[-1] == 2  # the short last batch is counted with its own size
    expected = expected_betas(KLS, sizes)
    n = len(KLS)
    # The module sees beta_i in batch i: the update after batch i-1, never its own batch's.
    assert [module.seen[i] for i in range(n)] == pytest.approx(expected[:n], rel=1e-12, abs=0)
    assert [module.logged[i] for i in range(n)] == pytest.approx(expected[1:], rel=1e-6, abs=0)
    assert callback.value == pytest.approx(expected[-1], rel=1e-12, abs=0)
    assert module.kl_coef == callback.value
    assert (callback.n_batches, callback.n_samples, callback.n_skipped) == (n, sum(sizes), 0)
    # Beta moved on every batch except where the KL hit the target exactly (e = 0).
    assert [a == b for a, b in zip(expected, expected[1:])] == [kl == TARGET for kl in KLS]


def test_token_unit_reads_kl_per_token_and_updates_a_tensor_buffer():
    module = KLModule(KLS, key="objective/kl_per_token")
    del module.kl_coef
    module.register_buffer("kl_coef", torch.tensor(7.0))
    buffer = module.kl_coef
    callback = KLControllerCallback(FixedKLController(0.25), unit="token")
    assert callback.monitor == "objective/kl_per_token"
    fit(module, [callback])
    assert set(module.seen.values()) == {0.25}
    assert module.kl_coef is buffer and float(buffer) == 0.25  # written in place
    assert callback.n_batches == len(KLS)


def test_nonfinite_kl_skips_the_update_and_warns_once():
    kls = list(KLS)
    kls[3], kls[6] = math.nan, math.inf
    callback = KLControllerCallback(adaptive())
    module = KLModule(kls)
    with pytest.warns(RuntimeWarning, match="no finite KL for batch 4") as record:
        fit(module, [callback])
    assert sum("no finite KL" in str(w.message) for w in record) == 1
    sizes = batch_sizes()
    used = [(kl, n) for kl, n in zip(kls, sizes) if math.isfinite(kl)]
    expected = expected_betas(*zip(*used))
    assert callback.value == pytest.approx(expected[-1], rel=1e-12, abs=0)
    assert module.seen[4] == module.seen[3] and module.seen[7] == module.seen[6]
    assert (callback.n_batches, callback.n_skipped) == (len(kls), 2)


def test_a_kl_below_the_negative_tolerance_is_flagged_at_once():
    """A sign error (-5 nats) warns in the batch it first appears, however early; noise-sized
    negatives (-0.05, -0.5) do not; the update itself is unchanged (the law's beta sequence)."""
    kls = [0.5, -0.05, -5.0, -0.5, -4.0, 2.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    callback = KLControllerCallback(adaptive())
    module = KLModule(kls)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(module, [callback])
    ours = [str(w.message) for w in record if "negative_kl_tolerance" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].startswith("KLControllerCallback: 'objective/kl' is -5 (nats per sequence) ")
    assert "in batch 3, below -negative_kl_tolerance=-1" in ours[0]
    assert callback.n_negative == 2
    expected = expected_betas(kls, batch_sizes())
    assert callback.value == pytest.approx(expected[-1], rel=1e-12, abs=0)
    restored = KLControllerCallback(adaptive())
    restored.load_state_dict(callback.state_dict())
    assert restored.n_negative == 2
    old = {k: v for k, v in callback.state_dict().items() if k != "n_negative"}
    restored.load_state_dict(old)  # a checkpoint from before the check
    assert restored.n_negative == 0
    # math.inf disables it; a NaN or negative tolerance is refused, naming the option.
    quiet = KLControllerCallback(adaptive(), negative_kl_tolerance=math.inf)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(KLModule(kls), [quiet])
    assert not [w for w in record if "negative_kl_tolerance" in str(w.message)]
    assert quiet.n_negative == 0
    token = KLControllerCallback(adaptive(), unit="token")
    assert (callback.negative_kl_tolerance, token.negative_kl_tolerance) == (1.0, 0.05)
    for bad in (math.nan, -0.1, "0.1"):
        with pytest.raises(ValueError, match=r"negative_kl_tolerance must be a number >= 0"):
            KLControllerCallback(adaptive(), negative_kl_tolerance=bad)


def test_a_kl_not_logged_again_is_not_used_twice():
    callback = KLControllerCallback(adaptive())
    module = KLModule(KLS, log_every=2)  # logs only in even batches
    with pytest.warns(RuntimeWarning, match="was not logged in this training batch"):
        fit(module, [callback])
    sizes = batch_sizes()
    expected = expected_betas(KLS[::2], sizes[::2])
    assert callback.value == pytest.approx(expected[-1], rel=1e-12, abs=0)
    assert callback.n_skipped == len(KLS) // 2
    assert callback.n_samples == sum(sizes[::2])


# ---- checkpoints and resume -------------------------------------------------------------


class LateRestoreStrategy(SingleDeviceStrategy):
    """Restores callback states after on_fit_start, as FSDP, DeepSpeed and ModelParallel do."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


@pytest.mark.parametrize("late_restore", [False, True], ids=["restore-before", "restore-after"])
def test_resume_mid_epoch_continues_the_same_beta_trajectory(tmp_path, late_restore):
    def strategy():
        return LateRestoreStrategy(torch.device("cpu")) if late_restore else "auto"

    # Full batches only: the resumed run restarts the (not resumable) dataloader mid-epoch.
    n_samples = BATCH * len(KLS)
    full_module, full_cb = KLModule(KLS, n_samples=n_samples), KLControllerCallback(adaptive())
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    fit(full_module, [full_cb, saver], strategy=strategy())
    ckpt = tmp_path / "epoch=0-step=5.ckpt"
    state = torch.load(ckpt, weights_only=True)["callbacks"][full_cb.state_key]
    assert (state["n_batches"], state["n_samples"]) == (5, 5 * BATCH)

    module, callback = KLModule(KLS, n_samples=n_samples), KLControllerCallback(adaptive())
    fit(module, [callback], ckpt_path=ckpt, strategy=strategy())
    assert sorted(module.seen) == list(range(5, len(KLS)))
    # Exact equality: the resumed run repeats the same float operations.
    assert {i: module.seen[i] for i in module.seen} == {i: full_module.seen[i] for i in module.seen}
    assert module.seen[5] != INIT  # the restored beta, not the initial one, reached batch 5
    assert callback.value == full_cb.value
    assert callback.state_dict() == full_cb.state_dict()


def test_state_dict_round_trip_and_old_checkpoints_without_counters():
    callback = KLControllerCallback(adaptive())
    callback.controller.update(4.0, 10)
    callback.n_batches, callback.n_samples, callback.n_skipped = 3, 12, 1
    other = KLControllerCallback(adaptive())
    other.load_state_dict(callback.state_dict())
    assert other.state_dict() == callback.state_dict()
    assert other.value == callback.value != INIT
    minimal = KLControllerCallback(adaptive())
    minimal.load_state_dict({"controller": callback.controller.state_dict()})
    assert (minimal.value, minimal.n_batches, minimal.n_samples) == (callback.value, 0, 0)


def test_state_key_is_built_from_monitor_and_attribute():
    a = KLControllerCallback(adaptive())
    b = KLControllerCallback(adaptive(), unit="token", attribute="beta")
    assert a.state_key == "KLControllerCallback{'monitor': 'objective/kl', 'attribute': 'kl_coef'}"
    assert b.state_key != a.state_key


# ---- errors -----------------------------------------------------------------------------


def test_error_when_the_monitored_key_was_never_logged():
    module = KLModule(KLS, key="kl/other")
    with pytest.raises(RuntimeError, match=r"'objective/kl'.*available keys: \['kl/other'\]"):
        fit(module, [KLControllerCallback(adaptive())])


class TwoKLs(KLModule):
    """Logs a second KL under ``objective/kl_b`` and has a second beta, ``kl_coef_b``."""

    def __init__(self):
        super().__init__(KLS)
        self.kl_coef_b = 0.0

    def training_step(self, batch, batch_idx):
        self.log("objective/kl_b", 4.0)
        return super().training_step(batch, batch_idx)


def test_two_controllers_logging_beta_under_one_key_are_refused_at_fit_start():
    """Lightning keeps the last value logged under a key: one beta would vanish from the logs."""

    def second(**kwargs):
        return KLControllerCallback(
            adaptive(), monitor="objective/kl_b", attribute="kl_coef_b", **kwargs
        )

    module = TwoKLs()
    with pytest.raises(ValueError, match=r"log_key 'objective/kl_coef'.*log_key="):
        fit(module, [KLControllerCallback(adaptive()), second()])
    assert module.seen == {}  # refused before any batch
    first, other = KLControllerCallback(adaptive()), second(log_key="objective/kl_coef_b")
    trainer = fit(TwoKLs(), [first, other])
    metrics = trainer.callback_metrics
    assert float(metrics["objective/kl_coef"]) == pytest.approx(first.value)
    assert float(metrics["objective/kl_coef_b"]) == pytest.approx(other.value)
    assert first.value != pytest.approx(other.value)


def test_error_when_the_module_has_no_such_attribute():
    module = KLModule(KLS)
    with pytest.raises(AttributeError, match=r"KLModule has no attribute `beta`.*self\.beta ="):
        fit(module, [KLControllerCallback(adaptive(), attribute="beta")])
    assert module.seen == {}  # failed at fit start, before any batch


def test_an_integer_tensor_beta_is_refused_not_truncated():
    """fill_ on an integer buffer would turn beta 0.5 into 0: the module would train unpenalized."""
    module = KLModule(KLS)
    del module.kl_coef
    module.register_buffer("kl_coef", torch.tensor(1))
    with pytest.raises(TypeError, match=r"KLModule.kl_coef` is a torch.int64 tensor.*float"):
        fit(module, [KLControllerCallback(adaptive())])
    assert module.seen == {} and int(module.kl_coef) == 1


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"unit": "nats"}, r"unit='nats'.*\['sequence', 'token'\]"),
        ({"monitor": ""}, "monitor"),
        ({"attribute": ""}, "attribute"),
        ({"attribute": 3}, "attribute"),
        ({"log_key": ""}, "log_key"),
        ({"batch_size_fn": 4}, "batch_size_fn"),
    ],
)
def test_bad_arguments_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        KLControllerCallback(adaptive(), **kwargs)


def test_controller_must_follow_the_protocol():
    with pytest.raises(TypeError, match=r"controller.*lacks \['value', 'update'"):
        KLControllerCallback(object())


# ---- the controller on the reduction over ranks (fake ranks: test_callback_base.py) ------------


def test_callback_updates_on_the_sample_weighted_mean_of_all_ranks():
    others = [(6.0, 12)]
    trainer = fake_trainer(others, {"objective/kl": torch.tensor(1.0)})
    module = SimpleNamespace(kl_coef=0.0)
    callback = KLControllerCallback(adaptive(), log_key=None)
    callback.on_train_batch_end(trainer, module, None, {"prompt": ["p"] * 4}, 0)
    mean = (1.0 * 4 + 6.0 * 12) / 16  # 4.75: not the unweighted mean 3.5 of the two ranks
    assert module.kl_coef == pytest.approx(expected_betas([mean], [16])[-1], rel=1e-12)
    assert (callback.n_batches, callback.n_samples) == (1, 16)


def test_batch_size_fn_overrides_the_inferred_count():
    trainer = fake_trainer([], {"objective/kl": torch.tensor(3.0)})
    module = SimpleNamespace(kl_coef=0.0)
    callback = KLControllerCallback(
        adaptive(), log_key=None, batch_size_fn=lambda batch: 4 * len(batch["prompt"])
    )
    callback.on_train_batch_end(trainer, module, None, {"prompt": ["p"] * 2}, 0)
    assert callback.n_samples == 8
    assert module.kl_coef == pytest.approx(expected_betas([3.0], [8])[-1], rel=1e-12)
    bad = KLControllerCallback(adaptive(), log_key=None, batch_size_fn=lambda batch: -1)
    with pytest.raises(ValueError, match="batch size must be a non-negative int"):
        bad.on_train_batch_end(trainer, module, None, {"prompt": ["p"]}, 0)
    for count, wrong in ((4.0, "4.0"), (True, "True"), (np.int64(-2), "-2")):
        bad = KLControllerCallback(adaptive(), log_key=None, batch_size_fn=lambda b, c=count: c)
        with pytest.raises(ValueError, match=f"non-negative int, got {wrong}"):
            bad.on_train_batch_end(trainer, module, None, {"prompt": ["p"]}, 0)


def test_an_integer_of_numpy_counts_as_the_batch_size():
    trainer = fake_trainer([], {"objective/kl": torch.tensor(3.0)})
    module = SimpleNamespace(kl_coef=0.0)
    callback = KLControllerCallback(adaptive(), log_key=None, batch_size_fn=lambda b: np.int64(4))
    callback.on_train_batch_end(trainer, module, None, {"prompt": ["p"]}, 0)
    assert callback.n_samples == 4 and type(callback.n_samples) is int
    assert module.kl_coef == pytest.approx(expected_betas([3.0], [4])[-1], rel=1e-12)


def test_a_batch_without_samples_is_skipped_saying_so():
    """A batch of 0 counted samples has no KL to weigh: the warning says that, not that the
    (finite) logged KL is not finite."""
    trainer = fake_trainer([], {"objective/kl": torch.tensor(1.0)})
    module = SimpleNamespace(kl_coef=0.5)
    callback = KLControllerCallback(adaptive(), log_key=None, batch_size_fn=lambda b: 0)
    with pytest.warns(RuntimeWarning) as record:
        callback.on_train_batch_end(trainer, module, None, {"prompt": ["p"]}, 0)
    said = [str(w.message) for w in record]
    assert len(said) == 1 and "no finite KL" not in said[0]
    assert said[0].startswith("KLControllerCallback: no samples in batch 1 (the batch size is 0")
    assert callback.n_skipped == 1 and module.kl_coef == 0.5


def test_a_law_class_in_place_of_a_law_is_refused_by_name():
    with pytest.raises(TypeError, match="got the class AdaptiveKLController; construct it"):
        KLControllerCallback(AdaptiveKLController)


# ---- two real processes (gloo) ------------------------------------------------------------

# Each rank logs its own KL sequence on batches of its own size; both must compute the same
# beta, that of the controller updated on the sample-weighted mean with the global batch size.
DDP_KLS = {0: [0.5, 3.0, 2.0, 9.0], 1: [4.0, 1.0, 2.5, 0.0]}
DDP_BATCH = {0: 2, 1: 6}


class RankModule(KLModule):
    def __init__(self, out_dir):
        super().__init__(kls=None)
        self.out_dir = str(out_dir)

    def training_step(self, batch, batch_idx):
        self.kls = DDP_KLS[self.global_rank]
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        n = DDP_BATCH[self.global_rank]
        return DataLoader(TensorDataset(torch.randn(4 * n, 3)), batch_size=n)

    def on_train_end(self):
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump({"seen": self.seen, "kl_coef": self.kl_coef}, f)


def test_two_process_ddp_gives_every_rank_the_same_beta(tmp_path):
    # fork lets the workers reuse the imported torch; spawn re-imports it (slower).
    fork = "fork" in multiprocessing.get_all_start_methods()
    callback = KLControllerCallback(adaptive())
    fit(
        RankModule(tmp_path),
        [callback],
        strategy="ddp_fork" if fork else "ddp_spawn",
        devices=2,
        use_distributed_sampler=False,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0] == results[1]
    n = DDP_BATCH[0] + DDP_BATCH[1]
    means = [(a * DDP_BATCH[0] + b * DDP_BATCH[1]) / n for a, b in zip(DDP_KLS[0], DDP_KLS[1])]
    expected = expected_betas(means, [n] * len(means))
    seen = [results[0]["seen"][str(i)] for i in range(len(means))]
    assert seen == pytest.approx(expected[:-1], rel=1e-12, abs=0)
    assert results[0]["kl_coef"] == pytest.approx(expected[-1], rel=1e-12, abs=0)


@pytest.mark.parametrize(("hold", "every", "warns"), [(5, 20, False), (20, 20, True), (3, 1, True)])
def test_a_hold_as_long_as_the_refresh_period_warns_at_set_up(hold, every, warns):
    """``hold_after_refresh >= every`` holds beta from the first refresh to the end of the run:
    each refresh restarts the hold before it ends. The refresh callback's set-up says so."""
    from rlkl_lightning.algorithms.reference_refresh import ReferenceRefresh

    cb = KLControllerCallback(AdaptiveKLController(INIT, TARGET, HORIZON), hold_after_refresh=hold)
    trainer = SimpleNamespace(callbacks=[cb], strategy=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ReferenceRefresh(every=every).setup(trainer, SimpleNamespace(refresh_reference=id), "fit")
    said = [str(w.message) for w in record if "hold_after_refresh" in str(w.message)]
    assert cb.refresh_every == every and len(said) == warns
    if warns:
        assert f"hold_after_refresh ({hold}, `kl.hold_after_refresh`) >= the reference" in said[0]
        assert f"refresh's `every` ({every})" in said[0] and "never acts again" in said[0]
        assert f"Use hold_after_refresh < {every}" in said[0]


def test_beta_at_a_bound_for_bound_patience_batches_warns_once_and_is_counted():
    law = ExponentialKLController(1.0, target=1.0, k=1.0, min_kl_coef=0.5, max_kl_coef=2.0)
    callback = KLControllerCallback(law, bound_patience=20)
    module = SimpleNamespace(kl_coef=1.0)
    kls = [5.0] * 40 + [0.5] + [0.0] * 30  # at the ceiling, off it, then at the floor
    with pytest.warns(RuntimeWarning) as caught:
        for kl in kls:
            callback.on_kl(None, module, kl, 8)
    said = [str(w.message) for w in caught if "consecutive batches" in str(w.message)]
    assert said == [
        "KLControllerCallback: beta has sat at its bound max_kl_coef=2 for 20 consecutive "
        "batches (KL 5 against the target 1, nats per sequence): the KL law cannot reach the "
        "target. Move the bound (`kl.max_kl_coef`) or the target; further batches at a bound "
        "are counted in `n_at_bound` (`kl.bound_patience` sets the patience, 0 silences this)."
    ]
    assert callback.n_at_bound == 40 + 30 and callback.at_bound == 30  # warned once
    quiet = KLControllerCallback(
        ExponentialKLController(1.0, target=1.0, k=1.0, max_kl_coef=2.0), bound_patience=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kl in kls[:40]:
            quiet.on_kl(None, module, kl, 8)
    assert quiet.n_at_bound == 40
    with pytest.raises(ValueError, match="bound_patience must be an int >= 0"):
        KLControllerCallback(law, bound_patience=-1)


def test_a_fixed_beta_equal_to_its_bound_is_never_at_a_bound():
    """The fixed law has no target to reach: its beta equal to ``max_kl_coef`` (the CLI's
    ``kl.controller: fixed`` with ``kl.max_kl_coef`` = ``penalty.init_coef``) neither warns nor
    counts, where the warning used to format the missing target and raise a TypeError."""
    callback = KLControllerCallback(FixedKLController(0.1, max_kl_coef=0.1), bound_patience=3)
    module = SimpleNamespace(kl_coef=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(10):
            callback.on_kl(None, module, 5.0, 8)
    assert callback.n_at_bound == 0 and module.kl_coef == 0.1
