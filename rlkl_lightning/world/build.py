"""Build and cache the offline default world.

Two stages, each cached under a hash of the settings that make it (:class:`.WorldConfig`):

``<cache>/corpus-<hash>/``
    splits, prompts and tokenizer: :func:`~rlkl_lightning.world.cache.build_corpus`.
``<cache>/world-<hash>/``
    ``model/`` (GPT-2 and tokenizer, ``save_pretrained``), ``report.json``: the reference
    model, trained here by :mod:`.sft` and evaluated by :mod:`.evaluate`.

The cache is ``$RLKL_CACHE`` if set, else ``~/.cache/rlkl_lightning``; stages are built
atomically under a lock (:func:`~rlkl_lightning.world.cache.build_stage`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlkl_lightning import metric_keys as keys
from rlkl_lightning.world.cache import (
    Corpus,
    build_corpus,
    build_stage,
    default_cache_dir,
    info,
    jsonl_texts,
)
from rlkl_lightning.world.config import CustomWorldConfig, WorldConfig

_WORLD_DONE = "report.json"


@dataclass(frozen=True)
class World:
    """A built world: the default one, or one made from a user's texts (:mod:`.custom`).

    Attributes:
        config: The settings that made it.
        root: Directory of the model stage (``world-<hash>``; a custom world's directory).
        model_dir: Reference model and tokenizer (``AutoModelForCausalLM`` /
            ``AutoTokenizer`` load it).
        corpus: The corpus stage (splits, prompts, tokenizer).
        report: Contents of ``report.json``: perplexities, unigram baseline, timings.
    """

    config: WorldConfig | CustomWorldConfig
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
        return jsonl_texts(self.prompts_file)

    def texts(self, split: str = "test") -> list[str]:
        """Review texts of one split."""
        if split not in self.splits:
            raise ValueError(
                f"World.texts: `split` must be one of {list(self.splits)}, got {split!r}"
            )
        return jsonl_texts(self.splits[split])


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
    build_stage(
        root,
        _WORLD_DONE,
        lambda tmp: make_reference_model(config, corpus, tmp, progress, num_threads, target=root),
        progress,
    )
    report = json.loads((root / _WORLD_DONE).read_text())
    return World(config=config, root=root, model_dir=root / "model", corpus=corpus, report=report)


# --- building ----------------------------------------------------------------------


def make_reference_model(
    config: WorldConfig | CustomWorldConfig,
    corpus: Corpus,
    out: Path,
    progress: bool,
    num_threads: int | None,
    label: str = "Default world",
    duration: str = "about 2-3 minutes on 2 CPU cores",
    target: Path | None = None,
) -> None:
    """Train the reference model on ``corpus`` into ``out/model``; write ``out/report.json``.

    Args:
        config: The model and SFT settings: ``seed``, ``n_layer``, ``n_head``, ``n_embd``,
            ``n_positions``, ``sft_steps``, ``batch_size``, ``lr``, ``warmup_steps``,
            ``weight_decay``, ``val_check_interval``.
        corpus: Its train and validation splits train it; the test split is held out.
        out: The stage's (temporary) directory.
        progress: Show progress and messages.
        num_threads: torch threads while training (see :func:`build_world`).
        label: Names the world in messages.
        duration: How long the training is expected to take, in messages.
        target: The world's directory, where ``out`` is moved once complete (the message
            names it); None: ``out``.
    """
    if progress:
        info(
            f"{label}: training the reference model ({config.sft_steps} steps; "
            f"{duration}, once) into {target or out} ..."
        )
    with _quiet_lightning(progress), _torch_threads(num_threads):
        # In a fresh, empty context: when the world is built while LightningCLI instantiates a
        # module (``policy: default``), Lightning's context variable of "given hyperparameters"
        # would otherwise hand that module's arguments to the SFT modules' save_hyperparameters.
        report = contextvars.Context().run(_train_and_evaluate, config, corpus, out, progress)
    (out / _WORLD_DONE).write_text(json.dumps(report, indent=2))
    if progress:
        info(
            f"{label}: held-out perplexity {report['test_perplexity']:.2f} "
            f"(unigram baseline {report['unigram_test_perplexity']:.2f})"
        )


def _train_and_evaluate(
    config: WorldConfig | CustomWorldConfig, corpus: Corpus, out: Path, progress: bool
) -> dict:
    import torch
    from lightning.pytorch import Trainer

    from rlkl_lightning.console import RunProgressBar
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
        # "Training" over the SFT's steps, not Lightning's "Epoch 0/-2" of a max_steps run.
        callbacks=[RunProgressBar(leave=True)] if progress else [],
    )
    trainer.fit(module, data)
    train_seconds = time.perf_counter() - start
    module.save_pretrained(out / "model")

    train, val, test = (jsonl_texts(corpus.splits[s]) for s in ("train", "validation", "test"))
    tokens_per_step = data.num_train_tokens / len(data.train_data) * config.batch_size
    report = {
        "config": dataclasses.asdict(config),
        "corpus": corpus.stats,
        "test_perplexity": round(perplexity(module.model, module.tokenizer, test), 3),
        "validation_perplexity": round(perplexity(module.model, module.tokenizer, val), 3),
        "validation_perplexity_trainer": _metric(trainer, keys.PERPLEXITY),
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
    """Hide Lightning's tips (always) and, without progress, its info lines and save bars."""
    import lightning.pytorch  # noqa: F401  (its import sets the logger's level)
    from transformers.utils import logging as hf_logging

    from rlkl_lightning.console import drop_lightning_tips

    drop_lightning_tips()

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
