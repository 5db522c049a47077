"""Every example runs with --smoke (seconds), so none of them can rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SINGLE_PROCESS = ["toy2d_ebm.py", "digits_jem.py", "timm_finetune.py", "posthoc_ood.py"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("script", SINGLE_PROCESS)
def test_example_smoke(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.rglob("*.png")), f"{script} wrote no figure"


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    ddp = {s for s in scripts if "ddp" in s}
    assert ddp, "the torchrun example must exist and its file name must contain 'ddp'"
    assert scripts - ddp == set(SINGLE_PROCESS)
