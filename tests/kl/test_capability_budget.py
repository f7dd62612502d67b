"""CapabilityBudget: its law against the formula written out here, and driven by a Trainer."""

from __future__ import annotations

import json
import math
import multiprocessing
import random
import re
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from helpers.kl_callbacks import fit
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from rlkl_lightning.kl.capability_budget import CapabilityBudget, budget_error
from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import (
    ExponentialKLController,
    FixedKLController,
    LogPIDKLController,
)
from rlkl_lightning.kl.drift_monitor import KLDriftMonitor

REF = 10.0  # the reference's perplexity in the synthetic plant
SLOPE = 0.1  # log(ppl / ref) per nat of KL: the plant's excess grows in proportion to the KL


# ---- the law, one evaluation at a time ------------------------------------------------------


def test_budget_error_is_the_log_of_the_excess_over_the_budgets_with_a_floor():
    b = math.log(1.15)
    assert budget_error(b, b, 0.1) == 0.0
    assert budget_error(2 * b, b, 0.1) == pytest.approx(math.log(2), rel=1e-15)
    assert budget_error(0.5 * b, b, 0.1) == pytest.approx(math.log(0.5), rel=1e-15)
    assert budget_error(-0.3, b, 0.1) == pytest.approx(math.log(0.1), rel=1e-15)  # floored


class FakeControllerCallback(SimpleNamespace):
    """What the budget reads of a KLControllerCallback: batches, the KL sums, set_target."""

    def set_target(self, target):
        self.target = target


def _wired(budget: CapabilityBudget, target: float) -> FakeControllerCallback:
    ctl = FakeControllerCallback(n_batches=0, kl_sum=0.0, kl_count=0, target=target)
    budget._controller, budget.target = ctl, target
    budget.reference = REF
    return ctl


def _expected(
    z,
    target,
    ratio,
    batches,
    kl_mean,
    kl_before,
    budget=1.15,
    gain=0.5,
    tau=20.0,
    rise=0.02,
    fall=0.04,
    follow=0.7,
    lo=0.1,
    hi=100.0,
):
    """The PI law of the class docstring, its prediction at 0, written out: (z, target)."""
    b = math.log(budget)
    e = math.log(max(math.log(ratio), 0.1 * b) / b)
    dz = -gain * (1 - math.exp(-batches / tau)) * e
    dz = min(max(dz, -fall * batches), rise * batches)
    lag = kl_mean < follow * target  # the KL still climbing: no rise, by either term
    if dz > 0 and lag:
        dz = 0.0
    # the KL law does not bring the KL down to the target (it is above and not falling)
    stuck = kl_mean > target / follow and not kl_mean < kl_before
    if stuck and dz < 0:
        dz = 0.0
    z = min(max(z + dz, math.log(lo)), math.log(hi))
    now = math.log(target)
    u = min(max(z - gain * e, now - fall * batches), now + rise * batches)
    if lag:
        u = min(u, now)
    if stuck:
        u = max(u, now)
    return z, min(max(math.exp(u), lo), hi)


