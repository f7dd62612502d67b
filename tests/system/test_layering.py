"""The package's layering: no import cycles, and the rules that keep the packages apart.

Every ``.py`` file under ``rlkl_lightning/`` is parsed with :mod:`ast` (nothing is imported)
and every ``import`` of an ``rlkl_lightning`` module becomes an edge of a graph, wherever it
stands: at module level, inside a function or under ``if TYPE_CHECKING:`` (an annotation-only
import still ties two modules together). A cycle in that graph is a failure that names its
modules, and so is an edge that breaks a layering rule (:data:`RULES`). What is not an edge:

- the string module names of a package's ``_LAZY`` table, which ``__getattr__`` imports on
  first use of a name (they are data, not import statements);
- the implicit import of a module's parent packages (``rlkl_lightning.world`` before
  ``rlkl_lightning.world.build``); ``from rlkl_lightning.world import build_world`` is an
  edge to the package, ``from rlkl_lightning.world import lexicon`` one to the submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rlkl_lightning"

# Cycles in modules that other pieces of work own, each expected to fail until its owner
# removes it; an entry whose cycle is gone fails (strict xfail) so that it is deleted here.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    names = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


class _Imports(ast.NodeVisitor):
    """Collects the package modules one file imports (see the module docstring)."""

    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.modules = modules
        self.found: set[str] = set()
        self.external: set[str] = set()  # top-level names of other packages (``lightning``)

    def visit_Import(self, node: ast.Import) -> None:  # noqa: D102
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: D102
        base = node.module or ""
        if not node.level and not base.startswith(PACKAGE):
            self.external.add(base.partition(".")[0])
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            self._add(submodule if submodule in self.modules else base)

    def _add(self, name: str) -> None:
        if name in self.modules:
            self.found.add(name)
        elif not name.startswith(PACKAGE):
            self.external.add(name.partition(".")[0])


def import_graph(external: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (and, with ``external``, other top-level names)."""
    paths = module_names()
    graph = {}
    for name, path in paths.items():
        visitor = _Imports(name, path.name == "__init__.py", set(paths))
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        graph[name] = (visitor.found | (visitor.external if external else set())) - {name}
    return graph


def tangles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm).

    Every module of such a component imports, directly or not, every other one.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=sorted)


