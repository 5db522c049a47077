"""Which packages the distribution ships; everything else is in pyproject.toml.

pyproject.toml alone cannot both find packages and install a folder under another name, and both
are needed: every package under ``jem_plugin/`` is found (a new subpackage cannot be left out of
the wheel), and ``adapters/`` is installed as ``jem_adapters`` (the name ``adapters`` is taken on
PyPI), its subpackages found too.
"""

from setuptools import find_packages, setup

ADAPTERS = "jem_adapters"
setup(
    packages=find_packages(include=["jem_plugin", "jem_plugin.*"])
    + [ADAPTERS + name.removeprefix("adapters") for name in find_packages(include=["adapters", "adapters.*"])],
    package_dir={ADAPTERS: "adapters"},
)