def test_each_evaluation_follows_the_formula_with_its_clip_hold_floor_and_ceiling():
    budget = CapabilityBudget(
        1.15, gain=0.5, tau=30.0, raise_per_batch=0.005, min_target=0.5, max_target=4.0
    )
    budget.model.update = lambda *args: 0.0  # the prediction: tested on its own below
    budget.model.loop_gain = lambda batches: 1.0  # gain x 1 x (2 + share) < 1.6: not cut
    ctl = _wired(budget, 3.5)
    # (ratio measured, batches since the last evaluation, mean KL over them)
    steps = [
        (1.02, 40, 3.4),  # under and following, a long interval: a raise clipped at 40 x rise
        (1.30, 5, 2.1),  # over budget: lower, by gain (1 - exp(-5 / tau)) e and gain e
        (1.15, 5, 2.0),  # at budget, the KL lagging: no move (the proportional rise held)
        (1.02, 5, 0.5),  # under, but the KL has not reached the target: held
        (1.02, 5, 3.9),  # under and following: raise (error floored at log 0.1)
        *[(5.0, 100, None)] * 12,  # far over, the KL following: clipped steps, to the floor
        (1.30, 5, 1.0),  # over, the KL above target / follow and not falling: not lowered
        (1.30, 5, 1.0),  # ... again
        (1.30, 5, 0.9),  # over, the KL above target / follow but falling: lowered (the floor)
        (1.02, 5, 1.0),  # under: raising is never held by a KL above the target
    ]
    z, target, kl_before = math.log(3.5), 3.5, math.nan
    for ratio, batches, kl_mean in steps:
        kl_mean = target if kl_mean is None else kl_mean
        ctl.n_batches += batches
        ctl.kl_sum += kl_mean * batches
        ctl.kl_count += batches
        new = budget.step(ratio * REF)
        z, target = _expected(
            z, target, ratio, batches, kl_mean, kl_before, tau=30.0, rise=0.005, lo=0.5, hi=4.0
        )
        kl_before = kl_mean
        assert new == pytest.approx(target, rel=1e-14)
        assert budget.integral == pytest.approx(z, rel=1e-14, abs=1e-15)
        assert budget.ratio == pytest.approx(ratio, rel=1e-14)
    assert budget.n_held == 2 and budget.n_held_low == 2
    assert budget.n_evaluations == len(steps) and target > 0.5


def test_the_integrals_step_per_evaluation_is_bounded_whatever_the_interval():
    # 0.4.0's integral stepped by rate x n x e: ten times more at n = 50 than at n = 5.
    for batches, share in [(5, 1 - math.exp(-0.25)), (50, 1 - math.exp(-2.5)), (10**6, 1.0)]:
        budget = CapabilityBudget(1.15, gain=0.5, tau=20.0, fall_per_batch=10.0)
        budget.model.update = lambda *args: 0.0
        budget.model.loop_gain = lambda n: 1.0
        ctl = _wired(budget, 2.0)
        budget.integral = math.log(2.0)
        ctl.n_batches, ctl.kl_sum, ctl.kl_count = batches, 2.0 * batches, batches
        budget.step(1.3 * REF)
        e = math.log(math.log(1.3) / math.log(1.15))
        assert budget.integral == pytest.approx(math.log(2.0) - 0.5 * share * e, rel=1e-12)


def _plant(budget, tau_i, tau_p, a, n, batches, star=3.0, noise=0.0, kl_noise=0.0, seed=0):
    """The two-lag plant: the KL follows the target with a lag tau_i, the log excess follows a
    log KL with a lag tau_p and an elasticity a (at budget for a KL of `star`). Returns the
    ratio at each evaluation (noise-free) and the target after it."""
    rng = random.Random(seed)
    b = math.log(budget.budget)
    start = budget.target
    ctl = _wired(budget, start)
    budget.integral = math.log(start)
    p, q = math.exp(-1 / tau_i), math.exp(-1 / tau_p)
    log_kl = log_seen = math.log(start)  # the plant starts settled at the start
    ratios, targets = [], []
    for t in range(1, batches + 1):
        log_kl = p * log_kl + (1 - p) * math.log(budget.target)
        log_seen = q * log_seen + (1 - q) * log_kl
        ctl.n_batches += 1
        ctl.kl_sum += math.exp(log_kl + rng.gauss(0, kl_noise))
        ctl.kl_count += 1
        if t % n == 0:
            excess = b * math.exp(a * (log_seen - math.log(star)))
            budget.step(math.exp(excess + rng.gauss(0, noise)) * REF)
            ratios.append(math.exp(excess))
            targets.append(budget.target)
    return ratios, targets


PLANTS = [(10, 20, 0.77), (20, 100, 0.77), (20, 100, 1.3), (20, 200, 1.3)]


