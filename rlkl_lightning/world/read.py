"""A user's corpus, read from any mix of files and cleaned into a list of distinct texts.

What :func:`read_corpus` takes (each entry of ``sources``):

* ``.txt``, or a file of any other suffix (rt-polarity's ``.pos``/``.neg``): plain UTF-8
  text (a file that is not text is refused; a line that is not UTF-8 is read as
  Windows-1252 or Latin-1, line by line, with a warning that counts such lines).
  ``unit="line"``: one text per line; ``"paragraph"``: one text per paragraph (lines up to
  a blank line, joined with spaces: hard-wrapped prose);
  ``"auto"`` (the default) takes paragraphs when blank lines are frequent (at least 5 blocks,
  and one per :data:`LINES_PER_PARAGRAPH` non-blank lines: blank lines separate paragraphs),
  else lines (a one-text-per-line file with a few stray blank lines).
* ``.csv`` / ``.tsv`` / ``.json`` / ``.jsonl`` / ``.parquet``: one text per row, from
  ``column``, or when that is ``None`` the first column named like text (``text``,
  ``review``, ``content``, ... :data:`rlkl_lightning.texts.TEXT_COLUMNS`), else the only text
  column.
* a directory written by ``datasets``' ``save_to_disk`` (its ``split`` for a
  ``DatasetDict``), or a directory of data files of one type, each read as above.

Every file is checked before a parser sees it (:mod:`rlkl_lightning.texts`: UTF-8 without NUL
bytes, JSON objects only). Then every text is cleaned: Unicode NFC, control characters and
runs of whitespace (CRLF, tabs, newlines inside a CSV field) become one space, and a text
longer than ``max_chars`` is cut at the last space before that length (a hard cut if it has
none near the end). Empty texts and exact duplicates (after cleaning) are dropped, the first
occurrence kept.
"""

from __future__ import annotations

import codecs
import re
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path

from rlkl_lightning.texts import (
    FILE_BUILDERS,
    check_directory,
    check_text_file,
    is_saved_dataset,
    load_texts,
)

UNITS = ("auto", "line", "paragraph")
#: ``unit="auto"`` takes paragraphs if there is a blank-line-separated block for at most this
#: many non-blank lines, and at least :data:`MIN_PARAGRAPHS` blocks.
LINES_PER_PARAGRAPH = 20
MIN_PARAGRAPHS = 5
OWNER = "rlkl_lightning.world"
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def read_corpus(
    sources: str | Sequence[str],
    column: str | None = None,
    split: str = "train",
    unit: str = "auto",
    max_chars: int = 1000,
) -> tuple[list[str], dict]:
    """The distinct, cleaned texts of ``sources``, in reading order, and counts of what was done.

    Args:
        sources: Files and directories (see the module docstring).
        column: Text column of table-like files and datasets; ``None``: picked by name.
        split: Split of a ``DatasetDict`` directory.
        unit: What one text is in a ``.txt`` file: ``"auto"``, ``"line"`` or ``"paragraph"``.
        max_chars: Longest text kept, in characters (longer ones are cut).

    Returns:
        ``(texts, stats)``; ``stats`` counts ``read``, ``empty``, ``truncated``,
        ``duplicates`` and ``kept`` texts, gives the unit taken for each ``.txt`` file
        (``units``) and, by file, the count of lines that were not UTF-8 and were read as
        Windows-1252 or Latin-1 (``not_utf8_lines``; only files that had such lines).

    Raises:
        ValueError: A source is missing, not text, not UTF-8 or unparsable; a
            column is missing; an option is out of range; nothing is left. The message names
            the option (``--texts``, ``--column``, ``--unit``, ``--max_chars``).
    """
    if unit not in UNITS:
        raise ValueError(f"{OWNER}: `--unit` must be one of {list(UNITS)}, got {unit!r}")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise ValueError(f"{OWNER}: `--max_chars` must be an integer >= 1, got {max_chars!r}")
    sources = [sources] if isinstance(sources, (str, Path)) else list(sources)
    if not sources:
        raise ValueError(f"{OWNER}: `--texts` names no file; give one or more files")
    raw: list[str] = []
    units: dict[str, str] = {}
    not_utf8: dict[str, int] = {}
    tables = 0  # sources read by column
    for source in sources:
        for path in _expand(Path(source).expanduser()):
            suffix = path.suffix.lower()
            if path.is_file() and (suffix == ".txt" or suffix not in FILE_BUILDERS):
                texts, units[str(path)], fallen = _read_txt(path, unit)
                if fallen:
                    not_utf8[str(path)] = fallen
            else:
                tables += 1
                texts = load_texts(
                    str(path),
                    column,
                    split=split,
                    owner=OWNER,
                    source_option="--texts",
                    column_option="--column",
                    prose=True,
                )
            raw += texts
    if column is not None and not tables:  # a plain text file has no columns to pick from
        raise ValueError(
            f"{OWNER}: `--column` {column!r} picks a column of a table ("
            f"{', '.join(s for s in FILE_BUILDERS if s != '.txt')}) or a dataset directory, "
            "but `--texts` names plain text only; leave out `--column`"
        )
    cleaned, truncated = [], 0
    for text in raw:
        text, cut = clean_text(text, max_chars)
        cleaned.append(text)
        truncated += cut
    non_empty = [t for t in cleaned if t]
    kept = list(dict.fromkeys(non_empty))
    stats = {
        "read": len(raw),
        "empty": len(cleaned) - len(non_empty),
        "truncated": truncated,
        "duplicates": len(non_empty) - len(kept),
        "kept": len(kept),
        "units": units,
        "not_utf8_lines": not_utf8,
    }
    if not kept:
        raise ValueError(f"{OWNER}: `--texts` {sources} hold no non-empty text")
    return kept, stats


