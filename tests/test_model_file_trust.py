"""A model file runs no code unless the user says so (issue 60): a file whose network is a
``module:factory`` only names code; ``jem.load`` and the commands that read model files refuse it
in one line unless ``trust_factory`` / ``--trust-factory`` allows importing and calling it."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.app import data as D
from jem_plugin.app.cli import main
from jem_plugin.app.model_files import model_spec, save_model_checkpoint, wrap_for_data
from jem_plugin.nets import ToyMLP

# Writes a marker file when imported and another when its factory is called: the code a model file
# could make jem run.
FACTORY_MODULE = """\
from pathlib import Path
import torch.nn as nn
Path(__file__).with_name("imported.marker").write_text("imported")
def build(num_classes, **options):
    Path(__file__).with_name("called.marker").write_text("called")
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
"""


def _net(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))


@pytest.fixture
def factory_file(tmp_path, monkeypatch):
    """``(model file, factory spec)``: a digits model file naming a factory module that lies beside
    it, in the current directory and on ``sys.path``, as a user who trained it would meet it. The
    file is written through the library's own save (no training, the module never imported)."""
    module = f"usernet_{uuid.uuid4().hex[:8]}"  # a fresh name: no earlier import is cached
    (tmp_path / f"{module}.py").write_text(FACTORY_MODULE)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # restored after the test
    monkeypatch.chdir(tmp_path)
    spec = model_spec(f"{module}:build", "digits", 10, (1, 8, 8), D.DIGITS_DOMAIN)
    path = tmp_path / "model.pt"
    save_model_checkpoint(path, wrap_for_data(_net(), spec), spec)
    yield path, f"{module}:build"
    sys.modules.pop(module, None)


def _markers(path):
    return sorted(p.name for p in path.parent.glob("*.marker"))


def test_jem_load_refuses_a_factory_in_one_line_and_runs_nothing(factory_file):
    path, factory = factory_file
    with pytest.raises(jem.CheckpointError) as err:
        jem.load(path)
    msg = str(err.value)
    assert err.value.reason == "unsafe"
    assert factory in msg and "trust_factory=True" in msg and "--trust-factory" in msg and "\n" not in msg, msg
    assert _markers(path) == []
    assert factory.partition(":")[0] not in sys.modules


def test_trust_factory_true_imports_and_calls_the_factory(factory_file):
    path, _ = factory_file
    jm = jem.load(path, trust_factory=True)
    assert _markers(path) == ["called.marker", "imported.marker"]
    x = D.load_digits("test", seed=0)[0][0][None]
    assert jm(x).shape == (1, 10)


def test_the_factory_itself_is_called_and_nothing_is_imported(factory_file):
    path, factory = factory_file
    made = []

    def build(num_classes: int) -> nn.Module:
        made.append(num_classes)
        return _net(num_classes)

    jm = jem.load(path, trust_factory=build)
    assert made == [10] and _markers(path) == [] and factory.partition(":")[0] not in sys.modules
    stored = torch.load(path, weights_only=True)["objects"]["model"]
    assert torch.equal(jm.model[1].weight, stored["1.weight"])  # the file's weights, in the given network


def test_a_factory_given_for_a_registered_network_is_refused(tmp_path):
    spec = model_spec("toy-mlp", "toy2d", 8, (2,), D.DIGITS_DOMAIN)
    save_model_checkpoint(tmp_path / "model.pt", wrap_for_data(ToyMLP(num_classes=8), spec), spec)
    assert jem.load(tmp_path / "model.pt", trust_factory=True).num_classes == 8  # a flag given always: harmless
    with pytest.raises(jem.CheckpointError, match="builds itself") as err:
        jem.load(tmp_path / "model.pt", trust_factory=_net)
    assert err.value.reason == "mismatch"


@pytest.mark.parametrize("command", ["eval", "ood", "sample"])
def test_the_commands_refuse_it_without_the_flag(factory_file, command, capsys):
    path, factory = factory_file
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: error:") and factory in err and "--trust-factory" in err and "\n" not in err, err
    assert _markers(path) == []


def test_jem_eval_with_the_flag_builds_it(factory_file, capsys):
    path, _ = factory_file
    assert main(["eval", str(path), "--trust-factory", "--out", str(path.with_name("eval.json"))]) == 0
    assert _markers(path) == ["called.marker", "imported.marker"]
    assert path.with_name("eval.json").is_file()
