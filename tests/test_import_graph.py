"""The package's layers, checked on every import its source holds; and no import cycles.

The layers of docs/contributing.md ("How the code is organised") are declared once, in ``LAYERS``
(which folders and modules each holds) and ``SEES`` (which other layers each may import). Every
``import``/``from`` statement of ``jem_plugin/`` and ``adapters/`` (installed as ``jem_adapters``)
counts: at module level, under ``if TYPE_CHECKING:`` and inside functions. A deferred import is
still a dependency: it runs when the function is called, and a cycle that only the type checker
sees still ties two modules into one. Built-in plugins are registered by name through pluggy
(``importlib.import_module`` in :mod:`jem_plugin.plugins`), which is how the core is meant to
reach them, so only import statements are read.

``python tests/test_import_graph.py`` prints what the checks find and the package's floors: the
longest chain of imports inside ``jem_plugin`` (a module on a circle counts once per member).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import jem_adapters
import jem_plugin

#: Each layer's modules: ``name.*`` holds a package and everything under it, a plain name that one
#: module; a module belongs to the most specific entry that holds it (a module named exactly,
#: else the longest package).
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("jem_plugin.*",),
    "public names": ("jem_plugin",),  # jem_plugin/__init__.py: `import jem_plugin as jem`
    "figures": ("jem_plugin.viz",),
    "built-in plugins": ("jem_plugin.builtins.*", "jem_adapters.*"),
    "integrations": ("jem_plugin.integrations.*",),
    "app": ("jem_plugin.app.*",),
}
#: The other layers a layer may import (its own always).
SEES: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "public names": frozenset({"core", "integrations"}),  # GenerativeLossMixin is public
    "figures": frozenset({"core"}),
    "built-in plugins": frozenset({"core"}),
    "integrations": frozenset({"core"}),
    "app": frozenset({"core", "public names", "figures", "built-in plugins", "integrations"}),
}
#: Each scanned package by its import name: the folder ``adapters/`` is installed as ``jem_adapters``.
ROOTS: dict[str, Path] = {
    "jem_plugin": Path(jem_plugin.__file__).parent,
    "jem_adapters": Path(jem_adapters.__file__).parent,
}


@dataclass(frozen=True)
class Source:
    text: str
    is_package: bool  # an __init__.py: its relative imports start from itself


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (one of the scanned ones)
    line: int
    where: str  # "module level", "TYPE_CHECKING" or "in NAME()"


def read_sources(roots: Mapping[str, Path] = ROOTS) -> dict[str, Source]:
    """Every module under ``roots`` (package folders), by its dotted name."""
    found: dict[str, Source] = {}
    for name, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = (name, *path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = Source(path.read_text(), is_package)
    return found


class _Reader(ast.NodeVisitor):
    """Each import statement with where it sits (the innermost function, or a TYPE_CHECKING block)."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def _enter(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, f"in {node.name}()")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, f"in {node.name}()")

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            self.scope.append("TYPE_CHECKING")
            for child in node.body:
                self.visit(child)
            self.scope.pop()
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, node: ast.Import | ast.ImportFrom) -> None:
        self.found.append((node, self.scope[-1] if self.scope else "module level"))

    visit_Import = _add
    visit_ImportFrom = _add


def read_imports(sources: Mapping[str, Source]) -> list[Import]:
    """Every import of one scanned module by another, wherever in the file it is written."""
    found: list[Import] = []
    for name, source in sources.items():
        package = name if source.is_package else name.rpartition(".")[0]
        reader = _Reader()
        reader.visit(ast.parse(source.text))
        for node, where in reader.found:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                stem = node.module or ""
                absolute = stem if node.level == 0 else ".".join(p for p in (base, stem) if p)
                # `from a import b` names the submodule a.b where there is one, else a name of a
                subs = [f"{absolute}.{alias.name}" for alias in node.names]
                targets = [t for t in subs if t in sources] or [absolute]
            found += [Import(name, t, node.lineno, where) for t in targets if t in sources and t != name]
    return found


def layer_of(module: str) -> str:
    """The layer holding ``module``, by the most specific entry of ``LAYERS``."""
    best: tuple[int, str] | None = None
    for layer, entries in LAYERS.items():
        for entry in entries:
            package = entry.removesuffix(".*")
            if entry == module:
                specificity = 1_000_000  # named exactly
            elif entry.endswith(".*") and (module == package or module.startswith(package + ".")):
                specificity = len(package)
            else:
                continue
            if best is None or specificity > best[0]:
                best = (specificity, layer)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


def leaks(imports: Iterable[Import]) -> list[str]:
    """Each import of a layer that its module's layer may not see, as one line."""
    out = []
    for imp in imports:
        src, dst = layer_of(imp.module), layer_of(imp.target)
        if dst != src and dst not in SEES[src]:
            out.append(f"{imp.module} ({src}) -> {imp.target} ({dst}), line {imp.line}, {imp.where}")
    return out


def import_graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    """Module -> the modules it imports. A module's import of its own parent package is left out:
    Python has initialised the parent before the child runs, so that import loads nothing."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.target, set())
        if not imp.module.startswith(imp.target + "."):
            graph.setdefault(imp.module, set()).add(imp.target)
    return graph


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan), each sorted; a component is a circle when it
    has more than one member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One shortest circle through each group of modules that import each other, as
    ``[a, b, ..., a]`` from the group's first module by name."""
    return [_shortest_circle(graph, set(comp), comp[0]) for comp in _components(graph) if len(comp) > 1]