@pytest.mark.parametrize("n", [5, 10, 25, 50])
@pytest.mark.parametrize("tau_i,tau_p,a", PLANTS)
def test_on_plants_of_two_lags_the_loop_settles_without_passing_the_budget(tau_i, tau_p, a, n):
    # The start 3x below the target that holds the budget (docs/budget.md, "How fast"); the
    # review's slow plants (20, 100) and (20, 200) with an elasticity of 1.3 among them. 0.4.0's
    # law swung a third past the budget's excess on the slow plants, and oscillated at n = 50.
    budget = CapabilityBudget(1.3)
    budget.target = 1.0
    ratios, targets = _plant(budget, tau_i, tau_p, a, n, batches=4000)
    assert max(ratios) < 1 + 1.02 * 0.3  # never past the budget
    assert ratios[-1] == pytest.approx(1.3, abs=0.01 * 0.3)  # settled, within 1% of the excess
    assert targets[-1] == pytest.approx(3.0, rel=0.02)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget_ratio", [1.15, 1.3])
@pytest.mark.parametrize("tau_i,tau_p,a", PLANTS)
def test_with_noise_on_the_perplexity_and_the_kl_the_loop_stays_within_a_quarter(
    tau_i, tau_p, a, budget_ratio, seed
):
    # An evaluation's log perplexity scatters by 0.003 and a batch's KL by 25% (log sd).
    budget = CapabilityBudget(budget_ratio)
    budget.target = 1.0
    ratios, _ = _plant(budget, tau_i, tau_p, a, 5, 1500, noise=0.003, kl_noise=0.25, seed=seed)
    excess = budget_ratio - 1
    assert max(ratios) < 1 + 1.25 * excess
    tail = ratios[-100:]  # the last 500 batches
    assert max(abs(r - budget_ratio) for r in tail) < 0.1 * excess


def test_the_gain_cut_is_what_keeps_a_long_interval_stable():
    # The stability condition (docs/budget.md): without the cut, gain 1 on the fast plant at
    # n = 50 keeps swinging; with it, the same gain settles.
    for cut, settles in [(False, False), (True, True)]:
        budget = CapabilityBudget(1.3, gain=1.0)
        budget.target = 1.0
        if not cut:
            budget.model.loop_gain = lambda n: 1e-9
        ratios, _ = _plant(budget, 10, 20, 1.3, 50, batches=4000)
        assert (max(abs(r - 1.3) for r in ratios[-20:]) < 0.01 * 0.3) == settles


def test_the_model_finds_the_plants_lag_and_elasticity():
    budget = CapabilityBudget(1.3)
    budget.target = 1.0
    _plant(budget, 20, 100, 1.3, 5, batches=600)
    assert budget.model.lag == 100.0
    assert budget.model.elasticity == pytest.approx(1.3, rel=0.02)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("star", [0.5, 2.0])
