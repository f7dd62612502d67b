"""Texts from local files, a local dataset directory or the hub, read with ``datasets``.

A source is a local file or list of files (``.txt``: one text per line, column ``text``;
``.csv``/``.tsv``; ``.json``/``.jsonl``: JSON lines or a JSON list of records; ``.parquet``),
a local directory (of such data files, or written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``), or any other string: a dataset on the Hugging Face hub
(``"imdb"``), loaded with ``datasets.load_dataset(name, split=...)``. Both the PPO prompts
(:mod:`rlkl_lightning.data`) and the SFT texts (:mod:`rlkl_lightning.world.sft`) come
through :func:`load_texts`.

Local files are not trusted (docs/checkpoints.md) and are checked before ``datasets`` parses
them, so a bad file gives an error that names the option and the file instead of failing
deep inside a parser:

* text files (every type but ``.parquet``) must be UTF-8 without NUL bytes: the check streams
  the file (1 MiB at a time) and names the line of the first bad byte;
* JSON files must hold JSON objects (one per line, or in one list), parsed with Python's
  ``json`` first: pyarrow's JSON reader, which ``datasets`` uses, crashes the process on a
  ``null`` row;
* a directory must hold data files of one supported type (hidden files and ``*.md`` aside);
* a parser's error (a CSV row with too many fields, a JSON line that is not an object, values
  of changing types) is reported with the file and the parser's reason.

What is read is bounded: empty texts are dropped (counted in a warning), and a text longer
than :data:`MAX_TEXT_CHARS` characters is cut to that many (its start, or its end for
prompts, which are cut on the left to ``max_prompt_tokens`` later), so no tokenizer ever sees
a 50 MB line. ``datasets`` parses local files into a temporary cache that is deleted once the
texts are read, so nothing from them stays on disk.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

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

#: Longest text kept, in characters; longer ones are cut when read (see :func:`load_texts`).
#: About 25,000 English tokens: far above any prompt, and above the context of the models
#: this library trains on a CPU.
MAX_TEXT_CHARS = 100_000

_SCAN_BYTES = 1 << 20  # read size of the UTF-8 / NUL check
_NEWLINE = b"\n"
_MAX_REASON = 300  # characters of a parser's message quoted in an error


def load_texts(
    source: str | Sequence[str],
    column: str | None,
    *,
    split: str = "train",
    owner: str = "PromptDataModule",
    source_option: str = "prompts",
    column_option: str = "prompt_column",
    keep: Literal["start", "end"] = "start",
    max_chars: int = MAX_TEXT_CHARS,
    prose: bool = False,
) -> list[str]:
    """Read one text column from local files, a local dataset directory or the hub.

    Args:
        source: File path, list of file paths, dataset directory or hub dataset name.
        column: Name of the text column; ``None``: the first of :data:`TEXT_COLUMNS` that
            the data has (any case), else its only text column (see :func:`pick_text_column`).
        split: Split to load from a directory or hub dataset (local files are one split).
        owner: Class name used in error messages.
        source_option: Option name of ``source`` used in error messages.
        column_option: Option name of ``column`` used in error messages.
        keep: Which end of a text longer than ``max_chars`` is kept: ``"start"`` (texts that
            are cut on the right later, e.g. to a model's context) or ``"end"`` (prompts,
            cut on the left).
        max_chars: Longest text kept, in characters (warned once per source when texts are
            cut).
        prose: A column picked as the only text one must look like prose (see
            :func:`pick_text_column`); a named ``column`` is taken as it is.

    Returns:
        The non-empty texts, stripped of surrounding whitespace, in file order.

    Raises:
        ValueError: A file is missing, has an unsupported suffix, is not UTF-8 text or holds
            NUL bytes, cannot be parsed; a directory mixes file types; the column is missing
            or not text, or nothing is left. The message names the option and the file.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    with tempfile.TemporaryDirectory(prefix="rlkl-texts-", ignore_cleanup_errors=True) as cache:
        dataset, where = _load_dataset(source, split, owner, source_option, cache)
        if column is None:
            column = pick_text_column(dataset, f"{owner}: {where}", column_option, prose)
        if column not in dataset.column_names:
            raise ValueError(
                f"{owner}: `{column_option}` {column!r} not found in {where}; "
                f"available columns: {dataset.column_names}"
            )
        values = list(dataset[column])  # read before the temporary cache goes
    texts, dropped, cut = [], 0, 0
    for value in values:
        if value is not None and not isinstance(value, str):
            raise ValueError(
                f"{owner}: `{column_option}` {column!r} in {where} holds "
                f"{type(value).__name__} values, not text"
            )
        text = value.strip() if value is not None else ""
        if not text:
            dropped += 1
            continue
        if len(text) > max_chars:
            cut += 1
            text = text[:max_chars] if keep == "start" else text[-max_chars:]
        texts.append(text)
    if not texts:
        raise ValueError(f"{owner}: no non-empty texts in column {column!r} of {where}")
    if dropped:
        rank_zero_warn(
            f"{owner}: dropped {dropped:,} empty texts of {where} ({len(texts):,} kept)",
            category=RuntimeWarning,
        )
    if cut:
        rank_zero_warn(
            f"{owner}: {cut:,} texts of {where} are longer than {max_chars:,} characters; "
            f"each keeps its {'first' if keep == 'start' else 'last'} {max_chars:,}",
            category=RuntimeWarning,
        )
    return texts


