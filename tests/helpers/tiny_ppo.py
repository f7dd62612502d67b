"""PPOModule on a tiny local model: its arguments, prompt and text loaders, and a quiet fit.

``module_args`` are the keyword arguments of a ``PPOModule`` (or ``RLOOModule``) that learns
``good_fraction`` in a few batches of ``PROMPTS``; ``fit`` trains it on the CPU. An override of
an option group is a dict of the fields that change (``penalty={"placement": "loss"}``), merged into
the group's arguments here; ``with_options`` changes the groups of a built module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.utils.data import DataLoader

from helpers.trainers import cpu_trainer
from rlkl_lightning.rewards import FunctionReward

PROMPTS = ["the film was", "this book is", "the food", "it was really", "a story"]


def good_fraction(prompt: str, response: str) -> float:
    """Trivially learnable reward: the fraction of response words that are 'good'."""
    words = response.split()
    return sum(w == "good" for w in words) / max(len(words), 1)


def loader(prompts: list[str], batch_size: int) -> DataLoader:
    return DataLoader(prompts, batch_size=batch_size, collate_fn=lambda xs: {"prompt": xs})


def text_loader(texts: list[str], batch_size: int) -> DataLoader:
    return DataLoader(texts, batch_size=batch_size, collate_fn=lambda xs: {"text": xs})


GROUPS = ("sampling", "optimization", "objective", "penalty", "models", "safeguards", "logging")
GROUPS += ("ppo", "group")


def module_args(path, **overrides: Any) -> dict[str, Any]:
    """The tiny module's arguments; a group's override (a dict) is merged into its fields."""
    args: dict[str, Any] = dict(
        policy=str(path),
        reward=FunctionReward(good_fraction),
        penalty={"init_coef": 0.0},
        # prompt + response must fit the tiny model's 64 positions
        sampling={"max_prompt_tokens": 16, "max_new_tokens": 8},
        optimization={"ppo_epochs": 2, "num_minibatches": 2, "lr": 3e-3},
        logging={"log_samples_every": 0},
    )
    for key, value in overrides.items():
        if key in GROUPS and isinstance(value, dict):
            args[key] = {**args.get(key, {}), **value}
        else:
            args[key] = value
    return args


def with_options(module, **changes: dict[str, Any]):
    """``module`` with the fields ``changes`` gives of its groups (``penalty={"placement": ...}``).

    A group is frozen: it is built again. The module's ``policy_objective`` holds the
    ``objective`` and ``penalty`` groups, the sampling temperature and ``max_new_tokens``, so it
    follows them too.
    """
    for name, fields in changes.items():
        setattr(module, name, dataclasses.replace(getattr(module, name), **fields))
    module.policy_objective.penalty = module.penalty
    module.policy_objective.options = module.objective
    module.policy_objective.temperature = module.sampling.temperature
    module.policy_objective.max_new_tokens = module.sampling.max_new_tokens
    return module


def fit(module, batches: int, batch_size: int = 16, callbacks=(), logger=False, val=None):
    """``batches`` batches of PROMPTS, then one pass over ``val`` where given."""
    trainer = cpu_trainer(
        callbacks,
        logger=logger,
        log_every_n_steps=1,
        limit_val_batches=None if val is not None else 0,
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batches * batch_size)]
    trainer.fit(module, loader(prompts, batch_size), val)
    return trainer
