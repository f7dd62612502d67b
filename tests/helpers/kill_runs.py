"""The config of a ``train.py`` run to kill: tiny PPO, checkpoints, a kill helper's stall points.

``write_config`` names the stall helpers of ``helpers/kill_helpers.py`` by class path; the run
needs ``tests/`` on its ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

WORDS = "the film was good bad this book is very not a story food nice dull plot".split()
PROMPTS = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(2 + i % 3)) for i in range(12)]
STEPS_PER_BATCH = 2  # ppo_epochs x num_minibatches
BATCHES = 6  # 3 per epoch: prompts 12, batch 4 (per process)


def write_config(tmp_path: Path, policy: Path, name: str, **options) -> Path:
    """The run's YAML; ``stall_at`` / ``stall_write`` / ``stall_after_write`` name the stall.

    ``stall_after_write``: the kill helper stalls right after that many writes of
    ``last.ckpt``.

    ``every``: a checkpoint every that many batches (2); validation runs at the end of each
    epoch (batches 3 and 6).

    ``refresh_every``: a ``ReferenceRefresh`` (hard reset) every that many batches, and beta
    held for one batch after each.

    ``budget``: a ``CapabilityBudget`` at that budget, the log-PID law, a validation after
    every batch (the cascade moves the target at each) and the test text logged too.
    """
    run_dir = tmp_path / name
    run_dir.mkdir()
    prompts = run_dir / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    plugins, marker = [], str(run_dir / "killed_in_write")
    if options.get("stall_write"):
        plugins = [
            {"class_path": "helpers.kill_helpers.StallInsideWrite", "init_args": {"marker": marker}}
        ]
    if options.get("stall_after_write"):
        plugins = [
            {
                "class_path": "helpers.kill_helpers.StallAfterWrite",
                "init_args": {
                    "marker": str(run_dir / "killed_after_write"),
                    "nth": options["stall_after_write"],
                },
            }
        ]
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": -1,
            "max_steps": BATCHES * STEPS_PER_BATCH,
            "enable_model_summary": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": "tiny"},
            },
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {
                        "every_n_train_steps": options.get("every", 2) * STEPS_PER_BATCH,
                        "save_last": True,
                        "monitor": "step",
                        "mode": "max",
                        "save_top_k": 2,
                    },
                },
                {
                    "class_path": "helpers.kill_helpers.StallBeforeBatch",
                    "init_args": {
                        "marker": str(run_dir / "killed_before_batch"),
                        "at": options.get("stall_at"),
                    },
                },
            ],
            "plugins": plugins or None,
        },
        "model": {
            "class_path": "rlkl_lightning.PPOModule",
            "init_args": {
                "policy": str(policy),
                "penalty": {"init_coef": 0.2},
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 6},
                "optimization": {"ppo_epochs": 1, "num_minibatches": 2, "lr": 3e-3},
                "logging": {"log_samples_every": 2},
            },
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {"prompts": str(prompts), "heldout": str(prompts), "batch_size": 4},
        },
        # The drift monitor's warm-up (3 x window) outlasts the run: no drift warning.
        "kl": {
            "controller": {"class_path": "AdaptiveKLController", "init_args": {"horizon": 40.0}},
            "target": 0.35,
            "window": 4,
        },
    }
    if options.get("refresh_every"):
        refresh = {
            "class_path": "rlkl_lightning.ReferenceRefresh",
            "init_args": {"every": options["refresh_every"]},
        }
        config["trainer"]["callbacks"].insert(0, refresh)
        config["kl"]["hold_after_refresh"] = 1
    if options.get("budget"):
        budget = {
            "class_path": "rlkl_lightning.CapabilityBudget",
            "init_args": {"budget": options["budget"]},
        }
        config["trainer"]["callbacks"].insert(0, budget)
        config["trainer"].update(val_check_interval=1, check_val_every_n_epoch=None)
        config["data"]["init_args"]["test_heldout"] = str(prompts)
        config["kl"] = {"controller": "logpid", "target": 0.35, "window": 4}
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
