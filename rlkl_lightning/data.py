"""Prompts and held-out text for PPO, read with ``datasets``.

A source is one of:

- ``"default"``: the offline default world (:mod:`rlkl_lightning.world`): review
  openings from its held-out split as prompts, the held-out reviews as held-out text;
- a local file or list of files: ``.txt`` (one text per line, column ``text``),
  ``.csv``/``.tsv``, ``.json``/``.jsonl`` (JSON lines or a JSON list of records),
  ``.parquet``; or a local dataset directory;
- any other string: a dataset on the Hugging Face hub (``"imdb"``), loaded with
  ``datasets.load_dataset(name, split=...)``.

Training batches are ``{"prompt": list[str]}``, validation batches
``{"text": list[str]}``. Under DDP the training loader deals the prompts of one shared
order to the ranks itself (:class:`~rlkl_lightning.resumable.RankShardSampler`); validation
batches are sharded by Lightning's ``DistributedSampler``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from rlkl_lightning.resumable import EpochShuffleSampler, RankShardSampler, ResumableDataLoader
from rlkl_lightning.world.build import WorldConfig

if TYPE_CHECKING:
    import datasets

# Local file suffix -> datasets builder.
FILE_BUILDERS = {
    ".txt": "text",
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


def collate_dicts(rows: list[dict]) -> dict[str, list]:
    """Turn a list of rows (dicts) into a dict of lists; picklable for worker processes."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def load_texts(
    source: str | Sequence[str],
    column: str,
    *,
    split: str = "train",
    owner: str = "PromptDataModule",
    source_option: str = "prompts",
    column_option: str = "prompt_column",
) -> list[str]:
    """Read one text column from local files, a local dataset directory or the hub.

    Args:
        source: File path, list of file paths, dataset directory or hub dataset name.
        column: Name of the text column.
        split: Split to load from a directory or hub dataset (local files are one split).
        owner: Class name used in error messages.
        source_option: Option name of ``source`` used in error messages.
        column_option: Option name of ``column`` used in error messages.

    Returns:
        The non-empty texts, stripped of surrounding whitespace, in file order.

    Raises:
        ValueError: A file is missing or has an unsupported suffix, the column is
            missing or not text, or nothing is left.
    """
    dataset, where = _load_dataset(source, split, owner, source_option)
    if column not in dataset.column_names:
        raise ValueError(
            f"{owner}: `{column_option}` {column!r} not found in {where}; "
            f"available columns: {dataset.column_names}"
        )
    texts = []
    for value in dataset[column]:
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(
                f"{owner}: `{column_option}` {column!r} in {where} holds "
                f"{type(value).__name__} values, not text"
            )
        if value.strip():
            texts.append(value.strip())
    if not texts:
        raise ValueError(f"{owner}: no non-empty texts in column {column!r} of {where}")
    return texts


def _load_dataset(
    source: str | Sequence[str], split: str, owner: str, option: str
) -> tuple[datasets.Dataset, str]:
    import datasets

    files = [source] if isinstance(source, (str, Path)) else list(source)
    if not files:
        raise ValueError(f"{owner}: `{option}` is an empty list")
    paths = [Path(f).expanduser() for f in files]
    local = len(paths) > 1 or paths[0].suffix.lower() in FILE_BUILDERS or paths[0].exists()
    with _quiet_datasets():
        if not local:  # a hub dataset name, e.g. "imdb"
            name = str(files[0])
            try:
                return datasets.load_dataset(name, split=split), f"hub dataset {name!r}"
            except Exception as error:  # offline, unknown name, unknown split, ...
                raise ValueError(
                    f"{owner}: `{option}` {name!r} is not a local file or directory, and "
                    f"loading it from the Hugging Face hub (split {split!r}) failed: {error}"
                ) from error
        for path in paths:
            if not path.exists():
                raise ValueError(f"{owner}: `{option}` file not found: {str(path)!r}")
        if len(paths) == 1 and paths[0].is_dir():
            try:
                return datasets.load_dataset(str(paths[0]), split=split), f"{paths[0]}"
            except Exception as error:
                raise ValueError(
                    f"{owner}: `{option}` directory {str(paths[0])!r} could not be loaded "
                    f"as a dataset (split {split!r}): {error}"
                ) from error
        suffixes = {p.suffix.lower() for p in paths}
        unknown = sorted(suffixes - FILE_BUILDERS.keys())
        if unknown:
            raise ValueError(
                f"{owner}: `{option}` has unsupported file type(s) {unknown}; "
                f"allowed: {sorted(FILE_BUILDERS)}"
            )
        builders = {FILE_BUILDERS[s] for s in suffixes}
        if len(builders) > 1:
            raise ValueError(
                f"{owner}: `{option}` mixes file types {sorted(suffixes)}; use one type"
            )
        builder = builders.pop()
        kwargs = {"sep": "\t"} if suffixes == {".tsv"} else {}
        where = f"{option} file {paths[0].name}" if len(paths) == 1 else f"{option} files"
        try:
            data = datasets.load_dataset(
                builder, data_files=[str(p) for p in paths], split="train", **kwargs
            )
        except Exception as error:
            raise ValueError(f"{owner}: could not read `{option}` {files}: {error}") from error
        return data, where


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide datasets' per-file progress bars while reading small local files."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


