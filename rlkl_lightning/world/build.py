"""Build and cache the offline default world.

Two stages, each cached under a hash of the settings that make it:

``<cache>/corpus-<hash>/``
    ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` (fields ``text``,
    ``rating``, ``domain``), ``prompts.jsonl`` (review openings from the test split),
    ``tokenizer/``, ``corpus.json`` (counts and the VADER-rating correlation).
``<cache>/world-<hash>/``
    ``model/`` (GPT-2 and tokenizer, ``save_pretrained``), ``report.json``.

The cache is ``$RLKL_CACHE`` if set, else ``~/.cache/rlkl_lightning``. A stage is
built in a temporary directory and renamed into place when complete, so an
interrupted build never leaves a half-made world; a lock file keeps two processes
from building the same stage at once. The hashes include a fingerprint of the
lexicon and patterns, so editing them rebuilds the world.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Bump when the generator's logic changes in a way the lexicon fingerprint cannot see.
CORPUS_VERSION = 1
CACHE_ENV = "RLKL_CACHE"
_CORPUS_DONE, _WORLD_DONE = "corpus.json", "report.json"
log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Corpus:
    """The corpus stage of a world: splits, prompts, tokenizer.

    Attributes:
        root: Directory of the stage.
        splits: JSONL file per split (``train``, ``validation``, ``test``).
        prompts_file: JSONL of prompt openings (``text``, ``rating``, ``domain``).
        tokenizer_dir: The tokenizer, ``save_pretrained`` format.
        stats: Contents of ``corpus.json``.
    """

    root: Path
    splits: dict[str, Path]
    prompts_file: Path
    tokenizer_dir: Path
    stats: dict

    @classmethod
    def at(cls, root: Path) -> Corpus:
        """Open a built corpus directory."""
        from rlkl_lightning.world.corpus import SPLITS

        return cls(
            root=root,
            splits={s: root / f"{s}.jsonl" for s in SPLITS},
            prompts_file=root / "prompts.jsonl",
            tokenizer_dir=root / "tokenizer",
            stats=json.loads((root / _CORPUS_DONE).read_text()),
        )


@dataclass(frozen=True)
class World:
    """A built default world.

    Attributes:
        config: The settings that made it.
        root: Directory of the model stage (``world-<hash>``).
        model_dir: Reference model and tokenizer (``AutoModelForCausalLM`` /
            ``AutoTokenizer`` load it).
        corpus: The corpus stage (splits, prompts, tokenizer).
        report: Contents of ``report.json``: perplexities, unigram baseline, timings.
    """

    config: WorldConfig
    root: Path
    model_dir: Path
    corpus: Corpus
    report: dict = field(default_factory=dict)

    @property
    def splits(self) -> dict[str, Path]:
        """JSONL file per split (``train``, ``validation``, ``test``)."""
        return self.corpus.splits

    @property
    def prompts_file(self) -> Path:
        """JSONL of prompt openings from the held-out split."""
        return self.corpus.prompts_file

    def prompts(self) -> list[str]:
        """The prompt openings: the first 2-5 words of held-out reviews, see ``make_prompts``."""
        return [row["text"] for row in _read_jsonl(self.prompts_file)]

    def texts(self, split: str = "test") -> list[str]:
        """Review texts of one split."""
        if split not in self.splits:
            raise ValueError(
                f"World.texts: `split` must be one of {list(self.splits)}, got {split!r}"
            )
        return _texts(self.splits[split])


def default_cache_dir() -> Path:
    """``$RLKL_CACHE`` if set, else ``~/.cache/rlkl_lightning``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlkl_lightning")


def default_model_dir(
    cache_dir: str | Path | None = None, build: bool = True, num_threads: int | None = None
) -> Path:
    """Directory of the default world's reference model (built first if missing).

    Args:
        cache_dir: Cache root; ``None``: :func:`default_cache_dir`.
        build: Build the world if it is missing (a few minutes on a laptop CPU, once).
            If False, the path is returned whether or not it exists.
        num_threads: torch threads for a build, see :func:`build_world`.
    """
    if build:
        return build_world(cache_dir=cache_dir, num_threads=num_threads).model_dir
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"world-{WorldConfig().world_key()}" / "model"


