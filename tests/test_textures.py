"""The generated colour data set (jem_plugin.app.data.textures): deterministic, well formed, its
classes told apart by colour statistics and by shape, neither trivially; its PNG folder and its
``--data textures`` spec."""

from __future__ import annotations

import matplotlib.colors as mc
import numpy as np
import pytest
import torch

from benchmarks.folders import write_textures_folder
from jem_plugin.app import data as D
from jem_plugin.app.data._textures import _TEX_HUES
from jem_plugin.app.model_files import load_data


def test_deterministic_per_seed_and_extendable():
    x, y = D.textures(3, seed=0)
    x2, y2 = D.textures(3, seed=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, D.textures(3, seed=1)[0])
    more, _ = D.textures(5, seed=0)
    assert torch.equal(more[:30], x), "a larger set extends a smaller one"
    assert torch.equal(D.textures(2, seed=0, offset=3)[0], more[30:]), "offset ranges are disjoint splits"


def test_shapes_range_and_balanced_labels():
    x, y = D.textures(4, size=16, seed=2)
    assert x.shape == (40, 3, 16, 16) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert y.tolist() == list(range(10)) * 4 and y.dtype == torch.long
    assert len(D.TEXTURE_CLASSES) == 10 and D.textures(0)[0].shape == (0, 3, 32, 32)
    with pytest.raises(ValueError):
        D.textures(2, size=4)


def test_classes_differ_in_colour_statistics():
    """Pixels of a class's own hue (saturated, bright) are several times more common in its
    images than in the others', whose backgrounds take every hue."""
    x, y = D.textures(20, seed=0)
    hsv = mc.rgb_to_hsv(x.permute(0, 2, 3, 1).numpy())
    vivid = (hsv[..., 1] > 0.45) & (hsv[..., 2] > 0.55)
    for k, hue in enumerate(_TEX_HUES):
        near = ((np.abs((hsv[..., 0] - hue + 0.5) % 1 - 0.5) < 0.05) & vivid).mean(axis=(1, 2))
        own, other = near[y.numpy() == k].mean(), near[y.numpy() != k].mean()
        assert own > 2 * other, (k, own, other)


@pytest.mark.slow
def test_neither_colour_alone_nor_a_small_cnn_solves_it_trivially():
    """A colour histogram (4x4x4 RGB bins, logistic regression) stays far from perfect; a small
    CNN learns the classes well above chance from 40 images each, and not perfectly."""
    from sklearn.linear_model import LogisticRegression

    from jem_plugin.sample_quality import train_judge

    x, y = D.textures(40, seed=0)
    xt, yt = D.textures(20, seed=0, offset=10_000)

    def hist(a):
        px = a.permute(0, 2, 3, 1).reshape(len(a), -1, 3).numpy()
        return np.stack([np.histogramdd(p, bins=(4, 4, 4), range=[(0, 1)] * 3)[0].ravel() / len(p) for p in px])

    colour_acc = LogisticRegression(max_iter=2000).fit(hist(x), y.numpy()).score(hist(xt), yt.numpy())
    assert colour_acc < 0.5
    judge = train_judge(x * 2 - 1, y, epochs=8, test=(xt * 2 - 1, yt), seed=0)
    assert 0.25 < judge.test_accuracy < 0.95


def test_photo_crops_are_colour_images_in_the_unit_range():
    p = D.photo_crops(5, size=16, seed=3)
    assert p.shape == (5, 3, 16, 16) and 0 <= float(p.min()) and float(p.max()) <= 1
    assert float((p[:, 0] - p[:, 2]).abs().mean()) > 0.01, "colour, not grey"
    assert torch.equal(p, D.photo_crops(5, size=16, seed=3))


@pytest.mark.slow
def test_folder_round_trip_and_data_spec(tmp_path):
    root = write_textures_folder(tmp_path / "tex", per_class=2, size=32, seed=0)
    ds, domain, k, shape = load_data(f"folder:{root}", image_size=32)
    assert k == 10 and shape == (3, 32, 32) and ds.classes == [f"{i}_{c}" for i, c in enumerate(D.TEXTURE_CLASSES)]
    x, y = D.textures(2, seed=0)
    got = torch.stack([ds[i][0] for i in range(len(ds))])
    labels = torch.tensor(ds.targets)
    order = torch.cat([torch.nonzero(y == c).flatten() for c in range(10)])  # the folder is class by class
    assert torch.equal(labels, y[order])
    assert float(((got + 1) / 2 - x[order]).abs().max()) <= 0.5 / 255 + 1e-6  # 8-bit PNG

    tr, dom, k, shape = load_data("textures:3", image_size=16)
    te, *_ = load_data("textures", train=False, image_size=16)
    assert (len(tr), len(te), k, shape) == (30, 1000, 10, (3, 16, 16))
    xtr = tr.tensors[0]
    assert -1 <= float(xtr.min()) and float(xtr.max()) <= 1 and dom.mean == (0.5, 0.5, 0.5)
    torch.testing.assert_close((xtr + 1) / 2, D.textures(3, size=16)[0], atol=1e-6, rtol=0)
    assert not any(torch.equal(a, b) for a in te.tensors[0][:30] for b in xtr), "train and test are disjoint"
    with pytest.raises(Exception, match="textures:N"):
        load_data("textures:many")
