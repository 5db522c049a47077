"""Weights trained elsewhere are never read with a silent assumption (issue 59, item 2):
`jem ood --model resnet10t --weights ce.pth`, for a classifier trained at 32x32 on [-1, 1] data,
scored 0.100 accuracy without a word, at timm's 176 pixels and ImageNet normalisation. Now
`--weights` says in one line the size, mean, std and range it assumed and where each came from,
and a training size the weights themselves hold (a ViT's positional embedding, a size stored in
the checkpoint) is used, or its mismatch with --image-size said."""

from __future__ import annotations

import json

import pytest
import timm
import torch

from benchmarks.folders import write_digits_folder
from jem_plugin.app import CLIError
from jem_plugin.app.cli import main
from jem_plugin.app.user_weights import load_user_model, pos_embed_size


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("assumed")
    write_digits_folder(root / "test", classes=(0, 1, 2), per_class=4)
    torch.manual_seed(0)
    resnet = timm.create_model("resnet10t", num_classes=3)
    torch.save(resnet.state_dict(), root / "resnet.pth")
    # a training script's checkpoint that records its input size under its arguments
    torch.save({"state_dict": resnet.state_dict(), "args": {"img_size": 16}}, root / "resnet_args.pth")
    vit = timm.create_model("vit_tiny_patch16_224", num_classes=3, img_size=32)  # trained at 32: a 2x2 grid
    torch.save(vit.state_dict(), root / "vit32.pth")
    return root


def _load(root, weights, model="resnet10t", **kw):
    return load_user_model(model, str(root / weights), f"folder:{root / 'test'}", **kw)


def test_the_assumed_size_and_normalisation_are_said_with_where_each_came_from(root, capsys):
    _, spec = _load(root, "resnet.pth")
    line = spec["assumed"]
    assert spec["sample_shape"][-1] == 176
    assert "inputs 176x176 (timm's pretrained config)" in line
    assert "mean 0.485,0.456,0.406 and std 0.229,0.224,0.225 (timm's pretrained config)" in line
    assert "[0, 1] pixels become [-2.12, 2.64]" in line and "give --image-size, --mean and --std" in line
    _, spec = _load(root, "resnet.pth", image_size=32, mean=(0.5,) * 3, std=(0.5,) * 3)
    assert "inputs 32x32 (--image-size)" in spec["assumed"] and "(--mean/--std)" in spec["assumed"]
    assert "become [-1, 1]" in spec["assumed"]


def test_jem_eval_prints_the_line(root, capsys):
    argv = ["eval", "--model", "resnet10t", "--weights", str(root / "resnet.pth"), "--data", f"folder:{root / 'test'}"]
    assert main([*argv, "--quiet"]) == 0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith(f"jem: --weights {root / 'resnet.pth'}")]
    assert "176x176 (timm's pretrained config)" in line


def test_a_size_stored_in_the_checkpoint_is_used(root):
    _, spec = _load(root, "resnet_args.pth")
    assert spec["sample_shape"][-1] == 16 and "inputs 16x16 (its args['img_size'])" in spec["assumed"]
    _, spec = _load(root, "resnet_args.pth", image_size=32)  # the flag wins, and the mismatch is said
    assert spec["sample_shape"][-1] == 32 and "(--image-size; its args['img_size'] says 16)" in spec["assumed"]


def test_a_vit_is_read_at_the_size_of_its_positional_embedding(root):
    state = torch.load(root / "vit32.pth")
    assert pos_embed_size(state, timm.create_model("vit_tiny_patch16_224", num_classes=3)) == 32
    jm, spec = _load(root, "vit32.pth", model="vit_tiny_patch16_224")  # built at 224, its weights hold 32
    assert spec["sample_shape"][-1] == 32 and "inputs 32x32 (the weights' positional embedding)" in spec["assumed"]
    with torch.no_grad():
        assert jm(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    with pytest.raises(CLIError, match=r"trained at 32x32 \(the weights' positional embedding\), not --image-size 64"):
        _load(root, "vit32.pth", model="vit_tiny_patch16_224", image_size=64)


def test_the_eval_json_is_unchanged_by_the_line(root, capsys):
    argv = ["eval", "--model", "resnet10t", "--weights", str(root / "resnet_args.pth")]
    assert main([*argv, "--data", f"folder:{root / 'test'}", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 12


def test_a_factory_vit_at_another_size_is_told_the_size_of_its_weights(root, tmp_path, monkeypatch):
    (tmp_path / "vitnet.py").write_text(
        "import timm\ndef build(num_classes):\n    return timm.create_model('vit_tiny_patch16_224', num_classes=num_classes)\n"
    )
    monkeypatch.chdir(tmp_path)  # module:factory specs are found in the current directory
    with pytest.raises(CLIError, match=r"positional embedding is for 32x32 inputs: build the network at that size"):
        _load(root, "vit32.pth", model="vitnet:build")