def test_near_a_budget_of_one_the_target_holds_within_a_fifth_of_the_right_one(star, seed):
    # The review's case: budget 1.01, a plant without lag, log perplexity noise sd 0.002
    # (a fifth of log 1.01): 0.4.0's asymmetric steps dragged the target to its floor.
    budget = CapabilityBudget(1.01)
    budget.target = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the noise is under half the excess: no warning
        _, targets = _plant(budget, 1e-3, 1e-3, 1.0, 5, 1500, star=star, noise=0.002, seed=seed)
    last_third = targets[-len(targets) // 3 :]
    assert sum(last_third) / len(last_third) == pytest.approx(star, rel=0.2)
    assert budget.model.noise_sd == pytest.approx(0.002, rel=0.3)


def test_a_budget_below_the_noise_warns_once_naming_the_smallest_it_can_hold():
    budget = CapabilityBudget(1.001)
    budget.target = 1.0
    with pytest.warns(RuntimeWarning, match="scatter") as caught:
        _plant(budget, 1e-3, 1e-3, 1.0, 5, 1500, star=2.0, noise=0.002)
    said = [str(w.message) for w in caught if "scatter" in str(w.message)]
    assert len(said) == 1
    smallest = float(said[0].split("can hold is about ")[1].split(" ")[0])
    assert smallest == pytest.approx(math.exp(2 * 0.002), rel=0.002)


def test_a_kl_that_does_not_follow_the_target_down_holds_the_target_and_warns_once():
    # The KL law is stuck at 1.3 nats (PPO's floor on the default world): a budget that keeps
    # lowering the target would wind the law's beta up without end.
    budget = CapabilityBudget(1.15, min_target=0.1)
    ctl = _wired(budget, 1.3)
    targets = []
    with pytest.warns(RuntimeWarning, match="not lowered further") as caught:
        for _ in range(40):
            ctl.n_batches += 5
            ctl.kl_sum += 1.3 * 5
            ctl.kl_count += 5
            targets.append(budget.step(1.25 * REF))  # far over budget, every time
    assert len([w for w in caught if "not lowered" in str(w.message)]) == 1
    # Lowered (by at most max_step a time) until the target passed follow x the KL, then held.
    assert targets[0] < 1.3 and min(targets) == targets[-1]
    assert 1.3 * 0.7 * math.exp(-0.2) <= targets[-1] < 1.3 * 0.7
    assert budget.n_held_low >= 30 and targets[-30:] == [targets[-1]] * 30


def test_mode_max_steers_a_score_that_must_stay_above_budget_times_the_reference():
    budget = CapabilityBudget(0.9, mode="max", reference_key=None, fall_per_batch=1.0)
    budget.model.update = lambda *args: 0.0
    budget.model.loop_gain = lambda n: 1.0
    ctl = _wired(budget, 3.0)
    budget.reference, budget.integral = 1.0, math.log(3.0)
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 5, 15.0, 5
    # A score of 0.8 is below 0.9: its loss log(1/0.8) exceeds the budget's log(1/0.9).
    new = budget.step(0.8)
    e = math.log(math.log(1 / 0.8) / math.log(1 / 0.9))
    share = 1 - math.exp(-5 / 20)
    assert new == pytest.approx(3.0 * math.exp(-0.5 * share * e - 0.5 * e), rel=1e-14)


def test_a_perplexity_drifting_at_a_constant_kl_is_followed_with_a_steady_error():
    # The excess grows as c(t) x KL, c rising by exp(rho) a batch; the KL holds the target.
    # The integral lowers log T by rho a batch at the steady error rho n / (gain share)
    # (docs/budget.md, "When it cannot hold the budget"); the prediction is taken out.
    rho, n = 0.001, 5
    budget = CapabilityBudget(1.15)
    budget.model.update = lambda *args: 0.0
    budget.model.loop_gain = lambda batches: 1.0
    ctl = _wired(budget, 1.5)
    budget.integral = math.log(1.5)
    b = math.log(1.15)
    for k in range(400):  # log T falls by 2 in all, above the floor (0.1)
        target = budget.target
        ctl.n_batches += n
        ctl.kl_sum += target * n
        ctl.kl_count += n
        budget.step(math.exp(b * (target / 1.5) * math.exp(rho * n * k)) * REF)
    error = budget_error(math.log(budget.ratio), b, 0.1)
    assert error == pytest.approx(rho * n / (0.5 * (1 - math.exp(-n / 20))), rel=1e-3)


@pytest.mark.parametrize("metric", [math.nan, math.inf, -1.0, 0.0])
def test_an_unusable_metric_leaves_the_target_and_warns_once(metric):
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 2.0)
    with pytest.warns(RuntimeWarning, match="target stays 2"):
        assert budget.step(metric) == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert budget.step(metric) == 2.0
    ctl.n_batches += 5
    assert budget.n_skipped == 2 and budget.target == 2.0


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"budget": 1.0}, "budget"),
        ({"budget": 0.9}, "budget"),
        ({"budget": 1.2, "mode": "max"}, "budget"),
        ({"mode": "lower"}, "mode"),
        ({"tau": 0.0}, "tau"),
        ({"gain": -1.0}, "gain"),
        ({"fall_per_batch": math.nan}, "fall_per_batch"),
        ({"raise_per_batch": -1.0}, "raise_per_batch"),
        ({"min_target": -1.0}, "min_target"),
        ({"min_target": 2.0, "max_target": 1.0}, "max_target"),
        ({"follow": 1.5}, "follow"),
        ({"error_floor": 1.0}, "error_floor"),
        ({"monitor": ""}, "monitor"),
    ],
)
def test_bad_options_are_refused_naming_the_option(kwargs, option):
    with pytest.raises(ValueError, match=f"`?{option}`? must"):
        CapabilityBudget(**kwargs)