def build_corpus(
    config: WorldConfig | None = None, cache_dir: str | Path | None = None, progress: bool = True
) -> Corpus:
    """The corpus stage (reviews, splits, prompts, tokenizer), built if missing."""
    config = config or WorldConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"corpus-{config.corpus_key()}"
    _ensure(target, _CORPUS_DONE, lambda tmp: _make_corpus(config, tmp, progress), progress)
    return Corpus.at(target)


def build_world(
    config: WorldConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    num_threads: int | None = None,
) -> World:
    """The default world, built if missing or if ``config`` changed.

    Args:
        config: Settings of the world; ``None``: ``WorldConfig()``, the standard one.
        cache_dir: Cache root; ``None``: ``$RLKL_CACHE`` or ``~/.cache/rlkl_lightning``.
        progress: Show a progress bar and messages while building.
        num_threads: torch CPU threads while training the model (restored afterwards);
            ``None`` keeps torch's setting. On a machine whose cores are busy with other
            work, 1 thread can be many times faster than oversubscribed threads.

    Returns:
        The world; a second call with the same config returns the cached one at once.
    """
    config = config or WorldConfig()
    corpus = build_corpus(config, cache_dir, progress)
    root = corpus.root.parent / f"world-{config.world_key()}"
    _ensure(
        root,
        _WORLD_DONE,
        lambda tmp: _make_model(config, corpus, tmp, progress, num_threads),
        progress,
    )
    report = json.loads((root / _WORLD_DONE).read_text())
    return World(config=config, root=root, model_dir=root / "model", corpus=corpus, report=report)


# --- building ----------------------------------------------------------------------


