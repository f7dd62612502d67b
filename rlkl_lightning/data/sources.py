"""Named text sources, such as ``"default"`` and ``"default:train"``, that a world makes.

``prompts: default`` names texts of the default world, which the world builds on first use; the
world lives above the data (:mod:`rlkl_lightning.world` imports from here, never the other way
round), so it registers its names here: importing ``rlkl_lightning`` imports
:mod:`rlkl_lightning.world.names`, which calls :func:`register_text_source`.
:class:`~rlkl_lightning.data.prompts.PromptDataModule` reads a source ``NAME`` or ``NAME:PART``
whose ``NAME`` is registered from the files that the name's builder returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OWNER = "PromptDataModule"


@dataclass(frozen=True)
class SourceFiles:
    """The files of one named source, once it is built.

    Attributes:
        prompts: What ``NAME`` reads as ``prompts`` (the default world: the openings of its
            test split).
        heldout: What ``NAME`` reads as ``heldout`` or ``test_heldout`` (the default world: its
            test split).
        parts: ``PART`` -> the file ``NAME:PART`` reads (the default world: its ``train``,
            ``validation`` and ``test`` splits).
        part_is: What a part is, for the message of a part that does not exist
            (``"a split of the default world"``).
    """

    prompts: str
    heldout: str
    parts: dict[str, str]
    part_is: str = "a part"


@dataclass(frozen=True)
class TextSource:
    """A registered name: how its settings are checked and how its files are made.

    Attributes:
        settings: ``settings(given)``: the data module's ``world`` option as the builder takes
            it (a mapping of its fields made the settings object, ``None`` kept), or a
            ``ValueError`` that names the option.
        build: ``build(settings, progress)``: the source's files, built on first use (with a
            progress display if ``progress``); cheap once they exist.
    """

    settings: Callable[[Any], Any]
    build: Callable[[Any, bool], SourceFiles]


_SOURCES: dict[str, TextSource] = {}


def register_text_source(
    name: str,
    build: Callable[[Any, bool], SourceFiles],
    settings: Callable[[Any], Any] = lambda given: given,
) -> None:
    """Make ``name`` and ``name:PART`` stand for the files ``build(settings, progress)`` returns.

    Registering a name again replaces it.
    """
    if not name or ":" in name:
        raise ValueError(f"register_text_source: `name` must be non-empty, no ':', got {name!r}")
    _SOURCES[name] = TextSource(settings=settings, build=build)


def text_source_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_SOURCES)


def named_source(source: Any) -> str | None:
    """The registered name that ``source`` (``NAME`` or ``NAME:PART``) reads from, else None."""
    if not isinstance(source, str):
        return None
    name = source.partition(":")[0]
    return name if name in _SOURCES else None


def text_source(name: str) -> TextSource:
    """The registered source ``name`` (see :func:`named_source`)."""
    return _SOURCES[name]


def source_file(source: str, files: SourceFiles, role: str, option: str) -> str:
    """The file a named ``source`` reads as ``role`` (``"prompts"`` or ``"heldout"``).

    Raises:
        ValueError: Naming ``option`` and the parts there are, for a part the source lacks.
    """
    name, colon, part = source.partition(":")
    if not colon:
        return files.prompts if role == "prompts" else files.heldout
    if part not in files.parts:
        allowed = tuple(f"{name}:{p}" for p in files.parts)
        raise ValueError(
            f"{OWNER}: `{option}` names {files.part_is}: one of {allowed} (or `{name}`), "
            f"got {source!r}"
        )
    return files.parts[part]
