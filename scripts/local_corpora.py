"""Write three corpora of real text from files every Python installation has (no download).

    python scripts/local_corpora.py OUT_DIR

``OUT_DIR/stdlib_docs.csv``: the docstrings of the standard library's modules and of their
public classes and functions, one paragraph per row (columns ``name`` and ``docstring``).
``OUT_DIR/package_readmes.txt``: the long descriptions (READMEs: markdown, code, tables) of the
installed packages, from their ``METADATA``, separated by blank lines.
``OUT_DIR/stdlib_code.jsonl``: the source code of the standard library's public functions and
methods (field ``text``, one function per line): code rather than prose.

docs/worlds.md, "A world from your own text", builds a world from each; what they hold depends on
the Python version and the installed packages.
"""

from __future__ import annotations

import csv
import email
import importlib
import inspect
import json
import site
import sys
import warnings
from pathlib import Path

_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data"}


def stdlib_docstrings() -> list[tuple[str, str]]:
    """``(name, paragraph)`` for every paragraph of every public stdlib docstring."""
    rows = []
    for name in sorted(sys.stdlib_module_names - _SKIP):
        if name.startswith("_"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform-specific or optional modules
            continue
        objects = [(name, module)] + [
            (f"{name}.{key}", value)
            for key, value in vars(module).items()
            if not key.startswith("_")
            and (inspect.isclass(value) or inspect.isfunction(value))
            and getattr(value, "__module__", None) == name
        ]
        for qualname, obj in objects:
            for paragraph in (inspect.getdoc(obj) or "").split("\n\n"):
                if paragraph.strip():
                    rows.append((qualname, paragraph.strip()))
    return rows


def package_readmes() -> list[str]:
    """The long description of every installed distribution that has one."""
    texts = []
    for root in site.getsitepackages():
        for metadata in sorted(Path(root).glob("*.dist-info/METADATA")):
            message = email.message_from_string(metadata.read_text(errors="replace"))
            body = message.get_payload()
            if isinstance(body, str) and body.strip():
                texts.append(body.strip())
    return texts


def stdlib_functions() -> list[str]:
    """The source of the public functions and classes' methods of the stdlib modules."""
    texts = []
    for name in sorted(sys.stdlib_module_names - _SKIP):
        if name.startswith("_"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # platform-specific or optional modules
            continue
        functions = []
        for key, value in vars(module).items():
            if key.startswith("_") or getattr(value, "__module__", None) != name:
                continue
            if inspect.isfunction(value):
                functions.append(value)
            elif inspect.isclass(value):  # its methods, dunders included
                functions += [v for v in vars(value).values() if inspect.isfunction(v)]
        for function in functions:
            try:
                texts.append(inspect.getsource(function))
            except (OSError, TypeError):  # no source file (frozen, built-in)
                continue
    return texts


def main(out: str) -> None:
    """Write the three corpora into ``out``."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "stdlib_docs.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "docstring"])
        writer.writerows(stdlib_docstrings())
    (directory / "package_readmes.txt").write_text("\n\n".join(package_readmes()) + "\n")
    with open(directory / "stdlib_code.jsonl", "w") as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in stdlib_functions())
    print(f"wrote stdlib_docs.csv, package_readmes.txt and stdlib_code.jsonl in {directory}")


if __name__ == "__main__":
    main(sys.argv[1])
