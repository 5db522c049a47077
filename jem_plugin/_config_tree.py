"""A tree of frozen dataclasses read by flat names, and written as plain data (private).

:mod:`jem_plugin.recipes` describes its tree here once (:class:`ConfigTree`): which field holds a
section, the prefix of each section's flat names, and which fields hold a choice among several
small dataclasses (a *union*: an init spec, a covariance). Everything else is derived from the
fields: the flat names (``sgld_steps``, ``init_covariance``), their types and help text, reading
and replacing by flat name, and the plain-data form (``{"kind": ..., ...}`` for a choice).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from .errors import InvalidInputError

__all__ = ["ConfigTree", "MISSING"]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


#: What :meth:`ConfigTree.get` returns for a path the current choice does not have.
MISSING: Any = _Missing()

# {flat name: (path in the tree, {kind: class} for a union choice, else None)}
Table = dict[str, tuple[tuple[str, ...], "dict[str, type] | None"]]


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _is_section(hint: Any) -> bool:
    return dataclasses.is_dataclass(hint) and isinstance(hint, type)


def _scalar_type(hint: Any) -> dict[str, Any]:
    args, origin = typing.get_args(hint), typing.get_origin(hint)
    if origin is Literal:
        return {"type": str, "choices": list(args), "optional": False}
    if origin in (typing.Union, types.UnionType):
        plain = [a for a in args if a is not type(None) and not dataclasses.is_dataclass(a)]
        return {"type": plain[0] if plain else str, "choices": None, "optional": type(None) in args}
    return {"type": hint, "choices": None, "optional": False}


class ConfigTree:
    """The flat names of the tree under ``root`` and its plain-data form.

    ``prefixes``: a section field's name -> the prefix of its settings' flat names (``""``: bare).
    ``unions``: ``(owner class, field name)`` -> ``{kind: class}`` for a field holding one of several
    choices; the choice reads as its kind, and its settings take the prefix of the field's flat
    name when the field names one (``"flag"`` metadata), else its section's prefix. ``tagged``:
    other classes written with a ``"kind"`` tag (a schedule in a plain field). ``skip``: root
    fields that are not settings. A field's ``"flag"`` metadata names it outright.
    """

    def __init__(
        self,
        root: type,
        prefixes: Mapping[str, str],
        unions: Mapping[tuple[type, str], Mapping[str, type]],
        tagged: tuple[type, ...] = (),
        skip: tuple[str, ...] = (),
    ) -> None:
        self.root, self.prefixes, self.unions, self.skip = root, dict(prefixes), dict(unions), skip
        self.kinds: tuple[type, ...] = (*(c for m in self.unions.values() for c in m.values()), *tagged)
        self._tagged = {_kind_of(c): c for c in tagged}
        self._table: Table = {}

    # ------------------------------------------------------------------ names
    def table(self) -> Table:
        """``{flat name: (path, kinds or None)}``, walked once."""
        if not self._table:
            for f, hint in _fields(self.root):
                if f.name in self.skip:
                    continue
                if _is_section(hint):
                    self._walk(hint, (f.name,), self.prefixes[f.name])
                else:
                    self._table[f.name] = ((f.name,), None)
        return self._table

    def _walk(self, cls: type, path: tuple[str, ...], prefix: str) -> None:
        for f, hint in _fields(cls):
            sub = path + (f.name,)
            name = f.metadata.get("flag") or (f"{prefix}_{f.name}" if prefix else f.name)
            if (cls, f.name) in self.unions:
                kinds = dict(self.unions[(cls, f.name)])
                self._table[name] = (sub, kinds)
                for member in kinds.values():
                    self._walk(member, sub, name if f.metadata.get("flag") else prefix)
            elif _is_section(hint):
                self._walk(hint, sub, self.prefixes.get(f.name, f.name))
            else:
                self._table.setdefault(name, (sub, None))

    def describe(self) -> dict[str, dict[str, Any]]:
        """``{flat name: {"help", "path", "type", "choices", "optional"}}`` from the fields."""
        out: dict[str, dict[str, Any]] = {}
        for name, (path, kinds) in self.table().items():
            f, hint = self._field_at(path)
            info: dict[str, Any] = {"help": f.metadata.get("help", ""), "path": ".".join(path)}
            info.update(
                {"type": str, "choices": list(kinds), "optional": False} if kinds is not None else _scalar_type(hint)
            )
            out[name] = info
        return out

    def _field_at(self, path: tuple[str, ...]) -> tuple[dataclasses.Field, Any]:
        cls: type = self.root
        for i, part in enumerate(path):
            f, hint = {g.name: (g, h) for g, h in _fields(cls)}[part]
            if i == len(path) - 1:
                return f, hint
            if (cls, part) in self.unions:  # inside a choice: the member that has the next field
                nxt = path[i + 1]
                cls = next(
                    m for m in self.unions[(cls, part)].values() if nxt in {g.name for g in dataclasses.fields(m)}
                )
            else:
                cls = hint
        raise KeyError(path)

    # ------------------------------------------------------------------ reading and replacing
    def is_choice(self, value: Any) -> bool:
        """Whether ``value`` is one choice of a union (or a tagged class)."""
        return isinstance(value, self.kinds)

    @staticmethod
    def get(obj: Any, path: tuple[str, ...]) -> Any:
        """The value at ``path``, or :data:`MISSING` when the current choices lack it."""
        for part in path:
            if not (dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}):
                return MISSING
            obj = getattr(obj, part)
        return obj

    @classmethod
    def set(cls, obj: Any, path: tuple[str, ...], value: Any) -> Any:
        """A copy of ``obj`` with ``value`` at ``path``."""
        if len(path) == 1:
            return dataclasses.replace(obj, **{path[0]: value})
        return dataclasses.replace(obj, **{path[0]: cls.set(getattr(obj, path[0]), path[1:], value)})

    def flat(self, obj: Any) -> dict[str, Any]:
        """Every setting of ``obj`` by flat name; a union choice reads as its kind."""
        out: dict[str, Any] = {}
        for name, (path, kinds) in self.table().items():
            value = self.get(obj, path)
            if value is not MISSING:
                out[name] = _kind_of(value) if kinds is not None else value
        return out

    def replace(self, obj: Any, changes: Mapping[str, Any], what: str) -> Any:
        """A copy of ``obj`` with ``changes`` by flat name: kinds first (outer before inner), and a
        setting the current kind lacks refused in one line (``what`` names ``obj`` in errors)."""
        table = self.table()
        unknown = sorted(set(changes) - set(table))
        if unknown:
            raise InvalidInputError(f"{what}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(table)}")
        for name in sorted(changes, key=lambda n: (0 if table[n][1] is not None else 1, len(table[n][0]))):
            path, kinds = table[name]
            value = changes[name]
            if kinds is not None:
                if value not in kinds:
                    raise InvalidInputError(f"{name} must be one of {', '.join(kinds)}, got {value!r}")
                current = self.get(obj, path)
                if self.is_choice(current) and _kind_of(current) == value:
                    continue  # the same kind: keep its settings
                value = kinds[value]()
            elif self.get(obj, path) is MISSING:
                owner = self.get(obj, path[:-1])
                raise InvalidInputError(
                    f"{what}: {name} does not apply to {type(owner).__name__.lower()} {_kind_of(owner)!r}; set "
                    f"the kind first ({self._kind_flag_for(path)})"
                )
            obj = self.set(obj, path, value)
        return obj

    def _kind_flag_for(self, path: tuple[str, ...]) -> str:
        """The flat name of the innermost choice that ``path`` lies in."""
        owners = [(len(p), n) for n, (p, kinds) in self.table().items() if kinds is not None and path[: len(p)] == p]
        return max(owners)[1]

    # ------------------------------------------------------------------ plain data
    def to_plain(self, value: Any) -> Any:
        """``value`` as plain data: dataclasses as dicts, choices with their ``"kind"``."""
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            body = {f.name: self.to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return {"kind": _kind_of(value), **body} if self.is_choice(value) else body
        if isinstance(value, tuple):
            return [self.to_plain(v) for v in value]
        return value

    def from_plain(self, cls: type, data: Mapping[str, Any]) -> Any:
        """The ``cls`` that :meth:`to_plain` wrote as ``data``."""
        kwargs: dict[str, Any] = {}
        for f, hint in _fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if (cls, f.name) in self.unions and isinstance(value, Mapping):
                body = dict(value)
                value = self.from_plain(self.unions[(cls, f.name)][body.pop("kind")], body)
            elif isinstance(value, Mapping) and value.get("kind") in self._tagged:
                body = dict(value)
                value = self.from_plain(self._tagged[body.pop("kind")], body)
            elif _is_section(hint):
                value = self.from_plain(hint, value)
            kwargs[f.name] = value
        return cls(**kwargs)


def _kind_of(value: Any) -> str:
    """The kind of a choice (``"gaussian"``, ``"lowrank"``, ``"poly"``): its class's ``kind``."""
    return str(value.kind)
