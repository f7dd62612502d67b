"""Swappable parts named in a config: one registry per kind, one resolver, one message.

A component (a KL control law, a KL estimator, an advantage estimator) is named in a config in
one of these forms, built-in and plugged alike:

* a registered short name: ``controller: adaptive``;
* the dotted import path of a user's own class or object: ``mypackage.module.MyLaw``;
* a ``{class_path, init_args}`` mapping, as jsonargparse writes it, whose ``class_path`` is a
  registered name, a class name the parser knows, or a dotted path:
  ``{class_path: AdaptiveKLController, init_args: {horizon: 1000}}``;
* in Python, the class or object itself (or a ``functools.partial`` of a class, which the
  parser makes of a ``{class_path, init_args}`` block for a component built later).

:class:`Registry` holds one kind's registered names (``@LAWS.register("adaptive")`` on a
class, ``ESTIMATORS.register("k3")(estimator)`` on an object) and resolves every form the same
way, with one message for a name that names nothing. :func:`plain_spec` turns a component into
the plain ``{"class_path": ..., "init_args": {...}}`` that hyperparameters and checkpoints
store (loadable with ``torch.load(weights_only=True)``). A path comes from the user's own
config or command line, never from a checkpoint or a data file.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["Registry", "import_object", "plain_spec"]


def import_object(path: str) -> Any:
    """The object at the dotted path ``module.sub.name``; ImportError/AttributeError if none."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ImportError(f"{path!r} is not a dotted path module.name")
    return getattr(importlib.import_module(module_name), attribute)


