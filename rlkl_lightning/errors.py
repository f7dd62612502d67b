"""The message a user's mistake prints on the command line: the project's own, alone and last.

An error a user can cause (an option out of range, a missing file, a checkpoint of another run)
is a ``ValueError`` or ``RuntimeError`` raised by this package, often wrapped by jsonargparse in
a "Does not validate against any of the Union subtypes" error that quotes the whole config; a
value the parser itself refuses (``--kl.target=nan``, an unknown option) is jsonargparse's
``ArgumentError``, printed after a usage dump. :func:`user_message` reduces either to a few
lines; :func:`rlkl_lightning.cli.main` prints them alone and exits with status 2, and the world's
command line (``python -m rlkl_lightning.world``) prints a bad option the same way.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
import traceback
from argparse import ArgumentError

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # rlkl_lightning/
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
# A logger's constructor refused its arguments (MLflow's tracking URI, ...), as jsonargparse
# reports it while building the trainer's classes.
_LOGGER_GIVEN = re.compile(r"class_path='lightning\.pytorch\.loggers\.(?:[\w.]+\.)?(?P<name>\w+)'")
_NOT_A_NUMBER = re.compile(r"^[+-]?(?:nan|inf|infinity)$", re.IGNORECASE)
_OUTER_KEY = re.compile(r"^Parser key \"(?P<key>[^\"]+)\":", re.MULTILINE)
# The nested error of one class (a module, a data module, a callback), up to its siblings.
_CLASS_PROBLEM = re.compile(
    r"^(?P<indent> *)- Problem with given class_path '(?P<cls>[^']+)':\n"
    r"(?P<body>(?:(?:(?P=indent)  .*|[ \t]*)(?:\n|$))*)",  # blank lines too (a str's union)
    re.MULTILINE,
)
_INNER_KEY = re.compile(r"^Parser key \"(?P<key>[^\"]+)\":\s*(?P<rest>.*)$", re.DOTALL)
_EXPECTED = re.compile(r"^Expected a <class '(?P<type>\w+)'>\. Got value: (?P<value>.*)$")
_SUBTYPES = re.compile(r"^ *Subtypes: \[(?P<types>.*)\]$", re.MULTILINE)
_GIVEN = re.compile(r"^ *Given value: (?P<value>.*)$", re.MULTILINE)
_TYPE_NAMES = {
    "float": "a number",
    "int": "an integer",
    "bool": "true or false",
    "str": "a string",
    "NoneType": "null",
}


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
        return _class_message(outer["key"], problem, message)
    lines = [x for x in message.splitlines() if not x.lstrip().startswith("Given value")]
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"... ({len(lines) - MAX_LINES} more lines: --verbose)"]
    return "\n".join(lines)


def _class_message(outer: str, problem: re.Match, message: str) -> str:
    """One class's refusal, named by its full YAML path: ``model.init_args.optimization.lr``.

    A component inside the class (``model.init_args.reward``, a ``class_path`` of its own) is
    followed down to the innermost refusal, whose reason (``module ... has no attribute ...``)
    is the parser's own.
    """
    where = outer
    while True:
        body = textwrap.dedent(problem["body"]).strip()
        inner = _INNER_KEY.match(body)
        if inner is None:  # an unknown option, a class that does not import, ...
            text = " ".join(x.strip() for x in body.splitlines()[:MAX_LINES] if x.strip())
            return f"`{where}` ({problem['cls']}): {text}"
        if where == outer:
            where = _class_place(outer, problem["cls"], message)
        where = f"{where}.init_args.{inner['key']}"
        rest = textwrap.dedent(inner["rest"])
        deeper = _CLASS_PROBLEM.search(rest)
        if deeper is None:
            return f"`{where}` {_type_reason(rest)}"
        problem = deeper


def _class_place(outer: str, cls: str, message: str) -> str:
    """``trainer.callbacks[0]`` for the one listed callback of class ``cls``, else ``outer``."""
    given = _GIVEN.findall(message)
    try:
        value = ast.literal_eval(given[-1]) if given else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if isinstance(value, list):
        places = [
            i for i, x in enumerate(value) if isinstance(x, dict) and x.get("class_path") == cls
        ]
        if len(places) == 1:
            return f"{outer}[{places[0]}]"
    return outer


def _type_reason(text: str) -> str:
    """The reason, ``must be an integer, got 1.5``, from the parser's note on one value."""
    text = text.strip()
    expected = _EXPECTED.match(text)
    subtypes = _SUBTYPES.search(text)
    given = _GIVEN.search(text)
    if expected:
        types, value = [expected["type"]], expected["value"]
    elif subtypes and given:
        types = re.findall(r"<class '([\w.]+)'>|(\w[\w.\[\], ]*)", subtypes["types"])
        types = [a or b for a, b in types]
        value = given["value"]
    else:
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        return ": " + " ".join(lines[:MAX_LINES])
    if "float" in types and _NOT_A_NUMBER.match(value.strip()):
        names = ["a finite number" if t == "float" else _TYPE_NAMES.get(t, t) for t in types]
        return f"must be {' or '.join(names)} (NaN and inf are refused), got {value}"
    names = [_TYPE_NAMES.get(t, t) for t in types]
    names = [_class_named(n) if "." in n else n for n in names]
    return f"must be {' or '.join(names)}, got {value}"


def _class_named(path: str) -> str:
    """A class the parser expects, as a user gives it: by its dotted path or in a block."""
    name = path.rpartition(".")[2]
    return f"a {name} (the dotted path of one, or a {{class_path, init_args}} block)"


def user_message(error: BaseException) -> str | None:
    """The few lines to print for ``error``, or None when it is not a user's mistake (a bug)."""
    if not isinstance(error, ValueError | RuntimeError | ArgumentError):
        return None  # a TypeError, KeyError, ... is a bug: its traceback is the useful output
    own = project_error(error)
    if own is not None:
        return str(own)
    if isinstance(error, ArgumentError):
        return parser_message(str(error))
    return logger_message(str(error))


def logger_message(message: str) -> str | None:
    """A logger that refused its arguments: ``trainer.logger`` (its class) and its reason.

    The logger's own error (a bad MLflow ``tracking_uri``, ...) is one line among the
    alternatives of the ``trainer.logger`` union, under 100 lines of traceback. None when
    ``message`` is not that.
    """
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return None
    names = {found["name"] for found in _LOGGER_GIVEN.finditer(message)}
    if not names:
        return None
    errors = [x.strip()[1:].strip() for x in message.splitlines() if x.strip().startswith("- ")]
    reasons = [x for x in errors if x and not x.startswith(("Expected a ", "Not a valid"))]
    if not reasons:
        return None
    which = f" ({names.pop()})" if len(names) == 1 else ""
    return f"`trainer.logger`{which}: {reasons[0]}"