def _ensure(target: Path, marker: str, make: Callable[[Path], None], progress: bool) -> None:
    """Build ``target`` with ``make(tmp_dir)`` unless it is complete; atomic rename."""
    if (target / marker).is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if (target / marker).is_file():  # another process finished it meanwhile
            return
        for stale in target.parent.glob(f".tmp-{target.name}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete (tampered with): rebuild
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        try:
            make(tmp)
            if not (tmp / marker).is_file():
                raise RuntimeError(f"building {target.name} did not write {marker}")
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        _info(f"Default world: built {target}")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (POSIX ``flock``; no-op where unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_corpus(config: WorldConfig, out: Path, progress: bool) -> None:
    from rlkl_lightning.world import lexicon
    from rlkl_lightning.world.corpus import generate_reviews, make_prompts, split_reviews
    from rlkl_lightning.world.patterns import PATTERNS
    from rlkl_lightning.world.tokenizer import train_tokenizer

    start = time.perf_counter()
    if progress:
        _info(f"Default world: writing {config.num_reviews} reviews and a tokenizer ...")
    reviews = generate_reviews(config.num_reviews, seed=config.seed)
    splits = split_reviews(reviews, config.num_validation, config.num_test, seed=config.seed)
    for name, rows in splits.items():
        _write_jsonl(out / f"{name}.jsonl", [r.to_dict() for r in rows])
    prompts = make_prompts(
        splits["test"], config.prompt_min_words, config.prompt_max_words, seed=config.seed
    )
    _write_jsonl(out / "prompts.jsonl", prompts)
    tokenizer = train_tokenizer(
        [r.text for r in splits["train"]], config.vocab_size, config.n_positions
    )
    tokenizer.save_pretrained(out / "tokenizer")
    stats = {
        "config": {name: getattr(config, name) for name in config._CORPUS_FIELDS},
        "num_reviews": {name: len(rows) for name, rows in splits.items()},
        "num_prompts": len(prompts),
        "lexicon_words": len(lexicon.vocabulary()),
        "lexicon_polar_words": len(lexicon.polar_vocabulary()),
        "patterns": len(PATTERNS),
        "vader_rating_pearson_test": _vader_pearson(splits["test"]),
        "seconds": round(time.perf_counter() - start, 2),
    }
    (out / _CORPUS_DONE).write_text(json.dumps(stats, indent=2))


def _make_model(
    config: WorldConfig, corpus: Corpus, out: Path, progress: bool, num_threads: int | None
) -> None:
    if progress:
        _info(
            f"Default world: training the reference model ({config.sft_steps} steps; "
            f"about 2-3 minutes on 2 CPU cores, once) into {out.parent} ..."
        )
    with _quiet_lightning(progress), _torch_threads(num_threads):
        # In a fresh, empty context: when the world is built while LightningCLI instantiates a
        # module (``policy: default``), Lightning's context variable of "given hyperparameters"
        # would otherwise hand that module's arguments to the SFT modules' save_hyperparameters.
        report = contextvars.Context().run(_train_and_evaluate, config, corpus, out, progress)
    (out / _WORLD_DONE).write_text(json.dumps(report, indent=2))
    if progress:
        _info(
            f"Default world: held-out perplexity {report['test_perplexity']:.2f} "
            f"(unigram baseline {report['unigram_test_perplexity']:.2f})"
        )


def _train_and_evaluate(config: WorldConfig, corpus: Corpus, out: Path, progress: bool) -> dict:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import RichProgressBar

    from rlkl_lightning.world.evaluate import perplexity, unigram_perplexity
    from rlkl_lightning.world.sft import SFTDataModule, SFTModule

    start = time.perf_counter()
    tokenizer_dir = str(corpus.tokenizer_dir)
    module = SFTModule(
        tokenizer=tokenizer_dir,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        n_positions=config.n_positions,
        lr=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps,
        seed=config.seed,
    )
    data = SFTDataModule(
        tokenizer=tokenizer_dir,
        train_files=str(corpus.splits["train"]),
        val_files=str(corpus.splits["validation"]),
        max_length=config.n_positions,
        batch_size=config.batch_size,
        seed=config.seed,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=config.sft_steps,
        val_check_interval=min(config.val_check_interval, config.sft_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=progress,
        callbacks=[RichProgressBar(leave=True)] if progress else [],
    )
    trainer.fit(module, data)
    train_seconds = time.perf_counter() - start
    module.save_pretrained(out / "model")

    train, val, test = (_texts(corpus.splits[s]) for s in ("train", "validation", "test"))
    tokens_per_step = data.num_train_tokens / len(data.train_data) * config.batch_size
    report = {
        "config": dataclasses.asdict(config),
        "corpus": corpus.stats,
        "test_perplexity": round(perplexity(module.model, module.tokenizer, test), 3),
        "validation_perplexity": round(perplexity(module.model, module.tokenizer, val), 3),
        "validation_perplexity_trainer": _metric(trainer, "val/perplexity"),
        "unigram_test_perplexity": round(
            unigram_perplexity(module.tokenizer, train, test, config.n_positions), 3
        ),
        "sft_steps": trainer.global_step,
        "sft_epochs": round(config.sft_steps * config.batch_size / len(data.train_data), 2),
        "sft_tokens_seen_approx": int(tokens_per_step * trainer.global_step),
        "sft_seconds": round(train_seconds, 1),
        "torch_threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in module.model.parameters()),
    }
    report["build_seconds"] = round(corpus.stats["seconds"] + time.perf_counter() - start, 1)
    return report


def _vader_pearson(reviews) -> float:
    """Pearson correlation of VADER's compound score with the rating."""
    import numpy as np
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    scores = np.array([analyzer.polarity_scores(r.text)["compound"] for r in reviews])
    ratings = np.array([r.rating for r in reviews], dtype=float)
    return round(float(np.corrcoef(scores, ratings)[0, 1]), 4)


def _metric(trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    return None if value is None else round(float(value), 3)


@contextlib.contextmanager
def _torch_threads(num_threads: int | None) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet_lightning(progress: bool) -> Iterator[None]:
    """Without progress: hide Lightning's info lines and transformers' save bars."""
    import lightning.pytorch  # noqa: F401  (its import sets the logger's level)
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("lightning.pytorch")
    level, bars = logger.level, hf_logging.is_progress_bar_enabled()
    if not progress:
        logger.setLevel(logging.WARNING)
        hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*number of training batches.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        try:
            yield
        finally:
            logger.setLevel(level)
            if bars:
                hf_logging.enable_progress_bar()


def _info(message: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _texts(path: Path) -> list[str]:
    return [row["text"] for row in _read_jsonl(path)]


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
