"""Checkpoints of older layouts resume and export as today's do.

The test makes them itself: a run's ``last.ckpt`` whose module hyperparameters and
``RunSettings`` record are rewritten to the layout an older version wrote, with the same
weights and states: 0.1.0's flat options (``lr``, ``init_kl_coef``,
``model.init_args.max_new_tokens``, ...) and 0.2.0-0.4.0's groups with the KL penalty's group
named ``kl`` (``model.init_args.kl.init_coef``).
"""

from __future__ import annotations

import pytest
import torch
from helpers.cli_runs import cli_error, tiny_cli_config

from rlkl_lightning.cli import main
from rlkl_lightning.export import export_policy
from rlkl_lightning.migrations import ADDED_GROUPS, ADDED_OPTIONS, FLAT_KEYS, RENAMED_GROUPS

#: The place today of every 0.1.0 option -> its flat name (``"penalty.init_coef" ->
#: "init_kl_coef"``).
OLD_NAME = {place: name for name, place in FLAT_KEYS.items()}
#: Today's groups that hold the options of 0.1.0.
GROUPS_010 = {place.partition(".")[0] for place in OLD_NAME}
#: Today's name of a renamed group -> its name in 0.2.0-0.4.0 (``"penalty" -> "kl"``).
OLD_GROUP = {new: old for old, (new, _) in RENAMED_GROUPS.items()}
PREFIX = "model.init_args."


def old_law(settings: dict) -> None:
    """0.1.0-0.4.0 named the law and kept every law's gain beside it in the `kl` group."""
    law = {key: settings.pop(key) for key in list(settings) if key.startswith("kl.controller.")}
    assert law["kl.controller.class_path"].endswith(".AdaptiveKLController'")
    settings["kl.controller"] = "'adaptive'"
    settings.update({"kl.horizon": law["kl.controller.init_args.horizon"], "kl.k": "0.1"})
    settings.update({"kl.kp": "0.5", "kl.ki": "0.05"})


def flat_layout(checkpoint: dict) -> dict:
    """``checkpoint`` as 0.1.0 wrote it: flat hyperparameters, flat settings keys."""
    hparams = {}
    for key, value in checkpoint["hyper_parameters"].items():
        if key in ADDED_GROUPS:  # groups 0.1.0 did not have
            continue
        if isinstance(value, dict) and any(f"{key}.{name}" in OLD_NAME for name in value):
            old = {OLD_NAME.get(f"{key}.{name}"): v for name, v in value.items()}
            hparams.update({name: v for name, v in old.items() if name})  # 0.1.0 had these
        else:
            hparams[key] = value
    checkpoint["hyper_parameters"] = hparams
    record = checkpoint["callbacks"]["RunSettings"]
    flat = {}
    for key, value in record["settings"].items():
        if key.startswith(PREFIX):
            group, _, rest = key.removeprefix(PREFIX).partition(".")
            name, dot, deeper = rest.partition(".")
            if group in ADDED_GROUPS or f"{group}.{name}" in ADDED_OPTIONS:
                continue
            if group in GROUPS_010 and f"{group}.{name}" not in OLD_NAME:
                continue  # an option 0.1.0 did not have
            if group in GROUPS_010:
                key = f"{PREFIX}{OLD_NAME[f'{group}.{name}']}{dot}{deeper}"
        flat[key] = value
    old_law(flat)
    # 0.1.0 recorded these too; they no longer shape the trajectory (the `logging` group).
    flat[f"{PREFIX}num_logged_samples"] = "4"
    flat[f"{PREFIX}kl_token_threshold"] = "None"
    record["settings"] = flat
    return checkpoint


def kl_group_layout(checkpoint: dict) -> dict:
    """``checkpoint`` as 0.2.0-0.4.0 wrote it: the groups, the KL penalty's named ``kl``, no
    option added since (``ppo.advantage``)."""
    checkpoint = without_added_options(checkpoint)
    checkpoint["hyper_parameters"] = {
        OLD_GROUP.get(key, key): value for key, value in checkpoint["hyper_parameters"].items()
    }
    record = checkpoint["callbacks"]["RunSettings"]
    settings = {}
    for key, value in record["settings"].items():
        group, dot, rest = key.removeprefix(PREFIX).partition(".")
        if key.startswith(PREFIX) and group in OLD_GROUP:
            key = f"{PREFIX}{OLD_GROUP[group]}{dot}{rest}"
        settings[key] = value
    old_law(settings)
    record["settings"] = settings
    return checkpoint


LAYOUTS = {"0.1.0": flat_layout, "0.4.0": kl_group_layout}


@pytest.fixture(scope="module")
def written(tiny_lm_dir, tmp_path_factory):
    """A run of 2 batches, its ``last.ckpt`` and the same checkpoint in each old layout."""
    tmp = tmp_path_factory.mktemp("old_checkpoint")
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp / "ckpt"), "save_last": True},
    }
    config = tiny_cli_config(tiny_lm_dir, tmp, trainer={"callbacks": [checkpoint]})
    main(["fit", "--config", str(config)])
    last = tmp / "ckpt" / "last.ckpt"
    old = {}
    for version, layout in LAYOUTS.items():
        old[version] = tmp / f"{version}.ckpt"
        torch.save(layout(torch.load(last, weights_only=True)), old[version])
    return config, last, old


