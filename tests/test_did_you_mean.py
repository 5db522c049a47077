"""Unknown names suggest the nearest registered ones (issue 59): `--model resnet10` names
resnet10t; a score, recipe or command misspelt names the one meant, in the same words everywhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.app.cli import main
from jem_plugin.errors import UnknownNameError
from jem_plugin.nets import build_model
from jem_plugin.recipes import get_recipe


def test_the_nearest_names_are_named_and_a_far_name_gets_none():
    assert UnknownNameError.did_you_mean("fats", ["paper", "fast", "generative"]) == " (did you mean 'fast'?)"
    three = UnknownNameError.did_you_mean("resnt18", ["resnet18", "resnet18d", "skresnet18", "vit"])
    assert three == " (did you mean 'resnet18', 'resnet18d' or 'skresnet18'?)"
    assert UnknownNameError.did_you_mean("zzzz", ["paper", "fast"]) == ""


def test_a_wrong_model_name_suggests_the_timm_name_meant(capsys):
    with pytest.raises(UnknownNameError, match=r"unknown --model 'resnet10' \(did you mean 'resnet10t'"):
        build_model("resnet10", 10, 3)
    with pytest.raises(UnknownNameError, match=r"did you mean 'digits-cnn'\?"):
        build_model("digits_cnn", 10, 1)
    assert main(["train", "--model", "resnet10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: error: unknown --model 'resnet10' (did you mean 'resnet10t'") and "\n" not in err


def test_a_wrong_score_name_suggests_the_registered_one(capsys):
    jm = jem.wrap(nn.Linear(4, 3), data_range=(-1.0, 1.0))
    with pytest.raises(UnknownNameError, match=r"unknown OOD score 'mps' \(did you mean 'msp'"):
        jem.ood.score(jm, torch.zeros(2, 4), method="mps")
    with pytest.raises(UnknownNameError, match=r"'mps' \(did you mean 'msp'.*\), 'nope'; available"):
        jem.ood.evaluate_all(jm, torch.zeros(2, 4), {"noise": torch.ones(2, 4)}, methods="mps,nope")
    assert main(["ood", "model.pt", "--scores", "max_logits"]) == 2
    assert "unknown OOD score 'max_logits' (did you mean 'max_logit'" in capsys.readouterr().err


def test_a_wrong_recipe_or_command_suggests_the_one_meant(capsys):
    with pytest.raises(UnknownNameError, match=r"unknown recipe 'fats' \(did you mean 'fast'\?\); available"):
        get_recipe("fats")
    assert main(["train", "--recipe", "fats"]) == 2
    assert "invalid choice: 'fats' (did you mean 'fast'?) (choose from " in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "invalid choice: 'trian' (did you mean 'train'?)" in capsys.readouterr().err
