"""A world made from a user's texts: ``python -m rlkl_lightning.world --texts FILES``.

:func:`build_custom_world` reads the texts (:mod:`.read`), keeps at most ``max_texts`` of
them (a seeded random subset), splits them into train / validation / test, takes each test
text's opening words as a prompt, and trains the default world's byte-level BPE tokenizer
(:mod:`.tokenizer`) and GPT-2 reference model (:mod:`.sft`, through
:func:`~rlkl_lightning.world.build.make_reference_model`) on the training split. Sizes the
user leaves unset follow the corpus (:func:`resolve`).

The world is one directory, named by a hash of the kept texts and the resolved settings
(``<cache>/custom-<hash>``, or ``out``), built atomically like the default world's stages
(:func:`~rlkl_lightning.world.cache.build_stage`): a second call with the same texts and
settings returns it at once. It holds ``train.jsonl``, ``validation.jsonl``, ``test.jsonl``
and ``prompts.jsonl`` (field ``text``), ``tokenizer/``, ``model/`` (``save_pretrained``),
``corpus.json`` and ``report.json`` (counts, perplexities, timings), ``study.yaml`` (what
a study on this world changes in every run, see
:func:`rlkl_lightning.compare.custom_world.study_overrides`) and ``world.json``
(its hash and settings; written last).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkl_lightning.world.cache import Corpus, build_stage, default_cache_dir, info, write_jsonl
from rlkl_lightning.world.config import CustomWorldConfig, WorldConfig
from rlkl_lightning.world.read import OWNER, read_corpus

if TYPE_CHECKING:
    from rlkl_lightning.world.build import World

# Bump when the way a custom world is made changes in a way its settings cannot see.
CUSTOM_VERSION = 1
#: Fewest texts the training split may keep.
MIN_TRAIN_TEXTS = 20
#: Characters in the default world's training split: the corpus size at which the automatic
#: sizes of :func:`resolve` equal the default world's (2,048 tokens, 3 layers of width 128).
DEFAULT_TRAIN_CHARS = 1_950_000
#: Most tokens an automatic SFT schedule trains on: 1.5x the default world's 650k (its time:
#: docs/worlds.md).
SFT_TOKEN_BUDGET = 1_000_000
STUDY_FILE = "study.yaml"
_MARKER = "world.json"
_LABEL = "Custom world"
_READ_FIELDS = ("column", "split", "unit", "max_chars", "max_texts")


def split_sizes(config: CustomWorldConfig, n_texts: int) -> tuple[int, int]:
    """``(num_validation, num_test)`` for ``n_texts`` texts.

    Raises:
        ValueError: If fewer than :data:`MIN_TRAIN_TEXTS` texts would be left for training.
    """
    validation = config.num_validation or min(500, max(10, n_texts // 20))
    test = config.num_test or min(1_000, max(10, n_texts // 10))
    if n_texts - validation - test < MIN_TRAIN_TEXTS:
        raise ValueError(
            f"{OWNER}: too few texts for the splits: {n_texts} distinct non-empty texts, but "
            f"validation ({validation}, `--num_validation`) + test ({test}, `--num_test`) + "
            f"at least {MIN_TRAIN_TEXTS} for training need {validation + test + MIN_TRAIN_TEXTS}"
            "; give more text or smaller splits"
        )
    return validation, test


def resolve(config: CustomWorldConfig, n_texts: int, train_chars: int) -> CustomWorldConfig:
    """``config`` with the splits and model sizes it leaves ``None`` chosen for the corpus.

    The rules (``r``: training characters over :data:`DEFAULT_TRAIN_CHARS`, the default
    world's): vocabulary ``2048 * sqrt(r)`` rounded to 64 within 512-4,096 (a BPE's useful
    vocabulary grows sublinearly with its corpus); 3 layers of width 128 (the default world's
    model) below ``r = 4``, else 4 layers (a third more compute: the width stays 128 so that
    a study on the world stays minutes on a CPU; ``n_embd`` sets it). The SFT schedule needs
    the token count: :func:`sft_schedule`.
    """
    validation, test = split_sizes(config, n_texts)
    ratio = train_chars / DEFAULT_TRAIN_CHARS
    vocab = config.vocab_size or int(min(4096, max(512, 64 * round(32 * math.sqrt(ratio)))))
    return dataclasses.replace(
        config,
        num_validation=validation,
        num_test=test,
        vocab_size=vocab,
        n_layer=config.n_layer or (4 if ratio >= 4 else 3),
        n_embd=config.n_embd or WorldConfig.n_embd,
    )


def sft_schedule(settings: CustomWorldConfig, n_train: int, train_tokens: int) -> CustomWorldConfig:
    """``settings`` with the SFT steps, warm-up and validation interval it leaves ``None`` set.

    Steps: 4 epochs of the ``n_train`` training texts (``train_tokens`` tokens as the SFT
    sees them), but at most :data:`SFT_TOKEN_BUDGET` tokens, within 100-800 steps. The
    default world's 800 steps are 1.4 epochs of its 18,500 short reviews (650k tokens); a
    smaller corpus needs more passes, and the budget bounds the build time of long texts.
    Warm-up: a tenth of the steps, at most 30. Validation: twice.
    """
    batch = settings.batch_size
    epochs = 4 * n_train / batch
    budget = SFT_TOKEN_BUDGET / (batch * train_tokens / n_train)
    steps = settings.sft_steps or min(800, max(100, math.ceil(min(epochs, budget))))
    warmup = settings.warmup_steps
    return dataclasses.replace(
        settings,
        sft_steps=steps,
        warmup_steps=warmup if warmup is not None else min(30, steps // 10),
        val_check_interval=settings.val_check_interval or max(1, steps // 2),
    )


def world_key(texts: list[str], settings: CustomWorldConfig) -> str:
    """Hash of the kept texts and the settings that make the world from them."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    build = {k: v for k, v in dataclasses.asdict(settings).items() if k not in _READ_FIELDS}
    payload = {"version": CUSTOM_VERSION, "texts": digest.hexdigest(), "settings": build}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def subsample(texts: list[str], max_texts: int, seed: int) -> list[str]:
    """At most ``max_texts`` of ``texts``: a seeded random subset, in the original order."""
    if len(texts) <= max_texts:
        return texts
    keep = sorted(random.Random(seed).sample(range(len(texts)), max_texts))
    return [texts[i] for i in keep]


