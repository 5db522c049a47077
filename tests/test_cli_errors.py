"""Every user mistake a newcomer made in issue 14 ends in one line naming the fix, exit status 2."""

from __future__ import annotations

import json

import pytest

from benchmarks.folders import write_digits_folder
from jem_plugin.app.cli import main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A digits model, a 3-class image folder, a folder lacking one class, and custom model modules."""
    root = tmp_path_factory.mktemp("world")
    digits_run = root / "digits_run"
    assert main(["train", "--baseline", "--epochs", "1", "--out", str(digits_run), "--quiet"]) == 0
    write_digits_folder(root / "three", classes=(0, 1, 2), per_class=10)
    write_digits_folder(root / "two", classes=(0, 2), per_class=5, offset=10)
    folder_run = root / "folder_run"
    assert (
        main(
            [
                "train",
                "--baseline",
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--data",
                f"folder:{root / 'three'}",
                "--image-size",
                "16",
                "--model",
                "resnet10t",
                "--out",
                str(folder_run),
                "--quiet",
            ]
        )
        == 0
    )
    (root / "nonc.py").write_text("import torch.nn as nn\ndef build():\n    return nn.Linear(64, 10)\n")
    (root / "fixedsize.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes):\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n"
    )
    (root / "a_file").write_text("not a directory")
    (root / "bad.json").write_text(json.dumps({"epochs": "five"}))
    return root


CASES = [
    # (argv with {root} placeholders, text the one line must contain)
    (["train", "--device", "mps"], "use --device cpu"),
    (["sample", "{root}/digits_run/model.pt", "--n", "0"], "must be at least 1"),
    (["sample", "{root}/digits_run/model.pt", "--n", "-4"], "must be at least 1"),
    (["sample", "{root}/digits_run/model.pt", "--out", "{root}/samples.json"], "give a name ending .png"),
    # the grey digits model reads the RGB folder as grey (as --ood does); its 3 classes are not the 10
    (["eval", "{root}/digits_run/model.pt", "--data", "folder:{root}/three"], "missing 3, 4, 5, 6, 7, 8, 9"),
    (["eval", "{root}/digits_run/model.pt", "--data", "toy2d"], "--data digits"),
    (["ood", "{root}/digits_run/model.pt", "--data", "toy2d"], "--data digits"),
    (["eval", "{root}/folder_run/model.pt", "--data", "folder:{root}/two"], "missing 1"),
    (["train", "--out", "{root}/a_file"], "give a directory"),
    (["eval", "{root}/digits_run/model.pt", "--out", "{root}"], "give a file name"),
    (["train", "--model", "nonc:build"], "takes no num_classes argument"),
    (["train", "--model", "no_such_module_here:build"], "PYTHONPATH"),
    (
        ["train", "--model", "fixedsize:build", "--data", "folder:{root}/three", "--image-size", "16"],
        "make the model accept this input size",
    ),
    (["train", "--model", "vit_tiny_patch16_224"], "--image-size"),
    (["train", "--epochs", "0"], "must be at least 1"),
    (["train", "--config", "{root}/bad.json"], "bad.json"),
    (["train", "--recipe", "no_such_recipe"], "invalid choice"),
    (["ood", "{root}/digits_run/model.pt", "--ood", "mnist"], "use noise or folder:PATH"),
    (
        ["train", "--data", "folder:{root}/three", "--model", "resnet10t", "--batch-size", "64", "--image-size", "16"],
        "lower --batch-size",
    ),
    (
        ["train", "--model", "digits-cnn", "--data", "folder:{root}/three", "--image-size", "16", "--batch-size", "8"],
        "--model resnet10t",
    ),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(a[:3]) for a, _ in CASES])
def test_mistake_is_one_line_with_exit_2(world, argv, message, capsys, monkeypatch):
    monkeypatch.chdir(world)  # module:factory specs are found in the current directory
    code = main([a.replace("{root}", str(world)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("jem: error:") and "\n" not in err and "Traceback" not in err, err
    assert message in err, err


def test_the_default_cpu_names_a_gpu_the_machine_has_and_a_given_device_does_not(capsys, monkeypatch):
    """`jem train` on a GPU machine without --device trains on the CPU, as documented, and says in
    one line that a GPU is there; --device cpu given by hand is taken as meant."""
    import torch

    from jem_plugin.app.cli import build_parser
    from jem_plugin.app.commands._common import _device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Some GPU")
    default = build_parser().parse_args(["eval", "model.pt"]).device
    assert _device(default) == torch.device("cpu")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "this machine has a GPU (Some GPU): add --device cuda" in err
    given = build_parser().parse_args(["eval", "model.pt", "--device", "cpu"]).device
    assert _device(given) == torch.device("cpu") and capsys.readouterr().err == ""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device(default) == torch.device("cpu") and capsys.readouterr().err == ""  # no GPU: nothing to say
