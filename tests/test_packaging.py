"""A non-editable install ships every subpackage (pyproject lists them by hand)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib needs Python 3.11")
def test_every_subpackage_is_listed_for_installation():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jem_plugin").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert "jem_adapters" in listed and cfg["package-dir"]["jem_adapters"] == "adapters"
    assert "py.typed" in cfg["package-data"]["jem_plugin"]
    assert (ROOT / "jem_plugin" / "py.typed").is_file()
