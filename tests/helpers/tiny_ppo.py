"""PPOModule on a tiny local model: its arguments, prompt and text loaders, and a quiet fit.

``module_args`` are the keyword arguments of a ``PPOModule`` (or ``RLOOModule``) that learns
``good_fraction`` in a few batches of ``PROMPTS``; ``fit`` trains it on the CPU.
"""

from __future__ import annotations

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


def module_args(path, **overrides):
    args = dict(
        policy=str(path),
        reward=FunctionReward(good_fraction),
        init_kl_coef=0.0,
        max_prompt_tokens=16,  # prompt + response must fit the tiny model's 64 positions
        max_new_tokens=8,
        ppo_epochs=2,
        num_minibatches=2,
        lr=3e-3,
        log_samples_every=0,
    )
    args.update(overrides)
    return args


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
