"""The message a user's mistake prints on the command line: the project's own, alone and last.

An error a user can cause (an option out of range, a missing file, a checkpoint of another run)
is a ``ValueError`` or ``RuntimeError`` raised by this package, often wrapped by jsonargparse in
a "Does not validate against any of the Union subtypes" error that quotes the whole config; a
value the parser itself refuses (``--kl.target=nan``, an unknown option) is jsonargparse's
``ArgumentError``, printed after a usage dump. :func:`user_message` reduces either to a few
lines; :func:`rlkl_lightning.cli.main` prints them alone and exits with status 2.
"""

from __future__ import annotations

import os
import re
import traceback
from argparse import ArgumentError

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # rlkl_lightning/
VERBOSE_ENV = "RLKL_VERBOSE"  # set to 1 (or pass --verbose) to see the traceback instead
MAX_LINES = 12  # of one parser message; a longer one is cut with a note

_NOT_FINITE = re.compile(
    r"Parser key \"(?P<key>[^\"]+)\":\s*Expected a <class '(?P<type>float|int)'>\. "
    r"Got value: (?P<value>[+-]?(?:nan|inf|infinity))\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_UNION_NOT_FINITE = re.compile(  # an Optional number: `float | None`, `int | None`
    r"Expected a <class '(?P<type>float|int)'>.*Given value: "
    r"(?P<value>[+-]?(?:nan|inf|infinity))\s*$",
    re.IGNORECASE | re.DOTALL,
)
_OUTER_KEY = re.compile(r"^Parser key \"(?P<key>[^\"]+)\":", re.MULTILINE)
_CLASS_PROBLEM = re.compile(r"- Problem with given class_path '(?P<cls>[^']+)':\n(?P<body>.*)")


def raised_here(error: BaseException) -> bool:
    """Whether ``error`` was raised by a line of this package (not by a library under it)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep)


def project_error(error: BaseException) -> BaseException | None:
    """The package's own ``ValueError``/``RuntimeError`` behind ``error``, innermost first."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    for candidate in reversed(chain):
        if isinstance(candidate, ValueError | RuntimeError) and raised_here(candidate):
            return candidate
    return None


def parser_message(message: str) -> str:
    """The parser's message without the subtypes, the NoneType branch and the quoted config."""
    found = _NOT_FINITE.search(message)
    outer = _OUTER_KEY.match(message)
    if found is None and outer and (union := _UNION_NOT_FINITE.search(message)):
        found = {"key": outer["key"], "type": union["type"], "value": union["value"]}
    if found:
        key = found["key"]
        if outer and outer["key"] != key:  # `model` -> `model.init_args.lr`
            key = f"{outer['key']}.init_args.{key}"
        kind = "a finite number" if found["type"].lower() == "float" else "an integer"
        return f"`{key}` must be {kind} (NaN and inf are refused), got {found['value']}"
    problem = _CLASS_PROBLEM.search(message)
    outer = _OUTER_KEY.match(message)
    if problem and outer:
        body = [line.strip() for line in problem["body"].splitlines()]
        body = body[: next((i for i, x in enumerate(body) if x.startswith("- ")), len(body))]
        message = f"`{outer['key']}` ({problem['cls']}): " + " ".join(x for x in body if x)
    lines = [x for x in message.splitlines() if not x.lstrip().startswith("Given value")]
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"... ({len(lines) - MAX_LINES} more lines: --verbose)"]
    return "\n".join(lines)


def user_message(error: BaseException) -> str | None:
    """The few lines to print for ``error``, or None when it is not a user's mistake (a bug)."""
    if not isinstance(error, ValueError | RuntimeError | ArgumentError):
        return None  # a TypeError, KeyError, ... is a bug: its traceback is the useful output
    own = project_error(error)
    if own is not None:
        return str(own)
    if isinstance(error, ArgumentError):
        return parser_message(str(error))
    return None
