"""Write the fortune-cookie corpus of the budget study from Debian's ``fortunes`` package.

    apt-get install fortunes
    python scripts/fortunes_corpus.py OUT.jsonl
    python -m rlkl_lightning.world --texts OUT.jsonl --out worlds/fortunes

Each fortune of ``/usr/share/games/fortunes`` (the files without a suffix, less the ASCII art,
code and jargon collections) becomes one line of text: its lines joined with single spaces,
attribution lines (``-- Someone``) dropped, kept when 20-300 characters long and mostly
letters. The files are Latin-1 text, read as text: nothing in them runs.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SOURCE = Path("/usr/share/games/fortunes")
SKIP = {
    "art",
    "ascii-art",
    "debian",
    "computers",
    "linux",
    "linuxcookie",
    "perl",
    "startrek",
    "zippy",
    "riddles",
    "definitions",
    "miscellaneous",
}


def fortunes(source: Path = SOURCE) -> list[str]:
    """The kept fortunes, in file order."""
    texts = []
    for path in sorted(source.iterdir()):
        if "." in path.name or path.name in SKIP or not path.is_file():
            continue
        for entry in path.read_text(encoding="latin-1").split("\n%\n"):
            lines = [line.strip() for line in entry.strip().splitlines()]
            text = re.sub(r"\s+", " ", " ".join(x for x in lines if x and not x.startswith("--")))
            text = text.strip()
            if 20 <= len(text) <= 300 and sum(c.isalpha() for c in text) > 0.6 * len(text):
                texts.append(text)
    return texts


def main() -> None:
    """Write ``{"text": ...}`` per line to the path given."""
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/fortunes_corpus.py OUT.jsonl")
    texts = fortunes()
    with open(sys.argv[1], "w") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    print(f"{len(texts)} fortunes written to {sys.argv[1]}")


if __name__ == "__main__":
    main()
