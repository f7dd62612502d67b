"""RLOOModule under `--trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu`.

Leave-one-out groups must stay on one rank: each rank repeats the prompts the sampler dealt it,
so rank ``r`` holds the groups of prompts ``r, r + 2, ...`` of the global batch, whole. The KL
callbacks count the responses of the global batch (2 ranks x 2 prompts x k), with no
``batch_size_fn``, and every rank uses the same beta.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.cli_runs import law
from helpers.ddp_runs import train_py

from rlkl_lightning.algorithms.advantages import group_advantages
from rlkl_lightning.data.samplers import EpochShuffleSampler

pytestmark = pytest.mark.dist  # several processes: make test-dist

PROMPTS = ["the film was", "this book is", "the food", "a story", "it was", "not a", "very", "good"]
SEED, PER_RANK, K, BATCHES = 3, 2, 3, 2


def test_rloo_groups_stay_on_one_rank_and_the_callbacks_count_responses(tmp_path, tiny_lm_dir):
    import torch
    from helpers.tiny_models import make_tiny_lm

    reference = make_tiny_lm(tmp_path / "reference", seed=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "max_epochs": 1,
            "limit_train_batches": BATCHES,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
        },
        "model": {
            "class_path": "helpers.rloo_recording.RecordingRLOO",
            "init_args": {
                "record_dir": str(tmp_path / "out"),
                "policy": str(tiny_lm_dir),
                "reference": str(reference),
                "group": {"responses_per_prompt": K},
                "penalty": {"init_coef": 0.2},
                "sampling": {"max_prompt_tokens": 8, "max_new_tokens": 6},
                "optimization": {"ppo_epochs": 1, "num_minibatches": 1},
                "logging": {"log_samples_every": 0},
            },
        },
        "data": {
            "class_path": "rlkl_lightning.data.PromptDataModule",
            "init_args": {
                "prompts": str(prompts),
                "heldout": None,
                "batch_size": PER_RANK,
                "seed": SEED,
            },
        },
        "kl": {"controller": law("adaptive", horizon=10), "target": 0.5, "window": 2},
    }
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    train_py(path, tmp_path, "--trainer.strategy", "ddp", "--trainer.devices", "2")
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]

    order = [PROMPTS[i] for i in EpochShuffleSampler(len(PROMPTS), SEED)]
    global_batch = 2 * PER_RANK
    for b in range(BATCHES):
        batch = order[b * global_batch : (b + 1) * global_batch]
        for r, record in enumerate(ranks):
            step = record["batches"][b]
            # Rank r holds its own prompts (every second of the global batch), each K times.
            assert step["prompts"] == [p for p in batch[r::2] for _ in range(K)]
            returns = torch.tensor(step["returns"])
            want = group_advantages(returns, K, "rloo")
            assert step["advantages"] == pytest.approx(want.tolist(), abs=1e-6)
        assert ranks[0]["batches"][b]["beta_used"] == ranks[1]["batches"][b]["beta_used"]
    responses = BATCHES * global_batch * K
    for record in ranks:
        assert record["world_size"] == 2
        assert record["callback_samples"] == [responses, responses]  # controller and monitor
        assert record["samples_seen"] == responses
    assert ranks[0]["kl_coef"] == ranks[1]["kl_coef"] != 0.2  # beta moved, the same on both
