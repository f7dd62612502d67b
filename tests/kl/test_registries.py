"""The registries of KL estimators, control laws and advantage estimators: one convention.

Names, dotted paths, ``{class_path, init_args}`` blocks with a component's own arguments, the
one message of a value that names nothing, the plain specs checkpoints store, docs.
"""

from __future__ import annotations

import io
import re
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch

from rlkl_lightning.algorithms.advantage_estimators import (
    ADVANTAGES,
    advantage_estimator,
    advantage_spec,
)
from rlkl_lightning.components import Registry
from rlkl_lightning.kl import estimators as est
from rlkl_lightning.kl.controllers import AdaptiveKLController, KLLaw
from rlkl_lightning.kl.estimators import (
    ESTIMATORS,
    KL_ESTIMATORS,
    Estimator,
    estimator_names,
    estimator_spec,
    kl_estimator,
    per_token_kl,
    sample_estimators,
)
from rlkl_lightning.kl.laws import KL_LAWS, LAWS, build_controller, law_name, law_names, law_spec
from rlkl_lightning.kl.loss import KL_LOSS_ESTIMATORS, kl_loss
from rlkl_lightning.kl.settings import KLSettings

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
import torch

from rlkl_lightning.kl.controllers import KLLaw
from rlkl_lightning.kl.estimators import Estimator


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


class Scaled(Estimator):
    # scale * l**2: an estimator with an argument

    def __init__(self, scale=1.0):
        super().__init__("scaled", lambda log_ratio: scale * log_ratio.square(), loss=True)


class Stepping(KLLaw):
    # beta times `factor` when the KL is above target, divided by it below

    law = "stepping"

    def __init__(self, init_kl_coef, target, factor=2.0, min_kl_coef=None, max_kl_coef=None):
        super().__init__(init_kl_coef, min_kl_coef, max_kl_coef)
        self.target, self.factor = target, factor

    def step(self, kl, n_steps):
        return self.value * (self.factor if kl > self.target else 1 / self.factor)


class Shifted:
    # a group advantage with an argument: the scores minus `shift`, on every token

    def __init__(self, shift=0.0):
        self.shift = shift

    def __call__(self, traj, kl_coef, options, global_sum):
        advantages = (traj.scores - self.shift)[:, None] * traj.response_mask
        return traj._replace(advantages=advantages)


def plain_scores(traj, kl_coef, options, global_sum):
    return traj._replace(advantages=traj.scores[:, None] * traj.response_mask)
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
    # Computed beside the registered ones, under its own name (logged as objective/kl_k4).
    assert list(sample_estimators("k1", "exact", f"{user}.k4")) == ["k1", "k2", "k3", "k4"]


def test_an_estimator_block_takes_its_own_arguments(user):
    spec = {"class_path": f"{user}.Scaled", "init_args": {"scale": 3.0}}
    found = kl_estimator(spec, role="loss")
    lp, lq = torch.randn(3, 5), torch.randn(3, 5)
    assert found.name == "scaled" and torch.equal(found.per_token(lp, lq), 3.0 * (lp - lq) ** 2)
    # Stored as the plain spec, every argument written out; a name stays a name.
    assert estimator_spec(spec) == {
        "class_path": f"{user}.Scaled",
        "init_args": {"scale": 3.0},
    }
    assert estimator_spec({"class_path": f"{user}.Scaled"})["init_args"] == {"scale": 1.0}
    assert estimator_spec("k3") == "k3" and estimator_spec(ESTIMATORS["k3"]) == "k3"
    with pytest.raises(ValueError, match=r"`penalty.estimator.init_args` has no argument 'scal'"):
        kl_estimator({"class_path": f"{user}.Scaled", "init_args": {"scal": 3.0}})
    with pytest.raises(ValueError, match=r"the plugged estimator's name 'k1' is a registered"):
        kl_estimator(Estimator("k1", lambda x: 2 * x))


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
        ESTIMATORS.register("k1")(Estimator("k1", lambda x: x))
    with pytest.raises(ValueError, match="without a dot"):
        ESTIMATORS.register("my.k4")(Estimator("my.k4", lambda x: x))
    with pytest.raises(ValueError, match="need the full logits"):
        ESTIMATORS.register("k9")(Estimator("k9", None))
    with pytest.raises(ValueError, match="registered as 'k8'; use its name"):
        ESTIMATORS.register("k8")(Estimator("k9", lambda x: x))
    added = ESTIMATORS.register("k_test")(Estimator("k_test", lambda x: x.abs(), loss=True))
    try:
        assert kl_estimator("k_test") is added
        assert "k_test" in estimator_names("loss") and "k_test" in sample_estimators()
    finally:
        ESTIMATORS.unregister("k_test")


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
    assert KL_LAWS == law_names() == LAWS.names()
    assert KL_LAWS == ("fixed", "adaptive", "exponential", "pi", "logpid")
    assert law_spec("adaptive") == {
        "class_path": "rlkl_lightning.kl.controllers.AdaptiveKLController",
        "init_args": {"horizon": 10_000.0, "min_kl_coef": None, "max_kl_coef": None},
    }
    assert all(law_name(name) == name for name in KL_LAWS)


