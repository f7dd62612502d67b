"""scripts/law_gains.py: the plant fit and the SIMC gains of configs/ppo_exponential.yaml and
configs/ppo_pi.yaml."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from rlkl_lightning.config_files import compose

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("law_gains", ROOT / "scripts" / "law_gains.py")
law_gains = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(law_gains)


def test_the_lag_fit_recovers_a_noiseless_lag_after_a_dead_time():
    t = np.arange(1, 151)
    kl = 4.0 * np.clip(1 - np.exp(-(t - 5.0) / 11.5), 0, None)
    level, tau, theta = law_gains.fit_lag(kl)
    assert (tau, theta) == (11.5, 5.0)
    assert level == pytest.approx(4.0, rel=1e-12)


def test_the_gains_put_the_loop_crossover_where_simc_asks():
    """A second computation: the open loop |L(i w)| is 1 at w = 1 / (tau_c + delay)."""
    g, tau, theta, target = 4.2, 11.5, 5.0, 6.0
    found = law_gains.gains(g, tau, theta, target)
    assert found["tau_c"] == theta + tau
    # PI on e = (KL - target) / target, with the plant g e^{-theta s} / (tau s + 1):
    w = 1 / (found["tau_c"] + theta)
    s = 1j * w
    pi = (found["kp"] + found["ki"] / s) / target  # log beta per nat
    assert abs(pi * g * np.exp(-theta * s) / (tau * s + 1)) == pytest.approx(1.0, rel=1e-12)
    # Integral-only (exponential law), the lag taken as a delay of theta + tau:
    w = 1 / (found["tau_c"] + theta + tau)
    assert abs(found["k"] / (1j * w) * g) == pytest.approx(1.0, rel=1e-12)


def test_the_law_configs_hold_the_derived_gains():
    """The measured plant (calibration seed 10, README) gives the configs' gains, to 2 digits."""
    found = law_gains.gains(g=4.19, tau=11.5, theta=5)
    exponential, pi = (  # the law's arguments
        compose(ROOT / "configs" / f"ppo_{law}.yaml")["kl"]["controller"]["init_args"]
        for law in ("exponential", "pi")
    )
    assert exponential["k"] == float(f"{found['k']:.2g}")
    assert (pi["kp"], pi["ki"]) == (float(f"{found['kp']:.2g}"), float(f"{found['ki']:.2g}"))


def test_the_model_levels_where_the_fit_says_and_the_integral_laws_reach_the_target():
    from rlkl_lightning.kl.controllers import (
        ExponentialKLController,
        FixedKLController,
        PIKLController,
    )

    model = {"level": 3.87, "g": 4.19, "tau": 11.5, "theta": 5, "seed": 0, "noise": 0.0}
    kl = law_gains.simulate(FixedKLController(0.03), batches=400, **model)
    assert kl[-1] == pytest.approx(3.87 - 4.19 * np.log(0.3), rel=1e-9)  # the level at 0.03
    for law in (ExponentialKLController(0.1, 6.0, k=0.0072), PIKLController(0.1, 6.0, 0.77, 0.067)):
        kl = law_gains.simulate(law, batches=400, **model)
        assert kl[-1] == pytest.approx(6.0, rel=1e-6)  # no steady-state error
        assert law.value == pytest.approx(0.1 * np.exp(-(6.0 - 3.87) / 4.19), rel=1e-6)
