"""``scripts/man_pages_corpus.py``: the prose sentences of gzipped roff pages, nothing else."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("man_corpus", ROOT / "scripts/man_pages_corpus.py")
man_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(man_corpus)

PAGE = r""".\" A comment that is never text.
.TH DEMO 7 2026-11-30 "Linux man-pages"
.SH NAME
demo \- a page that is only a test of the corpus script
.SH SYNOPSIS
.nf
.B "#include <demo.h>"
.fi
The synopsis section is dropped even when it has sentences like this one.
.SH DESCRIPTION
The \fBdemo\fP interface reads a file and writes it back unchanged to its owner.
It keeps the \-\-quiet option for compatibility with older callers only. Short one.
.PP
A second paragraph names
.BR open (2)
and continues after the macro with several more words here.
.TP
.B \-\-verbose
Prints every step of the work as it happens to the standard error stream.
.EX
int main(void) { return demo("this code is never taken as prose text"); }
.EE
.de XX
This macro definition is not text and must be left out of the corpus.
..
Paths like C:\ecode\edemo keep their backslashes, which the escape writes as text.
A \s+2size escape is not resolved, so this sentence is left out of the corpus.
"""


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


def test_the_prose_sentences_are_kept_and_code_tags_synopsis_and_links_are_not(tmp_path):
    pages = tmp_path / "man" / "man7"
    pages.mkdir(parents=True)
    page = _write(pages, "demo.7.gz", PAGE)
    _write(pages, "alias.7.gz", ".so man7/demo.7\n")  # a link page: skipped
    (pages / "link.7.gz").symlink_to(page)  # a symbolic link: skipped
    out = tmp_path / "man.jsonl"
    man_corpus.main(str(out), str(tmp_path / "man"))
    texts = sorted(json.loads(line)["text"] for line in out.read_text().splitlines())
    assert texts == sorted(
        [
            "The demo interface reads a file and writes it back unchanged to its owner.",
            "It keeps the --quiet option for compatibility with older callers only.",
            "A second paragraph names open(2) and continues after the macro with several more "
            "words here.",
            "Prints every step of the work as it happens to the standard error stream.",
            "Paths like C:\\code\\demo keep their backslashes, which the escape writes as text.",
        ]
    )


def test_roff_arguments_and_escapes():
    assert man_corpus.arguments('"two words" one ""') == ["two words", "one", ""]
    assert man_corpus.arguments('"say ""hi"""') == ['say "hi"']
    text = r"\fBbold\fR \(aqq\(aq \-\- \(em x\&y \[bu]z"
    assert man_corpus.unescape(text) == "bold 'q' -- -- xy z"