def openings(texts: list[str], min_words: int, max_words: int, seed: int) -> list[str]:
    """Prompts: each text's first ``k`` words, ``k`` uniform in ``[min_words, max_words]``.

    The opening always leaves at least one word for the policy to write: a text of ``k``
    words or fewer opens with all but its last (none if that is fewer than ``min_words``).
    Text without spaces (Chinese, Japanese: more than 12 characters per "word") opens with
    its first ``2k`` characters instead.
    """
    rng = random.Random(seed)
    out = []
    for text in texts:
        k = rng.randint(min_words, max_words)
        words = text.split()
        if len(text) > 12 * len(words):
            if len(text) > 2 * min_words:
                out.append(text[: min(2 * k, len(text) - 1)].rstrip())
        elif len(words) > min_words:
            out.append(" ".join(words[: min(k, len(words) - 1)]))
    return out


def build_custom_world(
    texts: str | list[str],
    config: CustomWorldConfig | None = None,
    out: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    num_threads: int | None = None,
) -> World:
    """The world made from ``texts``, built if missing (see the module docstring).

    Args:
        texts: Files and directories of text (:func:`~rlkl_lightning.world.read.read_corpus`).
        config: How to make it; ``None``: ``CustomWorldConfig()``.
        out: Its directory; ``None``: ``<cache_dir>/custom-<hash>``. A directory there that
            is not a world is never overwritten; a world of other texts or settings is
            rebuilt.
        cache_dir: Cache root when ``out`` is ``None``; ``None``: ``$RLKL_CACHE`` or
            ``~/.cache/rlkl_lightning``.
        progress: Show progress and messages.
        num_threads: torch threads while training the model; ``None``: torch's setting.

    Returns:
        The world (:class:`~rlkl_lightning.world.build.World`).
    """
    config = config or CustomWorldConfig()
    start = time.perf_counter()
    corpus, stats = read_corpus(texts, config.column, config.split, config.unit, config.max_chars)
    corpus = subsample(corpus, config.max_texts, config.seed)
    stats["subsampled_to"] = len(corpus) if stats["kept"] > len(corpus) else None
    validation, test = split_sizes(config, len(corpus))
    from rlkl_lightning.world.corpus import shuffle_split

    splits = shuffle_split(corpus, validation, test, config.seed, owner=OWNER)
    settings = resolve(config, len(corpus), sum(len(t) for t in splits["train"]))
    prompts = openings(
        splits["test"], settings.prompt_min_words, settings.prompt_max_words, settings.seed
    )
    if not prompts:
        raise ValueError(
            f"{OWNER}: no held-out text is longer than `--prompt_min_words` "
            f"({settings.prompt_min_words}) words, so there are no prompts; give longer texts"
        )
    key = world_key(corpus, settings)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = Path(out).expanduser() if out is not None else root / f"custom-{key}"
    if (
        out is not None
        and target.exists()
        and _key(target) is None
        and (not target.is_dir() or any(target.iterdir()))
    ):
        raise ValueError(
            f"{OWNER}: `--out` {str(target)!r} exists and is not a world; name a new or "
            "empty directory"
        )
    if out is not None:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a folder above it is a file
            found = next(p for p in target.parents if p.exists())
            why = f"{str(found)!r} is a file" if found.is_file() else error.strerror
            raise ValueError(
                f"{OWNER}: `--out` {str(target)!r} cannot be made: {why}; name a new or empty "
                "directory"
            ) from None
    stats |= {
        "sources": [str(s) for s in ([texts] if isinstance(texts, (str, Path)) else texts)],
        "num_texts": {name: len(rows) for name, rows in splits.items()},
        "num_prompts": len(prompts),
        "train_chars": sum(len(t) for t in splits["train"]),
        "train_words": sum(len(t.split()) for t in splits["train"]),
        "read_seconds": round(time.perf_counter() - start, 2),
    }

    def make(tmp: Path) -> None:
        _make(tmp, key, settings, splits, prompts, stats, progress, num_threads, target)

    if out is not None and _key(target) not in (None, key):
        print(
            f"{OWNER}: replacing the world in {str(target)!r}: it was built from other texts "
            "or settings",
            file=sys.stderr,
            flush=True,
        )
    build_stage(target, _MARKER, make, progress, label=_LABEL, complete=lambda d: _key(d) == key)
    world = open_world(target)
    warn_if_no_better_than_unigram(world.report, str(target))
    return world