def test_the_made_checkpoints_have_the_old_layouts(written):
    _, _, old = written
    flat = torch.load(old["0.1.0"], weights_only=True)
    assert "lr" in flat["hyper_parameters"] and "optimization" not in flat["hyper_parameters"]
    assert flat["hyper_parameters"]["init_kl_coef"] == 0.2
    assert "model.init_args.max_new_tokens" in flat["callbacks"]["RunSettings"]["settings"]
    grouped = torch.load(old["0.4.0"], weights_only=True)
    assert grouped["hyper_parameters"]["kl"]["init_coef"] == 0.2
    assert "penalty" not in grouped["hyper_parameters"]
    settings = grouped["callbacks"]["RunSettings"]["settings"]
    assert "model.init_args.kl.init_coef" in settings and "kl.target" in settings
    assert not any(key.startswith("model.init_args.penalty.") for key in settings)
    for saved in (flat, grouped):  # the law by its name, its gain beside it
        settings = saved["callbacks"]["RunSettings"]["settings"]
        assert (settings["kl.controller"], settings["kl.horizon"]) == ("'adaptive'", "100.0")


def _resume(config, checkpoint, out) -> dict:
    """Resume ``checkpoint`` for one more batch; the weights it ends with."""
    save = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(out), "save_last": True},
    }
    main(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            str(checkpoint),
            "--trainer.max_steps=3",
            "--trainer.callbacks",
            f"[{save}]".replace("'", '"'),
        ]
    )
    return torch.load(out / "last.ckpt", weights_only=True)


@pytest.mark.parametrize("version", LAYOUTS)
def test_an_old_checkpoint_resumes_as_the_new_one_does(written, tmp_path, version):
    config, last, old = written
    from_new = _resume(config, last, tmp_path / "new")
    from_old = _resume(config, old[version], tmp_path / "old")
    assert from_old["global_step"] == from_new["global_step"] == 3
    assert from_old["state_dict"].keys() == from_new["state_dict"].keys()
    for key, value in from_new["state_dict"].items():
        assert torch.equal(from_old["state_dict"][key], value), key
    # Beta, the controller's and the monitor's states, the settings record: all the same
    # (the checkpoint callbacks' own states name their directories, which differ).
    states = [
        {k: v for k, v in c["callbacks"].items() if not k.startswith("ModelCheckpoint")}
        for c in (from_old, from_new)
    ]
    assert len(states[0]) >= 3 and states[0] == states[1]
    # Written again in today's layout.
    assert from_old["hyper_parameters"] == from_new["hyper_parameters"]
    assert from_old["hyper_parameters"]["penalty"]["init_coef"] == 0.2


def without_added_options(checkpoint: dict) -> dict:
    """``checkpoint`` as 0.4.0 wrote it: the groups, without the options added since."""
    prefix = "model.init_args."
    for place in ADDED_OPTIONS:
        group, _, name = place.partition(".")
        (checkpoint["hyper_parameters"].get(group) or {}).pop(name, None)
        checkpoint["callbacks"]["RunSettings"]["settings"].pop(f"{prefix}{place}", None)
    return checkpoint


def test_a_checkpoint_from_before_an_added_option_resumes_as_the_new_one_does(written, tmp_path):
    """A 0.4.0 PPO checkpoint has no ``ppo.advantage``: it resumes with the default, ``gae``."""
    config, last, _ = written
    older = tmp_path / "older.ckpt"
    torch.save(without_added_options(torch.load(last, weights_only=True)), older)
    assert "advantage" not in torch.load(older, weights_only=True)["hyper_parameters"]["ppo"]
    from_new = _resume(config, last, tmp_path / "new")
    from_older = _resume(config, older, tmp_path / "older")
    assert from_older["hyper_parameters"]["ppo"]["advantage"] == "gae"
    for key, value in from_new["state_dict"].items():
        assert torch.equal(from_older["state_dict"][key], value), key


@pytest.mark.parametrize(
    ("version", "change", "listed"),
    [
        ("0.1.0", "sampling.max_new_tokens=3", "sampling.max_new_tokens: 4 -> 3"),
        ("0.1.0", "penalty.init_coef=0.3", "penalty.init_coef: 0.2 -> 0.3"),
        ("0.4.0", "penalty.init_coef=0.3", "penalty.init_coef: 0.2 -> 0.3"),
    ],
)
def test_a_change_on_an_old_checkpoint_is_listed_under_its_new_name(
    written, capfd, version, change, listed
):
    config, _, old = written
    args = ["fit", "--config", str(config), "--ckpt_path", str(old[version])]
    message = cli_error([*args, "--trainer.max_steps=3", f"--{PREFIX}{change}"], capfd)
    assert message.startswith("`ckpt_path`: this run's settings differ")
    # Like with like: only the option that changed is listed, under today's name.
    lines = [line.strip() for line in message.splitlines()[1:] if line.startswith("  ")]
    assert lines == [f"{PREFIX}{listed}"]
    # The law's name and gain of then are its spec of now: a changed gain is listed so.
    message = cli_error(
        [*args, "--trainer.max_steps=3", "--kl.controller.init_args.horizon=50"], capfd
    )
    lines = [line.strip() for line in message.splitlines()[1:] if line.startswith("  ")]
    assert lines == ["kl.controller.init_args.horizon: 100.0 -> 50.0"]


@pytest.mark.parametrize("version", LAYOUTS)
def test_an_old_checkpoint_exports(written, tmp_path, version):
    _, last, old = written
    saved = torch.load(old[version], weights_only=True)
    out = export_policy(saved["hyper_parameters"], saved["state_dict"], tmp_path / "old")
    new = torch.load(last, weights_only=True)
    ref = export_policy(new["hyper_parameters"], new["state_dict"], tmp_path / "new")
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
