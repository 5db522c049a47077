"""The documentation stays true: the site builds with ``mkdocs build --strict``, every ```python
block of ``docs/**/*.md`` and ``README.md`` runs, and the README keeps its shape.

Each page's python blocks run in order in one namespace, in a temporary working directory. A block
that needs a GPU, the network or a long run carries an HTML comment on the line before its fence,
``<!-- skip: needs a GPU -->``; it is compiled, not run. Deprecated spellings fail a block: a
``DeprecationWarning`` raised by jem-plugin while it runs is an error.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The README's test command: what .ci/run runs, verbatim.
TEST_COMMAND = 'pip install -e ".[test]" && ruff check . && ruff format --check . && mypy && python -m pytest -q -n 2 --dist worksteal --cov'

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<why>.+?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None  # why it is not run, or None


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [README]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (also inside lists and admonitions), in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        language = (match["info"].strip().split() or [""])[0].lower()
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = _SKIP.match(before)
        body, j = [], i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])
        ):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{_name(page)}:{i + 1}: code block never closed")
        found.append(Block(page, i + 1, language, "\n".join(body) + "\n", skip["why"] if skip else None))
        i = j + 1
    return found


def _python_pages() -> list[Path]:
    return [p for p in _pages() if any(b.language in ("python", "py") for b in blocks(p))]


def put_jem_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``jem`` command installed with this interpreter first on ``PATH``, for the blocks that run
    it as a user would (``subprocess.run(["jem", ...])``): ``venv/bin/python -m pytest`` without an
    activated venv has no ``jem`` on ``PATH`` otherwise. It lies beside ``sys.executable`` (not
    resolved: a venv's python is a link to the base interpreter), or in the scheme's scripts folder."""
    found = [str(Path(sys.executable).parent), sysconfig.get_path("scripts"), os.environ.get("PATH", "")]
    monkeypatch.setenv("PATH", os.pathsep.join(d for d in dict.fromkeys(found) if d))


# ---------------------------------------------------------------------------- python blocks
@pytest.mark.slow
@pytest.mark.parametrize("page", _python_pages(), ids=_name)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    put_jem_on_path(monkeypatch)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.syspath_prepend(str(tmp_path))  # a block may write a module that a later one imports
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the examples are tiny; more threads only contend on a shared machine
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__docs__"}
    jem_dir = str(ROOT / "jem_plugin")
    try:
        for block in blocks(page):
            if block.language not in ("python", "py"):
                continue
            where = f"{_name(page)}:{block.line}"
            code = compile(block.code, where, "exec")  # skipped blocks must still be valid Python
            if block.skip is not None:
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                exec(code, namespace)
            deprecated = [
                w
                for w in caught
                if issubclass(w.category, DeprecationWarning)
                and (w.filename == where or w.filename.startswith(jem_dir))
            ]
            assert not deprecated, f"{where}: deprecated spelling: {deprecated[0].message}"
    finally:
        torch.set_num_threads(threads)


def test_the_jem_command_is_found_beside_the_interpreter_without_an_activated_venv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a shell that never activated the venv
    assert shutil.which("jem") is None
    put_jem_on_path(monkeypatch)
    found = shutil.which("jem")
    assert found is not None and Path(found).parent in (
        Path(sys.executable).parent,
        Path(sysconfig.get_path("scripts")),
    )


def test_load_examples_run_on_a_model_file_they_make() -> None:
    """A block that loads a model file (``jem.load``, ``jem.load_sampler``) runs here, making the file
    with ``jem train`` itself: a user copies it whole (issue 48: skip-marked load snippets used names
    nothing defined)."""
    loads = [
        (page, b)
        for page in _pages()
        for b in blocks(page)
        if b.language in ("python", "py") and re.search(r"\bjem\.load(_sampler)?\(", b.code)
    ]
    assert loads
    for page, b in loads:
        where = f"{_name(page)}:{b.line}"
        assert b.skip is None, f"{where}: a jem.load example runs in the docs test; make its model file in it"
        made = b.code.find('"jem", "train"')
        assert 0 <= made < b.code.find("jem.load"), f"{where}: make the model file (jem train) before loading it"


def test_skip_markers_name_a_reason() -> None:
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"<!--\s*skip\b(.*?)-->", text, flags=re.S):
            assert _SKIP.match(match.group(0)), f"{_name(page)}: write skip markers as <!-- skip: why -->"


# ---------------------------------------------------------------------------- the site
@pytest.mark.slow
def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="pip install -e '.[test]' installs the docs tools")
    pytest.importorskip("material", reason="pip install -e '.[test]' installs mkdocs-material")
    pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[test]' installs mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "sampling" / "index.html").is_file()


def test_api_overview_lists_every_public_name() -> None:
    import jem_plugin

    text = (DOCS / "reference" / "jem_plugin.md").read_text(encoding="utf-8")
    missing = [name for name in jem_plugin.__all__ if f"`{name}`" not in text]
    assert not missing, f"docs/reference/jem_plugin.md does not list {missing}"


# ---------------------------------------------------------------------------- the README
def test_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the rest into docs/"
    assert TEST_COMMAND in lines, "README.md must keep the test command line that .ci/run runs"
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    # the CPU-only torch hint comes before the install command it must precede
    cpu = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    install = next(i for i, line in enumerate(lines) if line.strip().startswith("pip install -e ."))
    assert cpu < install


# ---------------------------------------------------------------------------- jem commands
def _jem_commands() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``jem ...`` line in the docs' and README's shell blocks."""
    found = []
    for page in _pages():
        for block in blocks(page):
            if block.language not in ("bash", "sh", "console", "shell"):
                continue
            for k, line in enumerate(block.code.splitlines()):
                line = line.split(" #", 1)[0].strip().removeprefix("$ ")
                for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
                    words = shlex.split(part) if part else []
                    if words[:1] == ["jem"] and len(words) > 1:
                        found.append((f"{_name(page)}:{block.line + k + 1}", words[1:]))
    return found


def test_documented_jem_commands_parse() -> None:
    """Every flag the docs give a ``jem`` subcommand exists (argparse would refuse it otherwise)."""
    from jem_plugin.app.cli import build_parser

    parser = build_parser()
    commands = _jem_commands()
    assert commands
    for where, argv in commands:
        if argv[0] in ("-h", "--help", "--version"):
            continue
        try:
            parser.parse_known_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `jem {' '.join(argv)}` does not parse")
        sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]  # argparse's private structure: a subparsers action
        known = {s for a in sub._actions for s in a.option_strings}
        for word in argv[1:]:
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                assert flag in known, f"{where}: `jem {argv[0]}` has no flag {flag}"


def test_cli_page_names_only_existing_flags() -> None:
    """The `jem` command's page names no flag that no subcommand has (in prose too)."""
    from jem_plugin.app.cli import build_parser

    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]  # argparse's private structure: a subparsers action
    known = {s for sub in subparsers.values() for a in sub._actions for s in a.option_strings}
    known |= {s for a in parser._actions for s in a.option_strings}
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert not named - known, f"docs/cli.md names flags no jem command has: {sorted(named - known)}"