def import_path(obj: Any) -> str:
    """The dotted path that imports ``obj`` (a class or a module-level object)."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class Registry:
    """The registered components of one kind, and the resolver of every form naming one.

    Args:
        option: The option that names a component of this kind (``kl.controller``), for
            messages; a caller may name another (``model.init_args.kl.estimator``).
        what: What a dotted path must name, for messages (``a KLLaw subclass``).
        check: ``check(name, component)`` raises a ValueError for a component this kind
            refuses to register (None: any).
    """

    def __init__(
        self, option: str, what: str, check: Callable[[str, Any], None] | None = None
    ) -> None:
        self.option = option
        self.what = what
        self._check = check
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        """Register the decorated class (or the object passed) as ``name``; return it.

        Example::

            @LAWS.register("halving")
            class HalvingLaw(KLLaw): ...

        Raises:
            ValueError: For a name that is taken or is not an identifier (a name has no dot).
        """
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(
                f"register: a registered name is an identifier without a dot, got {name!r}"
            )
        if name in self._entries:
            raise ValueError(f"register: the name {name!r} is already registered")

        def add(obj: Any) -> Any:
            if self._check is not None:
                self._check(name, obj)
            self._entries[name] = obj
            return obj

        return add

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's own registration)."""
        del self._entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order of registration."""
        return tuple(self._entries)

    def items(self) -> list[tuple[str, Any]]:
        """``(name, component)`` pairs, in the order of registration."""
        return list(self._entries.items())

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __getitem__(self, name: str) -> Any:
        return self._entries[name]

    def name_of(self, obj: Any) -> str | None:
        """The registered name of ``obj`` (a class or an object), or None."""
        return next((name for name, entry in self._entries.items() if entry is obj), None)

    def error(
        self, got: Any, option: str | None = None, detail: str = "", names: tuple | None = None
    ) -> ValueError:
        """The one message of a value that names no component of this kind.

        Args:
            got: The value given.
            option: The option it was given to (default: the registry's).
            detail: Why, appended after the value (``: No module named 'x'``).
            names: The allowed names (default: every registered one).
        """
        names = self.names() if names is None else names
        return ValueError(
            f"`{option or self.option}` must be one of {names} or the dotted path of "
            f"{self.what} (mypackage.module.Name), got {got!r}{detail}"
        )

    def resolve(
        self, value: Any, option: str | None = None, names: tuple | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The component ``value`` names and the arguments it is given.

        Args:
            value: A registered name, a dotted path, a ``{class_path, init_args}`` mapping (or
                jsonargparse Namespace), a ``functools.partial`` of a class, or the component.
            option: The option, for messages.
            names: The names a message lists (default: every registered one).

        Returns:
            ``(target, init_args)``: the registered or imported class/object, and the
            arguments the config gives it (empty for a name, a path or an object).

        Raises:
            ValueError: For a name that is not registered, a path that does not import, or a
                mapping without a ``class_path`` or with other keys.
        """
        if hasattr(value, "as_dict") and callable(value.as_dict):  # a jsonargparse Namespace
            value = value.as_dict()
        if isinstance(value, functools.partial):
            return _partial_target(value), dict(value.keywords)
        if isinstance(value, Mapping):
            extra = sorted(set(value) - {"class_path", "init_args", "dict_kwargs"})
            if "class_path" not in value or extra:
                raise ValueError(
                    f"`{option or self.option}` as a mapping takes `class_path` and "
                    f"`init_args`, got {dict(value)!r}"
                )
            init = value.get("init_args") or {}
            if hasattr(init, "as_dict"):
                init = init.as_dict()
            target, _ = self.resolve(value["class_path"], option, names)
            return target, dict(init)
        if isinstance(value, str):
            if value in self._entries:
                return self._entries[value], {}
            by_class = self._by_class_name(value)
            if by_class is not None:
                return by_class, {}
            if "." not in value:
                raise self.error(value, option, names=names)
            try:
                return import_object(value), {}
            except (ImportError, AttributeError) as error:
                detail = f", which does not import: {error}"
                raise self.error(value, option, detail, names) from None
        return value, {}

    def _by_class_name(self, name: str) -> Any:
        """A registered class whose ``__name__`` is ``name`` (the parser's short form)."""
        for entry in self._entries.values():
            if inspect.isclass(entry) and entry.__name__ == name:
                return entry
        return None


def _partial_target(value: functools.partial) -> Any:
    """The class a ``functools.partial`` builds: its function, or the parser's last argument."""
    if inspect.isclass(value.func):
        return value.func
    classes = [arg for arg in value.args if inspect.isclass(arg)]  # jsonargparse's instantiator
    if classes:
        return classes[-1]
    return value.func


def check_arguments(target: Any, init_args: Mapping[str, Any], option: str, skip: int = 0) -> None:
    """Refuse ``init_args`` that ``target``'s signature does not take, naming those it does.

    Args:
        target: A class (its ``__init__``) or a function.
        init_args: The arguments a config gives it.
        option: The option, for the message: the component's (``kl.controller``), or the
            arguments' own (``--init_args``).
        skip: Leading positional parameters the caller fills (``init_kl_coef, target``).
    """
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    takes = [p.name for p in parameters[skip:] if p.kind is not p.VAR_POSITIONAL]
    unknown = [name for name in init_args if name not in takes]
    if unknown:
        where = (
            option
            if option.rpartition(".")[2].lstrip("-") == "init_args"
            else option + ".init_args"
        )
        raise ValueError(
            f"`{where}` has no argument {unknown[0]!r}: "
            f"{getattr(target, '__name__', target)} takes {takes}"
        )


def plain_spec(target: Any, init_args: Mapping[str, Any], skip: int = 0) -> dict[str, Any]:
    """``{"class_path": ..., "init_args": {...}}`` with every argument, defaults filled in.

    Plain values only (strings, numbers, bools, None, lists, dicts), so that hyperparameters
    and checkpoints hold no object; the arguments a class's signature gives defaults to are
    written out, so two specs of the same component compare equal whichever form named it.

    Args:
        target: The component's class (or function, or object: then no arguments).
        init_args: The arguments given.
        skip: Leading positional parameters the caller fills, left out.
    """
    arguments: dict[str, Any] = {}
    if inspect.isclass(target) or inspect.isfunction(target):
        try:
            parameters = list(inspect.signature(target).parameters.values())[skip:]
        except (TypeError, ValueError):
            parameters = []
        for p in parameters:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if p.name in init_args:
                arguments[p.name] = init_args[p.name]
            elif p.default is not p.empty:
                arguments[p.name] = p.default
    for name, value in init_args.items():
        arguments.setdefault(name, value)
    return {"class_path": import_path(target), "init_args": arguments}
