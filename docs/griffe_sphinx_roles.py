"""Griffe extension for the API reference: Sphinx roles in docstrings become cross-references.

The package's docstrings name other objects the Sphinx way (``:class:`~pkg.mod.Name```,
``:func:`name```, ``:mod:`.sibling```). mkdocstrings renders Markdown, where such a role would
show as literal text, so this extension rewrites each role before rendering:

* a target inside ``rlkl_lightning`` that the reference renders becomes an autorefs link,
  ``[`Name`][rlkl_lightning.mod.Name]``, which ``mkdocs build --strict`` checks;
* a target outside the package (``torch.where``, ``ValueError``) becomes inline code;
* a target that names nothing (a stale name) becomes inline code too, and is reported with a
  warning naming the file and line of the docstring, so a strict build fails. The exceptions are
  the targets listed in the ``known`` option (``"object.path: target"``), each a docstring
  problem already reported to the code's owner; they are logged, not warned about;
* the ``::`` that ends a paragraph before a literal block becomes ``:``, as Sphinx shows it.

Sphinx also reads a ``#:`` comment above an attribute as its docstring; griffe does not, so this
extension gives such attributes (``Defer``, ``TEXT_COLUMNS``, ...) those comments as docstrings,
and the reference shows them.

A target is resolved as Sphinx would: ``.name`` relative to the docstring's module (then its
parents), a dotted path from the package as given, and a bare name in the scope of the
documented object, a class's inherited members included. Docstrings of private objects are not
rendered, so their roles become code without a check.
"""

from __future__ import annotations

import builtins
import logging
import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc|const):`(?P<target>[^`]+)`")
#: A paragraph that ends with ``::`` before a literal block: Sphinx shows a single ``:``.
LITERAL = re.compile(r"(?m)(\S)::$")
PACKAGE = "rlkl_lightning"
logger = logging.getLogger("mkdocs.plugins.griffe_sphinx_roles")


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring in the package.

    Args:
        known: Unresolved targets to log instead of warning about, as ``"object.path: target"``.
    """

    def __init__(self, known: list[str] | None = None) -> None:
        self.known = {tuple(part.strip() for part in item.split(":", 1)) for item in known or []}
        self.seen: set[tuple[str, str]] = set()

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite every docstring of the package once all of it is loaded."""
        if pkg.path != PACKAGE:
            return
        for obj in _walk(pkg):
            if obj.is_attribute and obj.docstring is None:
                _comment_docstring(obj)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = LITERAL.sub(r"\1:", obj.docstring.value)
                obj.docstring.value = ROLE.sub(
                    lambda m, obj=obj: self._markdown(pkg, obj, m["target"]), obj.docstring.value
                )
        for path, target in sorted(self.known - self.seen):
            logger.warning("known unresolved target %r of %s no longer occurs", target, path)

    def _markdown(self, root: griffe.Module, obj: griffe.Object, target: str) -> str:
        """The Markdown for one role's ``target`` in the docstring of ``obj``."""
        name = re.sub(r"\s+", "", target)
        short = name.startswith("~")
        name = name.lstrip("~")
        title = name.lstrip(".").split(".")[-1] if short else name.lstrip(".")
        if _private(obj.path):
            return f"`{title}`"
        path = _resolve(root, obj, name)
        if path is not None and path.split(".")[0] == PACKAGE:
            path = _canonical(root, path)
        if path is None:
            where = f"{obj.docstring.parent.filepath}:{obj.docstring.lineno}"
            message = "%s: the docstring of %s names %r, which does not resolve"
            if (obj.path, target) in self.known:
                self.seen.add((obj.path, target))
                logger.info(message, where, obj.path, target)
            else:
                logger.warning(message, where, obj.path, target)
            return f"`{title}`"
        if path.split(".")[0] == PACKAGE and _rendered(root, path):
            return f"[`{title}`][{path}]"
        return f"`{title}`"


def _resolve(root: griffe.Module, obj: griffe.Object, name: str) -> str | None:
    """The full path that ``name`` stands for in the docstring of ``obj``; None if nothing."""
    if name.startswith("."):
        rest = name.lstrip(".")
        scope: Any = obj if obj.is_module else obj.module
        while scope is not None:
            if _find(root, f"{scope.path}.{rest}"):
                return f"{scope.path}.{rest}"
            scope = scope.parent
        return None
    head, _, tail = name.partition(".")
    if head == PACKAGE:
        return name if _find(root, name) else None
    try:
        resolved = obj.resolve(head)
    except griffe.NameResolutionError:
        return _inherited(obj, name) or (name if head in dir(builtins) else None)
    full = f"{resolved}.{tail}" if tail else resolved
    if full.split(".")[0] == PACKAGE and not _find(root, full):
        return _inherited(obj, name)
    return full


def _inherited(obj: griffe.Object, name: str) -> str | None:
    """``name`` as a member, inherited or not, of the class that ``obj`` is or belongs to."""
    cls: Any = obj
    while cls is not None and not cls.is_class:
        cls = cls.parent
    if cls is None or "." in name:
        return None
    try:
        members = cls.all_members
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return f"{cls.path}.{name}" if name in members else None


def _node(root: griffe.Module, path: str) -> Any:
    """The object or alias at ``path`` in the package (members of a class include inherited)."""
    if path.split(".")[0] != PACKAGE:
        return None
    node: Any = root
    for part in path.split(".")[1:]:
        try:
            node = node.all_members[part] if node.is_class else node.members[part]
        except (KeyError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return node


def _find(root: griffe.Module, path: str) -> bool:
    """Whether ``path`` names an object of the package."""
    return _node(root, path) is not None


def _canonical(root: griffe.Module, path: str) -> str | None:
    """``path`` with every import followed to where the object is defined; None if nowhere.

    A member inherited by a class keeps the class's path: the reference shows it there.
    """
    for _ in range(10):
        parts = path.split(".")
        for i in range(2, len(parts) + 1):
            node = _node(root, ".".join(parts[:i]))
            if node is None:
                return None
            if node.is_alias and not node.parent.is_class:
                path = ".".join([node.target_path, *parts[i:]])
                break
        else:
            return path
        if path.split(".")[0] != PACKAGE:
            return path
    return None


def _rendered(root: griffe.Module, path: str) -> bool:
    """Whether the reference shows the object at ``path``: public, and a module or documented."""
    node = _node(root, path)
    if node is None or _private(path):
        return False
    try:
        target = node.final_target if node.is_alias else node
        return target.is_module or target.docstring is not None
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return False


def _comment_docstring(attr: griffe.Object) -> None:
    """Give ``attr`` the ``#:`` comment lines right above it as its docstring."""
    lines = attr.module.lines
    start = attr.lineno - 1  # the attribute's own line, 0-based
    comment: list[str] = []
    while start > 0 and lines[start - 1].strip().startswith("#:"):
        start -= 1
        comment.insert(0, lines[start].strip()[2:].strip())
    if comment:
        parser = attr.module.docstring.parser if attr.module.docstring else None
        text = "\n".join(comment)
        end = attr.lineno - 1
        attr.docstring = griffe.Docstring(
            text, lineno=start + 1, endlineno=end, parent=attr, parser=parser
        )


def _private(path: str) -> bool:
    """Whether any part of ``path`` is private (and so left out of the reference)."""
    return any(part.startswith("_") and not part.endswith("__") for part in path.split("."))


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined under it (aliases left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)