def test_an_unknown_law_names_the_option_and_lists_the_registered_ones():
    with pytest.raises(ValueError) as info:
        KLSettings(controller="bang_bang")
    message = str(info.value)
    assert f"`kl.controller` must be one of {KL_LAWS} or the dotted path of" in message
    assert message.endswith("got 'bang_bang'")


def test_every_form_of_a_law_gives_the_same_spec(user):
    """A name, a class name, a dotted path, a block, the class: one law, one stored spec."""
    block = {"class_path": "AdaptiveKLController", "init_args": {"horizon": 1000.0}}
    want = law_spec(block)
    assert want["init_args"]["horizon"] == 1000.0
    for form in (
        {"class_path": "adaptive", "init_args": {"horizon": 1000.0}},
        {
            "class_path": "rlkl_lightning.kl.controllers.AdaptiveKLController",
            "init_args": {"horizon": 1000.0},
        },
        partial(AdaptiveKLController, horizon=1000.0),
    ):
        assert law_spec(form) == want
    assert law_spec(AdaptiveKLController) == law_spec("adaptive")
    # The spec is plain: it survives a weights_only round trip.
    buffer = io.BytesIO()
    torch.save({"law": want}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["law"] == want


def test_a_built_controller_is_refused_naming_the_forms_that_work():
    with pytest.raises(ValueError, match=r"takes the law, not a built controller .*partial"):
        KLSettings(controller=AdaptiveKLController(0.1, 6.0))


def test_a_plugged_law_takes_its_gain_and_gets_the_bounds_from_kl_base(user):
    spec = {"class_path": f"{user}.Stepping", "init_args": {"factor": 4.0}}
    law = KLSettings(controller=spec, target=2.0, max_kl_coef=1.0).kl_controller(0.1)
    assert isinstance(law, KLLaw) and law.law == "stepping" and law.factor == 4.0
    assert law.update(3.0, 8) == 0.4 and law.update(3.0, 8) == 1.0  # the bound holds
    assert law.update(float("nan"), 8) == 1.0  # a non-finite KL leaves beta (KLLaw's)
    assert law.state_dict() == {"law": "stepping", "value": 1.0}
    assert law_name(spec) == f"{user}.Stepping"
    with pytest.raises(ValueError, match=r"has no argument 'gain': Stepping takes \['factor'"):
        KLSettings(controller={"class_path": f"{user}.Stepping", "init_args": {"gain": 1.0}})


def test_a_dotted_path_builds_the_users_law(user):
    settings = KLSettings(controller=f"{user}.Halving", target=2.0)
    law = settings.kl_controller(0.1)
    assert type(law).__name__ == "Halving" and law.target == 2.0
    assert law.bounds == (1e-3, 10.0)  # unset bounds are not passed: the law's own defaults
    bounded = KLSettings(controller=f"{user}.Halving", target=2.0, max_kl_coef=5.0)
    assert bounded.kl_controller(0.1).bounds == (1e-3, 5.0)
    assert law.update(3.0, 8) == 0.05 and law.update(1.0, 8) == 0.1


def test_a_plugged_law_is_refused_where_it_does_not_fit(user):
    with pytest.raises(ValueError, match=r"`kl.controller` must be one of .*does not import"):
        KLSettings(controller=f"{user}.Missing")
    with pytest.raises(ValueError, match=r"`kl.controller` must be one of .*which names NoneType"):
        KLSettings(controller=f"{user}.__doc__")
    settings = KLSettings(controller=f"{user}.NoState", min_kl_coef=0.01)
    with pytest.raises(ValueError, match=r"called as NoState\(init_kl_coef, target, min_kl_coef"):
        settings.kl_controller(0.1)
    with pytest.raises(ValueError, match=r"lacks \['state_dict', 'load_state_dict'\]"):
        KLSettings(controller=f"{user}.NoState").kl_controller(0.1)


def test_the_builtin_laws_get_their_exact_arguments():
    block = {"class_path": "adaptive", "init_args": {"horizon": 500.0}}
    settings = KLSettings(controller=block, target=4.0, max_kl_coef=2.0)
    got = build_controller(block, 0.3, 4.0, max_kl_coef=2.0)
    want = AdaptiveKLController(0.3, 4.0, 500.0, max_kl_coef=2.0)
    assert repr(got) == repr(want) == repr(settings.kl_controller(0.3))
    for kl in (1.0, 9.0, 4.0):
        assert got.update(kl, 64) == want.update(kl, 64)


def test_the_docs_list_the_registered_laws():
    controllers = (ROOT / "docs" / "controllers.md").read_text()
    (sentence,) = re.findall(r"`kl.controller` \(([^)]*)\) picks", controllers)
    assert tuple(re.findall(r"`([a-z]+)`", sentence)) == KL_LAWS
    extending = (ROOT / "docs" / "extending.md").read_text()
    assert all(f"`{name}`" in extending for name in KL_LAWS)


def test_the_ddp_means_log_a_plugged_estimator_under_its_name():
    from types import SimpleNamespace

    from rlkl_lightning.algorithms.metrics import _global_sample_means

    traj = SimpleNamespace(
        scores=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3), sample_mask=None
    )
    diagnostics = {f"kl_{name}": torch.tensor([0.5, 1.5]) for name in KL_ESTIMATORS}
    diagnostics["kl_k4"] = torch.tensor([2.0, 4.0])
    means = _global_sample_means(traj, diagnostics, "k4", 0.1, lambda x: x)
    assert float(means["objective/kl"]) == float(means["objective/kl_k4"]) == 3.0
    registered = _global_sample_means(traj, diagnostics, "k2", 0.1, lambda x: x)
    assert float(registered["objective/kl"]) == float(registered["objective/kl_k2"]) == 1.0
    assert "objective/kl_k4" not in registered