def test_the_fixed_law_is_refused_by_name_with_the_allowed_laws():
    trainer = SimpleNamespace(callbacks=[KLControllerCallback(FixedKLController(0.1))])
    with pytest.raises(ValueError, match=r"`kl.controller` must be one of \('adaptive', "):
        CapabilityBudget().setup(trainer, None, "fit")
    with pytest.raises(ValueError, match="exactly one KLControllerCallback"):
        CapabilityBudget().setup(SimpleNamespace(callbacks=[]), None, "fit")


# ---- a Trainer: a synthetic plant ------------------------------------------------------------


class PlantModule(pl.LightningModule):
    """KL = 1 / beta each batch; held-out perplexity = REF * exp(SLOPE * KL of the last batch).

    Records the target the budget logged after each batch (keyed by the global batch index).
    """

    def __init__(self, n_batches=40, rank_offsets=(0.0, 0.0)):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.kl_coef = 1.0
        self.n_batches = n_batches
        self.rank_offsets = rank_offsets
        self.kl = 0.0
        self.targets: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        self.kl = 1.0 / self.kl_coef
        self.log("objective/kl", self.kl)
        return (self.layer(batch[0]) ** 2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        metrics = self.trainer.callback_metrics
        if "objective/kl_target" in metrics:
            i = self.trainer.fit_loop.epoch_loop.total_batch_idx
            self.targets[i] = float(metrics["objective/kl_target"])

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_epoch_end(self):
        # Under DDP each rank measures its own value; sync_dist averages them.
        ppl = REF * math.exp(SLOPE * self.kl + self.rank_offsets[self.global_rank])
        self.log("val/perplexity", ppl, sync_dist=True)
        self.log("val/perplexity_ref", REF, sync_dist=True)

    def train_dataloader(self):
        data = torch.randn(4 * self.n_batches, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(1, 3)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _callbacks(**budget):
    controller = KLControllerCallback(ExponentialKLController(1.0, target=3.0, k=0.3))
    monitor = KLDriftMonitor(3.0, window=4, verbose=False)
    return [controller, monitor, CapabilityBudget(**{"budget": 1.15, "tau": 5.0, **budget})]


VAL = dict(limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None)


def test_the_cascade_settles_at_the_budget_and_the_monitor_follows_its_target():
    module = PlantModule(n_batches=160)
    callbacks = _callbacks()
    fit(module, callbacks, **VAL)
    controller, monitor, budget = callbacks
    # At equilibrium exp(SLOPE * KL) = 1.15 and the KL law holds KL = target.
    assert budget.target == pytest.approx(math.log(1.15) / SLOPE, rel=0.02)
    assert budget.ratio == pytest.approx(1.15, rel=0.003)
    assert controller.target == monitor.target == budget.target
    assert module.targets[159] == pytest.approx(
        budget.target, rel=1e-3
    )  # logged before the last move
    assert budget.reference == REF and budget.n_skipped == 0


def test_a_resume_continues_the_cascade_bit_for_bit(tmp_path):
    whole = PlantModule(n_batches=24)
    fit(whole, _callbacks(), **VAL)
    first = PlantModule(n_batches=24)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=11, save_top_k=-1)
    fit(first, [*_callbacks(), saver], max_steps=11, **VAL)
    resumed = PlantModule(n_batches=24)
    callbacks = _callbacks()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # restored without a warning
        fit(resumed, callbacks, ckpt_path=str(tmp_path / "epoch=0-step=11.ckpt"), **VAL)
    assert {i: t for i, t in resumed.targets.items() if i >= 11} == {
        i: t for i, t in whole.targets.items() if i >= 11
    }
    assert callbacks[2].target == whole.trainer.callbacks[2].target


def test_a_refresh_of_the_reference_does_not_reset_the_budget():
    budget = CapabilityBudget(1.15)
    trainer = SimpleNamespace(
        callback_metrics={"val/perplexity": torch.tensor(12.0), "val/perplexity_ref": 10.0},
        sanity_checking=False,
        strategy=SimpleNamespace(broadcast=lambda x, src=0: x),
    )
    ctl = _wired(budget, 2.0)
    budget.reference = None
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 5, 10.0, 5
    budget.on_validation_end(trainer, None)
    trainer.callback_metrics["val/perplexity_ref"] = 11.5  # a refreshed reference's
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 10, 20.0, 10
    budget.on_validation_end(trainer, None)
    assert budget.reference == 10.0 and budget.ratio == pytest.approx(1.2)
    state = budget.state_dict()
    again = CapabilityBudget(1.15)
    again.load_state_dict(state)
    assert again.reference == 10.0 and again.target == budget.target


# ---- two real processes (gloo) ------------------------------------------------------------


class RankPlant(PlantModule):
    def __init__(self, out_dir):
        super().__init__(n_batches=20, rank_offsets=(0.02, -0.01))
        self.out_dir = str(out_dir)

    def on_train_end(self):
        budget = next(c for c in self.trainer.callbacks if isinstance(c, CapabilityBudget))
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as f:
            json.dump({"targets": self.targets, "target": budget.target}, f)


def test_two_process_ddp_gives_every_rank_the_same_target(tmp_path):
    fork = "fork" in multiprocessing.get_all_start_methods()
    fit(
        RankPlant(tmp_path),
        _callbacks(),
        strategy="ddp_fork" if fork else "ddp_spawn",
        devices=2,
        use_distributed_sampler=False,
        **VAL,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    # sync_dist averages the ranks' perplexities: a single process with the mean's offset.
    offset = math.log((math.exp(0.02) + math.exp(-0.01)) / 2)
    single = PlantModule(n_batches=20, rank_offsets=(offset,))
    callbacks = _callbacks()
    fit(single, callbacks, **VAL)
    assert ranks[0]["target"] == pytest.approx(callbacks[2].target, rel=1e-6)
    assert ranks[0]["target"] != pytest.approx(3.0, rel=1e-3)  # it moved


def test_logpid_law_with_a_budget_runs_and_logs_the_target():
    module = PlantModule(n_batches=12)
    controller = KLControllerCallback(LogPIDKLController(1.0, target=3.0))
    budget = CapabilityBudget(1.15)
    fit(module, [controller, budget], **VAL)
    assert len(module.targets) == 12 and budget.n_evaluations == 6


# ---- what a run is told (issue 47, item 5) --------------------------------------------------


def test_a_lowering_held_under_budget_says_within_budget_not_over():
    # The integral sits below the target (it remembers an earlier excess): under budget the
    # loop would still lower the target, and the KL law holds the KL above target / follow.
    # (In a run the prediction alone can make it so: 1.135 measured, more to come.)
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 2.0)
    budget.integral = math.log(2.0) - 1.0
    ctl.n_batches, ctl.kl_sum, ctl.kl_count = 5, 3.5 * 5, 5
    with pytest.warns(RuntimeWarning, match="not lowered further") as caught:
        assert budget.step(1.145 * REF) == 2.0
    (message,) = [str(w.message) for w in caught]
    assert "is within budget (1.145 x the reference's, budget 1.15; " in message
    assert "over budget" not in message


def _setup_trainer(*extra, limit_val_batches=1.0, heldout="default:validation"):
    controller = KLControllerCallback(ExponentialKLController(1.0, target=3.0))
    data = SimpleNamespace(hparams={"heldout": heldout})
    return SimpleNamespace(
        callbacks=[controller, *extra], limit_val_batches=limit_val_batches, datamodule=data
    )


@pytest.mark.parametrize(
    ("settings", "option"),
    [
        ({"limit_val_batches": 0}, "`trainer.limit_val_batches` must be > 0"),
        ({"limit_val_batches": 0.0}, "`trainer.limit_val_batches` must be > 0"),
        ({"heldout": None}, "`data.init_args.heldout` must name the held-out text"),
    ],
)
def test_a_run_without_validation_is_refused_at_set_up_naming_the_option(settings, option):
    with pytest.raises(ValueError, match=re.escape(option)) as info:
        CapabilityBudget().setup(_setup_trainer(**settings), None, "fit")
    assert "\n" not in str(info.value)


def test_a_run_shorter_than_its_validation_interval_is_refused_after_its_first_batch():
    module = PlantModule(n_batches=8)
    with pytest.raises(ValueError, match=r"`trainer.val_check_interval` must be at most the "):
        fit(
            module,
            _callbacks(),
            limit_val_batches=1,
            val_check_interval=10,
            check_val_every_n_epoch=None,
        )
    # A run of the interval's length is one evaluation, and is accepted.
    callbacks = _callbacks()
    fit(
        PlantModule(n_batches=8),
        callbacks,
        limit_val_batches=1,
        val_check_interval=8,
        check_val_every_n_epoch=None,
    )
    assert callbacks[2].n_evaluations == 1


def test_with_a_reference_refresh_the_set_up_says_which_reference_the_ratio_is_against(caplog):
    from rlkl_lightning import ReferenceRefresh

    with caplog.at_level("INFO"):
        CapabilityBudget().setup(_setup_trainer(ReferenceRefresh(every=10)), None, "fit")
    (said,) = [r.getMessage() for r in caplog.records if "CapabilityBudget" in r.getMessage()]
    assert "the ratio stays against the initial reference's value" in said


def test_the_end_of_a_run_prints_one_summary_line(caplog):
    module = PlantModule(n_batches=40)
    callbacks = _callbacks()
    with caplog.at_level("INFO"):
        fit(module, callbacks, **VAL)
    budget = callbacks[2]
    lines = [r.getMessage() for r in caplog.records if "evaluations skipped" in r.getMessage()]
    assert lines == [budget.summary()]
    assert 0 < budget.n_in_band < budget.n_evaluations == 20
    share = f"{budget.n_in_band / 20:.0%}"
    assert lines[0] == (
        f"CapabilityBudget: {budget.n_in_band} of 20 evaluations ({share}) with the ratio in "
        f"the band [1.12, 1.18] (budget 1.15 +- 20% of its excess); final target "
        f"{budget.target:.4g}; beta at a bound in {callbacks[0].n_at_bound} of 40 batches; "
        "0 evaluations skipped."
    )


def test_a_resume_says_once_which_target_is_in_force_and_the_monitor_takes_it(tmp_path, caplog):
    first = PlantModule(n_batches=24)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=11, save_top_k=-1)
    fit(first, [*_callbacks(), saver], max_steps=11, **VAL)
    saved = first.trainer.callbacks[2].target
    # Another configured target (--resume_with_changes): the budget's is the one in force.
    controller = KLControllerCallback(ExponentialKLController(1.0, target=1.0, k=0.3))
    monitor = KLDriftMonitor(1.0, window=4, verbose=False)
    budget = CapabilityBudget(budget=1.15)
    resumed = PlantModule(n_batches=12)
    with warnings.catch_warnings(), caplog.at_level("INFO"):
        warnings.simplefilter("error", RuntimeWarning)  # no "judged against 1" from the monitor
        fit(
            resumed,
            [controller, monitor, budget],
            ckpt_path=str(tmp_path / "epoch=0-step=11.ckpt"),
            max_steps=12,
            **VAL,
        )
    said = [r.getMessage() for r in caplog.records if "target in force" in r.getMessage()]
    assert said == [
        f"CapabilityBudget: resumed; the KL target in force is {saved:.4g} (the budget's, from "
        "the checkpoint; `kl.target` 1 only starts a run)."
    ]
    assert resumed.targets[11] == pytest.approx(saved, rel=1e-7)  # logged as float32
    assert controller.target == monitor.target == budget.target


