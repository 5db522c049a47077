"""A folder whose images mix modes (greyscale, 16-bit greyscale, RGBA, RGB), as a user's own
folder often does (issue 48, item 7).

Every image used to be read with PIL's ``convert("RGB")``, silently: 16-bit grey clipped to
white and the colour stored under transparent pixels showed through, so a mixed folder trained
to far less than its all-RGB copy. Every image is now read in one mode, as a viewer shows it,
and one line says how many were converted from which modes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from jem_plugin.app.data import conversion_note, digits_tensors, image_folder
from jem_plugin.app.model_files import load_data

CLASSES = (0, 1, 7, 8)


def _write(root: Path, mixed: bool, per_class: int, offset: int) -> Path:
    """Digits as ``root/<digit>/<n>.png``; ``mixed`` stores them in turn as RGB, L, 16-bit L and
    RGBA (the background transparent, white stored under it), else all as RGB of what a viewer
    shows (the same pixels)."""
    from PIL import Image

    xt, yt = digits_tensors("all")
    x, y = ((xt.numpy()[:, 0] + 1.0) * 127.5).round().astype(np.uint8), yt.numpy()
    for c in CLASSES:
        d = root / str(c)
        d.mkdir(parents=True, exist_ok=True)
        for i, j in enumerate(np.flatnonzero(y == c)[offset : offset + per_class]):
            g = x[j]
            kind = i % 4 if mixed else 0
            if kind == 0:
                im = Image.fromarray(np.stack([g] * 3, -1), "RGB")
            elif kind == 1:
                im = Image.fromarray(g, "L")
            elif kind == 2:
                im = Image.fromarray(g.astype(np.uint16) * 257)  # 16-bit grey, full range
            else:
                alpha = np.where(g > 0, 255, 0).astype(np.uint8)
                rgb = np.where(g[..., None] > 0, np.stack([g] * 3, -1), 255).astype(np.uint8)
                im = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
            im.save(d / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    return {
        (kind, split): _write(root / f"{kind}_{split}", kind == "mixed", 40 if split == "train" else 20, offset)
        for kind in ("mixed", "rgb")
        for split, offset in (("train", 0), ("test", 40))
    }


def _tensors(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ds, *_ = load_data(f"folder:{folder}", image_size=8)  # as `jem train --data folder:PATH` reads it
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    return torch.stack(xs), torch.tensor(ys)


def _accuracy(train: Path, test: Path) -> float:
    """Held-out accuracy of a tiny network trained on ``train`` (seconds)."""
    (x, y), (xt, yt) = _tensors(train), _tensors(test)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(x[0].numel(), 32), torch.nn.ReLU())
    net.append(torch.nn.Linear(32, len(CLASSES)))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float((net(xt).argmax(1) == yt).float().mean())


def test_a_mixed_folder_trains_to_the_accuracy_of_its_all_rgb_copy(folders):
    rgb = _accuracy(folders["rgb", "train"], folders["rgb", "test"])
    mixed = _accuracy(folders["mixed", "train"], folders["mixed", "test"])
    assert rgb > 0.8
    assert abs(mixed - rgb) <= 0.05, (mixed, rgb)


def test_the_loader_reads_one_mode_and_counts_what_it_converted(folders):
    assert image_folder(folders["mixed", "train"], image_size=8).mode == "RGB"  # half grey: a tie keeps colour
    ds = image_folder(folders["mixed", "train"], image_size=8, channels=1)
    assert ds.mode == "L"
    assert ds.converted == {"RGB": 40, "RGBA": 40, "I;16": 40}
    assert {tuple(ds[i][0].shape) for i in range(len(ds))} == {(1, 8, 8)}
    note = conversion_note(ds, "folder:mixed")
    assert note is not None and "converted 120 of the 160 images" in note
    assert "40 RGB" in note and "40 RGBA" in note and "40 I;16" in note


def test_the_models_channels_decide_the_mode_and_a_viewers_pixels_come_through(folders):
    ds = image_folder(folders["mixed", "train"], image_size=8, channels=3)
    copy = image_folder(folders["rgb", "train"], image_size=8, channels=3)
    assert ds.mode == "RGB" and ds.converted == {"L": 40, "I;16": 40, "RGBA": 40}
    assert copy.converted == {} and conversion_note(copy, "folder:rgb") is None
    for i in range(8):  # one of each stored mode, twice
        assert torch.allclose(ds[i][0], copy[i][0], atol=1 / 127.5), i


def test_jem_reports_the_conversion_in_one_line(folders, capsys):
    load_data(f"folder:{folders['mixed', 'test']}", image_size=8)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "converted" in ln]
    assert len(lines) == 1 and "to RGB" in lines[0] and "20 L" in lines[0], lines


@pytest.fixture(scope="module")
def mixed_run(folders, tmp_path_factory):
    """A baseline trained by `jem train` on the mixed folder (resnet10t at 12x12, one epoch)."""
    from jem_plugin.app.cli import main

    out = tmp_path_factory.mktemp("mixed_run") / "run"
    argv = ["train", "--baseline", "--data", f"folder:{folders['mixed', 'train']}", "--image-size", "12"]
    assert main([*argv, "--epochs", "1", "--batch-size", "16", "--out", str(out), "--quiet"]) == 0
    return out / "model.pt"


def _conversion_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if "converted" in ln]


@pytest.mark.parametrize(
    "command",
    [
        ["ood", "--scores", "msp,knn"],  # the run's folder: its held-out split, then its training part for knn
        ["sample", "--n", "4", "--sgld-steps", "1"],  # the check reads both parts too
        ["eval"],
    ],
    ids=lambda c: c[0],
)
def test_a_command_reading_a_folder_twice_says_the_conversion_once(mixed_run, command, tmp_path, capsys):
    """`jem ood` and `jem sample` read the run's folder for its held-out split and again for its
    training part: the line said twice the same thing."""
    from jem_plugin.app.cli import main

    capsys.readouterr()
    out = tmp_path / ("samples.png" if command[0] == "sample" else "result.json")
    assert main([command[0], str(mixed_run), *command[1:], "--out", str(out)]) == 0
    lines = _conversion_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "to RGB (" in lines[0], lines


def test_an_ood_folder_is_read_in_the_models_channels_and_says_what_it_converted(folders, tmp_path, capsys):
    """A grey model (digits) scored on a folder of RGB, RGBA and 16-bit grey images: `jem ood`
    read every OOD image as RGB whatever the model took, and stopped at the shape check."""
    from jem_plugin.app.cli import main

    run = tmp_path / "digits"
    assert main(["train", "--baseline", "--epochs", "1", "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    ood = f"folder:{folders['mixed', 'test']}"
    assert main(["ood", str(run / "model.pt"), "--ood", ood, "--scores", "msp", "--out", str(tmp_path / "o.json")]) == 0
    (line,) = _conversion_lines(capsys.readouterr().err)
    assert f"of {ood} to L (" in line and "20 RGB" in line and "20 RGBA" in line and "20 I;16" in line


def test_preprocessing_reads_an_image_file_as_training_read_it(folders):
    """jm.preprocessing() read a file with PIL's convert: a transparent background came out white
    where training saw black, and 16-bit grey came out clipped."""
    from PIL import Image

    import jem_plugin as jem

    jm = jem.wrap(torch.nn.Flatten(), data_range=(-1, 1), input_size=(3, 8, 8))
    trained = image_folder(folders["mixed", "train"], image_size=8, channels=3)
    prep = jm.preprocessing()
    for i in range(4):  # RGB, L, 16-bit L, RGBA, as _write stores them in turn
        path, _ = trained.samples[i]
        assert torch.allclose(prep(path), trained[i][0], atol=1e-6), Image.open(path).mode
        assert torch.allclose(prep(Image.open(path)), trained[i][0], atol=1e-6), Image.open(path).mode
