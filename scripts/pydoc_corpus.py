"""Write the docstring corpus of the budget study from the Python standard library's sources.

    python scripts/pydoc_corpus.py OUT.jsonl
    python -m rlkl_lightning.world --texts OUT.jsonl --out worlds/pydoc

Each paragraph of a module, class or function docstring in the running Python's standard
library (``sysconfig``'s ``stdlib``, less the tests, IDLE, lib2to3, ensurepip and the turtle
demos) becomes one line of text: its lines joined with single spaces, kept when 20-300
characters long, at least 5 words, mostly letters, starting with a capital and ending as a
sentence, and not a doctest, a table or a list. The files are parsed with ``ast``, never
imported: nothing in them runs. The order is shuffled with seed 0; 3.11.7 gives 8,304 texts.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

SKIP = re.compile(r"(^|/)(test|tests|idlelib|lib2to3|site-packages|ensurepip|turtledemo)(/|$)")
NOT_PROSE = (">>>", "...", "$", "%", "|", "+-", "==", "--", "*", "-")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def paragraphs(source: str) -> list[str]:
    """The prose paragraphs of every docstring in one module's source."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        doc = ast.get_docstring(node) if isinstance(node, DOCUMENTED) else None
        for block in re.split(r"\n\s*\n", doc or ""):
            lines = [line.strip() for line in block.splitlines()]
            if any(line.startswith(NOT_PROSE) for line in lines):
                continue
            text = " ".join(line for line in lines if line)
            letters = sum(c.isalpha() or c == " " for c in text) / max(len(text), 1)
            if (
                20 <= len(text) <= 300
                and len(text.split()) >= 5
                and letters >= 0.85
                and text[0].isupper()
                and text.endswith((".", ":", "?", "!"))
            ):
                found.append(text)
    return found


def main(out: str) -> None:
    """Write the corpus to ``out``, one ``{"text": ...}`` line per paragraph."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        if SKIP.search(path.relative_to(root).as_posix()):
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for text in paragraphs(source):
            if text not in seen:
                seen.add(text)
                texts.append(text)
    random.Random(0).shuffle(texts)
    with open(out, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    print(f"{len(texts)} texts from {root}")


if __name__ == "__main__":
    main(sys.argv[1])
