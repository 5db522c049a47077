"""A griffe extension: jem-plugin's reST-flavoured docstrings as Markdown for mkdocstrings.

The docstrings are written for readers of the source: ``code`` in double backquotes, Sphinx roles
(:class:`~jem_plugin.sampling.SGLD`), numpy-style section headers underlined with dashes whose
entries read ``name: description``, ``>>>`` examples and ``::`` literal blocks. The numpy parser
reads every paragraph after a ``Parameters`` header as more parameters, so the docs render the
docstrings as Markdown (``docstring_style: null``) after this extension rewrites them:

* ``code`` -> `code`;
* a role -> a cross-reference to the object's entry in the API reference, left as plain code when
  that object has no entry (optional references: they never fail a strict build);
* a header underlined with ``---``/``===`` -> a bold line; the ``name: description`` entries of
  Parameters, Attributes, Fields, Returns and Raises -> a list;
* ``>>>`` examples and ``::`` literal blocks -> fenced code;
* members whose docstring starts with "Deprecated" (old spellings kept for one release) are left
  out.

Used only by ``mkdocs.yml`` (``extensions:`` of the Python handler); the docstrings themselves are
not changed.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ENTRY_SECTIONS = {
    "parameters",
    "attributes",
    "fields",
    "returns",
    "raises",
    "other parameters",
    "yields",
}
_UNDERLINE = re.compile(r"^\s*(-{3,}|={3,})\s*$")
_ENTRY = re.compile(
    r"^(\*{0,2}[A-Za-z_][\w.]*(?:\s*,\s*\*{0,2}[A-Za-z_][\w.]*)*)\s*:(?:\s+(.*)|\s*)$"
)
_ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|data|exc|obj|const):`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")


class RestToMarkdown(griffe.Extension):
    """Rewrite every docstring of a loaded package (once the whole package is loaded, so that
    roles can be resolved against any of its modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _convert_tree(pkg, pkg, set())

    def on_package_loaded(
        self, *, pkg: griffe.Module, **kwargs: Any
    ) -> None:  # the hook's name in griffe 1
        _convert_tree(pkg, pkg, set())


def _convert_tree(obj: Any, pkg: griffe.Module, seen: set[int]) -> None:
    if id(obj) in seen or obj.is_alias:
        return
    seen.add(id(obj))
    if obj.docstring is not None:
        obj.docstring.value = to_markdown(
            obj.docstring.value, lambda target: _resolve(target, obj, pkg)
        )
    for name, member in list(obj.members.items()):
        if member.is_alias:
            continue
        if member.docstring is not None and member.docstring.value.lstrip().startswith(
            "Deprecated"
        ):
            del obj.members[
                name
            ]  # an old spelling kept for one release: not part of the reference
            continue
        _convert_tree(member, pkg, seen)


def _lookup(path: str, pkg: griffe.Module) -> Any:
    try:
        found = pkg.modules_collection[path]
    except (
        KeyError,
        ValueError,
        AttributeError,
        griffe.AliasResolutionError,
        griffe.CyclicAliasError,
    ):
        return None
    if found is not None and found.is_alias:
        try:
            return found.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return found


def _resolve(target: str, obj: Any, pkg: griffe.Module) -> str:
    """The full path of the object a role names, as seen from ``obj``'s docstring."""
    target = target.lstrip(".")
    scopes = []
    if obj.is_class or obj.is_module:
        scopes.append(obj)
    parent = obj.parent
    while parent is not None:
        scopes.append(parent)
        parent = parent.parent
    candidates = [target] + [f"{scope.path}.{target}" for scope in scopes]
    for candidate in candidates:
        found = _lookup(candidate, pkg)
        if found is not None:
            return str(found.path)
    return target


def _inline(text: str, resolve: Any) -> str:
    def role(match: re.Match) -> str:
        body = match.group(2)
        title, target = body, body
        explicit = re.fullmatch(r"(.+?)\s*<([^>]+)>", body)
        if explicit:
            title, target = explicit.group(1), explicit.group(2)
        elif body.startswith("~"):
            target = body[1:]
            title = target.rsplit(".", 1)[-1]
        if match.group(1) in ("meth", "func") and not title.endswith(")"):
            title += "()"
        identifier = resolve(target.strip())
        return (
            f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(title.strip())}</code></autoref>"
        )

    # Code first, so that a role inside code stays literal.
    parts = re.split(r"(``.+?``)", text)
    out = []
    for part in parts:
        if part.startswith("``") and part.endswith("``") and len(part) > 4:
            code = part[2:-2]
            fence = "``" if "`" in code else "`"
            pad = " " if code.startswith("`") or code.endswith("`") else ""
            out.append(f"{fence}{pad}{code}{pad}{fence}")
        else:
            out.append(_ROLE.sub(role, part))
    return "".join(out)


