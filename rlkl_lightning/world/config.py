"""Everything that makes a default world, and the hashes that name its cache entries.

The hashes include a fingerprint of the lexicon and patterns, so editing them rebuilds the
world (see :mod:`.cache` and :mod:`.build`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from rlkl_lightning.world.read import OWNER, UNITS

# Bump when the generator's logic changes in a way the lexicon fingerprint cannot see.
CORPUS_VERSION = 1


@dataclass(frozen=True)
class WorldConfig:
    """Everything that makes a default world (its hash names the cache entry).

    Attributes:
        seed: Seed of the corpus, the splits, the prompts and the model initialisation.
        num_reviews: Distinct reviews generated, all splits together.
        num_validation: Reviews in the validation split (SFT validation loss).
        num_test: Reviews in the held-out test split (prompts, perplexity).
        prompt_min_words: Shortest prompt opening, in words.
        prompt_max_words: Longest prompt opening, in words.
        vocab_size: BPE vocabulary size (special tokens and 256 bytes included).
        n_layer: Transformer blocks of the reference model.
        n_head: Attention heads.
        n_embd: Model width.
        n_positions: Context length in tokens.
        sft_steps: Optimizer steps of SFT.
        batch_size: Reviews per SFT batch.
        lr: Peak SFT learning rate.
        warmup_steps: SFT warm-up steps.
        weight_decay: SFT weight decay.
        val_check_interval: SFT steps between validation passes (progress display).
    """

    seed: int = 0
    num_reviews: int = 20_000
    num_validation: int = 500
    num_test: int = 1_000
    prompt_min_words: int = 2
    prompt_max_words: int = 5
    vocab_size: int = 2048
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 128
    sft_steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    val_check_interval: int = 400

    def __post_init__(self) -> None:
        positive = (
            "num_reviews num_validation num_test prompt_min_words vocab_size n_layer n_head "
            "n_embd n_positions sft_steps batch_size val_check_interval"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"WorldConfig: `{name}` must be an integer >= 1, got {value!r}")
        if self.num_validation + self.num_test >= self.num_reviews:
            raise ValueError(
                "WorldConfig: `num_validation` + `num_test` must be < `num_reviews`, got "
                f"{self.num_validation} + {self.num_test} >= {self.num_reviews}"
            )
        if self.prompt_max_words < self.prompt_min_words:
            raise ValueError(
                f"WorldConfig: `prompt_max_words` ({self.prompt_max_words}) must be >= "
                f"`prompt_min_words` ({self.prompt_min_words})"
            )
        if self.vocab_size <= 259:
            raise ValueError(f"WorldConfig: `vocab_size` must be > 259, got {self.vocab_size}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"WorldConfig: `n_embd` ({self.n_embd}) must be divisible by `n_head` "
                f"({self.n_head})"
            )
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError("WorldConfig: need `lr` > 0, `weight_decay` >= 0, `warmup_steps` >= 0")

    @classmethod
    def tiny(cls, **overrides) -> WorldConfig:
        """A world that builds in a few seconds, for tests (a barely trained model)."""
        settings = dict(
            num_reviews=600,
            num_validation=40,
            num_test=60,
            vocab_size=400,
            n_layer=1,
            n_head=2,
            n_embd=32,
            n_positions=128,
            sft_steps=30,
            batch_size=16,
            warmup_steps=5,
            val_check_interval=15,
        )
        settings.update(overrides)
        return cls(**settings)

    _CORPUS_FIELDS = (
        "seed num_reviews num_validation num_test prompt_min_words prompt_max_words "
        "vocab_size n_positions"
    ).split()

    def corpus_key(self) -> str:
        """Hash of the settings (and lexicon) that make the corpus and tokenizer."""
        settings = {name: getattr(self, name) for name in self._CORPUS_FIELDS}
        return _hash({"settings": settings, "lexicon": _lexicon_fingerprint()})

    def world_key(self) -> str:
        """Hash of every setting (and the lexicon): names the model stage."""
        return _hash({"settings": dataclasses.asdict(self), "lexicon": _lexicon_fingerprint()})


def _hash(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


_FINGERPRINT: str | None = None


def _lexicon_fingerprint() -> str:
    """Hash of the lexicon, the patterns and ``CORPUS_VERSION``."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        from rlkl_lightning.world import lexicon
        from rlkl_lightning.world.patterns import PATTERNS

        text = repr((CORPUS_VERSION, lexicon.all_words(), lexicon.DOMAINS, PATTERNS))
        _FINGERPRINT = hashlib.sha256(text.encode()).hexdigest()[:16]
    return _FINGERPRINT