@pytest.mark.parametrize("ratio", [1.05, 1.0])
def test_while_the_kl_lags_the_target_does_not_rise_by_any_term(ratio):
    # The review's reproduction: a KL stuck at 1 nat, the ratio under budget. The integral was
    # held, but the proportional term raised the target by max_raise every validation: to
    # 4.27 nats at a ratio of 1.05 and 14.9 at 1.0 after 60 validations.
    budget = CapabilityBudget(1.15)
    ctl = _wired(budget, 1.0)
    budget.integral = 0.0
    targets = [1.0]
    for _ in range(60):
        ctl.n_batches += 5
        ctl.kl_sum += 1.0 * 5
        ctl.kl_count += 5
        targets.append(budget.step(ratio * REF))
    for before, after in zip(targets, targets[1:]):
        if 1.0 < 0.7 * before:  # the KL has not reached follow x the target
            assert after <= before
    assert max(targets) < math.exp(0.05) / 0.7  # a rise stops once past KL / follow
    assert targets[-20:] == [targets[-1]] * 20 and budget.n_held >= 50


def test_the_docstring_gives_each_options_default_where_it_names_a_value():
    # 0.4.0's `rate` docstring gave 0.3.0's value (gain / 80 batches) after the default
    # had become 0.1.
    import inspect

    doc = inspect.getdoc(CapabilityBudget)
    defaults = inspect.signature(CapabilityBudget).parameters
    entries = re.split(r"\n    (?=\w+: )", doc.split("Args:")[1])
    named = {}
    for entry in entries:
        name, _, text = entry.strip().partition(": ")
        found = re.search(r"\((\d+(?:\.\d+)?): ", text)
        if found:
            named[name] = float(found.group(1))
    assert set(named) == {"raise_per_batch", "fall_per_batch"}
    for name, value in named.items():
        assert value == defaults[name].default, name