def _shortest_circle(graph: Mapping[str, set[str]], members: set[str], start: str) -> list[str]:
    paths = {start: [start]}  # breadth first inside the group: the shortest way back to start
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is in a group of modules it cannot reach back from")


def floors(graph: Mapping[str, set[str]], inside: str = "jem_plugin") -> tuple[int, list[str]]:
    """``(count, chain)``: the longest chain of imports among the modules under ``inside``,
    counted in modules (a module that imports none of them is one floor). The modules of a
    circle form one group that the chain passes through, counting each member once."""
    sub = {
        m: {t for t in ts if t == inside or t.startswith(inside + ".")}
        for m, ts in graph.items()
        if m == inside or m.startswith(inside + ".")
    }
    comps = _components(sub)
    comp_of = {m: i for i, comp in enumerate(comps) for m in comp}
    best: dict[int, tuple[int, list[str]]] = {}

    def longest(i: int) -> tuple[int, list[str]]:
        if i not in best:
            below = [longest(comp_of[t]) for m in comps[i] for t in sub[m] if comp_of[t] != i]
            height, chain = max(below, default=(0, []))
            label = comps[i][0] if len(comps[i]) == 1 else "{" + ", ".join(comps[i]) + "}"
            best[i] = (height + len(comps[i]), [label, *chain])
        return best[i]

    return max((longest(i) for i in range(len(comps))), default=(0, []))


def report() -> str:
    """What the checks find, each import with its line, and the floors of ``jem_plugin``."""
    imports = read_imports(read_sources())
    graph = import_graph(imports)
    first: dict[tuple[str, str], str] = {}
    for imp in imports:
        first.setdefault((imp.module, imp.target), f"line {imp.line}, {imp.where}")
    lines = [f"{len(imports)} imports between {len(graph)} modules"]
    lines += ["leak: " + leak for leak in leaks(imports)] or ["no leaks"]
    for comp in _components(graph):
        if len(comp) > 1:
            circle = _shortest_circle(graph, set(comp), comp[0])
            steps = [f"{a} -> {b} ({first[a, b]})" for a, b in zip(circle, circle[1:])]
            lines.append(f"cycle among {{{', '.join(comp)}}}:\n    " + "\n    ".join(steps))
    if not cycles(graph):
        lines.append("no cycles")
    height, chain = floors(graph)
    lines.append(f"floors of jem_plugin: {height} ({' -> '.join(chain)})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the checker itself
def _synthetic(**modules: str) -> dict[str, Source]:
    return {name.replace("__", "."): Source(text, False) for name, text in modules.items()}


def test_the_checker_flags_a_function_local_import_of_a_layer_not_seen():
    sources = _synthetic(
        jem_plugin__buffer="import torch\n\ndef save(x):\n    from .viz import draw\n    return draw(x)\n",
        jem_plugin__viz="from .buffer import save\n",
        jem_plugin__app__cli="from ..viz import draw\n",
    )
    assert leaks(read_imports(sources)) == [
        "jem_plugin.buffer (core) -> jem_plugin.viz (figures), line 4, in save()",
    ]


def test_the_checker_reads_type_checking_imports_and_the_adapters():
    sources = _synthetic(
        jem_plugin__stability="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .integrations import mixin\n",
        jem_plugin__integrations__mixin="",
        jem_adapters__timm="import jem_plugin.app.nets\n",
        jem_plugin__app__nets="",
    )
    assert leaks(read_imports(sources)) == [
        "jem_plugin.stability (core) -> jem_plugin.integrations.mixin (integrations), line 3, TYPE_CHECKING",
        "jem_adapters.timm (built-in plugins) -> jem_plugin.app.nets (app), line 1, module level",
    ]


def test_the_checker_finds_a_cycle_closed_by_an_import_inside_a_function():
    sources = _synthetic(
        jem_plugin__a="from .b import x\n",
        jem_plugin__b="from .c import y\n",
        jem_plugin__c="def f():\n    from . import a\n",
        jem_plugin__d="from .a import z\n",
    )
    graph = import_graph(read_imports(sources))
    assert cycles(graph) == [["jem_plugin.a", "jem_plugin.b", "jem_plugin.c", "jem_plugin.a"]]
    assert floors(graph) == (4, ["jem_plugin.d", "{jem_plugin.a, jem_plugin.b, jem_plugin.c}"])
    graph["jem_plugin.c"] = set()  # without the deferred import: a plain chain d -> a -> b -> c
    assert cycles(graph) == []
    assert floors(graph) == (4, ["jem_plugin.d", "jem_plugin.a", "jem_plugin.b", "jem_plugin.c"])


def test_a_package_reading_its_own_parent_is_no_cycle():
    sources = {
        "jem_plugin": Source("from .app import run\n", True),
        "jem_plugin.app": Source("from .. import errors\nfrom .. import wrap\n", True),
        "jem_plugin.errors": Source("", False),
    }
    graph = import_graph(read_imports(sources))
    assert cycles(graph) == [] and graph["jem_plugin.app"] == {"jem_plugin.errors"}


# ------------------------------------------------------------------------------ the package
def test_every_module_is_in_a_layer_that_may_see_what_it_imports():
    found = leaks(read_imports(read_sources()))
    assert not found, "imports against the layers of docs/contributing.md:\n" + "\n".join(found)


def test_no_module_imports_itself_back():
    found = cycles(import_graph(read_imports(read_sources())))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


if __name__ == "__main__":
    print(report())
