"""Checkpoints: exact resume after SIGKILL, atomic writes, clear errors, never executing code."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from jem_plugin.errors import CheckpointError
from jem_plugin.losses import JEMLoss
from jem_plugin.sampling import SGLD

HERE = Path(__file__).parent
SCRIPT = HERE / "_resume_script.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def net(width: int = 4) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width), nn.SiLU(), nn.Linear(width, 3))


# --------------------------------------------------------------------------- exact resume
def _script_main():
    sys.path.insert(0, str(HERE))
    try:
        import _resume_script
    finally:
        sys.path.remove(str(HERE))
    return _resume_script.main


def _sigkill(proc: subprocess.Popen) -> None:
    """SIGKILL a child and reap it (also its pipes): what a crash or an OOM killer does."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow
def test_sigkill_mid_training_resumes_bitwise(tmp_path, capsys):
    """A run SIGKILLed mid-training and resumed ends bitwise where an uninterrupted run ends.

    The killed run is a separate interpreter (its checkpoint is resumed across processes); the
    reference run and the resume reuse this process's imports to keep the test fast.
    """
    iters, every = "16", "4"
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(killed), "--iters", iters, "--every", every, "--sleep", "0.1"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ckpt = Checkpointer(killed, every=int(every))
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:  # wait for the second checkpoint, then kill mid-run
            found = ckpt.checkpoints()
            if found and found[-1][0] >= 8:
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.02)
        else:
            pytest.fail("no checkpoint appeared in time")
    finally:
        _sigkill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "final.pt").exists()
    killed_at = ckpt.checkpoints()[-1][0]
    assert 8 <= killed_at < int(iters)

    main = _script_main()
    main([str(tmp_path / "straight"), "--iters", iters, "--every", every])
    reference = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    capsys.readouterr()
    main([str(killed), "--iters", iters, "--every", every])  # resumes from the last checkpoint
    assert f"start {killed_at}" in capsys.readouterr().out
    resumed = torch.load(killed / "final.pt", weights_only=True)
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert torch.equal(resumed["buffer"], reference["buffer"])
    assert torch.equal(resumed["rng"], reference["rng"])


def test_loss_state_restores_its_buffer_into_a_loss_without_one_and_the_sampler_generator(tmp_path):
    torch.manual_seed(0)
    jm = jem.wrap(nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), num_classes=3)
    x, y = torch.rand(6, 1, 4, 4) * 2 - 1, torch.randint(0, 3, (6,))

    def make(buffer=None):
        return JEMLoss(SGLD(steps=2, generator=torch.Generator().manual_seed(1)), buffer, pxy_weight=1.0)

    loss_fn = make(jem.ReplayBuffer(100, (1, 4, 4), num_classes=3))
    loss_fn(jm, x, y)
    save_checkpoint(tmp_path / "c.pt", loss=loss_fn)
    expected = loss_fn(jm, x, y).loss.item()
    fresh = make()  # no buffer yet: the checkpoint recreates it
    load_checkpoint(tmp_path / "c.pt", loss=fresh)
    assert fresh(jm, x, y).loss.item() == expected
    assert torch.equal(fresh.buffer.data, loss_fn.buffer.data)


def test_rng_states_are_restored(tmp_path):
    gen = torch.Generator().manual_seed(7)
    save_checkpoint(tmp_path / "c.pt", gen=gen, step=3)
    expected = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=gen))
    torch.rand(5), np.random.rand(5), random.random(), torch.rand(4, generator=gen)
    extra = load_checkpoint(tmp_path / "c.pt", gen=gen)
    assert extra == {"step": 3}
    got = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(2, generator=gen))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and torch.equal(got[3], expected[3])


# --------------------------------------------------------------------------- atomic writes
def test_crash_between_write_and_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = net()
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, step=1)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, model=model, step=2)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind
    fresh = net()
    assert load_checkpoint(path, model=fresh) == {"step": 1}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, old[k])


WRITER = textwrap.dedent("""
    import io, sys, time, torch
    from jem_plugin.checkpoint import save_checkpoint
    torch.set_num_threads(1)
    path = sys.argv[1]
    real_save = torch.save

    def save_that_stalls_halfway(obj, f, *args, **kwargs):
        # From the third checkpoint on, write half the bytes, say so, and hang: the parent's
        # SIGKILL then lands inside a write, deterministically (no timing luck needed).
        if step >= 3:
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: buf.tell() // 2])
            f.flush()
            print("mid-write", flush=True)
            time.sleep(600)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save_that_stalls_halfway
    step = 0
    while True:
        step += 1
        save_checkpoint(path, big=torch.full((4_000_000,), float(step)), step=step, rng=False)
        print(step, flush=True)
""")


