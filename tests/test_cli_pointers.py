"""The messages the package prints point to the docs pages, not to files the wheel does not ship
(issue 60): ``jem train`` cited ``benchmarks/README.md``, which is in the repository only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jem_plugin
from jem_plugin.app.commands.train import RAISED_LR_EVIDENCE
from jem_plugin.app.default_recipe import BENCHMARKS_PAGE

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(jem_plugin.__file__).parent
# a repository path outside the package (benchmarks/README.md, results/...), in a string the user sees
UNSHIPPED = re.compile(r"\b(benchmarks|results|tests|examples)/[\w./-]+")


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node: a reader's notes, not a message."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_message_cites_a_file_the_wheel_does_not_ship():
    cited = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        notes = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in notes:
                cited += [f"{path.relative_to(ROOT)}:{node.lineno}: {m[0]}" for m in UNSHIPPED.finditer(node.value)]
    assert not cited, cited


def test_the_page_cited_holds_what_the_messages_quote():
    page = (ROOT / BENCHMARKS_PAGE).read_text(encoding="utf-8")
    assert "## The generalisation matrix" in page and "## The long row" in page
    assert BENCHMARKS_PAGE in RAISED_LR_EVIDENCE
