"""Weights trained elsewhere, given where a model file is expected (issue 59): a state_dict, a
training checkpoint holding one, or a whole pickled model, given to ``jem.load``, ``jem eval`` or
``jem sample``, get one line in our words pointing to ``--model NAME --weights FILE``: no torch
advice to allowlist classes, no internal function names, and nothing unpickled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.app.cli import main
from jem_plugin.checkpoint import load_checkpoint

POINTER = "jem eval --model NAME --weights FILE"


@pytest.fixture
def files(tmp_path):
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    torch.save(net.state_dict(), tmp_path / "weights.pth")
    torch.save({"epoch": 3, "model_state_dict": net.state_dict()}, tmp_path / "checkpoint.pth")
    torch.save(net, tmp_path / "whole.pt")
    return tmp_path


def _one_line_in_our_words(text: str) -> None:
    assert "\n" not in text and "add_safe_globals" not in text and "safe_globals" not in text, text
    assert "save_checkpoint" not in text and "load_checkpoint" not in text, text


@pytest.mark.parametrize(
    ("name", "reason", "said"),
    [
        ("weights.pth", "corrupt", "a network's weights alone (a state_dict)"),
        ("checkpoint.pth", "corrupt", "a training checkpoint holding a network's weights (under 'model_state_dict')"),
        ("whole.pt", "unsafe", "pickled Python objects (torch.nn.modules.container.Sequential: a whole model"),
    ],
)
def test_jem_load_points_weights_from_elsewhere_to_model_and_weights(files, name, reason, said):
    with pytest.raises(jem.CheckpointError) as err:
        jem.load(files / name)
    msg = str(err.value)
    assert err.value.reason == reason and said in msg and POINTER in msg, msg
    _one_line_in_our_words(msg)


@pytest.mark.parametrize(("command", "name"), [("eval", "weights.pth"), ("sample", "whole.pt")])
def test_the_commands_say_the_same_line(files, command, name, capsys):
    assert main([command, str(files / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: error:") and POINTER in err, err
    _one_line_in_our_words(err)


def test_load_checkpoint_names_the_refused_class_without_torchs_allowlisting_advice(files):
    with pytest.raises(jem.CheckpointError) as err:
        load_checkpoint(files / "whole.pt")
    assert err.value.reason == "unsafe" and "torch.nn.modules.container.Sequential" in str(err.value)
    assert "safe_globals" not in str(err.value) and "\n" not in str(err.value)