def first_words(text: str, n: int) -> str:
    """The first ``n`` whitespace-separated words of ``text``."""
    return " ".join(text.split()[:n])


class PromptDataModule(LightningDataModule):
    """Prompts for PPO rollouts and held-out text for perplexity.

    Args:
        prompts: ``"default"`` (openings of the default world's held-out reviews),
            local file(s) (.txt/.csv/.tsv/.json/.jsonl/.parquet), a local dataset
            directory, or a hub dataset name such as ``"imdb"``.
        prompt_column: Column holding the prompt text.
        prompt_split: Split of a hub dataset or directory to take prompts from.
        prompt_words: If set, cut every prompt to its first ``prompt_words`` words
            (makes openings from full texts such as IMDB reviews).
        heldout: Held-out text for validation perplexity, same forms as ``prompts``
            (``"default"``: the default world's held-out reviews); ``None`` disables
            validation.
        heldout_column: Column holding the held-out text.
        heldout_split: Split of a hub dataset or directory for held-out text.
        heldout_words: If set, cut held-out texts to their first ``heldout_words`` words.
        batch_size: Prompts per training batch (per process under DDP).
        val_batch_size: Held-out texts per validation batch; ``None``: ``batch_size``.
        num_prompts: Keep at most this many prompts (a seeded random subset).
        num_heldout: Keep at most this many held-out texts (a seeded random subset).
        seed: Seed of the subsets and of the shuffle.
        shuffle: Shuffle the prompts every epoch.
        num_workers: DataLoader worker processes.
        world: Config of the default world (``None``: the standard one); used only
            when ``prompts`` or ``heldout`` is ``"default"``.
    """

    def __init__(
        self,
        prompts: str | list[str] = "default",
        prompt_column: str = "text",
        prompt_split: str = "train",
        prompt_words: int | None = None,
        heldout: str | list[str] | None = "default",
        heldout_column: str = "text",
        heldout_split: str = "test",
        heldout_words: int | None = None,
        batch_size: int = 16,
        val_batch_size: int | None = None,
        num_prompts: int | None = None,
        num_heldout: int | None = 256,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        world: WorldConfig | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("val_batch_size", val_batch_size),
            ("num_prompts", num_prompts),
            ("num_heldout", num_heldout),
            ("prompt_words", prompt_words),
            ("heldout_words", heldout_words),
        ):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"PromptDataModule: `{name}` must be >= 1 or None, got {value!r}")
        if num_workers < 0:
            raise ValueError(f"PromptDataModule: `num_workers` must be >= 0, got {num_workers}")
        for name, column in (("prompt_column", prompt_column), ("heldout_column", heldout_column)):
            if not column:
                raise ValueError(f"PromptDataModule: `{name}` must be a non-empty column name")
        self.save_hyperparameters(ignore=["world"])
        self.world = world
        self.prompt_dataset: datasets.Dataset | None = None
        self.heldout_dataset: datasets.Dataset | None = None

    def _uses_world(self) -> bool:
        return self.hparams.prompts == "default" or self.hparams.heldout == "default"

    def prepare_data(self) -> None:
        """Build the default world once (local rank 0) if a source is ``"default"``."""
        if self._uses_world():
            from rlkl_lightning.world import build_world

            build_world(self.world)

    def setup(self, stage: str | None = None) -> None:
        """Read prompts and held-out text (every process reads the whole set)."""
        if self.prompt_dataset is not None:
            return
        hp = self.hparams
        world = None
        if self._uses_world():
            from rlkl_lightning.world import build_world

            world = build_world(self.world, progress=False)
        if hp.prompts == "default":
            prompts = load_texts(
                str(world.prompts_file), hp.prompt_column, column_option="prompt_column"
            )
        else:
            prompts = load_texts(hp.prompts, hp.prompt_column, split=hp.prompt_split)
        prompts = self._subset(prompts, hp.num_prompts, hp.prompt_words, salt=0)
        self.prompt_dataset = _as_dataset("prompt", prompts)
        if hp.heldout is None:
            return
        source = str(world.splits["test"]) if hp.heldout == "default" else hp.heldout
        heldout = load_texts(
            source,
            hp.heldout_column,
            split=hp.heldout_split,
            source_option="heldout",
            column_option="heldout_column",
        )
        heldout = self._subset(heldout, hp.num_heldout, hp.heldout_words, salt=1)
        self.heldout_dataset = _as_dataset("text", heldout)

    def _subset(self, texts: list[str], cap: int | None, words: int | None, salt: int) -> list[str]:
        if words is not None:
            texts = [first_words(t, words) for t in texts]
        if cap is not None and cap < len(texts):
            rng = random.Random(self.hparams.seed * 1_000_003 + salt)
            keep = sorted(rng.sample(range(len(texts)), cap))
            texts = [texts[i] for i in keep]
        return texts

    def train_dataloader(self) -> DataLoader:
        """Batches ``{"prompt": list[str]}``."""
        import torch

        self._require("prompt_dataset", "train_dataloader")
        # The order is a function of (seed, epoch) and the loader's position is checkpointed,
        # so a run resumed mid-epoch sees exactly the remaining batches (see resumable.py).
        # Under DDP each rank takes every world_size-th prompt of that same order, so the
        # global batches equal those of one process with a world_size times larger batch.
        # The generator keeps worker seeding off the global torch RNG that rollouts use.
        n = len(self.prompt_dataset)
        hp = self.hparams
        sampler = EpochShuffleSampler(n, hp.seed) if hp.shuffle else None
        shard = self._shard()
        if shard is not None:
            sampler = RankShardSampler(n, *shard, seed=hp.seed, shuffle=hp.shuffle)
        return ResumableDataLoader(
            self.prompt_dataset,
            batch_size=hp.batch_size,
            sampler=sampler,
            generator=torch.Generator().manual_seed(hp.seed),
            collate_fn=collate_dicts,
            num_workers=hp.num_workers,
        )

    def _shard(self) -> tuple[int, int] | None:
        """``(world_size, rank)`` under a multi-process strategy, else None."""
        trainer = self.trainer
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer else None
        if not kwargs or int(kwargs.get("num_replicas", 1)) <= 1:
            return None
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def val_dataloader(self) -> DataLoader | list:
        """Batches ``{"text": list[str]}``; an empty list if ``heldout`` is None."""
        if self.hparams.heldout is None:
            return []
        self._require("heldout_dataset", "val_dataloader")
        import torch

        return DataLoader(
            self.heldout_dataset,
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            generator=torch.Generator().manual_seed(self.hparams.seed),
            collate_fn=collate_dicts,
            num_workers=self.hparams.num_workers,
        )

    def _require(self, attribute: str, method: str) -> None:
        if getattr(self, attribute) is None:
            raise RuntimeError(f"PromptDataModule.{method}: call setup() first")


def _as_dataset(column: str, texts: list[str]) -> datasets.Dataset:
    import datasets

    return datasets.Dataset.from_dict({column: texts})
