"""The registries of KL estimators and control laws: names, dotted paths, errors, docs."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlkl_lightning.kl import estimators as est
from rlkl_lightning.kl.controllers import KL_LAWS, AdaptiveKLController
from rlkl_lightning.kl.estimators import (
    ESTIMATORS,
    KL_ESTIMATORS,
    Estimator,
    estimator_names,
    kl_estimator,
    per_token_kl,
    register_estimator,
    sample_estimators,
)
from rlkl_lightning.kl.laws import LAWS, Law, build_controller, control_law, law_names
from rlkl_lightning.kl.loss import KL_LOSS_ESTIMATORS, kl_loss
from rlkl_lightning.kl.settings import KLSettings

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
import torch

from rlkl_lightning.kl.estimators import Estimator
from rlkl_lightning.kl.laws import Law


def _square(log_ratio):
    return log_ratio.square()


k4 = Estimator("k4", _square, loss=False)
k4_loss = Estimator("k4", _square, loss=True)
needs_logits = Estimator("mine", None, loss=False)
not_an_estimator = 3


class Halving:
    def __init__(self, init_kl_coef, target, min_kl_coef=1e-3, max_kl_coef=10.0):
        self.value, self.target = init_kl_coef, target
        self.bounds = (min_kl_coef, max_kl_coef)

    def update(self, current_kl, n_steps):
        self.value *= 0.5 if current_kl > self.target else 2.0
        return self.value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class NoState:
    def __init__(self, init_kl_coef, target):
        self.value = init_kl_coef

    def update(self, current_kl, n_steps):
        return self.value


def halving_law(settings, init_kl_coef, **bounds):
    return Halving(init_kl_coef, settings.target * settings.horizon, **bounds)


law = Law("halving_law", halving_law)
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A user's module ``user_kl`` outside the package, importable by dotted path."""
    (tmp_path / "user_kl.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_kl"
    sys.modules.pop("user_kl", None)


# --------------------------------------------------------------------------------------------
# estimators


def test_the_registered_estimators_and_the_derived_tuples():
    assert KL_ESTIMATORS == estimator_names() == ("k1", "k2", "k3", "exact")
    assert set(ESTIMATORS) == set(KL_ESTIMATORS)
    assert KL_LOSS_ESTIMATORS == estimator_names("loss") == ("k1", "k2", "k3")
    assert estimator_names("reward") == KL_ESTIMATORS
    assert list(sample_estimators()) == ["k1", "k2", "k3"]  # exact needs the logits
    assert ESTIMATORS["exact"].needs_logits and not ESTIMATORS["exact"].loss
    for name in ("k1", "k2", "k3"):
        found = kl_estimator(name)
        assert found is ESTIMATORS[name] and found.name == name and found.loss


def test_an_unknown_estimator_names_the_option_and_lists_the_registered_ones():
    with pytest.raises(ValueError) as info:
        kl_estimator("k9", "model.init_args.penalty.estimator")
    message = str(info.value)
    assert (
        "`model.init_args.penalty.estimator` must be one of ('k1', 'k2', 'k3', 'exact')" in message
    )
    assert "got 'k9'" in message and "dotted path" in message
    with pytest.raises(
        ValueError, match=r"`penalty.loss_estimator` must be one of \('k1', 'k2', 'k3'\)"
    ):
        kl_estimator("exact", "penalty.loss_estimator", role="loss")


def test_a_dotted_path_resolves_to_the_users_estimator(user):
    found = kl_estimator(f"{user}.k4")
    assert found.name == "k4" and found.formula is not None and not found.loss
    lp, lq = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.equal(per_token_kl(lp, lq, f"{user}.k4"), (lp - lq).square())
    assert torch.equal(per_token_kl(lp, lq, found), (lp - lq).square())
    # Computed beside the registered ones, under the option string the pipeline looks up.
    assert list(sample_estimators("k1", "exact", f"{user}.k4")) == ["k1", "k2", "k3", f"{user}.k4"]


def test_a_plugged_estimator_is_refused_where_it_does_not_fit(user):
    with pytest.raises(ValueError, match=r"`penalty.loss_estimator`: estimator 'k4'.*loss=False"):
        kl_estimator(f"{user}.k4", "penalty.loss_estimator", role="loss")
    with pytest.raises(ValueError, match=r"needs the full logits.*cannot be plugged"):
        kl_estimator(f"{user}.needs_logits")
    with pytest.raises(
        ValueError,
        match=r"`penalty.estimator` = .user_kl.not_an_estimator. must be an .*Estimator, got int 3",
    ):
        kl_estimator(f"{user}.not_an_estimator")
    with pytest.raises(ValueError, match=r"`penalty.estimator` must be one of .*does not import"):
        kl_estimator(f"{user}.missing")
    with pytest.raises(ValueError, match=r"does not import"):
        kl_estimator("no_such_package_xyz.k4")


def test_a_plugged_loss_estimator_is_differentiated(user):
    new = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    ref, mask = torch.randn(2, 4, dtype=torch.float64), torch.ones(2, 4)
    term = kl_loss(new, new.detach(), ref, mask, f"{user}.k4_loss", None)
    k2 = kl_loss(new, new.detach(), ref, mask, "k2", None)
    assert torch.allclose(term, 2 * k2)
    (grad,) = torch.autograd.grad(term, new)
    assert torch.allclose(grad, 2 * (new - ref).detach() / new.numel())
    with pytest.raises(ValueError, match="loss=False"):
        kl_loss(new, new.detach(), ref, mask, f"{user}.k4", None)


def test_the_exact_world_enumerates_a_plugged_estimator(user, tmp_path_factory):
    from rlkl_lightning.world.exact import ExactWorld, placement_end_point

    world = ExactWorld(root=tmp_path_factory.mktemp("exact"))
    k4 = placement_end_point(world, 0.5, "reward", f"{user}.k4", steps=3)
    k2 = placement_end_point(world, 0.5, "reward", "k2", steps=3)
    assert k4.shape == k2.shape and not torch.equal(k4, k2)
    with pytest.raises(ValueError, match="loss=False"):
        placement_end_point(world, 0.5, "loss", f"{user}.k4", steps=1)
    with pytest.raises(ValueError, match=r"one of \('k1', 'k2', 'k3'\)"):
        placement_end_point(world, 0.5, "loss", "exact", steps=1)


def test_registering_checks_the_name_and_the_formula():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator(Estimator("k1", lambda x: x))
    with pytest.raises(ValueError, match="without a dot"):
        register_estimator(Estimator("my.k4", lambda x: x))
    with pytest.raises(ValueError, match="need the full logits"):
        register_estimator(Estimator("k9", None))
    added = register_estimator(Estimator("k_test", lambda x: x.abs(), loss=True))
    try:
        assert kl_estimator("k_test") is added
        assert "k_test" in estimator_names("loss") and "k_test" in sample_estimators()
    finally:
        del ESTIMATORS["k_test"]


def test_the_docs_list_the_registered_estimators():
    table = (ROOT / "docs" / "kl.md").read_text().split("## Units and estimators")[1]
    listed = re.findall(r"^\| `([a-z0-9_]+)` \|", table.split("\n\n**Units.**")[0], re.M)
    assert tuple(listed) == KL_ESTIMATORS
    extending = (ROOT / "docs" / "extending.md").read_text()
    for name in KL_ESTIMATORS:
        assert f"`{name}`" in extending
    assert est.__doc__ and all(f"``{name}" in est.__doc__ for name in KL_ESTIMATORS)


# --------------------------------------------------------------------------------------------
# laws


def test_the_registered_laws():
    assert (
        KL_LAWS
        == law_names()
        == tuple(LAWS)
        == ("fixed", "adaptive", "exponential", "pi", "logpid")
    )
    assert all(control_law(name) is LAWS[name] for name in KL_LAWS)


def test_an_unknown_law_names_the_option_and_lists_the_registered_ones():
    with pytest.raises(ValueError) as info:
        KLSettings(controller="bang_bang")
    message = str(info.value)
    assert f"`kl.controller` must be one of {KL_LAWS}, got 'bang_bang'" in message
    assert "dotted path" in message


def test_a_dotted_path_builds_the_users_law(user):
    settings = KLSettings(controller=f"{user}.Halving", target=2.0)
    law = settings.kl_controller(0.1)
    assert type(law).__name__ == "Halving" and law.target == 2.0
    assert law.bounds == (1e-3, 10.0)  # unset bounds are not passed: the law's own defaults
    bounded = KLSettings(controller=f"{user}.Halving", target=2.0, max_kl_coef=5.0)
    assert bounded.kl_controller(0.1).bounds == (1e-3, 5.0)
    assert law.update(3.0, 8) == 0.05 and law.update(1.0, 8) == 0.1
    # A path to a Law: its builder sees the whole group.
    by_law = KLSettings(controller=f"{user}.law", target=2.0, horizon=3.0).kl_controller(0.1)
    assert by_law.target == 6.0


def test_a_plugged_law_is_refused_where_it_does_not_fit(user):
    with pytest.raises(ValueError, match=r"`kl.controller` must be one of .*does not import"):
        KLSettings(controller=f"{user}.Missing")
    with pytest.raises(ValueError, match=r"`kl.controller`: .*must name a class"):
        KLSettings(controller=f"{user}.__doc__")
    settings = KLSettings(controller=f"{user}.NoState", min_kl_coef=0.01)
    with pytest.raises(ValueError, match=r"called as NoState\(init_kl_coef, target, min_kl_coef"):
        settings.kl_controller(0.1)
    with pytest.raises(ValueError, match=r"lacks \['state_dict', 'load_state_dict'\]"):
        KLSettings(controller=f"{user}.NoState").kl_controller(0.1)


def test_the_builtin_laws_get_their_exact_arguments():
    settings = KLSettings(controller="adaptive", target=4.0, horizon=500.0, max_kl_coef=2.0)
    got = build_controller("adaptive", settings, 0.3, max_kl_coef=2.0)
    want = AdaptiveKLController(0.3, 4.0, 500.0, max_kl_coef=2.0)
    assert repr(got) == repr(want) == repr(settings.kl_controller(0.3))
    for kl in (1.0, 9.0, 4.0):
        assert got.update(kl, 64) == want.update(kl, 64)
    assert isinstance(control_law("fixed"), Law)


def test_the_docs_list_the_registered_laws():
    controllers = (ROOT / "docs" / "controllers.md").read_text()
    (sentence,) = re.findall(r"`kl.controller` \(([^)]*)\) picks", controllers)
    assert tuple(re.findall(r"`([a-z]+)`", sentence)) == KL_LAWS
    extending = (ROOT / "docs" / "extending.md").read_text()
    assert all(f"`{name}`" in extending for name in KL_LAWS)


def test_the_ddp_means_read_a_plugged_estimators_kl_by_its_option():
    from types import SimpleNamespace

    from rlkl_lightning.algorithms.metrics import _global_sample_means

    traj = SimpleNamespace(scores=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3))
    diagnostics = {f"kl_{name}": torch.tensor([0.5, 1.5]) for name in KL_ESTIMATORS}
    diagnostics["kl_user_kl.k4"] = torch.tensor([2.0, 4.0])
    means = _global_sample_means(traj, diagnostics, "user_kl.k4", 0.1, lambda x: x)
    assert float(means["objective/kl"]) == 3.0
    assert "objective/kl_user_kl.k4" not in means  # read, not logged apart
    registered = _global_sample_means(traj, diagnostics, "k2", 0.1, lambda x: x)
    assert float(registered["objective/kl"]) == float(registered["objective/kl_k2"]) == 1.0
