"""Texts from local files, a local dataset directory or the hub, read with ``datasets``.

A source is a local file or list of files (``.txt``: one text per line, column ``text``;
``.csv``/``.tsv``; ``.json``/``.jsonl``: JSON lines or a JSON list of records; ``.parquet``),
a local dataset directory, or any other string: a dataset on the Hugging Face hub
(``"imdb"``), loaded with ``datasets.load_dataset(name, split=...)``. Both the PPO prompts
(:mod:`rlkl_lightning.data`) and the SFT texts (:mod:`rlkl_lightning.world.sft`) come
through :func:`load_texts`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

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
