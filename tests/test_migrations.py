"""The tables of older versions' options (rlkl_lightning/migrations.py) and their readers."""

from __future__ import annotations

from dataclasses import fields

from rlkl_lightning.algorithms.options import MODULE_GROUPS
from rlkl_lightning.compare.runs import init_arg
from rlkl_lightning.migrations import (
    ADDED_GROUPS,
    FLAT_KEYS,
    RENAMED_GROUPS,
    upgrade_config,
    upgrade_init_args,
    upgrade_settings_key,
)


def test_every_old_option_has_a_place_among_todays_fields():
    today = {f"{group}.{f.name}" for group, cls in MODULE_GROUPS.items() for f in fields(cls)}
    assert len(FLAT_KEYS) == 46 and set(FLAT_KEYS.values()) <= today
    assert len(set(FLAT_KEYS.values())) == 46  # one place each
    assert {new for new, _ in RENAMED_GROUPS.values()} <= MODULE_GROUPS.keys()
    assert not RENAMED_GROUPS.keys() & MODULE_GROUPS.keys()
    assert ADDED_GROUPS.keys() <= MODULE_GROUPS.keys()
    assert not {place.partition(".")[0] for place in FLAT_KEYS.values()} & ADDED_GROUPS.keys()


def test_old_init_args_read_as_todays_in_their_order():
    flat = {"policy": "gpt2", "init_kl_coef": 0.2, "lr": 1e-4, "kl_placement": "loss"}
    assert upgrade_init_args(flat) == {
        "policy": "gpt2",
        "penalty": {"init_coef": 0.2, "placement": "loss"},
        "optimization": {"lr": 1e-4},
    }
    grouped = {"policy": "gpt2", "kl": {"init_coef": 0.2}, "sampling": {"top_p": 0.9}}
    upgraded = upgrade_init_args(grouped)
    assert upgraded == {"policy": "gpt2", "penalty": {"init_coef": 0.2}, "sampling": {"top_p": 0.9}}
    assert list(upgraded) == ["policy", "penalty", "sampling"]
    assert grouped["kl"] == {"init_coef": 0.2}  # the input is left as it was
    today = {"penalty": {"init_coef": 0.1}, "sampling": {"top_p": 0.9}}
    assert upgrade_init_args(today) == today


def test_where_an_old_and_a_new_spelling_are_both_given_the_new_one_wins():
    both = {"kl": {"init_coef": 0.2, "placement": "loss"}, "penalty": {"init_coef": 0.3}}
    assert upgrade_init_args(both) == {"penalty": {"init_coef": 0.3, "placement": "loss"}}
    both = {"penalty": {"init_coef": 0.3}, "init_kl_coef": 0.2, "top_p": 0.5}
    assert upgrade_init_args(both) == {"penalty": {"init_coef": 0.3}, "sampling": {"top_p": 0.5}}


def test_old_settings_keys_and_configs_read_as_todays():
    assert upgrade_settings_key("model.init_args.lr") == "model.init_args.optimization.lr"
    assert upgrade_settings_key("model.init_args.peft.r") == "model.init_args.models.peft.r"
    old = "model.init_args.kl.init_coef"
    assert upgrade_settings_key(old) == "model.init_args.penalty.init_coef"
    for key in ("kl.target", "model.init_args.sampling.top_p", "data.init_args.lr"):
        assert upgrade_settings_key(key) == key  # the run's kl, today's keys, not the module's
    config = {"model": {"init_args": {"kl": {"init_coef": 0.2}}}, "kl": {"target": 3.0}}
    assert upgrade_config(config) == {
        "model": {"init_args": {"penalty": {"init_coef": 0.2}}},
        "kl": {"target": 3.0},
    }


def test_a_study_reads_an_older_run_config_under_todays_names():
    config = {"model": {"class_path": "rlkl_lightning.PPOModule", "init_args": {}}}
    assert init_arg(config, "model", "penalty.init_coef") == 0.1  # the default
    config["model"]["init_args"] = {"kl": {"init_coef": 0.3}}  # 0.4.0
    assert init_arg(config, "model", "penalty.init_coef") == 0.3
    config["model"]["init_args"] = {"init_kl_coef": 0.4}  # 0.1.0
    assert init_arg(config, "model", "penalty.init_coef") == 0.4
