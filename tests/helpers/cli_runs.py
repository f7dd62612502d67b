"""A tiny ``train.py`` config on a local model, and the error a CLI call ends with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the film was", "this book is", "the food", "it was really", "a story", "the plot"]


def tiny_cli_config(tiny_lm_dir, tmp_path, name="config.yaml", **groups) -> Path:
    """A config of 2 PPO batches of 4 prompts on the tiny model; ``groups`` update its groups."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = {
        "trainer": {
            "accelerator": "cpu",
            "default_root_dir": str(tmp_path),
            "max_steps": 2,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
        },
        "model": {
            "class_path": "rlkl_lightning.PPOModule",
            "init_args": {
                "policy": str(tiny_lm_dir),
                "penalty": {"init_coef": 0.2},
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 4},
                "optimization": {"ppo_epochs": 1, "num_minibatches": 1},
                "logging": {"log_samples_every": 0},
            },
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {"prompts": str(prompts), "heldout": None, "batch_size": 4},
        },
        "kl": {"controller": law("adaptive", horizon=100.0), "target": 1.0},
    }
    for group, values in groups.items():
        if isinstance(config.get(group), dict) and "init_args" in config[group]:
            config[group]["init_args"].update(values)
        elif isinstance(config.get(group), dict):
            config[group].update(values)
        else:
            config[group] = values
    path = tmp_path / "cli_configs" / name  # not default_root_dir: the CLI saves config.yaml there
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def cli_error(args: list[str], capfd) -> str:
    """The message ``main(args)`` ends with: ``error: ...`` last on stderr, exit status 2."""
    from rlkl_lightning.cli import main

    capfd.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capfd.readouterr().err.rstrip("\n")
    head, sep, message = err.rpartition("error: ")
    assert sep and (not head or head.endswith("\n")), err  # `error:` opens a line
    # No usage dump, no validator note quoting the config (the subprocess tests count lines).
    assert "usage:" not in err and "Does not validate" not in err and "Given value" not in err
    return message


def law(name: str, **init_args) -> dict:
    """A registered KL law with its arguments, as a config's ``kl.controller`` block."""
    from rlkl_lightning.kl.laws import law_spec

    return {"class_path": law_spec(name)["class_path"], "init_args": init_args}


def train_py(args: list[str], env: dict | None = None, timeout: float = 120):
    """``python train.py ARGS`` in a subprocess: (exit status, stdout and stderr merged)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return run.returncode, run.stdout