def warn_if_no_better_than_unigram(report: dict[str, Any], where: str) -> None:
    """Warn when the reference's held-out perplexity does not beat the unigram baseline.

    Such a reference has learned nothing beyond word frequencies: a KL to it says little.
    """
    ppl, unigram = report.get("test_perplexity"), report.get("unigram_test_perplexity")
    if isinstance(ppl, int | float) and isinstance(unigram, int | float) and not ppl < unigram:
        warnings.warn(
            f"{OWNER}: the reference of the world in {where!r} does not beat the unigram "
            f"baseline (held-out perplexity {ppl:.2f}, unigram {unigram:.2f}): it has learned "
            "no more than word frequencies; give more texts or more `--sft_steps`",
            RuntimeWarning,
            stacklevel=3,
        )


def _make(
    out: Path,
    key: str,
    settings: CustomWorldConfig,
    splits: dict[str, list[str]],
    prompts: list[str],
    stats: dict,
    progress: bool,
    num_threads: int | None,
    target: Path,
) -> None:
    from rlkl_lightning.world.build import make_reference_model
    from rlkl_lightning.world.tokenizer import train_tokenizer

    start = time.perf_counter()
    if progress:
        info(f"{_LABEL}: {stats['num_texts']} texts, {len(prompts)} prompts; a tokenizer ...")
    for name, rows in splits.items():
        write_jsonl(out / f"{name}.jsonl", [{"text": t} for t in rows])
    write_jsonl(out / "prompts.jsonl", [{"text": p} for p in prompts])
    tokenizer = train_tokenizer(splits["train"], settings.vocab_size, settings.n_positions)
    tokenizer.save_pretrained(out / "tokenizer")
    context = settings.n_positions
    encoded = tokenizer(prompts, truncation=True, max_length=context)["input_ids"]
    prompt_tokens = max(len(ids) for ids in encoded)
    encoded = tokenizer(splits["train"], truncation=True, max_length=context)["input_ids"]
    train_tokens = sum(min(len(ids) + 1, context) for ids in encoded)  # bos + text + eos
    settings = sft_schedule(settings, len(splits["train"]), train_tokens)
    stats = stats | {"max_prompt_tokens": prompt_tokens, "train_tokens": train_tokens}
    stats["seconds"] = round(stats["read_seconds"] + time.perf_counter() - start, 2)
    (out / "corpus.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False))
    make_reference_model(
        settings,
        Corpus.at(out),
        out,
        progress,
        num_threads,
        label=_LABEL,
        duration=f"{len(splits['train']):,} training texts",
        target=target,
    )
    study = {
        "model": {
            "init_args": {
                "policy": "./model",
                # Longest prompt, within half the context (prompts are cut on the left).
                "sampling": {"max_prompt_tokens": min(prompt_tokens, settings.n_positions // 2)},
            }
        },
        "data": {"init_args": {"prompts": "./prompts.jsonl", "heldout": "./test.jsonl"}},
    }
    header = (
        "# What a study on this world changes in every run: python -m rlkl_lightning.compare "
        "--world DIR\n# merges it into each run's config after the study's `overrides` (a "
        "value starting with ./ is a\n# path in this directory). The reward stays the run's "
        "own (VADER) unless set here (one of rlkl_lightning's own classes), e.g.\n"
        "# model: {init_args: {reward: {class_path: ...}}}\n"
    )
    (out / STUDY_FILE).write_text(header + yaml_dump(study))
    world = {
        "key": key,
        "version": CUSTOM_VERSION,
        "settings": dataclasses.asdict(settings),
        "sources": stats["sources"],
    }
    (out / _MARKER).write_text(json.dumps(world, indent=2))


def yaml_dump(data: dict) -> str:
    """``data`` as block YAML, keys in order."""
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _key(directory: Path) -> str | None:
    """The hash recorded in a custom world's ``world.json``; ``None`` if it has none."""
    try:
        return json.loads((directory / _MARKER).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def open_world(directory: str | Path, where: str = "compare: `world`") -> World:
    """A built custom world, from its directory.

    Raises:
        ValueError: Starting with ``where`` (who asks, and the option), if the directory
            holds no complete custom world.
    """
    from rlkl_lightning.world.build import World

    root = Path(directory).expanduser()
    if _key(root) is None:
        raise ValueError(
            f"{where} {str(root)!r} is not a world built by `python -m rlkl_lightning.world "
            f"--texts FILES` (it has no {_MARKER} with the world's hash)"
        )
    settings = json.loads((root / _MARKER).read_text())["settings"]
    return World(
        config=CustomWorldConfig(**settings),
        root=root,
        model_dir=root / "model",
        corpus=Corpus.at(root),
        report=json.loads((root / "report.json").read_text()),
    )
