"""Write the man-pages corpus of the budget study: sentences of the Linux man pages' prose.

    apt-get download manpages && dpkg-deb -x manpages_*.deb pkg
    python scripts/man_pages_corpus.py OUT.jsonl pkg/usr/share/man
    python -m rlkl_lightning.world --texts OUT.jsonl --out worlds/man

``MAN_DIR`` defaults to ``/usr/share/man``. The gzipped roff of every page (not the ``.so``
links), in path order, is read without a formatter: comments, macro definitions, code and
tables (``.EX``/``.nf``/``.TS``/``.SY``/``.EQ`` blocks), item tags and the NAME and SYNOPSIS
sections are dropped; the font macros' arguments are kept; escapes are resolved or removed.
Paragraphs are split into sentences; a sentence is kept with 40-300 characters, at least 6
words, at least 70% letters and spaces and no escape left; no duplicates. The sentences are
shuffled (seed 0) and the first 9,000 written as JSON lines (``{"text": ...}``). Debian
bookworm's ``manpages`` 6.03-2 gives 12,723 sentences from 207 pages. The law of 0.14.0 was
designed without this text: it is that study's unseen world.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys
from pathlib import Path

MAX_TEXTS = 9000
BACKSLASH = "\x00"  # a literal backslash (``\e``, ``\\``) until the escapes are checked
ALTERNATING = {"BR", "IR", "RB", "IB", "BI", "RI"}  # fonts alternate: arguments joined bare
SINGLE = {"B", "I", "SM", "SB"}  # one font: arguments joined with spaces
BREAKS = {"PP", "P", "LP", "TP", "TQ", "IP", "HP", "SH", "SS", "sp", "br", "RS", "RE"}
BREAKS |= {"INDENT", "UNINDENT", "in", "TH"}
SKIPPED = {"EX": "EE", "nf": "fi", "TS": "TE", "SY": "YS", "EQ": "EN"}  # block: its end
SPECIAL = {"aq": "'", "dq": '"', "lq": '"', "rq": '"', "oq": "'", "cq": "'", "em": "--"}
SPECIAL |= {"en": "-", "ha": "^", "ti": "~", "hy": "-", "mi": "-", "ga": "`"}
SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")


def arguments(text: str) -> list[str]:
    """A macro's arguments, split at blanks outside roff's double quotes."""
    args, current, quoted, started = [], [], False, False
    i = 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == '"' and text[i + 1 : i + 2] == '"':
                current.append('"')
                i += 1
            elif c == '"':
                quoted = False
            else:
                current.append(c)
        elif c == '"' and not current:
            quoted = started = True
        elif c in " \t":
            if current or started:
                args.append("".join(current))
                current, started = [], False
        else:
            current.append(c)
        i += 1
    if current or started:
        args.append("".join(current))
    return args


def unescape(text: str) -> str:
    """Roff's escapes resolved (quotes, dashes, blanks) or removed (fonts, strings, others)."""
    text = text.replace("\\\\", BACKSLASH).replace("\\e", BACKSLASH)
    text = re.sub(r"\\f(\(..|\[[^\]]*\]|.)", "", text)
    text = re.sub(r"\\\*(\(..|\[[^\]]*\]|.)", "", text)
    text = re.sub(r"\\\((..)", lambda m: SPECIAL.get(m.group(1), ""), text)
    text = re.sub(r"\\\[([^\]]*)\]", lambda m: SPECIAL.get(m.group(1), ""), text)
    for escape, value in (("\\-", "-"), ("\\`", "`"), ("\\'", "'"), ("\\~", " "), ("\\ ", " ")):
        text = text.replace(escape, value)
    for escape in ("\\&", "\\%", "\\:", "\\|", "\\^", "\\c"):
        text = text.replace(escape, "")
    return text.replace("\\0", " ")


def paragraphs(roff: str) -> list[str]:
    """The prose paragraphs of one page, outside its NAME and SYNOPSIS sections."""
    out: list[tuple[str, str]] = []
    current: list[str] = []
    section, block_end, in_macro, tag_next = "", None, False, False

    def flush() -> None:
        if current:
            out.append((section, " ".join(current)))
            current.clear()

    for line in roff.split("\n"):
        if in_macro:
            in_macro = not line.startswith("..")
            continue
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if block_end is not None:
            if re.match(r"[.']\s*" + block_end + r"\b", line):
                block_end = None
            continue
        if line.startswith((".", "'")):
            name, rest = re.match(r"[.']\s*(\S*)\s*(.*)", line).groups()
            if name in SKIPPED:
                flush()
                block_end = SKIPPED[name]
            elif name == "de":
                in_macro = True
            elif name in BREAKS:
                flush()
                if name == "SH":
                    section = " ".join(arguments(rest)).upper()
                tag_next = tag_next or name in ("TP", "TQ")  # the next line: the item's tag
            elif name in ALTERNATING or name in SINGLE:
                text = ("" if name in ALTERNATING else " ").join(arguments(rest))
                if not tag_next and text:
                    current.append(text)
                tag_next = False
            continue
        if tag_next:
            tag_next = False
        elif not line.strip():
            flush()
        else:
            current.append(line.strip())
    flush()
    return [text for name, text in out if name not in ("SYNOPSIS", "NAME")]


def kept(sentence: str) -> bool:
    """Whether a sentence is prose: 40-300 characters, 6+ words, mostly letters, no escape."""
    letters = sum(c.isalpha() or c == " " for c in sentence)
    return (
        40 <= len(sentence) <= 300
        and "\\" not in sentence
        and len(sentence.split()) >= 6
        and letters >= 0.7 * len(sentence)
    )


def main(out: str, man_dir: str = "/usr/share/man") -> None:
    """Write the corpus of ``man_dir``'s pages to ``out``."""
    pages = sorted(p for p in Path(man_dir).rglob("*.gz") if not p.is_symlink())
    texts, seen, read = [], set(), 0
    for path in pages:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            roff = f.read()
        if re.match(r"\s*\.so\s", roff):
            continue
        read += 1
        for paragraph in paragraphs(roff):
            for sentence in SENTENCE_END.split(re.sub(r"\s+", " ", unescape(paragraph)).strip()):
                sentence = sentence.strip()
                if kept(sentence) and (text := sentence.replace(BACKSLASH, "\\")) not in seen:
                    seen.add(text)
                    texts.append(text)
    found = len(texts)
    random.Random(0).shuffle(texts)
    with open(out, "w", encoding="utf-8") as f:
        for text in texts[:MAX_TEXTS]:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"{read} pages, {found} sentences, {min(found, MAX_TEXTS)} written -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
