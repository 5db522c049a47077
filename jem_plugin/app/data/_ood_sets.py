"""Out-of-distribution sets: uniform noise, patches and crops of scikit-learn's two bundled
photos, blends of two classes, transposed images; the digits experiment's four."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ._common import _gen


def uniform_noise(n: int, shape: Sequence[int] = (1, 8, 8), seed: int = 0) -> Tensor:
    """``n`` images of i.i.d. uniform noise over ``[-1, 1]``."""
    return torch.rand((n, *shape), generator=_gen(seed)) * 2.0 - 1.0


_PHOTO_GRAY: list[np.ndarray] | None = None


def _photos_gray() -> list[np.ndarray]:
    global _PHOTO_GRAY
    if _PHOTO_GRAY is None:
        from sklearn.datasets import load_sample_images

        imgs = load_sample_images().images  # two 427x640x3 uint8 photos
        # ITU-R 601 luma, as PIL's "L" mode
        _PHOTO_GRAY = [(im.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)) for im in imgs]
    return list(_PHOTO_GRAY)


def photo_patches(n: int, size: int = 8, seed: int = 0, patch: int = 32) -> Tensor:
    """``n`` grayscale photo patches shaped like digits: ``[n, 1, size, size]`` in ``[-1, 1]``.

    Random ``patch x patch`` crops of scikit-learn's two bundled photos are box-downsampled to
    ``size x size`` (so they look like small images, not like magnified pixels) and each is
    contrast-stretched to the full ``[-1, 1]`` range, as the digits are.
    """
    if patch % size:
        raise ValueError(f"patch ({patch}) must be a multiple of size ({size})")
    rng = np.random.default_rng(seed)
    photos = _photos_gray()
    out = np.empty((n, 1, size, size), dtype=np.float32)
    f = patch // size
    for i in range(n):
        im = photos[rng.integers(len(photos))]
        r = rng.integers(0, im.shape[0] - patch + 1)
        c = rng.integers(0, im.shape[1] - patch + 1)
        p = im[r : r + patch, c : c + patch].reshape(size, f, size, f).mean(axis=(1, 3))
        lo, hi = p.min(), p.max()
        out[i, 0] = (p - lo) / max(hi - lo, 1e-6) * 2.0 - 1.0
    return torch.from_numpy(out)


def photo_crops(n: int, size: int = 32, seed: int = 0, patch: int = 64) -> Tensor:
    """``n`` colour crops of scikit-learn's two bundled photos: ``[n, 3, size, size]`` in ``[0, 1]``.

    Random ``patch x patch`` crops, box-downsampled to ``size x size`` (``patch`` a multiple of it).
    """
    if patch % size:
        raise ValueError(f"patch ({patch}) must be a multiple of size ({size})")
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = load_sample_images().images  # two 427x640x3 uint8 photos
    f = patch // size
    out = np.empty((n, 3, size, size), dtype=np.float32)
    for i in range(n):
        im = photos[rng.integers(len(photos))]
        r = rng.integers(0, im.shape[0] - patch + 1)
        c = rng.integers(0, im.shape[1] - patch + 1)
        crop = im[r : r + patch, c : c + patch].astype(np.float32) / 255.0
        out[i] = crop.reshape(size, f, size, f, 3).mean(axis=(1, 3)).transpose(2, 0, 1)
    return torch.from_numpy(out)


def blends(x: Tensor, y: Tensor, n: int, seed: int = 0) -> Tensor:
    """``n`` averages of two images of ``x`` with *different* labels ``y``."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y have different lengths ({x.shape[0]} vs {y.shape[0]})")
    if y.unique().numel() < 2:
        raise ValueError("blends need images of at least two different classes")
    g = _gen(seed)
    i = torch.randint(len(x), (n,), generator=g)
    j = torch.randint(len(x), (n,), generator=g)
    same = y[i] == y[j]
    while same.any():  # resample partners until every pair mixes two classes
        j[same] = torch.randint(len(x), (int(same.sum()),), generator=g)
        same = y[i] == y[j]
    return (x[i] + x[j]) / 2.0


def transposed(x: Tensor) -> Tensor:
    """Images with height and width swapped (a digit reflected about its diagonal)."""
    return x.transpose(-1, -2).contiguous()


def digits_ood_sets(test_x: Tensor, test_y: Tensor, seed: int = 0, n: int | None = None) -> dict[str, Tensor]:
    """The four out-of-distribution sets of the digits experiment, each as large as the test set
    (or ``n``): ``noise``, ``patches``, ``blends``, ``transposed``."""
    n = len(test_x) if n is None else n
    shape = tuple(test_x.shape[1:])
    return {
        "noise": uniform_noise(n, shape, seed=seed),
        "patches": photo_patches(n, size=shape[-1], seed=seed),
        "blends": blends(test_x, test_y, n, seed=seed),
        "transposed": transposed(test_x)[:n],
    }
