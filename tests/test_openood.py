"""The OpenOOD v1.5 benchmark-directory loader, on a miniature copy written here, and `jem ood --openood`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from jem_plugin.app.openood import BENCHMARKS, load_openood, read_image_list
from jem_plugin.errors import DatasetNotFoundError


def write_mini_openood(root, benchmark="cifar10", per_list=3, size=8):
    """OpenOOD's layout with ``per_list`` random PNGs per image list (MNIST grey, as in OpenOOD)."""
    b = BENCHMARKS[benchmark]
    rng = np.random.default_rng(0)
    lists = root / "benchmark_imglist" / benchmark
    lists.mkdir(parents=True)
    for split, name in [("train", benchmark), ("test", benchmark), *[("test", n) for n in b.near + b.far]]:
        lines = []
        for i in range(per_list):
            rel = f"{name}/{split}/c{i % 2}/{i:04d}.png"
            p = root / b.images / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            grey = name == "mnist"
            pix = rng.integers(0, 256, (size, size) if grey else (size, size, 3), dtype=np.uint8)
            Image.fromarray(pix).save(p)
            label = i % 2 if name == benchmark else -1
            lines.append(f"{rel} {label}")
        (lists / f"{split}_{name}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def mini(tmp_path):
    return write_mini_openood(tmp_path / "data")


def test_loads_the_cifar10_protocol(mini):
    train, test, ood = load_openood(mini, "cifar10", image_size=16)
    assert len(train) == len(test) == 3 and train.targets == [0, 1, 0]
    assert list(ood) == ["near", "far"]
    assert list(ood["near"]) == ["cifar100", "tin"] and list(ood["far"]) == ["mnist", "svhn", "texture", "places365"]
    x, y = ood["far"]["mnist"][1]
    assert x.shape == (3, 16, 16) and y == -1 and x.min() >= -1 and x.max() <= 1
    torch.testing.assert_close(x[0], x[1])  # grey MNIST converted to RGB
    assert test.domain is not None and test.domain.low == (-1.0,) * 3
    # the OpenOOD checkout (data/ inside) works too, and a user's transform is used as given
    _, test2, _ = load_openood(mini.parent, "cifar10", transform=lambda im: torch.tensor(im.size))
    assert test2[0][0].tolist() == [8, 8] and test2.domain is None
    # the model's normalisation
    _, t3, _ = load_openood(mini, image_size=8, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.2))
    assert t3.domain.mean == (0.5, 0.4, 0.3)


def test_missing_files_are_one_line_naming_the_path(mini, tmp_path):
    (mini / "benchmark_imglist" / "cifar10" / "test_tin.txt").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"test_tin\.txt' does not exist: expected a text file of lines"):
        load_openood(mini)
    with pytest.raises(
        DatasetNotFoundError, match=r"benchmark_imglist' does not exist: give the OpenOOD data directory"
    ):
        load_openood(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown OpenOOD benchmark 'svhn'; choose one of cifar10, cifar100"):
        load_openood(mini, "svhn")
    other = write_mini_openood(tmp_path / "other")
    (other / "images_classic" / "svhn" / "test" / "c0" / "0000.png").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"0000\.png' named in .*test_svhn\.txt' does not exist"):
        load_openood(other)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(DatasetNotFoundError, match="is empty"):
        read_image_list(empty)


def test_list_lines_with_extras():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "l.txt"
        p.write_text("a/b.png 3\nc.png {'label': 7, 'x': 1}\nd.png\n")
        assert read_image_list(p) == [("a/b.png", 3), ("c.png", 7), ("d.png", -1)]


@pytest.mark.slow
def test_jem_ood_on_an_openood_directory(mini, tmp_path, capsys):
    """Wiring only: an untrained model file of the right input size, every set of the benchmark."""
    import timm

    from jem_plugin.app.cli import main
    from jem_plugin.app.data import signed_domain
    from jem_plugin.app.model_files import model_spec, save_model_checkpoint, wrap_for_data

    torch.manual_seed(0)
    spec = model_spec("test_resnet", "cifar10:/nowhere", 10, (3, 16, 16), signed_domain(3))
    jm = wrap_for_data(timm.create_model("test_resnet", num_classes=10), spec)
    save_model_checkpoint(tmp_path / "model.pt", jm, spec)
    out = tmp_path / "res" / "ood.json"
    argv = ["ood", str(tmp_path / "model.pt"), "--openood", str(mini), "--scores", "logpx,msp", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    sets = ["cifar100", "tin", "mnist", "svhn", "texture", "places365"]
    assert set(result) == {f"{m}/{s}" for m in ("logpx", "msp") for s in sets}
    assert (out.parent / "ood.csv").is_file() and (out.parent / "ood.png").stat().st_size > 1000


def test_jem_ood_on_an_openood_directory_with_weights_trained_elsewhere(mini, tmp_path, capsys):
    """``--model``/``--weights``: ten classes (the benchmark's), 32x32 (CIFAR's), the images
    normalised with the model's mean/std, fitted detectors on the benchmark's training list."""
    import timm

    from jem_plugin.app.cli import main

    torch.manual_seed(0)
    torch.save(timm.create_model("resnet10t", num_classes=10).state_dict(), tmp_path / "w.pth")
    out = tmp_path / "ood.json"
    argv = ["ood", "--model", "resnet10t", "--weights", str(tmp_path / "w.pth"), "--openood", str(mini)]
    assert main([*argv, "--scores", "msp,mahalanobis", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "auroc" in result["msp/svhn"] and "auroc" in result["mahalanobis/places365"]
    assert main([*argv, "--num-classes", "3", "--quiet"]) == 2
    assert "size mismatch" in capsys.readouterr().err