def _fast_plant_leads(lags: tuple[float, ...] | None = None) -> list[float]:
    """The model's lead at each evaluation of a plant whose excess follows the KL within batches.

    The default world's shape (a real ppo_budget run): the KL overshoots at start-up (2.1 nats at
    batch 14 against a target of 1) and settles near 1; the log excess follows a 3-batch lag of
    log KL with elasticity 0.7.
    """
    from rlkl_lightning.kl import budget_model

    if lags is not None:
        saved, budget_model.LAGS = budget_model.LAGS, lags
    try:
        model, leads, s = budget_model.ExcessModel(), [], None
        rng = random.Random(0)
        for evaluation in range(30):
            kls = []
            for batch in range(5 * evaluation, 5 * evaluation + 5):
                kl = 0.25 if batch < 5 else 1.7 if batch < 10 else 2.1 if batch < 15 else 1.0
                kl *= math.exp(rng.gauss(0.0, 0.1))
                s = math.log(kl) if s is None else s + (1 - math.exp(-1 / 3)) * (math.log(kl) - s)
                kls.append(kl)
            excess = 0.13 * math.exp(0.7 * s)  # log of the perplexity ratio
            log_kl = math.log(sum(kls) / len(kls))
            leads.append(model.update(log_kl, 5, excess, 0.1 * math.log(1.15)))
    finally:
        if lags is not None:
            budget_model.LAGS = saved
    return leads


