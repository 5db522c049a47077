"""What a non-editable install ships, read from the configuration (nothing is built here; CI's
`.ci/wheel_check.sh` builds the wheel and runs it): every package, found rather than listed, the
adapters under their installed name, the type marker, and one version everywhere it is shown."""

from __future__ import annotations

import pathlib
import re
import runpy
import shutil
import sys

import pytest
import setuptools

import jem_plugin

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_arguments(root: pathlib.Path, monkeypatch) -> dict:
    """What ``setup.py`` run in ``root`` passes to ``setuptools.setup`` (the call itself replaced)."""
    given: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    monkeypatch.chdir(root)
    runpy.run_path(str(root / "setup.py"))
    return given


def _packages_on_disk(root: pathlib.Path, folder: str, installed_as: str) -> set[str]:
    return {
        ".".join((installed_as, *p.parent.relative_to(root / folder).parts))
        for p in (root / folder).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def test_every_package_under_jem_plugin_and_adapters_is_found(monkeypatch):
    given = _setup_arguments(ROOT, monkeypatch)
    packages = set(given["packages"])
    missing = _packages_on_disk(ROOT, "jem_plugin", "jem_plugin") - packages
    assert not missing, f"setup.py does not find {sorted(missing)}"
    assert _packages_on_disk(ROOT, "adapters", "jem_adapters") <= packages
    assert given["package_dir"] == {"jem_adapters": "adapters"}
    assert not any(p == "adapters" or p.startswith("adapters.") for p in packages)  # only under its installed name
    assert not any(p.startswith(("tests", "benchmarks", "examples", "docs")) for p in packages)


def test_a_new_subpackage_is_found_without_editing_the_configuration(tmp_path, monkeypatch):
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for package in ("jem_plugin", "jem_plugin/app", "jem_plugin/app/new", "adapters", "adapters/extra", "tests"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    given = _setup_arguments(tmp_path, monkeypatch)
    assert sorted(given["packages"]) == [
        "jem_adapters",
        "jem_adapters.extra",
        "jem_plugin",
        "jem_plugin.app",
        "jem_plugin.app.new",
    ]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib needs Python 3.11")
def test_version_has_one_source_and_the_changelog_names_it():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in cfg["project"] and "version" in cfg["project"]["dynamic"]
    assert cfg["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jem_plugin.__version__"}
    assert "py.typed" in cfg["tool"]["setuptools"]["package-data"]["jem_plugin"]
    assert (ROOT / "jem_plugin" / "py.typed").is_file()
    newest = re.search(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest is not None and newest.group(1) == jem_plugin.__version__
