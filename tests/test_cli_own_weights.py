"""``jem ood --model SPEC --weights FILE``: a classifier trained elsewhere, scored from the command
line (issue 29: post-hoc OOD for the classifiers users already trained). Its images are normalised
as its training normalised them, its weights read from a state dict (also nested in a training
checkpoint, or saved from DDP), and every mistake ends in one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import jem_plugin as jem
from benchmarks.folders import write_digits_folder, write_photo_folder
from jem_plugin import ood
from jem_plugin.app.cli import main
from jem_plugin.app.data import image_files, image_folder

MEAN, STD = (0.4, 0.45, 0.5), (0.2, 0.25, 0.3)
NET = (
    "import torch.nn as nn\n"
    "def build(num_classes):\n"
    "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),\n"
    "                         nn.Flatten(), nn.Linear(128, 16), nn.ReLU(), nn.Linear(16, num_classes))\n"
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three-class digit folders, a photo folder, and a small CNN the user trained on the folder
    with their own normalisation, saved the way a DDP training script saves it."""
    root = tmp_path_factory.mktemp("own")
    write_digits_folder(root / "train", classes=(0, 1, 2), per_class=30)
    write_digits_folder(root / "test", classes=(0, 1, 2), per_class=10, offset=30)
    write_photo_folder(root / "photos", n=20)
    (root / "usernet.py").write_text(NET)
    ns: dict = {}
    exec(NET, ns)
    torch.manual_seed(0)
    model = ns["build"](3)
    train = image_folder(root / "train", image_size=16, mean=MEAN, std=STD)
    x = torch.stack([train[i][0] for i in range(len(train))])
    y = torch.tensor(train.targets)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ddp_keys = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"epoch": 60, "state_dict": ddp_keys, "optimizer": opt.state_dict()}, root / "checkpoint.pth")
    return root, model.eval()


def _run(root, *extra, monkeypatch=None):
    return main(
        [
            "ood",
            "--model",
            "usernet:build",
            "--weights",
            str(root / "checkpoint.pth"),
            "--data",
            f"folder:{root / 'test'}",
            "--ood",
            f"folder:{root / 'photos'}",
            "--image-size",
            "16",
            "--mean",
            ",".join(map(str, MEAN)),
            "--std",
            ",".join(map(str, STD)),
            "--quiet",
            *extra,
        ]
    )


def test_scores_a_classifier_trained_elsewhere_as_the_python_api_does(world, monkeypatch, capsys):
    root, model = world
    monkeypatch.chdir(root)  # usernet.py is found beside the command, as for jem train --model
    assert _run(root, "--scores", "msp,mahalanobis", "--fit-data", f"folder:{root / 'train'}") == 0
    result = json.loads(capsys.readouterr().out)
    # the same model, images and normalisation through the library
    jm = jem.wrap(model, mean=MEAN, std=STD)
    test = image_folder(root / "test", image_size=16, mean=MEAN, std=STD)
    x = torch.stack([test[i][0] for i in range(len(test))])
    photos = image_files(root / "photos", image_size=16, mean=MEAN, std=STD)
    xp = torch.stack([photos[i][0] for i in range(len(photos))])
    expected = ood.evaluate(ood.score(jm, x, "msp"), ood.score(jm, xp, "msp"))["auroc"]
    assert result["msp/photos"]["auroc"] == pytest.approx(expected, abs=1e-6)
    assert "auroc" in result["mahalanobis/photos"]
    assert (root / "checkpoint_ood.csv").exists() and (root / "checkpoint_ood.png").exists()


