"""The world's cache, and its first stage: the corpus.

Each stage is cached under a hash of the settings that make it (:class:`.WorldConfig`), in
``$RLKL_CACHE`` if set, else ``~/.cache/rlkl_lightning``. A stage is built in a temporary
directory and renamed into place when complete (:func:`build_stage`), so an interrupted build
never leaves a half-made stage and a stage being rebuilt stays until its successor is
complete; a lock file keeps two processes from building the same stage
at once.

``<cache>/corpus-<hash>/``
    ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` (fields ``text``,
    ``rating``, ``domain``), ``prompts.jsonl`` (review openings from the test split),
    ``tokenizer/``, ``corpus.json`` (counts and the VADER-rating correlation).

The second stage, the reference model, is :func:`rlkl_lightning.world.build.build_world`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlkl_lightning.world.config import WorldConfig

CACHE_ENV = "RLKL_CACHE"
_CORPUS_DONE = "corpus.json"


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


def default_cache_dir() -> Path:
    """``$RLKL_CACHE`` if set, else ``~/.cache/rlkl_lightning``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlkl_lightning")


def build_corpus(
    config: WorldConfig | None = None, cache_dir: str | Path | None = None, progress: bool = True
) -> Corpus:
    """The corpus stage (reviews, splits, prompts, tokenizer), built if missing."""
    config = config or WorldConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"corpus-{config.corpus_key()}"
    build_stage(target, _CORPUS_DONE, lambda tmp: _make_corpus(config, tmp, progress), progress)
    return Corpus.at(target)


def build_stage(
    target: Path,
    marker: str,
    make: Callable[[Path], None],
    progress: bool,
    label: str = "Default world",
    complete: Callable[[Path], bool] | None = None,
) -> None:
    """Build ``target`` with ``make(tmp_dir)`` unless it is complete; atomic rename.

    An existing ``target`` that is not the wanted stage is replaced only once the new one is
    complete: an interrupted rebuild leaves it as it was.

    Args:
        target: The stage's directory.
        marker: File that ``make`` writes last: its presence marks a complete stage.
        make: Writes the stage into the temporary directory it is given.
        progress: Print a message when built.
        label: Names the world in the message.
        complete: Whether a directory with the marker is the wanted stage (``None``: it is);
            one that is not is replaced.
    """

    def done() -> bool:
        return (target / marker).is_file() and (complete is None or complete(target))

    if done():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{target.name}.lock"):
        if done():  # another process finished it meanwhile
            return
        for prefix in (".tmp", ".old"):  # left by a killed build
            for stale in target.parent.glob(f"{prefix}-{target.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        from rlkl_lightning.random_streams import random_streams_kept

        try:
            try:
                with random_streams_kept():  # built inside a run, it leaves the run's draws alone
                    make(tmp)
            except (KeyboardInterrupt, SystemExit):
                # Ctrl-C; Lightning's trainer (the SFT) turns it into SystemExit(1), silently.
                kept = "the world there is kept" if target.exists() else "nothing was written"
                print(
                    f"{label}: interrupted while building {target}; {kept}. The same command "
                    "builds it again",
                    file=sys.stderr,
                    flush=True,
                )
                raise
            if not (tmp / marker).is_file():
                raise RuntimeError(f"building {target.name} did not write {marker}")
            _swap_in(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        info(f"{label}: built {target}")


def _swap_in(new: Path, target: Path) -> None:
    """Put the complete directory ``new`` at ``target``; an existing ``target`` goes only now.

    The old directory (incomplete, or a world being replaced) is renamed aside before the new
    one is renamed into place and only then deleted, so an interruption at any earlier moment
    (e.g. Ctrl-C during a rebuild's training) leaves the old one where it was.
    """
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".old-{target.name}-", dir=target.parent))
    os.replace(target, old / target.name)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (POSIX ``flock``; no-op where unavailable).

    The lock file is removed when the lock is released, so no ``.NAME.lock`` is left beside
    a world. A process that waited on a file removed meanwhile locks the new file instead (it
    checks that the path still names the file it holds), so two never hold the lock at once.
    """
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still keeps the cache consistent
        yield
        return
    while True:
        handle = open(path, "a")  # noqa: SIM115 (closed when the lock is released)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                break  # the file the path names: the lock is ours
        except FileNotFoundError:
            pass  # removed by its last holder: lock the new file
        except BaseException:
            handle.close()
            raise
        handle.close()  # closing releases the lock on the removed file
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _make_corpus(config: WorldConfig, out: Path, progress: bool) -> None:
    from rlkl_lightning.world import lexicon
    from rlkl_lightning.world.corpus import generate_reviews, make_prompts, split_reviews
    from rlkl_lightning.world.patterns import PATTERNS
    from rlkl_lightning.world.tokenizer import train_tokenizer

    start = time.perf_counter()
    if progress:
        info(f"Default world: writing {config.num_reviews} reviews and a tokenizer ...")
    reviews = generate_reviews(config.num_reviews, seed=config.seed)
    splits = split_reviews(reviews, config.num_validation, config.num_test, seed=config.seed)
    for name, rows in splits.items():
        write_jsonl(out / f"{name}.jsonl", [r.to_dict() for r in rows])
    prompts = make_prompts(
        splits["test"], config.prompt_min_words, config.prompt_max_words, seed=config.seed
    )
    write_jsonl(out / "prompts.jsonl", prompts)
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


def _vader_pearson(reviews) -> float:
    """Pearson correlation of VADER's compound score with the rating."""
    import numpy as np
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()
    scores = np.array([analyzer.polarity_scores(r.text)["compound"] for r in reviews])
    ratings = np.array([r.rating for r in reviews], dtype=float)
    return round(float(np.corrcoef(scores, ratings)[0, 1]), 4)


def info(message: str) -> None:
    """Print a build message (global rank 0 only)."""
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write one JSON object per line."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def jsonl_texts(path: Path) -> list[str]:
    """The ``text`` field of every row of a JSON-lines file."""
    return [row["text"] for row in read_jsonl(path)]
