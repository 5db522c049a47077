#!/usr/bin/env bash
# The wheel a user installs, checked end to end: build the sdist and the wheel (python -m build
# builds the wheel from the sdist, so a file the sdist leaves out fails here), `twine check` both,
# install the wheel (not editable) into a fresh virtual environment, and from there run
# `jem --version`, `jem doctor`, import every public name and run `jem demo --smoke`.
#
# The environment reuses the installed torch and the other dependencies (--system-site-packages,
# --no-deps: no second download of torch); only jem-plugin comes from the wheel, which is checked:
# jem_plugin and jem_adapters must be imported from the environment's site-packages, not from this
# checkout or its editable install.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step() { echo "wheel check [${SECONDS}s]: $*"; }

step "build the sdist and the wheel"
python -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
python -m twine check --strict "$work"/dist/*
wheel=("$work"/dist/*.whl)
version="$(basename "${wheel[0]}" | cut -d- -f2)"

step "install jem_plugin-$version into a fresh virtual environment"
# This pip installs into the new environment (--python, pip >= 22.3): no pip of its own to set up.
python -m venv --system-site-packages --without-pip "$work/venv"
bin="$work/venv/bin"
python -m pip --python "$bin/python" install --quiet --disable-pip-version-check --no-deps --no-index "${wheel[0]}"

# Away from the checkout and its PYTHONPATH: nothing may import jem_plugin from there.
cd "$work"
unset PYTHONPATH

step "import from the installed wheel"
git -C "$root" ls-files 'jem_plugin/*.py' 'jem_plugin/py.typed' 'adapters/*.py' >"$work/tracked.txt"
"$bin/python" - "$version" "$work/tracked.txt" <<'EOF'
import importlib.metadata
import pkgutil
import sys
import sysconfig
from pathlib import Path

import jem_adapters
import jem_plugin

site = Path(sysconfig.get_path("purelib")).resolve()
for module in (jem_plugin, jem_adapters):
    where = Path(module.__file__).resolve()
    print(f"{module.__name__}.__file__ = {where}")
    if site not in where.parents:
        sys.exit(f"{module.__name__} comes from {where}, not from the environment's {site}: not the wheel")
version = sys.argv[1]
if not jem_plugin.__version__ == importlib.metadata.version("jem-plugin") == version:
    sys.exit(f"versions disagree: __version__ {jem_plugin.__version__}, metadata "
             f"{importlib.metadata.version('jem-plugin')}, wheel {version}")
# Every file of the checkout's packages is in the wheel (adapters/ as jem_adapters/).
shipped = {str(f) for f in importlib.metadata.files("jem-plugin") or ()}
tracked = Path(sys.argv[2]).read_text().split()
installed_as = {f: "jem_adapters/" + f[len("adapters/") :] if f.startswith("adapters/") else f for f in tracked}
left_out = sorted(f for f, there in installed_as.items() if there not in shipped)
if left_out:
    sys.exit(f"the wheel leaves out {left_out}")
for info in pkgutil.walk_packages(jem_adapters.__path__, "jem_adapters."):
    importlib.import_module(info.name)
public: dict = {}
exec("from jem_plugin import *", public)
exec("from jem_adapters import *", public)
missing = sorted(set(jem_plugin.__all__) - set(public))
if missing:
    sys.exit(f"jem_plugin.__all__ names what it lacks: {missing}")
print(f"{len(tracked)} files shipped; imported the {len(jem_plugin.__all__)} names of jem_plugin.__all__ and jem_adapters")
EOF

step "jem --version"
said="$("$bin/jem" --version)"
echo "$said"
[[ "$said" == *" $version" ]] || { echo "jem --version says '$said', the wheel is $version"; exit 1; }

step "jem doctor"
"$bin/jem" doctor --seconds 0

step "jem demo --smoke"
"$bin/jem" demo --smoke --quiet --out "$work/demo"
test -s "$work/demo/report.html"

step "done"