def test_without_a_normalisation_the_adapters_domain_is_used(world, monkeypatch, capsys):
    """A plain nn.Module's adapter takes [-1, 1] inputs: the images are scaled so (0.5, 0.5), as
    jem.wrap(model) and the folder loader's default would have it."""
    root, model = world
    monkeypatch.chdir(root)
    argv = ["ood", "--model", "usernet:build", "--weights", str(root / "checkpoint.pth")]
    argv += ["--data", f"folder:{root / 'test'}", "--ood", f"folder:{root / 'photos'}", "--image-size", "16"]
    assert main([*argv, "--scores", "logpx", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    jm = jem.wrap(model)
    assert jm.domain.low == (-1.0,) and jm.domain.high == (1.0,)
    test, photos = image_folder(root / "test", image_size=16), image_files(root / "photos", image_size=16)
    x = torch.stack([test[i][0] for i in range(len(test))])
    xp = torch.stack([photos[i][0] for i in range(len(photos))])
    expected = ood.evaluate(ood.score(jm, x, "logpx"), ood.score(jm, xp, "logpx"))["auroc"]
    assert result["logpx/photos"]["auroc"] == pytest.approx(expected, abs=1e-6)


def test_jem_eval_gives_the_accuracy_and_calibration_of_weights_trained_elsewhere(world, monkeypatch, capsys):
    root, model = world
    monkeypatch.chdir(root)
    argv = ["eval", "--model", "usernet:build", "--weights", str(root / "checkpoint.pth")]
    argv += ["--data", f"folder:{root / 'test'}", "--image-size", "16", "--mean", ",".join(map(str, MEAN))]
    assert main([*argv, "--std", ",".join(map(str, STD))]) == 0
    result = json.loads(capsys.readouterr().out)
    test = image_folder(root / "test", image_size=16, mean=MEAN, std=STD)
    x, y = torch.stack([test[i][0] for i in range(len(test))]), torch.tensor(test.targets)
    with torch.no_grad():
        assert result["accuracy"] == pytest.approx((model(x).argmax(1) == y).float().mean().item())
    assert result["n"] == len(y) and "brier" in result and result["temperature"] is None
    assert (root / "checkpoint_eval" / "folder_test_reliability.png").exists()  # eval's own folder
    assert main(argv) == 2  # --mean without --std
    assert "give both --mean and --std" in capsys.readouterr().err


def test_fitted_detectors_without_training_images_are_skipped_in_one_line(world, monkeypatch, capsys):
    root, _ = world
    monkeypatch.chdir(root)
    assert _run(root, "--scores", "msp,knn", "--out", str(root / "nofit.json")) == 0
    captured = capsys.readouterr()
    assert "give --fit-data" in captured.err
    result = json.loads(captured.out)
    assert result["knn/photos"]["status"] == "skipped" and "auroc" in result["msp/photos"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-classes", "5"], "do not fit --model usernet:build"),
        (["--data", "digits"], "give --data folder:PATH"),
    ],
)
def test_mistakes_end_in_one_line(world, monkeypatch, capsys, extra, message):
    root, _ = world
    monkeypatch.chdir(root)
    assert _run(root, "--scores", "msp", *extra) == 2
    assert message in capsys.readouterr().err


def test_a_pickled_model_both_model_kinds_or_half_a_normalisation_are_refused(world, monkeypatch, capsys, tmp_path):
    root, model = world
    monkeypatch.chdir(root)
    torch.save(model, tmp_path / "pickled.pth")  # the whole module: code to run on load
    base = ["ood", "--model", "usernet:build", "--data", f"folder:{root / 'test'}"]
    assert main([*base, "--weights", str(tmp_path / "pickled.pth")]) == 2
    assert "need code to load" in capsys.readouterr().err
    assert main(["ood", str(root / "checkpoint.pth"), "--model", "usernet:build", "--weights", "w.pth"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["ood"]) == 2
    assert "--model SPEC --weights FILE" in capsys.readouterr().err
    assert main([*base, "--weights", str(root / "checkpoint.pth"), "--mean", "0.5"]) == 2
    assert "give both --mean and --std" in capsys.readouterr().err
    assert main([*base, "--weights", str(tmp_path / "not_written_yet.pth"), "--std", "0.5"]) == 2
    assert "give both --mean and --std" in capsys.readouterr().err  # said before the weights are looked for


@pytest.mark.parametrize("command", ["ood", "eval"])
def test_per_channel_normalisation_is_read_with_commas_or_spaces(command, capsys):
    """``--mean 0.485 0.456 0.406`` (as a user copies it from their transform) reads as the
    comma-separated form does; a word that is no number is refused in one line."""
    from jem_plugin.app.cli import parse_args

    base = [command, "--model", "resnet10t", "--weights", "w.pth"]
    spaced = parse_args([*base, "--mean", "0.485", "0.456", "0.406", "--std", "0.229", "0.224", "0.225"])
    commas = parse_args([*base, "--mean", "0.485,0.456,0.406", "--std", "0.229,0.224,0.225"])
    assert spaced.mean == commas.mean == [0.485, 0.456, 0.406]
    assert spaced.std == commas.std == [0.229, 0.224, 0.225]
    assert main([*base, "--mean", "0.5", "half"]) == 2
    assert "expected numbers separated by commas or spaces" in capsys.readouterr().err


def test_score_options_reach_the_detectors_as_the_python_api_gives_them(world, monkeypatch, capsys):
    """``--score-option SCORE.KEY=VALUE`` (repeatable, VALUE read as JSON) is the Python API's
    ``method_kwargs``: knn at k=3 scores as ``jem.ood.detector("knn", k=3)`` does. An option the
    score does not take, a score not run, or a malformed option ends in one line before loading."""
    root, model = world
    monkeypatch.chdir(root)
    fit = ["--fit-data", f"folder:{root / 'train'}"]
    assert _run(root, "--scores", "knn", "--score-option", "knn.k=3", *fit) == 0
    result = json.loads(capsys.readouterr().out)
    jm = jem.wrap(model, mean=MEAN, std=STD)
    train = image_folder(root / "train", image_size=16, mean=MEAN, std=STD)
    test = image_folder(root / "test", image_size=16, mean=MEAN, std=STD)
    photos = image_files(root / "photos", image_size=16, mean=MEAN, std=STD)

    def stack(ds):
        return torch.stack([ds[i][0] for i in range(len(ds))])

    knn = ood.detector("knn", k=3).fit(jm, (stack(train), torch.tensor(train.targets)))
    expected = ood.evaluate(ood.score(jm, stack(test), knn), ood.score(jm, stack(photos), knn))["auroc"]
    assert result["knn/photos"]["auroc"] == pytest.approx(expected, abs=1e-6)
    for option, message in [
        ("knn.kk=3", "OOD score 'knn' does not take option(s) kk; it accepts: k"),
        ("msp.temperature=2", "'msp' is not among the --scores run (knn)"),
        ("knn3", "expected SCORE.KEY=VALUE"),
    ]:
        assert _run(root, "--scores", "knn", "--score-option", option, *fit) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
