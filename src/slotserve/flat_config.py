"""Flat views of nested config dataclasses: every leaf setting under one name.

A root dataclass (EngineConfig) holds plain fields and sections (fields whose type is a
dataclass: `cache`, `scheduler`). `flat_fields(root)` lists every leaf once, by its flat name
(the field's name, or its metadata `name`), with its resolved type, default and the help
text of its class docstring's `name: text` entry; `build_flat(root, **settings)` builds the
root from flat settings. A renamed setting keeps its old flat names for a release (metadata
`deprecated_names`): build_flat accepts them with a DeprecationWarning, and the CLI keeps
their flags. Nothing here knows the engine: slotserve.config applies it to EngineConfig,
slotserve.engine_args makes CLI flags of it.
"""

from __future__ import annotations

import enum
import functools
import inspect
import re
import types
import typing
import warnings
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class FlatField:
    """One leaf setting of a nested config dataclass, under its flat name.

    name: the flat name (engine_config's keyword, the CLI flag's dest); the field's own
        name unless its metadata says `name`.
    section: the field of the root holding the nested dataclass ("cache"), or None.
    attr: the field's name in its own dataclass.
    annotation: the resolved type annotation.
    default: the dataclass default (MISSING for a required field).
    help: the field's `name: text` entry of its class docstring ("" if none).
    flag: whether the CLI gets a flag for it (metadata `flag`, default True).
    deprecated_names: its former flat names (metadata `deprecated_names`), still accepted
        for one release with a warning.
    """

    name: str
    section: str | None
    attr: str
    annotation: Any
    default: Any
    help: str
    flag: bool
    deprecated_names: tuple[str, ...] = ()

    @property
    def optional(self) -> bool:
        """Whether None is allowed (`X | None`)."""
        return type(None) in _union_args(self.annotation)

    @property
    def base_type(self) -> Any:
        """The annotation without `| None`: int, str, a Literal[...], an enum class, ..."""
        args = [a for a in _union_args(self.annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else self.annotation

    @property
    def choices(self) -> tuple | None:
        """The allowed values of a Literal or enum field; None for any other type."""
        base = self.base_type
        if typing.get_origin(base) is Literal:
            return typing.get_args(base)
        if isinstance(base, type) and issubclass(base, enum.Enum):
            return tuple(member.value for member in base)
        return None


def _union_args(annotation: Any) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def flat_fields(root: type) -> dict[str, FlatField]:
    """Every leaf field of the dataclass `root`, by flat name, in definition order.

    A field whose type is itself a dataclass is a section: its fields are listed in its
    place (one level deep). ValueError if two leaves share a flat name.
    """
    result: dict[str, FlatField] = {}
    hints = typing.get_type_hints(root)
    for f in fields(root):
        if is_dataclass(hints[f.name]):
            leaves = _own_fields(hints[f.name], section=f.name)
        else:
            leaves = _own_fields(root, section=None, only=f.name)
        for leaf in leaves:
            if leaf.name in result:
                raise ValueError(f"{root.__name__}: two settings named {leaf.name!r}")
            result[leaf.name] = leaf
    taken = set(result)
    for leaf in result.values():
        for old in leaf.deprecated_names:
            if old in taken:
                raise ValueError(f"{root.__name__}: {leaf.name}'s deprecated name {old!r} "
                                 "is another setting's name")
            taken.add(old)
    return result


def deprecated_names(leaves: dict[str, FlatField]) -> dict[str, str]:
    """Each former flat name of `leaves` -> the setting's name now."""
    return {old: leaf.name for leaf in leaves.values() for old in leaf.deprecated_names}


def _own_fields(cls: type, section: str | None, only: str | None = None) -> list[FlatField]:
    hints, docs = typing.get_type_hints(cls), _docstring_entries(cls)
    return [FlatField(name=f.metadata.get("name", f.name), section=section, attr=f.name,
                      annotation=hints[f.name], default=_default(f),
                      help=docs.get(f.name) or _enum_summary(hints[f.name]),
                      flag=f.metadata.get("flag", True),
                      deprecated_names=tuple(f.metadata.get("deprecated_names", ())))
            for f in fields(cls) if only is None or f.name == only]


def _enum_summary(annotation: Any) -> str:
    """The first line of an enum type's docstring (the help of an undocumented enum field)."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return (inspect.getdoc(annotation) or "").partition("\n")[0]
    return ""


def _default(f) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


# A docstring entry: "name: text" or "a / b: text" at the start of a line (after getdoc's
# dedent); more indented lines continue it.
_DOC_ENTRY = re.compile(r"^(\w+(?:\s*/\s*\w+)*):\s+(.*)$")


@functools.cache
def _docstring_entries(cls: type) -> dict[str, str]:
    """`name: text` entries of a class docstring, by field name."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (inspect.getdoc(cls) or "").splitlines():
        match = _DOC_ENTRY.match(line)
        if match:
            current = [match[2].strip()]
            for name in match[1].split("/"):
                entries[name.strip()] = current
        elif current is not None and line.startswith(" ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(parts) for name, parts in entries.items()}


def build_flat(root: type, **settings: Any) -> Any:
    """An instance of the dataclass `root` from flat settings (names as flat_fields(root));
    everything not given keeps its dataclass default. TypeError for an unknown name; a
    deprecated name sets its setting, with a DeprecationWarning."""
    leaves = flat_fields(root)
    settings = _renamed(leaves, settings)
    unknown = sorted(set(settings) - set(leaves))
    if unknown:
        raise TypeError(f"unknown {root.__name__} settings {unknown}; "
                        f"known: {', '.join(leaves)}")
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, value in settings.items():
        leaf = leaves[name]
        target = top if leaf.section is None else sections.setdefault(leaf.section, {})
        target[leaf.attr] = value
    hints = typing.get_type_hints(root)
    for section, section_settings in sections.items():
        top[section] = hints[section](**section_settings)
    return root(**top)


def _renamed(leaves: dict[str, FlatField], settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with each deprecated name replaced by its setting's (a DeprecationWarning
    each); TypeError if a setting is given under both names."""
    renamed = dict(settings)
    for old, new in deprecated_names(leaves).items():
        if old not in renamed:
            continue
        if new in renamed:
            raise TypeError(f"{new} given twice: as {new} and as its deprecated name {old}")
        warnings.warn(f"the setting {old!r} is deprecated: use {new!r}", DeprecationWarning,
                      stacklevel=4)
        renamed[new] = renamed.pop(old)
    return renamed
