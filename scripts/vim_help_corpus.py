"""Write the Vim help corpus of the budget study: prose paragraphs of Vim's help files.

    python scripts/vim_help_corpus.py OUT.jsonl [DOC_DIR]
    python -m rlkl_lightning.world --texts OUT.jsonl --out worlds/vim

``DOC_DIR`` defaults to ``/usr/share/vim/vim90/doc`` (Debian's ``vim-runtime``). Each paragraph
(blank-line separated) of each ``*.txt`` file, in file-name order, becomes one JSON line
(``{"text": ...}``) when it is prose: no indented or tabbed line (code, tables), no line ending
in a ``*tag*``, none starting a header, a rule or an Ex command; ``|links|`` unwrapped; 40-400
characters, at least 8 words, mostly letters, starting with a capital and ending as a
sentence; no duplicates. Vim 9.0's help gives 5,601 texts. The law of 0.11.0 was designed
without this text: it is the budget study's unseen world.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NOT_PROSE_START = ("==", "--", ":", ">", "<")


def paragraphs(raw: str) -> list[str]:
    """The prose paragraphs of one help file."""
    out = []
    for para in re.split(r"\n\s*\n", raw):
        lines = para.splitlines()
        if any(
            line.startswith(("\t", "    "))
            or "\t" in line
            or re.search(r"\*\S+\*\s*$", line)
            or line.strip().startswith(NOT_PROSE_START)
            for line in lines
        ):
            continue
        text = " ".join(line.strip() for line in lines if line.strip())
        text = re.sub(r"\|([^|\s]+)\|", r"\1", text)
        text = re.sub(r"\s+", " ", text).strip()
        if not 40 <= len(text) <= 400 or len(text.split()) < 8:
            continue
        letters = sum(c.isalpha() or c == " " for c in text) / len(text)
        if letters < 0.86 or not text[0].isupper() or not text.endswith((".", "?", "!")):
            continue
        out.append(text)
    return out


def main(out: str, doc_dir: str = "/usr/share/vim/vim90/doc") -> None:
    """Write the corpus of ``doc_dir``'s help files to ``out``."""
    texts, seen = [], set()
    for path in sorted(Path(doc_dir).glob("*.txt")):
        for text in paragraphs(path.read_text(encoding="utf-8", errors="replace")):
            if text not in seen:
                seen.add(text)
                texts.append(text)
    with open(out, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"{len(texts)} texts, {sum(len(t) for t in texts)} characters -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