@dataclass(frozen=True)
class CustomWorldConfig:
    """How a world is made from a user's texts (each field is a flag of the command).

    ``None`` sizes follow the corpus (:func:`~rlkl_lightning.world.custom.resolve`). The
    defaults of the SFT settings are :class:`WorldConfig`'s.

    Attributes:
        seed: Seed of the subset, the splits, the prompts and the model initialisation.
        column: Text column of CSV, JSON lines, parquet or dataset sources; ``None``: the
            first column named like text (``text``, ``review``, ``content``, ...), else the
            only text column.
        split: Split of a ``DatasetDict`` directory (``save_to_disk``).
        unit: One text of a ``.txt`` file: ``line``, ``paragraph`` (lines up to a blank
            line), or ``auto`` (paragraphs if blank lines are frequent, else lines).
        max_chars: Longest text kept, in characters; longer texts are cut (at a space).
        max_texts: Most texts kept: a larger corpus is cut to a seeded random subset of this
            many distinct texts (order kept).
        num_validation: Texts of the validation split (SFT validation); ``None``: 5% of the
            texts, at least 10 and at most 500.
        num_test: Texts of the held-out split (prompts, ``val/perplexity``); ``None``: 10%,
            at least 10 and at most 1,000.
        prompt_min_words: Shortest prompt opening, in words.
        prompt_max_words: Longest prompt opening, in words.
        vocab_size: BPE vocabulary (special tokens and 256 bytes included); ``None``: 2,048
            at the default world's corpus size, scaled by the square root of the training
            characters, rounded to 64, within 512-4,096.
        n_layer: Transformer blocks; ``None``: 3, or 4 from 4x the default world's corpus.
        n_head: Attention heads.
        n_embd: Model width; ``None``: 128, the default world's.
        n_positions: Context length in tokens (longer texts are cut in SFT), at least 48:
            a study's prompts are cut to half of it, and its runs write 24 tokens.
        sft_steps: SFT optimizer steps; ``None``: 4 epochs of the training split, at most
            1M tokens, within 100-800 steps (:func:`~rlkl_lightning.world.custom.sft_schedule`).
        batch_size: Texts per SFT batch.
        lr: Peak SFT learning rate.
        warmup_steps: SFT warm-up steps; ``None``: a tenth of ``sft_steps``, at most 30.
        weight_decay: SFT weight decay.
        val_check_interval: SFT steps between validation passes; ``None``: half the steps.
    """

    seed: int = WorldConfig.seed
    column: str | None = None
    split: str = "train"
    unit: str = "auto"
    max_chars: int = 1_000
    max_texts: int = 20_000
    num_validation: int | None = None
    num_test: int | None = None
    prompt_min_words: int = WorldConfig.prompt_min_words
    prompt_max_words: int = WorldConfig.prompt_max_words
    vocab_size: int | None = None
    n_layer: int | None = None
    n_head: int = WorldConfig.n_head
    n_embd: int | None = None
    n_positions: int = WorldConfig.n_positions
    sft_steps: int | None = None
    batch_size: int = WorldConfig.batch_size
    lr: float = WorldConfig.lr
    warmup_steps: int | None = None
    weight_decay: float = WorldConfig.weight_decay
    val_check_interval: int | None = None

    def __post_init__(self) -> None:
        positive = (
            "max_chars max_texts num_validation num_test prompt_min_words prompt_max_words "
            "vocab_size n_layer n_head n_embd n_positions sft_steps batch_size "
            "val_check_interval"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if value is None and name not in ("max_chars", "max_texts", "n_head"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{OWNER}: `--{name}` must be an integer >= 1, got {value!r}")
        if self.unit not in UNITS:
            raise ValueError(f"{OWNER}: `--unit` must be one of {list(UNITS)}, got {self.unit!r}")
        if self.prompt_max_words < self.prompt_min_words:
            raise ValueError(
                f"{OWNER}: `--prompt_max_words` ({self.prompt_max_words}) must be >= "
                f"`--prompt_min_words` ({self.prompt_min_words})"
            )
        if self.vocab_size is not None and self.vocab_size <= 259:
            raise ValueError(f"{OWNER}: `--vocab_size` must be > 259, got {self.vocab_size}")
        n_embd = self.n_embd or WorldConfig.n_embd
        if n_embd % self.n_head:
            raise ValueError(
                f"{OWNER}: `--n_embd` ({n_embd}) must be divisible by `--n_head` ({self.n_head})"
            )
        if self.n_positions < 48:  # a study's prompts (up to half) and 24 new tokens fit
            raise ValueError(f"{OWNER}: `--n_positions` must be >= 48, got {self.n_positions}")
        if not (self.lr > 0 and self.weight_decay >= 0):
            raise ValueError(f"{OWNER}: need `--lr` > 0 and `--weight_decay` >= 0")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"{OWNER}: `--warmup_steps` must be >= 0, got {self.warmup_steps}")
