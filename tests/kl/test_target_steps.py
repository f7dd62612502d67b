"""The public KL target: what a step of the target does to each law, and to the callback."""

from __future__ import annotations

import copy
import math

import pytest

from rlkl_lightning.kl.controller_callback import KLControllerCallback
from rlkl_lightning.kl.controllers import (
    AdaptiveKLController,
    ExponentialKLController,
    FixedKLController,
    LogPIDKLController,
    PIKLController,
)

OLD, NEW = 6.0, 3.0
# Above the log-PID floor (0.3 x target) under both targets, and away from the zero-KL start.
KLS = [2.5, 4.0, 7.5, 6.5, 5.0, 8.0, 3.5, 6.0]
LAWS = {
    "adaptive": lambda t: AdaptiveKLController(0.1, target=t, horizon=1000),
    "exponential": lambda t: ExponentialKLController(0.1, target=t, k=0.05),
    "pi": lambda t: PIKLController(0.1, target=t, kp=0.3, ki=0.05, min_kl_coef=1e-3),
    "logpid": lambda t: LogPIDKLController(0.1, target=t, min_kl_coef=1e-3),
}


def _run(ctl, kls, n=32):
    for kl in kls:
        ctl.update(kl, n)
    return ctl


@pytest.mark.parametrize("law", LAWS)
def test_a_step_of_the_target_leaves_beta_until_the_next_update(law):
    ctl = _run(LAWS[law](OLD), KLS[:4])
    beta = ctl.value
    ctl.set_target(NEW)
    assert ctl.target == NEW
    assert ctl.value == beta  # the step itself moves nothing


@pytest.mark.parametrize("law", ["adaptive", "exponential", "pi"])
def test_laws_without_target_state_continue_as_a_law_with_the_new_target_and_the_same_state(law):
    # Adaptive and exponential keep beta, PI keeps its integral: after the step each continues
    # exactly as a controller built with the new target and loaded with that state.
    moved = _run(LAWS[law](OLD), KLS[:4])
    same_state = LAWS[law](NEW)
    same_state.load_state_dict(moved.state_dict())
    moved.set_target(NEW)
    assert moved.state_dict() == same_state.state_dict()
    for kl in KLS[4:]:
        assert moved.update(kl, 32) == same_state.update(kl, 32)


def test_pi_keeps_its_integral_and_kicks_by_kp_times_the_change_of_the_error():
    ctl = _run(LAWS["pi"](OLD), KLS[:4])
    z = ctl.integral
    ctl.set_target(NEW)
    assert ctl.integral == z
    kl = 5.0
    error = min(max((kl - NEW) / NEW, -1.0), 1.0)  # error_clip 1
    expected = math.exp(z + 0.05 * error + 0.3 * error)
    assert ctl.update(kl, 32) == pytest.approx(expected, rel=1e-14)


def test_logpid_shifts_its_smoothed_error_to_what_the_new_target_would_have_given():
    # m is a smoothed log KL minus log target: a law that saw the same KLs under the new target
    # all along has m shifted by -log(NEW / OLD) and the same trend; the integral is kept.
    # Both start from the same reading of "no KL yet" (floor x OLD), expressed in each target.
    old = _run(LAWS["logpid"](OLD), KLS[:5])
    always_new = LAWS["logpid"](NEW)
    always_new.log_error = math.log(LogPIDKLController.floor) - math.log(NEW / OLD)
    _run(always_new, KLS[:5])
    z, trend = old.integral, old.trend
    old.set_target(NEW)
    assert old.log_error == pytest.approx(always_new.log_error, abs=1e-14)
    assert old.trend == pytest.approx(always_new.trend, abs=1e-14)
    assert old.integral == z and old.trend == trend


def test_logpid_before_its_start_keeps_the_floor_reading():
    ctl = LAWS["logpid"](OLD)
    ctl.update(0.0, 32)  # the policy is still its reference: not started
    before = ctl.state_dict()
    ctl.set_target(NEW)
    assert ctl.state_dict() == before  # a KL of 0 reads as the floor under any target


def test_the_fixed_law_has_no_target_and_refuses_by_name():
    ctl = FixedKLController(0.1)
    laws = r"\('adaptive', 'exponential', 'pi', 'logpid'\)"  # from the registry
    with pytest.raises(ValueError, match=rf"`kl.controller` one of {laws}"):
        ctl.set_target(3.0)
    callback = KLControllerCallback(ctl)
    assert callback.target is None
    with pytest.raises(ValueError, match="fixed law has no target"):
        callback.target = 3.0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "3"])
@pytest.mark.parametrize("law", LAWS)
def test_a_bad_target_raises_naming_it_and_changes_nothing(law, bad):
    ctl = _run(LAWS[law](OLD), KLS[:3])
    before = ctl.state_dict()
    with pytest.raises(ValueError, match="`target` must be a finite number > 0"):
        ctl.set_target(bad)
    assert ctl.target == OLD and ctl.state_dict() == before


class PluggedLaw:
    """A user's law with a ``target`` attribute and no ``set_target``."""

    def __init__(self, target):
        self.target, self.value = target, 0.1

    def update(self, kl, n):
        self.value *= 1.1 if kl > self.target else 0.9
        return self.value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_plugged_law_with_a_target_attribute_takes_the_new_target():
    callback = KLControllerCallback(PluggedLaw(OLD))
    callback.set_target(NEW)
    assert callback.controller.target == NEW
    with pytest.raises(ValueError, match="`target` must be a finite number > 0"):
        callback.set_target(-2.0)


@pytest.mark.parametrize("law", LAWS)
def test_the_callback_uses_the_new_target_from_the_next_update_and_checkpoints_it(law):
    callback = KLControllerCallback(LAWS[law](OLD))
    reference = LAWS[law](OLD)
    for kl in KLS[:3]:
        callback.on_kl(None, None, kl, 32)
        reference.update(kl, 32)
    callback.target = NEW
    reference.set_target(NEW)
    saved = copy.deepcopy(callback.state_dict())
    for kl in KLS[3:]:
        callback.on_kl(None, None, kl, 32)
        reference.update(kl, 32)
        assert callback.value == reference.value
    assert callback.kl_count == len(KLS) and callback.kl_sum == pytest.approx(sum(KLS))
    # A resume with the run's configuration (target OLD) continues at the moved target.
    resumed = KLControllerCallback(LAWS[law](OLD))
    resumed.load_state_dict(saved)
    assert resumed.target == NEW
    for kl in KLS[3:]:
        resumed.on_kl(None, None, kl, 32)
    assert resumed.value == callback.value


def test_a_resume_with_a_changed_target_steps_from_the_saved_one():
    callback = KLControllerCallback(LAWS["logpid"](OLD))
    for kl in KLS[:4]:
        callback.on_kl(None, None, kl, 32)
    saved = copy.deepcopy(callback.state_dict())
    stepped = copy.deepcopy(callback.controller)
    stepped.set_target(4.0)
    changed = KLControllerCallback(LAWS["logpid"](4.0))  # --resume_with_changes kl.target=4
    changed.load_state_dict(saved)
    assert changed.target == 4.0
    assert changed.controller.state_dict() == stepped.state_dict()
