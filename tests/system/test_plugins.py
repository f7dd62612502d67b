"""The plug-in path: a user's own estimator and law, named in train.py's options, no package edit.

A package written in ``tmp_path`` (outside ``rlkl_lightning/``) holds ``k4``, the plain squared
log-ratio ``l**2``, and a trivial law that halves beta when the KL is above target and doubles
it below, within bounds. Each trains two batches of ``configs/ppo_adaptive.yaml`` through
``train.py`` in a subprocess whose ``PYTHONPATH`` includes ``tmp_path``; the logged scalars show
that the plugged code ran.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import yaml
from helpers.cli_runs import ROOT, train_py

pytestmark = pytest.mark.slow  # train.py processes: make test-slow

PLUGINS = '''
"""A user's own KL estimator and control law."""

import math

from rlkl_lightning.kl.estimators import Estimator


def squared_log_ratio(log_ratio):
    return log_ratio.square()


# k4 = l**2: twice k2; not declared as a loss term.
k4_estimator = Estimator("k4", squared_log_ratio, loss=False)


class HalvingLaw:
    """Beta halves when the KL is above target, doubles when below, within bounds."""

    def __init__(self, init_kl_coef, target, min_kl_coef=1e-3, max_kl_coef=10.0):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.min_kl_coef, self.max_kl_coef = min_kl_coef, max_kl_coef

    def update(self, current_kl, n_steps):
        if n_steps > 0 and math.isfinite(current_kl):
            factor = 0.5 if current_kl > self.target else 2.0
            self.value = min(max(self.value * factor, self.min_kl_coef), self.max_kl_coef)
        return self.value

    def state_dict(self):
        return {"law": "halving", "value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])
'''


@pytest.fixture
def plugins(tmp_path):
    """``tmp_path`` holding the package ``myplugins``: the directory to put on PYTHONPATH."""
    package = tmp_path / "myplugins"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(PLUGINS))
    return tmp_path


def _find(tree, key: str):
    """The first value of ``key`` anywhere in a nested dict (None if absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            if (found := _find(value, key)) is not None:
                return found
    return None


def _train(plugins, tiny_lm_dir, name: str, *extra: str):
    """Two batches of configs/ppo_adaptive.yaml on the tiny model: every scalar in batch order,
    and the module's hyperparameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prompts = plugins / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"] * 4))
    runs = plugins / "runs" / name
    code, out = train_py(
        ["fit", "--config", "configs/ppo_adaptive.yaml"]
        + [
            f"--model.init_args.policy={tiny_lm_dir}",
            "--model.init_args.sampling.max_prompt_tokens=8",
        ]
        + ["--model.init_args.sampling.max_new_tokens=6"]
        + ["--model.init_args.logging.log_samples_every=0"]
        + [f"--data.init_args.prompts={prompts}", "--data.init_args.heldout=null"]
        + ["--data.init_args.batch_size=4"]
        + ["--trainer.max_steps", "32", "--trainer.limit_val_batches", "0"]
        + ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
        + [f"--trainer.logger.init_args.save_dir={runs}"]
        + list(extra),
        env={"PYTHONPATH": f"{ROOT}:{plugins}"},
        timeout=300,
    )
    assert code == 0, out[-4000:]
    (version,) = (runs / "ppo_adaptive").glob("version_*")
    events = EventAccumulator(str(version), size_guidance={"scalars": 0})
    events.Reload()
    logged = {
        tag: [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]
        for tag in events.Tags()["scalars"]
    }
    return logged, yaml.safe_load((version / "hparams.yaml").read_text())


def test_a_plugged_law_sets_beta(plugins, tiny_lm_dir):
    logged, hparams = _train(plugins, tiny_lm_dir, "law", "--kl.controller", "myplugins.HalvingLaw")
    kls, betas = logged["objective/kl"], logged["objective/kl_coef"]
    assert len(kls) == len(betas) == 2  # two batches, beta logged after each update
    target = 6.0  # configs/ppo_adaptive.yaml
    before = [_find(hparams, "init_kl_coef"), *betas[:-1]]  # the beta each batch used
    for beta, kl, after in zip(before, kls, betas, strict=True):
        factor = 0.5 if kl > target else 2.0  # the plugged law; the adaptive one moves < 1%
        if beta is not None:
            assert after == pytest.approx(min(max(beta * factor, 1e-3), 10.0), rel=1e-6)
        if kl != 0.0:  # the penalty used that beta: non_score_reward = -beta * kl
            used = -logged["objective/non_score_reward"][kls.index(kl)] / kl
            assert used == pytest.approx(after / factor, rel=1e-4)
    assert betas[1] / betas[0] in (pytest.approx(0.5), pytest.approx(2.0))


def test_a_plugged_estimator_is_the_measured_kl(plugins, tiny_lm_dir):
    logged, _ = _train(
        plugins, tiny_lm_dir, "k4", "--model.init_args.penalty.estimator", "myplugins.k4_estimator"
    )
    # Every registered estimator is logged beside the measured one, on the same samples:
    # k4 = l**2 is twice k2 = l**2 / 2, and unlike k1.
    for kl, k2 in zip(logged["objective/kl"], logged["objective/kl_k2"], strict=True):
        assert kl == pytest.approx(2 * k2, rel=1e-5, abs=1e-7)
        assert kl >= 0 and math.isfinite(kl)
    kl, k1 = logged["objective/kl"][-1], logged["objective/kl_k1"][-1]
    assert kl > 0 and kl != k1  # after one update the policy has moved
