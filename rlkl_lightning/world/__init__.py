"""The offline default world: reviews, tokenizer and reference model, made locally.

``build_world()`` returns the cached world, building it the first time (a few minutes
on a laptop CPU): a seeded corpus of English reviews with 1-5 star ratings
(:mod:`.corpus`, :mod:`.lexicon`, :mod:`.patterns`), a byte-level BPE tokenizer
(:mod:`.tokenizer`) and a small GPT-2 trained on the reviews (:mod:`.sft`).
Prompts are review openings from the held-out split; the held-out reviews measure
perplexity; VADER scores the sentiment of responses. The exact world (:mod:`.exact`) is a
response space small enough to list, where a trained policy's distance to the optimum is exact.
"""

from importlib import import_module
from typing import Any

from rlkl_lightning.world.build import World, build_world, default_model_dir
from rlkl_lightning.world.cache import CACHE_ENV, Corpus, build_corpus, default_cache_dir
from rlkl_lightning.world.config import WorldConfig

_LAZY = {
    "ExactWorld": "rlkl_lightning.world.exact",
    "Review": "rlkl_lightning.world.corpus",
    "ReviewGenerator": "rlkl_lightning.world.corpus",
    "generate_reviews": "rlkl_lightning.world.corpus",
    "make_prompt": "rlkl_lightning.world.corpus",
    "make_prompts": "rlkl_lightning.world.corpus",
    "split_reviews": "rlkl_lightning.world.corpus",
    "train_tokenizer": "rlkl_lightning.world.tokenizer",
    "SFTDataModule": "rlkl_lightning.world.sft",
    "SFTModule": "rlkl_lightning.world.sft",
    "perplexity": "rlkl_lightning.world.evaluate",
    "unigram_perplexity": "rlkl_lightning.world.evaluate",
}

__all__ = [
    "CACHE_ENV",
    "Corpus",
    "World",
    "WorldConfig",
    "build_corpus",
    "build_world",
    "default_cache_dir",
    "default_model_dir",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    """Import the heavier modules (torch, transformers) on first use."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlkl_lightning.world' has no attribute {name!r}")