def _kill_writer_midway(path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        assert lines == ["1", "2", "mid-write"], (lines, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        _sigkill(proc)


@pytest.mark.slow
def test_sigkill_during_writes_leaves_a_loadable_checkpoint(tmp_path):
    """Kill a process in the middle of writing a 16 MB checkpoint; the previous one stays whole."""
    path = tmp_path / "c.pt"
    _kill_writer_midway(path)
    # the kill left a half-written temp file behind, and the previous checkpoint untouched
    assert any(p.name.endswith(".tmp") for p in path.parent.iterdir())
    extra = load_checkpoint(path, rng=False)
    assert extra["step"] == 2
    assert torch.equal(extra["big"], torch.full((4_000_000,), float(extra["step"])))
    # A checkpoint written after the kill cleans up the dead write's temp file.
    ckpt = Checkpointer(tmp_path / "dir", keep=1)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / ".ckpt-000000001.pt.abc.tmp").write_bytes(b"partial")
    ckpt.save(1, step_value=1)
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["ckpt-000000001.pt"]


# --------------------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at") as info:
        load_checkpoint(tmp_path / "nope.pt", model=net())
    assert info.value.reason == "missing"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_or_truncated_file(tmp_path, damage):
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=net(), step=1)
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:]
    elif damage == "garbage":
        data = os.urandom(len(data))
    else:
        data = b""
    path.write_bytes(data)
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="corrupt") as info:
        load_checkpoint(path, model=model)
    assert info.value.reason == "corrupt"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_not_a_jem_checkpoint(tmp_path):
    torch.save(net().state_dict(), tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match="not a jem-plugin checkpoint"):
        load_checkpoint(tmp_path / "bare.pt", model=net())


def test_mismatched_model_names_object_and_first_mismatches_and_loads_nothing(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=net(width=4), optimizer=torch.optim.SGD(net().parameters(), lr=0.1))
    other = net(width=5)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"'model' \(Sequential\).*shape mismatch 1.weight: checkpoint "
        r"\(4, 16\) vs object \(5, 16\)",
    ) as info:
        load_checkpoint(path, model=other, optimizer=opt)
    assert info.value.reason == "mismatch"
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())

    extra_layer = nn.Sequential(*net(), nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"missing keys \['4.weight', '4.bias'\]"):
        load_checkpoint(path, model=extra_layer)
    with pytest.raises(CheckpointError, match="has no entry 'scheduler'"):
        load_checkpoint(path, model=net(), scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    two_groups = torch.optim.SGD([{"params": [p]} for p in net().parameters()], lr=0.1)
    with pytest.raises(CheckpointError, match="'optimizer' \\(SGD\\)"):
        load_checkpoint(path, optimizer=two_groups)


def test_mismatched_replay_buffer(tmp_path):
    from jem_plugin.buffer import ReplayBuffer

    save_checkpoint(tmp_path / "c.pt", buffer=ReplayBuffer(20, (1, 4, 4)))
    with pytest.raises(CheckpointError, match=r"'buffer'.*shape mismatch data"):
        load_checkpoint(tmp_path / "c.pt", buffer=ReplayBuffer(30, (1, 4, 4)))


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch", "pickle", "save_checkpoint"])
def test_pickled_code_is_refused_and_never_runs(tmp_path, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {
        "format": "jem-plugin-checkpoint",
        "version": 1,
        "kinds": {"x": "value"},
        "objects": {"x": Evil(marker)},
        "rng": None,
    }
    if writer == "torch":
        torch.save(payload, path)
    elif writer == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        save_checkpoint(path, x=Evil(marker))
    assert not marker.exists()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert info.value.reason in ("unsafe", "corrupt")
    if writer != "pickle":  # torch's zip format: the unpickler names the refused global
        assert info.value.reason == "unsafe" and "execute code" in str(info.value)
    assert not marker.exists()
    # The resume path refuses it too: an error for a refused global, a skip for unreadable data.
    ckpt = Checkpointer(tmp_path)
    os.replace(path, ckpt.path_for(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            assert ckpt.resume() == {}
        except CheckpointError as exc:
            assert exc.reason == "unsafe"
    assert not marker.exists()


# --------------------------------------------------------------------------- Checkpointer
def test_checkpointer_keeps_newest_and_resumes_latest(tmp_path):
    model = net()
    ckpt = Checkpointer(tmp_path / "run", every=2, keep=2)
    assert ckpt.latest() is None and ckpt.resume(model=model) == {}
    for step in range(1, 8):
        with torch.no_grad():
            model[1].bias.fill_(step)
        ckpt.maybe_save(step, model=model)
    assert [s for s, _ in ckpt.checkpoints()] == [4, 6]
    fresh = net()
    assert ckpt.resume(model=fresh)["step"] == 6
    assert torch.equal(fresh[1].bias, torch.full((4,), 6.0))
    assert ckpt.latest().stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_checkpointer_skips_a_corrupt_newest_file_with_warning(tmp_path):
    model = net()
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    ckpt.save(1, model=model)
    ckpt.save(2, model=model)
    ckpt.path_for(2).write_bytes(b"\x00" * 10)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert ckpt.resume(model=net())["step"] == 1
    with warnings.catch_warnings(), pytest.raises(CheckpointError, match="does not match 'model'"):
        warnings.simplefilter("ignore", RuntimeWarning)
        ckpt.resume(model=net(width=7))


def test_bare_model_state_loads_into_its_jem_view(tmp_path):
    model = net()
    save_checkpoint(tmp_path / "c.pt", model=model)
    jm = jem.wrap(net())
    load_checkpoint(tmp_path / "c.pt", model=jm)
    assert all(torch.equal(a, b) for a, b in zip(jm.model.state_dict().values(), model.state_dict().values()))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_checkpoint(tmp_path / "c.pt", model=jem.wrap(net(width=6)))
