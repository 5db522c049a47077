"""jem.load and jem.load_sampler: the model files `jem train` and `jem demo` write, read back in Python."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import jem_plugin as jem
from jem_plugin.app import data as D
from jem_plugin.app.cli import main
from jem_plugin.app.model_files import model_spec, save_model_checkpoint, wrap_for_data
from jem_plugin.checkpoint import load_checkpoint, save_checkpoint
from jem_plugin.nets import build_model


def _digits(n: int = 64) -> torch.Tensor:
    ds = D.load_digits("test", seed=0)
    return torch.stack([ds[i][0] for i in range(n)])


def _model_file(path, model="digits-cnn", **extra):
    """A model file as `jem train` writes it, without training: a built-in net on the digits' spec."""
    options = {"width": 4} if model == "digits-cnn" else None
    net = build_model(model, 10, 1, options)
    spec = model_spec(model, "digits", 10, (1, 8, 8), D.DIGITS_DOMAIN, options)
    jm = wrap_for_data(net, spec)
    save_model_checkpoint(path, jm, {**spec, **extra})
    return jm


# -------------------------------------------------------------- a model trained by `jem train`


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny `jem train` run in <tmp>/runs/jem, and the network as the run saved it."""
    import jem_plugin.app.commands.train as train_cmd

    root = tmp_path_factory.mktemp("load")
    saved = {}
    original = train_cmd.save_model_checkpoint

    def keep(path, jm, spec):
        saved["jm"] = copy.deepcopy(jm).eval()
        return original(path, jm, spec)

    mp = pytest.MonkeyPatch()
    mp.setattr(train_cmd, "save_model_checkpoint", keep)
    try:
        argv = ["train", "--epochs", "1", "--sgld-steps", "1", "--buffer-capacity", "100"]
        assert main([*argv, "--out", str(root / "runs" / "jem"), "--quiet"]) == 0
    finally:
        mp.undo()
    return root, saved["jm"]


@pytest.mark.slow
def test_load_gives_the_runs_network_exactly(run):
    root, in_run = run
    jm = jem.load(root / "runs" / "jem" / "model.pt")
    assert isinstance(jm, jem.JEM) and not jm.training
    x = _digits()
    with torch.no_grad():
        assert torch.equal(jm(x), in_run(x))
    assert jm.trained_px is True


@pytest.mark.slow
def test_domain_classes_and_temperature_are_the_runs(run):
    root, _ = run
    path = root / "runs" / "jem" / "model.pt"
    spec = json.loads((path.parent / "spec.json").read_text())
    jm = jem.load(path)
    assert jm.num_classes == spec["num_classes"] == 10
    d = jm.domain
    assert list(d.low) == spec["low"] and list(d.high) == spec["high"]
    assert (list(d.mean) if d.mean else None) == spec["mean"] and (list(d.std) if d.std else None) == spec["std"]
    assert d.input_size == tuple(spec["sample_shape"]) == (1, 8, 8)
    assert jm.classes == spec["classes"]
    kept = load_checkpoint(path, rng=False)["spec"].get("temperature")  # kept only if it lowered the ECE
    assert jm.temperature == kept


@pytest.mark.slow
def test_the_readme_snippet(run, monkeypatch):
    root, _ = run
    monkeypatch.chdir(root)
    jm = jem.load("runs/jem/model.pt")
    lp = jm.log_px(_digits(8))
    assert lp.shape == (8,) and torch.isfinite(lp).all()


@pytest.mark.slow
def test_load_sampler_draws_as_jem_sample(run):
    root, _ = run
    path = root / "runs" / "jem" / "model.pt"
    jm = jem.load(path)
    sgld, buffer = jem.load_sampler(path)
    stored = load_checkpoint(path.with_name("sampler.pt"), rng=False)
    assert sgld.steps == 1 == stored["sgld"]["steps"]  # the run's settings (--sgld-steps 1)
    assert sgld.step_size == stored["sgld"]["step_size"] and sgld.noise == stored["sgld"]["noise"]
    assert buffer.capacity == 100 and buffer.initialized and not buffer.needs_fit
    # Fresh chains from the run's init distribution (`jem sample`), then the run's chains (--from-buffer)
    g = torch.Generator().manual_seed(0)
    x0 = buffer.init_dist.sample(12, buffer.sample_shape, jm.domain, g)
    x = sgld.sample(jm, x_init=x0, y=torch.arange(12) % 10)
    assert x.shape == (12, 1, 8, 8) and torch.isfinite(x).all()
    assert float(x.min()) >= jm.domain.low[0] - 1e-5 and float(x.max()) <= jm.domain.high[0] + 1e-5
    x = sgld.sample(jm, 6, buffer=buffer)
    assert x.shape == (6, 1, 8, 8) and torch.isfinite(x).all()


# A `jem demo --smoke` model file: test_cli.py's test_demo_smoke_writes_report loads both of the
# demo's model files (one demo run checked both ways).


# -------------------------------------------------------------- units: files written here


def test_load_rebuilds_a_model_file_with_its_temperature(tmp_path):
    saved = _model_file(tmp_path / "model.pt", temperature=1.5)
    jm = jem.load(str(tmp_path / "model.pt"))
    x = _digits(4)
    with torch.no_grad():
        assert torch.equal(jm(x), saved.eval()(x))
    assert jm.temperature == 1.5 and jm.classes == [str(i) for i in range(10)]
    assert jm.trained_px is False and not jm.training
    assert jem.load(_model_path(tmp_path / "b.pt")).temperature is None  # none kept: None


def _model_path(path):
    _model_file(path)
    return path


def test_load_takes_a_device(tmp_path):
    jm = jem.load(_model_path(tmp_path / "model.pt"), device="cpu")
    assert next(jm.parameters()).device.type == "cpu"


def test_the_app_reads_model_files_through_the_library(tmp_path):
    from jem_plugin.app.model_files import load_model_checkpoint

    path = _model_path(tmp_path / "model.pt")
    jm, spec = load_model_checkpoint(str(path))
    assert spec["model"] == "digits-cnn" and isinstance(jm, jem.JEM) and not jm.training


def test_load_sampler_reads_the_sgld_and_buffer_saved_beside_the_model(tmp_path):
    from types import SimpleNamespace

    from jem_plugin.app.model_files import save_run_sampler

    jm = _model_file(tmp_path / "model.pt")
    buffer = jem.ReplayBuffer(40, (1, 8, 8), num_classes=10)
    buffer.initialize(jm.domain, torch.Generator().manual_seed(0))
    save_run_sampler(tmp_path / "model.pt", SimpleNamespace(sampler=jem.SGLD(steps=3, noise=0.005), buffer=buffer))
    sgld, loaded = jem.load_sampler(tmp_path / "model.pt")
    assert (sgld.steps, sgld.noise) == (3, 0.005) and sgld.cuda_graph == jem.SGLD().cuda_graph
    assert torch.equal(loaded.data, buffer.data) and loaded.num_classes == 10
    jm = jem.load(tmp_path / "model.pt")
    x0 = loaded.init_dist.sample(4, loaded.sample_shape, jm.domain)
    assert sgld.sample(jm, x_init=x0).shape == (4, 1, 8, 8)
    assert sgld.sample(jm, 4, buffer=loaded, y=torch.arange(4)).shape == (4, 1, 8, 8)
    with pytest.raises(jem.CheckpointError, match="no sampler file") as err:
        jem.load_sampler(_model_path(tmp_path / "model_baseline.pt"))
    assert err.value.reason == "missing"


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(jem.CheckpointError, match="no model file at") as err:
        jem.load(tmp_path / "nothing.pt")
    assert err.value.reason == "missing" and "\n" not in str(err.value)
    with pytest.raises(jem.CheckpointError, match="no model file at"):
        jem.load(tmp_path)  # a directory


@pytest.mark.parametrize("content", ["text", "state_dict"])
def test_a_file_that_is_not_a_jem_file_is_one_line(tmp_path, content):
    bad = tmp_path / "bad.pt"
    if content == "text":
        bad.write_text("not a checkpoint")
    else:
        torch.save({"weight": torch.zeros(2)}, bad)
    with pytest.raises(jem.CheckpointError, match="is not a model file written by `jem train`") as err:
        jem.load(bad)
    assert err.value.reason == "corrupt" and "\n" not in str(err.value)


def test_another_jem_checkpoint_is_not_a_model_file(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt.pt", rng=False, step=3)
    with pytest.raises(jem.CheckpointError, match="not a model file") as err:
        jem.load(path)
    assert err.value.reason == "mismatch"
    sampler = save_checkpoint(tmp_path / "sampler_x.pt", rng=False, kind="jem-plugin/sampler/1")
    with pytest.raises(jem.CheckpointError, match="the run's sampler file"):
        jem.load(sampler)
    save_checkpoint(tmp_path / "sampler.pt", rng=False, kind="something else")
    with pytest.raises(jem.CheckpointError, match="not a sampler file") as err:
        jem.load_sampler(tmp_path / "model.pt")  # the sampler.pt beside it is not one
    assert err.value.reason == "mismatch"


def test_a_factory_that_cannot_be_imported_names_itself(tmp_path, monkeypatch):
    (tmp_path / "mynet_for_load.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, **options):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    net = build_model("mynet_for_load:build", 10, 1)
    spec = model_spec("mynet_for_load:build", "digits", 10, (1, 8, 8), D.DIGITS_DOMAIN)
    save_model_checkpoint(tmp_path / "model.pt", wrap_for_data(net, spec), spec)
    assert jem.load(tmp_path / "model.pt", trust_factory=True).num_classes == 10  # importable: loads

    spec = model_spec("no_such_module_xyz:build", "digits", 10, (1, 8, 8), D.DIGITS_DOMAIN)
    save_model_checkpoint(tmp_path / "other.pt", wrap_for_data(net, spec), spec)
    with pytest.raises(jem.CheckpointError) as err:
        jem.load(tmp_path / "other.pt", trust_factory=True)
    msg = str(err.value)
    assert "no_such_module_xyz:build" in msg and "cannot be imported" in msg and "sys.path" in msg
    assert "no_such_module_xyz.py" in msg and "\n" not in msg


def test_weights_that_do_not_fit_the_network_are_refused(tmp_path):
    net = build_model("digits-cnn", 10, 1, {"width": 4})
    spec = model_spec("digits-cnn", "digits", 10, (1, 8, 8), D.DIGITS_DOMAIN, {"width": 8})  # not the net saved
    save_model_checkpoint(tmp_path / "model.pt", wrap_for_data(net, spec), spec)
    with pytest.raises(jem.CheckpointError) as err:
        jem.load(tmp_path / "model.pt")
    assert err.value.reason == "mismatch"