#: Column names taken as the text, in this order, when no column is given (any case).
TEXT_COLUMNS = (
    "text",
    "review",
    "content",
    "body",
    "sentence",
    "document",
    "comment",
    "message",
    "tweet",
    "post",
    "description",
    "abstract",
    "summary",
)


#: A column picked as the only text one, with ``prose=True``, is refused when fewer than this
#: fraction of its non-empty values are distinct, or its values average fewer words than
#: :data:`PROSE_MIN_WORDS`: a label or a category column (``pos``/``neg``), not a corpus.
PROSE_MIN_DISTINCT = 0.5
PROSE_MIN_WORDS = 3.0


def pick_text_column(
    dataset: datasets.Dataset, where: str, column_option: str, prose: bool = False
) -> str:
    """The text column of ``dataset``: a name from :data:`TEXT_COLUMNS`, else the only text one.

    With ``prose``, the only text column must look like prose (mostly distinct values of a
    few words or more); a column named like text is taken as it is.

    Raises:
        ValueError: If no column has such a name and the data has no or several text columns,
            or (``prose``) the only one looks like labels; the message lists the columns and
            names ``column_option``.
    """
    by_lower = {name.lower(): name for name in dataset.column_names}
    for name in TEXT_COLUMNS:
        if name in by_lower:
            return by_lower[name]
    strings = [
        name
        for name, feature in dataset.features.items()
        if getattr(feature, "dtype", None) in ("string", "large_string")
    ]
    if len(strings) == 1 and prose:
        values = [v for v in dataset[strings[0]] if isinstance(v, str) and v.strip()]
        distinct = len(set(values))
        words = sum(len(v.split()) for v in values) / max(len(values), 1)
        if distinct < PROSE_MIN_DISTINCT * len(values) or words < PROSE_MIN_WORDS:
            raise ValueError(
                f"{where}: no column named like text ({', '.join(TEXT_COLUMNS[:4])}, ...), and "
                f"the only text column {strings[0]!r} does not look like prose ({distinct:,} "
                f"distinct values in {len(values):,} rows, {words:.1f} words on average); name "
                f"the text column with `{column_option}` (columns: {dataset.column_names})"
            )
    if len(strings) == 1:
        return strings[0]
    raise ValueError(
        f"{where}: no column named like text ({', '.join(TEXT_COLUMNS[:4])}, ...) and "
        f"{len(strings) or 'no'} text columns among {dataset.column_names}; name the text "
        f"column with `{column_option}`"
    )


