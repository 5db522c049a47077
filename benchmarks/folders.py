"""Image folders written from the bundled data, for the tests and the benchmarks that exercise the
folder workflow (``jem train --data folder:ROOT``, ``jem ood --ood folder:ROOT``) without images of
their own. Not part of the installed library."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from jem_plugin.app.data import TEXTURE_CLASSES, digits_tensors, textures


def write_digits_folder(
    root: str | Path, classes: Iterable[int] = range(10), per_class: int = 20, size: int = 16, offset: int = 0
) -> Path:
    """Write bundled digits as an image folder (``root/<digit>/<n>.png``, RGB, ``size`` pixels).
    ``offset`` skips that many images of each class (two calls give disjoint folders)."""
    from PIL import Image

    xt, yt = digits_tensors("all")  # every digit, in scikit-learn's order, in [-1, 1]
    x, y = xt.numpy(), yt.numpy()
    root = Path(root)
    for c in classes:
        d = root / str(c)
        d.mkdir(parents=True, exist_ok=True)
        for i, j in enumerate(np.flatnonzero(y == c)[offset : offset + per_class]):
            pix = ((x[j, 0] + 1.0) * 127.5).astype(np.uint8)
            Image.fromarray(pix).resize((size, size), Image.Resampling.NEAREST).convert("RGB").save(d / f"{i:03d}.png")
    return root


def write_photo_folder(root: str | Path, n: int = 20, size: int = 16, seed: int = 0) -> Path:
    """Write ``n`` crops of scikit-learn's two bundled photos as ``root/photos/<n>.png`` (RGB): an
    out-of-distribution folder for ``jem ood --ood folder:ROOT``."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = load_sample_images().images
    d = Path(root) / "photos"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        im = photos[rng.integers(len(photos))]
        r, c = rng.integers(0, im.shape[0] - 64), rng.integers(0, im.shape[1] - 64)
        Image.fromarray(im[r : r + 64, c : c + 64]).resize((size, size), Image.Resampling.BILINEAR).save(
            d / f"{i:03d}.png"
        )
    return Path(root)


def write_textures_folder(
    root: str | Path, per_class: int = 20, size: int = 32, seed: int = 0, offset: int = 0
) -> Path:
    """Write :func:`~jem_plugin.app.data.textures` as an image folder (``root/<k>_<shape>/<n>.png``,
    RGB); ``offset`` as there (disjoint folders)."""
    from PIL import Image

    x, y = textures(per_class, size=size, seed=seed, offset=offset)
    pix = (x.permute(0, 2, 3, 1).numpy() * 255.0).round().clip(0, 255).astype(np.uint8)
    root = Path(root)
    counts = [0] * len(TEXTURE_CLASSES)
    for img, k in zip(pix, y.tolist()):
        d = root / f"{k}_{TEXTURE_CLASSES[k]}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(d / f"{counts[k]:03d}.png")
        counts[k] += 1
    return root
