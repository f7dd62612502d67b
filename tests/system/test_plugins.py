"""The plug-in path: a user's own estimator, law and advantage, named in train.py's options.

A package written in ``tmp_path`` (outside ``rlkl_lightning/``) holds ``k4``, the plain squared
log-ratio ``l**2``, and ``ScaledSquare``, that with a ``scale`` argument; a trivial law that
halves beta when the KL is above target and doubles it below, and ``SteppingLaw``, a
:class:`~rlkl_lightning.KLLaw` whose step factor is its argument; and ``ShiftedAdvantage``, a
group advantage whose shift is its argument. Each trains two batches of
``configs/ppo_adaptive.yaml`` (or ``configs/rloo_adaptive.yaml``) through ``train.py`` in a
subprocess whose ``PYTHONPATH`` includes ``tmp_path``, the arguments set in a YAML composed over
the shipped one; the logged scalars show that the plugged code ran with its argument, and the
checkpoint holds the argument. No package file changes.
"""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import yaml
from helpers.cli_runs import ROOT, train_py

pytestmark = pytest.mark.slow  # train.py processes: make test-slow

PLUGINS = '''
"""A user's own KL estimator and control law."""

import json
import math

from rlkl_lightning.kl.controllers import KLLaw
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


class ScaledSquare(Estimator):
    # scale * l**2, an estimator with an argument, logged as objective/kl_scaled_square
    def __init__(self, scale=1.0):
        super().__init__("scaled_square", lambda log_ratio: scale * log_ratio.square())


class SteppingLaw(KLLaw):
    # beta times `factor` above the target, divided by it below; KLLaw keeps the bounds
    law = "stepping"

    def __init__(
        self,
        init_kl_coef: float,
        target: float,
        factor: float = 2.0,
        min_kl_coef: float = 1e-3,
        max_kl_coef: float = 10.0,
    ):  # typed: the parser reads a component's arguments from its signature
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        self.target, self.factor = target, factor

    def step(self, kl, n_steps):
        return self.value * (self.factor if kl > self.target else 1.0 / self.factor)


class ShiftedAdvantage:
    # RLOO's advantages minus `shift`; each call appends the shift it used to `record`
    def __init__(self, shift=0.0, record=""):
        from rlkl_lightning.algorithms.advantage_estimators import ADVANTAGES

        self.rloo, self.shift, self.record = ADVANTAGES["group"]["rloo"], shift, record

    def __call__(self, traj, kl_coef, options, global_sum):
        traj = self.rloo(traj, kl_coef, options, global_sum)
        with open(self.record, "a") as out:
            out.write(json.dumps(self.shift) + "\\n")
        return traj._replace(advantages=(traj.advantages - self.shift) * traj.response_mask)
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


def _train(plugins, tiny_lm_dir, name: str, *extra: str, config: str = "ppo_adaptive"):
    """Two batches of configs/CONFIG.yaml on the tiny model: every scalar in batch order, the
    module's hyperparameters and the last checkpoint (opened with ``weights_only=True``)."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prompts = plugins / "prompts.txt"
    prompts.write_text("\n".join(["the film was", "this book is", "the food", "a story"] * 4))
    runs = plugins / "runs" / name
    code, out = train_py(
        ["fit", "--config", f"configs/{config}.yaml"]
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
    (version,) = (runs / config).glob("version_*")
    events = EventAccumulator(str(version), size_guidance={"scalars": 0})
    events.Reload()
    logged = {
        tag: [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]
        for tag in events.Tags()["scalars"]
    }
    hparams = yaml.safe_load((version / "hparams.yaml").read_text())
    checkpoint = torch.load(version / "checkpoints" / "last.ckpt", weights_only=True)
    return logged, hparams, checkpoint


def _yaml(plugins, name: str, settings: dict) -> str:
    """A config file of ``settings`` beside the plugins, composed over the shipped one."""
    path = plugins / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


def test_a_plugged_law_sets_beta(plugins, tiny_lm_dir):
    logged, hparams, _ = _train(
        plugins, tiny_lm_dir, "law", "--kl.controller", "myplugins.HalvingLaw"
    )
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
    logged, _, _ = _train(
        plugins, tiny_lm_dir, "k4", "--model.init_args.penalty.estimator", "myplugins.k4_estimator"
    )
    # Every registered estimator is logged beside the measured one, on the same samples:
    # k4 = l**2 is twice k2 = l**2 / 2, and unlike k1.
    for kl, k2 in zip(logged["objective/kl"], logged["objective/kl_k2"], strict=True):
        assert kl == pytest.approx(2 * k2, rel=1e-5, abs=1e-7)
        assert kl >= 0 and math.isfinite(kl)
    kl, k1 = logged["objective/kl"][-1], logged["objective/kl_k1"][-1]
    assert kl > 0 and kl != k1  # after one update the policy has moved


def test_a_plugged_law_takes_its_gain_from_the_yaml_into_the_checkpoint(plugins, tiny_lm_dir):
    law = {"class_path": "myplugins.SteppingLaw", "init_args": {"factor": 4.0}}
    config = _yaml(plugins, "stepping", {"kl": {"controller": law}})
    logged, _, checkpoint = _train(plugins, tiny_lm_dir, "stepping", "--config", config)
    kls, betas = logged["objective/kl"], logged["objective/kl_coef"]
    assert len(kls) == len(betas) == 2
    factor = 4.0 if kls[1] > 6.0 else 0.25  # the gain set in the YAML, not the default 2
    assert betas[1] == pytest.approx(min(max(betas[0] * factor, 1e-3), 10.0), rel=1e-9)
    settings = checkpoint["callbacks"]["RunSettings"]["settings"]
    assert settings["kl.controller.class_path"] == "'myplugins.SteppingLaw'"
    assert settings["kl.controller.init_args.factor"] == "4.0"
    controller = next(v for k, v in checkpoint["callbacks"].items() if "KLControllerCallback" in k)
    assert controller["controller"]["law"] == "stepping"


def test_a_plugged_estimator_takes_its_argument_and_is_logged_by_name(plugins, tiny_lm_dir):
    estimator = {"class_path": "myplugins.ScaledSquare", "init_args": {"scale": 3.0}}
    config = _yaml(
        plugins, "scaled", {"model": {"init_args": {"penalty": {"estimator": estimator}}}}
    )
    logged, hparams, checkpoint = _train(plugins, tiny_lm_dir, "scaled", "--config", config)
    for kl, own, k2 in zip(
        logged["objective/kl"],
        logged["objective/kl_scaled_square"],
        logged["objective/kl_k2"],
        strict=True,
    ):
        assert kl == own == pytest.approx(6 * k2, rel=1e-5, abs=1e-7)  # 3 l**2 = 6 k2
    assert hparams["penalty"]["estimator"] == estimator
    assert checkpoint["hyper_parameters"]["penalty"]["estimator"] == estimator


def test_a_plugged_advantage_takes_its_argument_into_the_checkpoint(plugins, tiny_lm_dir):
    record = plugins / "advantage_calls.jsonl"
    advantage = {
        "class_path": "myplugins.ShiftedAdvantage",
        "init_args": {"shift": 0.5, "record": str(record)},
    }
    config = _yaml(
        plugins, "shifted", {"model": {"init_args": {"group": {"advantage": advantage}}}}
    )
    _, _, checkpoint = _train(
        plugins, tiny_lm_dir, "shifted", "--config", config, config="rloo_adaptive"
    )
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls == [0.5, 0.5]  # one per batch, with the YAML's shift
    assert checkpoint["hyper_parameters"]["group"]["advantage"] == advantage