# --------------------------------------------------------------------------------------------
# advantage estimators, and the convention all registries share


def test_an_advantage_is_named_as_any_component(user):
    from rlkl_lightning.algorithms.options import GroupOptions

    assert advantage_estimator("rloo", "group") is ADVANTAGES["group"]["rloo"]
    assert advantage_estimator(f"{user}.plain_scores", "group").__name__ == "plain_scores"
    block = {"class_path": f"{user}.Shifted", "init_args": {"shift": 0.5}}
    built = advantage_estimator(block, "group", "group.advantage")
    assert type(built).__name__ == "Shifted" and built.shift == 0.5
    assert GroupOptions(advantage=block).advantage == {
        "class_path": f"{user}.Shifted",
        "init_args": {"shift": 0.5},
    }
    assert advantage_spec("grpo", "group") == "grpo"
    with pytest.raises(ValueError) as info:
        GroupOptions(advantage="gae")  # a token-level one: not among the group's
    assert str(info.value).startswith("`group.advantage` must be one of ('rloo', 'grpo') or ")
    with pytest.raises(ValueError, match=r"`group.advantage.init_args` has no argument 'shfit'"):
        GroupOptions(advantage={"class_path": f"{user}.Shifted", "init_args": {"shfit": 1}})


@pytest.mark.parametrize(
    ("registry", "option"),
    [
        (LAWS, "kl.controller"),
        (ESTIMATORS, "penalty.estimator"),
        (ADVANTAGES["group"], "group.advantage"),
    ],
)
def test_every_registry_is_one_registry_with_one_message(registry, option):
    assert isinstance(registry, Registry) and registry.option == option
    with pytest.raises(ValueError) as info:
        registry.resolve("typo")
    message = str(info.value)
    assert message.startswith(f"`{option}` must be one of {registry.names()} or the dotted path of")
    assert message.endswith("got 'typo'")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.names()[0])(object())