def _fenced(block: list[str], language: str = "") -> list[str]:
    lines = list(block)
    while lines and not lines[-1].strip():
        lines.pop()
    indent = min(
        (len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0
    )
    return ["", f"```{language}", *(line[indent:] for line in lines), "```", ""]


def _join_spans(text: str) -> str:
    """Code spans and roles that a line break splits, put on one line (the rest works line by line)."""
    text = re.sub(
        r"(:\w+:`)([^`]*)`",
        lambda m: m.group(1) + re.sub(r"\s*\n\s*", " ", m.group(2)) + "`",
        text,
    )
    pieces = text.split("``")
    for k in range(1, len(pieces), 2):  # odd pieces are inside a ``code`` span
        pieces[k] = re.sub(r"\s*\n\s*", " ", pieces[k])
    return "``".join(pieces)


def to_markdown(text: str, resolve: Any = lambda target: target) -> str:
    """``text`` (one docstring, dedented) as Markdown; ``resolve(target)`` gives a role's full path."""
    lines = _join_spans(text).splitlines()
    out: list[str] = []
    i, n = 0, len(lines)
    entries = False  # inside a Parameters-like section
    while i < n:
        line = lines[i]
        stripped = line.strip()
        # section header: a line underlined with dashes or equals signs
        if (
            stripped
            and i + 1 < n
            and _UNDERLINE.match(lines[i + 1])
            and not _UNDERLINE.match(line)
        ):
            out += ["", f"**{_inline(stripped, resolve)}**", ""]
            entries = stripped.lower() in _ENTRY_SECTIONS
            i += 2
            continue
        # doctest: >>> lines with their continuation and output, up to a blank line
        if stripped.startswith(">>>"):
            block = []
            while i < n and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += _fenced(block, "pycon")
            entries = False
            continue
        # literal block: a paragraph ending in '::', then an indented block
        if stripped.endswith("::") and not stripped.startswith(".."):
            head = stripped[:-2].rstrip()
            lead = line[: len(line) - len(line.lstrip())]
            if head:
                out.append(lead + _inline(head + ":", resolve))
            i += 1
            while i < n and not lines[i].strip():
                i += 1
            base = len(line) - len(line.lstrip())
            block = []
            while i < n and (
                not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > base
            ):
                block.append(lines[i])
                i += 1
            out += _fenced(block)
            entries = False
            continue
        if entries:
            match = _ENTRY.match(line) if line == line.lstrip() else None
            if match:
                names = ", ".join(
                    f"`{name.strip()}`" for name in match.group(1).split(",")
                )
                item = [f"- {names}: {_inline(match.group(2) or '', resolve)}".rstrip()]
                i += 1
                while i < n and lines[i].strip() and lines[i] != lines[i].lstrip():
                    item.append("  " + _inline(lines[i].strip(), resolve))
                    i += 1
                out += item
                continue
            if not stripped:
                j = i + 1
                while j < n and not lines[j].strip():
                    j += 1
                if j < n and _ENTRY.match(lines[j]) and lines[j] == lines[j].lstrip():
                    i = j
                    continue
                entries = False
            elif line == line.lstrip():
                entries = False
                out.append("")
        out.append(_inline(line, resolve))
        i += 1
    return "\n".join(out).strip("\n") + "\n"