def test_a_fast_plant_after_a_start_up_overshoot_predicts_no_rise_that_never_comes():
    # A bank of 50-200-batch lags alone read the start-up's low KL as a rise still to come
    # (lead 0.3-1, the prediction 1.4x against a measured 1.13x) for a hundred batches, and the
    # budget lowered the target under budget; the 10-batch lag explains the plant.
    leads = _fast_plant_leads()
    assert max(leads[8:]) < 0.05  # from batch 40 on
    assert max(_fast_plant_leads((50.0, 100.0, 200.0))[8:20]) > 0.2  # without it: a lead


def test_a_bank_saved_with_the_older_lags_loads_into_the_new_one():
    from rlkl_lightning.kl.budget_model import LAGS, ExcessModel

    old = {  # 0.6.0-0.7.0's state: lags 50, 100, 200, no "lags" key
        "now": 0.1,
        "seen": [-0.5, -0.7, -0.9],
        "fits": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]],
        "log_excess": -2.0,
        "excess": 0.13,
        "noise": [0.01, 3.0],
        "n_noise": 3,
    }
    model = ExcessModel()
    model.load_state_dict(old)
    assert LAGS == (10.0, 50.0, 100.0, 200.0)
    assert model.seen == [0.1, -0.5, -0.7, -0.9]  # the new lag starts at the KL of now
    assert model.fits == [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    again = ExcessModel()
    again.load_state_dict(model.state_dict())
    assert again.state_dict() == model.state_dict()