def shortest_cycle(graph: dict[str, set[str]], members: frozenset[str]) -> list[str]:
    """A shortest cycle through the first (sorted) module of a component, in import order."""
    start = min(members)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1]
                if nxt not in parents:
                    parents[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle through it")


def describe(graph: dict[str, set[str]], members: frozenset[str]) -> str:
    """``a -> b -> a`` (without the package prefix), and the other modules of its tangle."""
    cycle = shortest_cycle(graph, members)
    text = " -> ".join(_short(name) for name in [*cycle, cycle[0]])
    others = sorted(members - set(cycle))
    if others:
        text += f" (tangled with {', '.join(_short(name) for name in others)})"
    return text


def _short(name: str) -> str:
    return name.removeprefix(f"{PACKAGE}.")


def _in(name: str, *prefixes: str) -> bool:
    """``name`` is one of ``prefixes`` (short names) or a module inside one of them."""
    short = _short(name)
    return any(short == p or short.startswith(f"{p}.") for p in prefixes)


#: (what the rule says, modules it applies to, modules and packages they may not import,
#: whether the ban holds through other package modules too).
RULES = [
    (
        "the KL package imports nothing from the algorithms, models, data, world, study or "
        "speed-up code (its callbacks plug into any LightningModule)",
        lambda m: _in(m, "kl"),
        ("algorithms", "models", "data", "world", "compare", "perf", "cli"),
        True,
    ),
    (
        "a speed-up imports nothing else from the package",
        lambda m: _in(m, "perf"),
        tuple(
            p
            for p in ("kl", "algorithms", "models", "data", "world", "compare", "cli")
            + ("trajectory", "masked", "perplexity", "texts", "rewards", "checkpoints")
            + ("defaults", "console", "export")
        ),
        False,
    ),
    (
        "the algorithm files do not import speed-up code: the pipeline applies it in one place "
        "(and the options check `models.cpu_matmul` by perf's own rule)",
        lambda m: (
            _in(m, "algorithms") and _short(m) not in ("algorithms.pipeline", "algorithms.options")
        ),
        ("perf",),
        False,
    ),
    (
        "the models and the export do not import the world: the world registers its model "
        "names (models/named.py) when the package is imported",
        lambda m: _in(m, "models", "export"),
        ("world",),
        True,
    ),
    (
        "the library does not import the command line (cli/): the CLI is built on top of it",
        lambda m: _in(m, "kl", "algorithms", "models", "data", "perf"),
        ("cli",),
        True,
    ),
    (
        "the data does not reach the world: the world registers its named prompt sources "
        "(data/sources.py) when the package is imported",
        lambda m: _in(m, "data"),
        ("world",),
        True,
    ),
    (
        "the world reaches neither the studies (compare/) nor the command line (cli/): both "
        "are built on top of it; what its command line shares with train.py is below both "
        "(console, errors)",
        lambda m: _in(m, "world"),
        ("compare", "cli"),
        True,
    ),
    (
        "the tables of older versions' options import nothing from the package: the CLI, the "
        "algorithms, the export and the world all read them",
        lambda m: _short(m) == "migrations",
        ("kl", "algorithms", "models", "data", "world", "compare", "perf", "cli")
        + ("trajectory", "masked", "perplexity", "texts", "rewards", "checkpoints")
        + ("defaults", "export", "metric_keys"),
        False,
    ),
    (
        "nothing in the library imports the reward server: it sits above the rewards it serves",
        lambda m: _short(m) != "serve_reward",
        ("serve_reward",),
        False,
    ),
    (
        "the pure math imports no Lightning, directly or through another module",
        lambda m: (
            _short(m)
            in (
                "kl.estimators",
                "kl.loss",
                "kl.controllers",
                "algorithms.advantages",
                "algorithms.losses",
                "masked",
                "trajectory",
            )
        ),
        ("lightning", "pytorch_lightning", "lightning_fabric"),
        True,
    ),
]


#: Imports that break a rule on purpose: (importer, imported) -> why. The imported module must
#: import nothing else from the package, so that nothing more is reached through it. None now.
ALLOWED: dict[tuple[str, str], str] = {}


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every name ``start`` imports directly or through package modules -> one import path."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    del paths[start]
    return paths


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that breaks a rule of :data:`RULES`, with the path that reaches it."""
    problems = []
    for text, applies, banned, transitive in RULES:
        for module in sorted(m for m in graph if m.startswith(PACKAGE) and applies(m)):
            reached = (
                reachable(graph, module) if transitive else {n: [module, n] for n in graph[module]}
            )
            for name, path in sorted(reached.items()):
                hit = name in banned if not name.startswith(PACKAGE) else _in(name, *banned)
                if hit and not _allowed(path, banned):
                    chain = " -> ".join(_short(p) for p in path)
                    problems.append(f"{chain}: {text}")
    return problems


def _allowed(path: list[str], banned: tuple[str, ...]) -> bool:
    """The path enters the banned modules through an import of :data:`ALLOWED`."""
    for i, name in enumerate(path[1:], start=1):
        if name.startswith(PACKAGE) and _in(name, *banned):
            return (_short(path[i - 1]), _short(name)) in ALLOWED
    return False  # a banned package outside rlkl_lightning (``lightning``)


def test_the_packages_keep_their_layering_rules():
    problems = broken_rules(import_graph(external=True))
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_an_allowed_import_reaches_nothing_more_and_is_still_made():
    graph = import_graph()
    for (importer, imported), why in ALLOWED.items():
        assert f"{PACKAGE}.{imported}" in graph[f"{PACKAGE}.{importer}"], f"gone: delete it ({why})"
        assert not graph[f"{PACKAGE}.{imported}"], f"{imported} imports from the package"


def test_the_models_reach_no_world_and_the_library_no_cli(monkeypatch):
    p = f"{PACKAGE}."
    graph = {
        f"{p}models.loading": {f"{p}world"},
        f"{p}world": {f"{p}world.build"},
        f"{p}world.build": {f"{p}cli.console"},  # allowed
        f"{p}world.sft": {f"{p}cli.app"},
        f"{p}cli.console": set(),
        f"{p}cli.app": set(),
        f"{p}data.prompts": {f"{p}cli"},
        f"{p}cli": {f"{p}cli.app"},
    }
    monkeypatch.setitem(ALLOWED, ("world.build", "cli.console"), "a test's")
    assert [line.partition(":")[0] for line in broken_rules(graph)] == [
        "models.loading -> world",
        "models.loading -> world -> world.build",  # not -> cli.console: allowed
        "data.prompts -> cli",
        "data.prompts -> cli -> cli.app",
        "world.sft -> cli.app",
    ]


def test_the_data_reaches_no_world_and_the_world_no_study_or_cli():
    p = f"{PACKAGE}."
    graph = {
        f"{p}data.prompts": {f"{p}data.sources", f"{p}texts"},
        f"{p}data.sources": {f"{p}world.config"},
        f"{p}world.config": set(),
        f"{p}texts": set(),
        f"{p}world.custom": {f"{p}compare.config"},
        f"{p}compare.config": set(),
        f"{p}world.build": {f"{p}console"},
        f"{p}world.__main__": {f"{p}errors", f"{p}cli.errors"},
        f"{p}console": set(),
        f"{p}errors": set(),
        f"{p}cli.errors": set(),
    }
    assert [line.partition(":")[0] for line in broken_rules(graph)] == [
        "data.prompts -> data.sources -> world.config",
        "data.sources -> world.config",
        "world.__main__ -> cli.errors",
        "world.custom -> compare.config",
    ]


def test_a_broken_rule_is_found_through_another_module():
    p = f"{PACKAGE}."
    graph = {
        f"{p}kl.controllers": {f"{p}masked"},
        f"{p}masked": {"lightning"},
        f"{p}kl.reading": {f"{p}models.forward"},
        f"{p}models.forward": {"torch"},
        f"{p}perf.onednn": {f"{p}masked", "torch"},
        f"{p}algorithms.ppo": {f"{p}perf.gelu"},
        f"{p}algorithms.pipeline": {f"{p}perf.gelu"},
        f"{p}perf.gelu": set(),
    }
    found = broken_rules(graph)
    assert [line.partition(":")[0] for line in found] == [
        "kl.reading -> models.forward",
        "perf.onednn -> masked",
        "algorithms.ppo -> perf.gelu",
        "kl.controllers -> masked -> lightning",
        "masked -> lightning",
    ]


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    found = [members for members in tangles(graph) if members not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(describe(graph, m) for m in found)


def _known_cycles() -> list:
    params = [
        pytest.param(members, marks=pytest.mark.xfail(strict=True, reason=reason))
        for members, reason in KNOWN_CYCLES.items()
    ]
    return params or [pytest.param(None, marks=pytest.mark.skip(reason="no known cycle left"))]


@pytest.mark.parametrize(
    "members", _known_cycles(), ids=lambda m: " ".join(map(_short, sorted(m or []))) or "none"
)
def test_known_cycle_is_gone(members):
    assert members not in tangles(import_graph())


def test_the_graph_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('_LAZY = {"A": "rlkl_lightning.a"}\n')
    (package / "a.py").write_text("def f():\n    from rlkl_lightning.sub import b\n")
    (package / "sub" / "__init__.py").write_text("from .b import g\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlkl_lightning import c\n"
        "else:\n    import rlkl_lightning.a\n"
    )
    (package / "c.py").write_text("from rlkl_lightning.sub import g\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    graph = import_graph()
    assert graph == {
        PACKAGE: set(),
        f"{PACKAGE}.a": {f"{PACKAGE}.sub.b"},
        f"{PACKAGE}.c": {f"{PACKAGE}.sub"},
        f"{PACKAGE}.sub": {f"{PACKAGE}.sub.b"},
        f"{PACKAGE}.sub.b": {f"{PACKAGE}.a", f"{PACKAGE}.c"},  # TYPE_CHECKING counts
    }
    assert [describe(graph, m) for m in tangles(graph)] == ["a -> sub.b -> a (tangled with c, sub)"]


def test_a_tangle_is_named_by_a_shortest_cycle_and_its_other_modules():
    p = f"{PACKAGE}."
    graph = {
        f"{p}a": {f"{p}b"},
        f"{p}b": {f"{p}a", f"{p}c"},
        f"{p}c": {f"{p}d"},
        f"{p}d": {f"{p}b"},
        f"{p}e": {f"{p}a"},
    }
    assert tangles(graph) == [frozenset({f"{p}a", f"{p}b", f"{p}c", f"{p}d"})]
    assert describe(graph, tangles(graph)[0]) == "a -> b -> a (tangled with c, d)"