def _load_dataset(
    source: str | Sequence[str], split: str, owner: str, option: str, cache: str
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
                return datasets.load_dataset(name, split=split), f"`{option}` hub dataset {name!r}"
            except Exception as error:  # offline, unknown name, unknown split, ...
                raise ValueError(
                    f"{owner}: `{option}` {name!r} is not a local file or directory, and "
                    f"loading it from the Hugging Face hub (split {split!r}) failed: {error}"
                ) from error
        for path in paths:
            if not path.exists():
                raise ValueError(f"{owner}: `{option}` file not found: {str(path)!r}")
        if len(paths) == 1 and is_saved_dataset(paths[0]):
            return _load_saved(paths[0], split, owner, option)
        if len(paths) == 1 and paths[0].is_dir():
            where = f"`{option}` directory {str(paths[0])!r}"
            data_files = check_directory(paths[0], owner, option)
            try:
                return datasets.load_dataset(str(paths[0]), split=split, cache_dir=cache), where
            except Exception as error:
                raise ValueError(
                    f"{owner}: {where} could not be loaded as a dataset (split {split!r}, "
                    f"{len(data_files)} data files): {_reason(error)}"
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
        for path in paths:
            check_text_file(path, owner, option)
        if all(p.stat().st_size == 0 for p in paths):  # `datasets` fails on it with its own error
            names = ", ".join(repr(str(p)) for p in paths[:3])
            raise ValueError(f"{owner}: `{option}` {names} is empty; allowed: a file of texts")
        builder = builders.pop()
        kwargs = {"sep": "\t"} if suffixes == {".tsv"} else {}
        names = ", ".join(p.name for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        where = f"`{option}` file{'s' if len(paths) > 1 else ''} {names}"
        try:
            data = datasets.load_dataset(
                builder,
                data_files=[str(p) for p in paths],
                split="train",
                cache_dir=cache,
                **kwargs,
            )
        except Exception as error:
            message = f"{owner}: could not read `{option}` {names}: {_reason(error)}"
            raise ValueError(message) from error
        return data, where


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``save_to_disk`` (a Dataset or DatasetDict)."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    )


def _load_saved(path: Path, split: str, owner: str, option: str) -> tuple[datasets.Dataset, str]:
    """A ``save_to_disk`` directory: the Dataset, or the ``split`` of a DatasetDict.

    Its Arrow files are memory-mapped where they are (no copy, no code runs).
    """
    import datasets

    where = f"`{option}` dataset directory {str(path)!r}"
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as error:
        raise ValueError(
            f"{owner}: {where} could not be loaded (datasets.load_from_disk): {_reason(error)}"
        ) from error
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{owner}: {where} has no split {split!r}; allowed: {sorted(data)}")
        return data[split], f"{where} (split {split!r})"
    return data, where


def check_text_file(path: Path, owner: str, option: str) -> None:
    """Raise unless a text file (not ``.parquet``) is UTF-8 without NUL bytes; streamed.

    A JSON file must also hold JSON objects only (:func:`_check_json_file`).
    """
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder == "parquet":
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(path, "rb") as handle:
        if handle.read(4).startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            raise ValueError(
                f"{owner}: `{option}` file {str(path)!r} is UTF-16 text (it starts with UTF-16's "
                "byte-order mark); allowed: UTF-8 text (convert it, e.g. with "
                "`iconv -f utf-16 -t utf-8`)"
            )
        handle.seek(0)
        while chunk := handle.read(_SCAN_BYTES):
            pending = len(decoder.getstate()[0])  # bytes of a character split by the last read
            nul = chunk.find(b"\0")
            try:
                decoder.decode(chunk)
                bad = None
            except UnicodeDecodeError as err:
                bad = max(err.start - pending, 0)
            if nul >= 0 and (bad is None or nul <= bad):
                raise ValueError(
                    f"{owner}: `{option}` file {str(path)!r} holds a NUL byte (line "
                    f"{line + chunk.count(_NEWLINE, 0, nul)}): a binary file, or text in UTF-16? "
                    "allowed: UTF-8 text"
                )
            if bad is not None:
                raise ValueError(
                    f"{owner}: `{option}` file {str(path)!r} is not UTF-8 text: byte "
                    f"{chunk[bad]:#04x} at line {line + chunk.count(_NEWLINE, 0, bad)} (byte "
                    f"{offset + bad}); allowed: UTF-8 text (convert it, e.g. with "
                    "`iconv -f latin1 -t utf-8`)"
                )
            line += chunk.count(_NEWLINE)
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{owner}: `{option}` file {str(path)!r} is not UTF-8 text: it ends inside a "
            f"character (byte {offset - 1}); allowed: UTF-8 text"
        ) from err
    if builder == "json":
        _check_json_file(path, owner, option)


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


def _check_json_file(path: Path, owner: str, option: str) -> None:
    """Raise unless a JSON file is JSON lines of objects, or a list of objects (or of strings).

    ``datasets`` hands JSON lines to pyarrow's JSON reader, which crashes the whole process
    (a segmentation fault, no exception) on a row that is ``null`` at the start of a block, as
    in a file holding just ``null``; a row of objects only is what it is made for. Each row is
    parsed here with Python's ``json`` first.
    """

    def fail(problem: str) -> ValueError:
        return ValueError(
            f"{owner}: `{option}` file {str(path)!r} {problem}; allowed: JSON objects, one per "
            "line (JSON lines) or in one JSON list"
        )

    def kind(value: object) -> str:
        return _JSON_TYPES.get(type(value), "number")

    with open(path, encoding="utf-8-sig") as handle:  # -sig: a leading BOM, as datasets
        first = ""
        while not first and (chunk := handle.read(_SCAN_BYTES)):
            first = chunk.lstrip()[:1]
        handle.seek(0)
        if first == "[":  # one JSON list, which datasets reads whole
            try:
                rows = json.load(handle)
            except json.JSONDecodeError as err:
                raise fail(f"is not JSON ({err.msg}, line {err.lineno})") from err
            kinds = {kind(row) for row in rows}
            if kinds - {"object"} and kinds != {"string"}:
                raise fail(f"holds a list of {', '.join(sorted(kinds))} items, not only objects")
            return
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                if number == 1 and path.suffix.lower() == ".json" and _one_object(path):
                    return  # one JSON object over several lines
                raise fail(f"line {number} is not JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise fail(f"line {number} holds a JSON {kind(row)}, not an object")


def _one_object(path: Path) -> bool:
    """Whether a file is one JSON object (over several lines)."""
    with open(path, encoding="utf-8-sig") as handle:
        try:
            return isinstance(json.load(handle), dict)
        except json.JSONDecodeError:
            return False


def check_directory(
    directory: Path, owner: str, option: str, other_suffix_is_text: bool = False
) -> list[Path]:
    """The data files of a directory: one supported type, each checked; else a clear error.

    Hidden files and folders and ``*.md`` files (a dataset card) are not data. ``datasets``
    would read only the most common type of a mixed directory and skip the rest silently.
    ``other_suffix_is_text`` (a world's corpus, :mod:`rlkl_lightning.world.read`): a file of
    a suffix that is no table type is plain text like ``.txt`` (rt-polarity's ``.pos`` and
    ``.neg``) instead of refused, and plain text is left to the caller to check, as it checks
    a file given alone (it reads a line that is not UTF-8 as Windows-1252, with a warning).
    """
    files = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
        and p.suffix.lower() != ".md"
    )
    where = f"{owner}: `{option}` directory {str(directory)!r}"
    unknown = sorted({p.suffix.lower() or p.name for p in files} - FILE_BUILDERS.keys())
    unknown = [] if other_suffix_is_text else unknown
    if unknown:
        example = next(p for p in files if (p.suffix.lower() or p.name) in unknown)
        raise ValueError(
            f"{where} holds files of unsupported type(s) {unknown} (e.g. "
            f"{str(example.relative_to(directory))!r}); allowed: {sorted(FILE_BUILDERS)}"
        )
    suffixes = sorted({p.suffix.lower() for p in files})
    if len({FILE_BUILDERS.get(s, "text") for s in suffixes}) > 1:
        raise ValueError(f"{where} mixes file types {suffixes}; use one type")
    if not files:
        raise ValueError(f"{where} holds no data files; allowed: {sorted(FILE_BUILDERS)}")
    for path in files:
        if not (other_suffix_is_text and FILE_BUILDERS.get(path.suffix.lower(), "text") == "text"):
            check_text_file(path, owner, option)
    return files


def _reason(error: BaseException) -> str:
    """The innermost cause of a ``datasets`` error (the parser's own), type and message, short."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    if len(text) > _MAX_REASON:
        text = text[:_MAX_REASON] + " ..."
    return f"{type(error).__name__}: {text}"


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide datasets' progress bars and its log of a file that failed (the error says it)."""
    from datasets.utils import logging as ds_logging

    was_enabled, verbosity = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if was_enabled:
            ds_logging.enable_progress_bar()


def first_words(text: str, n: int) -> str:
    """The first ``n`` whitespace-separated words of ``text``."""
    return " ".join(text.split()[:n])
