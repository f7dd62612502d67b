"""A checkpoint written before the option groups (0.1.0: flat options) resumes and exports.

The test makes such a checkpoint itself: a run's ``last.ckpt`` whose module hyperparameters
and ``RunSettings`` record are rewritten to the flat layout 0.1.0 wrote (``lr``,
``init_kl_coef``, ``model.init_args.max_new_tokens``, ...), with the same weights and states.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from helpers.cli_runs import cli_error, tiny_cli_config

from rlkl_lightning.algorithms.options import ADDED_GROUPS, MODULE_GROUPS, RENAMED
from rlkl_lightning.cli import main
from rlkl_lightning.export import export_policy

#: The new place of every 0.1.0 option -> its flat name (``"kl.init_coef" -> "init_kl_coef"``).
OLD_NAME = {
    **{
        f"{group}.{f.name}": f.name
        for group, cls in MODULE_GROUPS.items()
        if group not in ADDED_GROUPS
        for f in fields(cls)
    },
    **{place: name for name, place in RENAMED.items()},
}


def flat_layout(checkpoint: dict) -> dict:
    """``checkpoint`` as 0.1.0 wrote it: flat hyperparameters, flat settings keys."""
    hparams = dict(checkpoint["hyper_parameters"])
    for group in ADDED_GROUPS:  # groups 0.1.0 did not have
        hparams.pop(group, None)
    for group in MODULE_GROUPS.keys() - ADDED_GROUPS.keys():
        for name, value in (hparams.pop(group, None) or {}).items():
            hparams[OLD_NAME[f"{group}.{name}"]] = value
    checkpoint["hyper_parameters"] = hparams
    record = checkpoint["callbacks"]["RunSettings"]
    prefix = "model.init_args."
    flat = {}
    for key, value in record["settings"].items():
        if key.startswith(prefix):
            group, _, rest = key.removeprefix(prefix).partition(".")
            name, dot, deeper = rest.partition(".")
            if group in ADDED_GROUPS:
                continue
            if group in MODULE_GROUPS:
                key = f"{prefix}{OLD_NAME[f'{group}.{name}']}{dot}{deeper}"
        flat[key] = value
    # 0.1.0-0.4.0 named the law and kept every law's gain beside it in the `kl` group.
    law = {key: flat.pop(key) for key in list(flat) if key.startswith("kl.controller.")}
    assert law["kl.controller.class_path"].endswith(".AdaptiveKLController'")
    flat["kl.controller"] = "'adaptive'"
    flat.update({"kl.horizon": law["kl.controller.init_args.horizon"], "kl.k": "0.1"})
    flat.update({"kl.kp": "0.5", "kl.ki": "0.05"})
    # 0.1.0 recorded these too; they no longer shape the trajectory (the `logging` group).
    flat[f"{prefix}num_logged_samples"] = "4"
    flat[f"{prefix}kl_token_threshold"] = "None"
    record["settings"] = flat
    return checkpoint


@pytest.fixture(scope="module")
def written(tiny_lm_dir, tmp_path_factory):
    """A run of 2 batches, its ``last.ckpt`` and the same checkpoint in the 0.1.0 layout."""
    tmp = tmp_path_factory.mktemp("old_checkpoint")
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp / "ckpt"), "save_last": True},
    }
    config = tiny_cli_config(tiny_lm_dir, tmp, trainer={"callbacks": [checkpoint]})
    main(["fit", "--config", str(config)])
    last = tmp / "ckpt" / "last.ckpt"
    old = tmp / "old.ckpt"
    torch.save(flat_layout(torch.load(last, weights_only=True)), old)
    return config, last, old


def test_the_made_checkpoint_has_the_old_layout(written):
    _, _, old = written
    saved = torch.load(old, weights_only=True)
    assert "lr" in saved["hyper_parameters"] and "optimization" not in saved["hyper_parameters"]
    assert saved["hyper_parameters"]["init_kl_coef"] == 0.2
    settings = saved["callbacks"]["RunSettings"]["settings"]
    assert "model.init_args.max_new_tokens" in settings
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


def test_an_old_checkpoint_resumes_as_the_new_one_does(written, tmp_path):
    config, last, old = written
    from_new = _resume(config, last, tmp_path / "new")
    from_old = _resume(config, old, tmp_path / "old")
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
    # Written again in the new layout.
    assert "optimization" in from_old["hyper_parameters"]


def test_a_change_on_an_old_checkpoint_is_listed_under_its_new_name(written, capfd):
    config, _, old = written
    args = ["fit", "--config", str(config), "--ckpt_path", str(old), "--trainer.max_steps=3"]
    message = cli_error([*args, "--model.init_args.sampling.max_new_tokens=3"], capfd)
    assert message.startswith("`ckpt_path`: this run's settings differ")
    # Like with like: only the option that changed is listed, under its group's name.
    listed = [line.strip() for line in message.splitlines()[1:] if line.startswith("  ")]
    assert listed == ["model.init_args.sampling.max_new_tokens: 4 -> 3"]
    # The law's name and gain of then are its spec of now: a changed gain is listed so.
    message = cli_error([*args, "--kl.controller.init_args.horizon=50"], capfd)
    listed = [line.strip() for line in message.splitlines()[1:] if line.startswith("  ")]
    assert listed == ["kl.controller.init_args.horizon: 100.0 -> 50.0"]


def test_an_old_checkpoint_exports(written, tmp_path):
    _, last, old = written
    saved = torch.load(old, weights_only=True)
    out = export_policy(saved["hyper_parameters"], saved["state_dict"], tmp_path / "old")
    new = torch.load(last, weights_only=True)
    ref = export_policy(new["hyper_parameters"], new["state_dict"], tmp_path / "new")
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
