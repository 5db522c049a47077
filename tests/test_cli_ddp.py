"""`jem train` under torchrun: 2 processes, gloo backend, CPU; one model file, per-rank buffers, resume."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jem_plugin.cli import main

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--sgld-steps", "2", "--buffer-size", "200", "--warmup-iters", "5", "--quiet"]

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build")


def _torchrun_train(out: Path, epochs: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "jem_plugin.cli", "train", "--epochs", str(epochs), *TRAIN, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    proc = _torchrun_train(out, epochs=1)
    return out, proc


def _checkpoint_steps(ckpt_dir: Path) -> dict[int, set[str]]:
    """{step: {"shared", "rank0", "rank1", ...}} of the files in a checkpoint directory."""
    found: dict[int, set[str]] = {}
    for p in ckpt_dir.iterdir():
        m = re.fullmatch(r"ckpt-(\d+)(?:\.(rank\d+))?\.pt", p.name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(m.group(2) or "shared")
    return found


def _buffer_tensor(path: Path) -> torch.Tensor:
    """The replay buffer's chains stored in a rank file (the JEMLoss state)."""
    return torch.load(path, map_location="cpu", weights_only=True)["objects"]["loss"]["buffer.data"]


def test_ddp_train_writes_one_model_and_per_rank_state(ddp_run, capsys):
    out, proc = ddp_run
    # Rank 0 alone writes the run's files (one "model:" line, not one per rank).
    assert proc.stdout.count("model: ") == 1
    assert (out / "model.pt").is_file() and (out / "spec.json").is_file()
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [1]
    # Each rank trained on its half of the data: batches per epoch of one rank's share.
    from jem_plugin.data import load_digits

    n_train = len(load_digits("train", seed=0))
    assert history["epochs"][0]["iterations"] == (n_train // 2) // 64
    # Each rank's own chains: one grid per rank.
    assert (out / "buffer_rank0.png").stat().st_size > 100
    assert (out / "buffer_rank1.png").stat().st_size > 100
    # Checkpoint: the shared file plus one file per rank, and the ranks' buffers differ.
    steps = _checkpoint_steps(out / "checkpoints")
    last = max(steps)
    assert steps[last] == {"shared", "rank0", "rank1"}
    b0 = _buffer_tensor(out / "checkpoints" / f"ckpt-{last:09d}.rank0.pt")
    b1 = _buffer_tensor(out / "checkpoints" / f"ckpt-{last:09d}.rank1.pt")
    assert b0.shape == b1.shape and not torch.equal(b0, b1)
    # The model loads and evaluates in a single process.
    capsys.readouterr()
    assert main(["eval", str(out / "model.pt")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["accuracy"] <= 1.0


def test_ddp_train_resumes_with_every_rank(ddp_run):
    out, _ = ddp_run
    first = max(_checkpoint_steps(out / "checkpoints"))
    _torchrun_train(out, epochs=2)
    history = json.loads((out / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]
    assert any(e["event"] == "resumed" and e["epoch"] == 1 for e in history["events"])
    steps = _checkpoint_steps(out / "checkpoints")
    assert max(steps) == 2 * first and steps[max(steps)] == {"shared", "rank0", "rank1"}