def clean_text(text: str, max_chars: int) -> tuple[str, bool]:
    """NFC, control characters and whitespace runs as one space, cut to ``max_chars``.

    A cut text ends at its last space before ``max_chars`` if that space lies in the last
    fifth of the kept length (a word is not cut in half), else exactly at ``max_chars``.

    Returns:
        The cleaned text and whether it was cut.
    """
    text = " ".join(_CONTROL.sub(" ", unicodedata.normalize("NFC", text)).split())
    if len(text) <= max_chars:
        return text, False
    cut = text[: max_chars + 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= max_chars * 0.8 else cut[:max_chars]).rstrip(), True


def _expand(path: Path) -> list[Path]:
    """A file as itself; a ``save_to_disk`` directory as itself; other directories' files."""
    if not path.exists():
        raise ValueError(f"{OWNER}: `--texts` file not found: {str(path)!r}")
    if path.is_dir() and not is_saved_dataset(path):
        return check_directory(path, OWNER, "--texts", other_suffix_is_text=True)
    return [path]  # a file of another suffix is read as plain text (_read_txt checks it is)


def _read_txt(path: Path, unit: str) -> tuple[list[str], str, int]:
    """The texts of a plain text file, the unit taken and the count of lines not in UTF-8.

    UTF-8 is expected. A file that is not UTF-8 throughout is decoded line by line: a line that
    is valid UTF-8 is read as UTF-8, any other as Windows-1252, or Latin-1 where a byte has no
    Windows-1252 character (rt-polarity's ``.pos``/``.neg`` are Latin-1), with a warning that
    counts those lines and names the first. So one Latin-1 line in a UTF-8 file costs that
    line only, not every other line's accents.
    """
    try:
        check_text_file(path, OWNER, "--texts")
    except ValueError as error:
        data = path.read_bytes() if "is not UTF-8 text" in str(error) else b"\0"
        if b"\0" in data:  # binary, UTF-16, or another refusal
            if path.suffix.lower() == ".txt":
                raise
            reason = str(error).partition(f"{str(path)!r} ")[2].partition("; allowed")[0]
            raise ValueError(
                f"{OWNER}: `--texts` file {str(path)!r} is not plain text ({reason}); allowed: "
                f"UTF-8 text of any suffix (one text per line or paragraph), "
                f"{sorted(set(FILE_BUILDERS) - {'.txt'})} tables, or a directory (of such "
                "files, or written by datasets' save_to_disk)"
            ) from None
        lines, fallen = _decode_lines(data.removeprefix(codecs.BOM_UTF8))
        if fallen:
            warnings.warn(
                f"{OWNER}: `--texts` file {str(path)!r} is not UTF-8 throughout: "
                f"{len(fallen):,} of {len(lines):,} lines (the first: line {min(fallen)}) read "
                f"as {' or '.join(sorted(set(fallen.values())))}, the others as UTF-8",
                RuntimeWarning,
                stacklevel=2,
            )
        lines = [line.strip() for line in lines]
        n_fallen = len(fallen)
    else:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a BOM; universal newlines
            lines = [line.strip() for line in handle]
        n_fallen = 0
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line:
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    blocks = [b for b in blocks if b]
    n_lines = sum(len(b) for b in blocks)
    if unit == "auto":
        frequent = len(blocks) >= max(MIN_PARAGRAPHS, n_lines / LINES_PER_PARAGRAPH)
        unit = "paragraph" if frequent and len(blocks) < n_lines else "line"
    if unit == "paragraph":
        return [" ".join(b) for b in blocks], unit, n_fallen
    return [line for b in blocks for line in b], unit, n_fallen


def _decode_lines(data: bytes) -> tuple[list[str], dict[int, str]]:
    """The lines of ``data`` (CRLF, CR or LF), each decoded on its own.

    A line is decoded as UTF-8 if it is valid UTF-8, else as ``"cp1252"``, else as
    ``"latin-1"`` (which decodes any byte).

    Returns:
        The decoded lines, and by 1-based line number the encoding of each line that was not
        UTF-8.
    """
    lines, fallen = [], {}
    for number, raw in enumerate(data.splitlines(), 1):
        for encoding in ("utf-8", "cp1252", "latin-1"):
            try:
                lines.append(raw.decode(encoding))
            except UnicodeDecodeError:
                continue
            if encoding != "utf-8":
                fallen[number] = encoding
            break
    return lines, fallen
