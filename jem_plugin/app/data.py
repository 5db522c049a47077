"""Embedded data for experiments, tests and the demo, and local-only image datasets.

Nothing here downloads anything. The digits (scikit-learn's bundled 8x8 handwritten digits)
and the photos behind :func:`photo_patches` (scikit-learn's two bundled sample images) ship
with scikit-learn. :func:`image_folder` and :func:`cifar10` read files the user already has
and say where to put them when they are missing.

Images follow the paper's convention: float ``[N, C, H, W]`` in ``[-1, 1]``, which is the
default :class:`~jem_plugin.adapter.InputDomain` of ``jem.wrap``. Each dataset built here
carries its domain as ``dataset.domain``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from ..adapter import InputDomain
from ..errors import DatasetNotFoundError, JEMError

if TYPE_CHECKING:
    from torchvision.datasets import CIFAR10, ImageFolder

_DS = TypeVar("_DS", bound=Dataset)

__all__ = [
    "DIGITS_DOMAIN",
    "DIGITS_CLASSES",
    "load_digits",
    "digits_tensors",
    "uniform_noise",
    "photo_patches",
    "blends",
    "transposed",
    "digits_ood_sets",
    "toy2d",
    "toy2d_logpdf",
    "gaussian_mixture_logpdf",
    "TOY2D_NAMES",
    "signed_domain",
    "normalize_transform",
    "image_folder",
    "image_files",
    "UnreadableImageError",
    "skipped_note",
    "cifar10",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "write_digits_folder",
    "write_photo_folder",
    "photo_crops",
    "TEXTURE_CLASSES",
    "textures",
    "write_textures_folder",
]

#: Domain of the embedded digits: one channel, 8x8, values in [-1, 1].
DIGITS_DOMAIN = InputDomain.from_range(-1.0, 1.0, input_size=(1, 8, 8))
DIGITS_CLASSES = tuple(str(i) for i in range(10))

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


# ---------------------------------------------------------------------------- digits
@functools.lru_cache(maxsize=1)
def _digits_cached() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits as _sk_load_digits

    d = _sk_load_digits()  # parses a bundled CSV: slow enough to cache
    x = d.images.astype(np.float32) / 16.0 * 2.0 - 1.0  # 0..16 -> [-1, 1]
    x.setflags(write=False)
    y = d.target.astype(np.int64)
    y.setflags(write=False)
    return x[:, None], y


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    x, y = _digits_cached()
    return x.copy(), y.copy()


def _with_domain(ds: _DS, domain: InputDomain, classes: Sequence[str] | None = None) -> _DS:
    ds.domain = domain  # type: ignore[attr-defined]  # the input domain travels with the dataset
    if classes is not None:
        ds.classes = list(classes)  # type: ignore[attr-defined]  # class names on a plain dataset, as torchvision's datasets carry them
    return ds


def load_digits(
    split: str = "train", test_fraction: float = 0.2, seed: int = 0, classes: Iterable[int] | None = None
) -> TensorDataset:
    """scikit-learn's bundled 8x8 digits as a ``TensorDataset`` of ``x [N, 1, 8, 8]`` in ``[-1, 1]``
    and ``y [N]`` (long).

    The train/test split is stratified by class and deterministic given ``seed``; ``"all"``
    returns all 1797 images. ``classes`` keeps only those labels (labels are *not* renumbered),
    e.g. ``classes=range(5)`` for held-out-class experiments.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = _digits_arrays()
    if split != "all":
        from sklearn.model_selection import train_test_split

        idx_train, idx_test = train_test_split(
            np.arange(len(y)), test_size=test_fraction, random_state=seed, stratify=y
        )
        idx = np.sort(idx_train if split == "train" else idx_test)
        x, y = x[idx], y[idx]
    if classes is not None:
        keep = np.isin(y, np.asarray(list(classes), dtype=np.int64))
        if not keep.any():
            raise ValueError(f"classes={list(classes)} selects no digits; labels are 0..9")
        x, y = x[keep], y[keep]
    ds = TensorDataset(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y))
    return _with_domain(ds, DIGITS_DOMAIN, DIGITS_CLASSES)


def digits_tensors(split: str = "train", **kwargs) -> tuple[Tensor, Tensor]:
    """``(x, y)`` tensors of :func:`load_digits` (same arguments)."""
    x, y = load_digits(split, **kwargs).tensors
    return x, y


# ---------------------------------------------------------------------------- OOD sets
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


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


# ---------------------------------------------------------------------------- toy 2D
TOY2D_NAMES = ("8gaussians", "2spirals", "checkerboard", "rings")

_8G_RADIUS, _8G_STD = 2.0, 0.2
_RING_RADII, _RING_STD = (0.75, 1.5, 2.25), 0.08
_SPIRAL_TURNS, _SPIRAL_RMAX, _SPIRAL_STD = 1.5, 2.5, 0.1


def _8g_means() -> Tensor:
    a = torch.arange(8, dtype=torch.float64) * (math.pi / 4)
    return torch.stack([torch.cos(a), torch.sin(a)], 1) * _8G_RADIUS


def _spiral(t: Tensor, cls: int) -> Tensor:
    # t in [0, 1] -> angle 0..turns*2pi, radius 0..rmax; class 1 is class 0 rotated by pi
    ang = t * (_SPIRAL_TURNS * 2 * math.pi)
    r = t * _SPIRAL_RMAX
    pts = torch.stack([r * torch.cos(ang), r * torch.sin(ang)], -1)
    return pts if cls == 0 else -pts


def toy2d(name: str = "8gaussians", n: int = 1000, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A 2D toy distribution: ``(x [n, 2] float32, y [n] long)`` with ``y`` the component
    (gaussian, spiral arm, filled square or ring) each point came from. Deterministic given
    ``seed``. :func:`toy2d_logpdf` gives the true log density."""
    g = _gen(seed)
    if name == "8gaussians":
        y = torch.randint(8, (n,), generator=g)
        x = _8g_means()[y] + _8G_STD * torch.randn(n, 2, generator=g, dtype=torch.float64)
    elif name == "2spirals":
        y = torch.randint(2, (n,), generator=g)
        t = torch.rand(n, generator=g, dtype=torch.float64).sqrt()  # uniform-ish along the arc
        x = torch.where(y[:, None] == 0, _spiral(t, 0), _spiral(t, 1))
        x = x + _SPIRAL_STD * torch.randn(n, 2, generator=g, dtype=torch.float64)
    elif name == "checkerboard":
        # 4x4 board on [-2, 2]^2; the 8 squares with (row + col) even are filled
        y = torch.randint(8, (n,), generator=g)
        row, k = y // 2, y % 2
        col = 2 * k + (row % 2)
        u = torch.rand(n, 2, generator=g, dtype=torch.float64)
        x = torch.stack([col + u[:, 0], row + u[:, 1]], 1) - 2.0
    elif name == "rings":
        y = torch.randint(len(_RING_RADII), (n,), generator=g)
        a = torch.rand(n, generator=g, dtype=torch.float64) * 2 * math.pi
        r = torch.tensor(_RING_RADII, dtype=torch.float64)[y]
        r = r + _RING_STD * torch.randn(n, generator=g, dtype=torch.float64)
        x = torch.stack([r * torch.cos(a), r * torch.sin(a)], 1)
    else:
        raise ValueError(f"unknown toy2d dataset {name!r}; choose one of {', '.join(TOY2D_NAMES)}")
    return x.float(), y.long()


def gaussian_mixture_logpdf(x: Tensor, means: Tensor, std: float | Tensor, weights: Tensor | None = None) -> Tensor:
    """Log density of an isotropic Gaussian mixture at ``x [N, D]`` (``means [K, D]``,
    ``std`` scalar or ``[K]``, ``weights [K]`` summing to 1, uniform by default)."""
    x = x.to(torch.float64)
    means = means.to(torch.float64)
    d = x.shape[1]
    std = torch.as_tensor(std, dtype=torch.float64).expand(means.shape[0])
    logw = (
        torch.full((means.shape[0],), -math.log(means.shape[0]), dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.float64).log()
    )
    const = logw - d * torch.log(std) - 0.5 * d * math.log(2 * math.pi)
    chunk = max(1, 2_000_000 // max(1, means.shape[0]))  # bound the [N, K] matrix in memory
    out = [torch.logsumexp(-0.5 * torch.cdist(xc, means).pow(2) / std**2 + const, dim=1) for xc in x.split(chunk)]
    return torch.cat(out) if out else x.new_zeros(0)


def toy2d_logpdf(name: str, x: Tensor) -> Tensor:
    """True log density of :func:`toy2d` ``name`` at ``x [N, 2]`` (float64; ``-inf`` off the
    checkerboard). ``2spirals`` is evaluated as a fine mixture of Gaussians along the arms."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if name == "8gaussians":
        return gaussian_mixture_logpdf(x, _8g_means(), _8G_STD)
    if name == "2spirals":
        # t = sqrt(u) has density 2t on [0, 1]; midpoint quadrature over t
        m = 2000
        t = (torch.arange(m, dtype=torch.float64) + 0.5) / m
        w = 2 * t / m
        means = torch.cat([_spiral(t, 0), _spiral(t, 1)])
        weights = torch.cat([w, w]) / 2
        return gaussian_mixture_logpdf(x, means, _SPIRAL_STD, weights / weights.sum())
    if name == "checkerboard":
        inside = (x.abs() < 2).all(1)
        cell = torch.floor(x + 2.0)
        filled = ((cell[:, 0] + cell[:, 1]) % 2 == 0) & inside
        return torch.where(filled, torch.full_like(x[:, 0], -math.log(8.0)), torch.full_like(x[:, 0], -math.inf))
    if name == "rings":
        # radius ~ N(r_k, s), angle uniform: p(x) = mean_k N(|x|; r_k, s) / (2 pi |x|)
        r = x.norm(dim=1).clamp_min(1e-12)
        radii = torch.tensor(_RING_RADII, dtype=torch.float64)
        comp = -0.5 * ((r[:, None] - radii) / _RING_STD) ** 2 - math.log(_RING_STD * math.sqrt(2 * math.pi))
        return torch.logsumexp(comp, 1) - math.log(len(_RING_RADII)) - torch.log(2 * math.pi * r)
    raise ValueError(f"unknown toy2d dataset {name!r}; choose one of {', '.join(TOY2D_NAMES)}")


# ---------------------------------------------------------------------------- local image data
def signed_domain(channels: int = 3, input_size: Sequence[int] | None = None) -> InputDomain:
    """The paper's domain: pixels mapped from ``[0, 1]`` to ``[-1, 1]`` (mean 0.5, std 0.5)."""
    return InputDomain.from_normalization((0.5,) * channels, (0.5,) * channels, input_size=input_size)


def normalize_transform(
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    image_size: int | Sequence[int] | None = None,
    channels: int = 3,
):
    """``(transform, domain)``: ``ToTensor`` (+ resize/centre-crop) + ``Normalize(mean, std)`` and
    the matching :class:`InputDomain`. ``mean=std=None`` means the paper's ``[-1, 1]``."""
    from torchvision import transforms as T

    if (mean is None) != (std is None):
        raise ValueError("pass both mean and std, or neither (for the paper's [-1, 1] scaling)")
    if mean is None or std is None:  # both None (checked above)
        mean, std = (0.5,) * channels, (0.5,) * channels
    steps = []
    size = None
    if image_size is not None:
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        steps += [T.Resize(size), T.CenterCrop(size)]
    steps += [T.ToTensor(), T.Normalize(tuple(mean), tuple(std))]
    domain = InputDomain.from_normalization(
        tuple(mean), tuple(std), input_size=(len(tuple(mean)), *size) if size else None
    )
    return T.Compose(steps), domain


class UnreadableImageError(JEMError, ValueError):
    """An image file of a folder data set that PIL cannot read (not an image, or truncated)."""


def _image_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a readable image, or None. Cheap: the header is parsed and PIL's
    ``verify`` run (a PNG's chunks are checked); a JPEG must end with its end-of-image marker
    (a truncated JPEG passes ``verify`` and fails only when decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            fmt = im.format
            im.verify()
    except UnidentifiedImageError:
        return "not an image file PIL can identify"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return str(exc) or type(exc).__name__
    if fmt == "JPEG":
        with open(path, "rb") as f:
            f.seek(max(0, Path(path).stat().st_size - 4096))
            if b"\xff\xd9" not in f.read():
                return "image file is truncated: no JPEG end-of-image marker"
    return None


def _load_rgb(path: str):
    """An image file as an RGB PIL image; an unreadable file names itself (the error of a file that
    passed the up-front check but fails to decode, e.g. in the middle of training)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        raise UnreadableImageError(
            f"{path}: not a readable image ({str(exc) or type(exc).__name__}); remove or replace it"
        ) from exc


def _readable(paths: Sequence[str], where: str, skip_bad: bool) -> tuple[list[bool], list[str]]:
    """``(keep mask, skipped paths)``: every file checked up front; an unreadable one ends the
    load in one line naming it, unless ``skip_bad``."""
    problems = [(p, _image_problem(p)) for p in paths]
    bad = [(p, why) for p, why in problems if why is not None]
    if bad and not skip_bad:
        p, why = bad[0]
        more = f" (and {len(bad) - 1} more of its {len(paths)} images)" if len(bad) > 1 else ""
        raise UnreadableImageError(
            f"{p}: not a readable image ({why}){more}; remove it, or pass --skip-bad-images to leave "
            "unreadable images out"
        )
    if bad and len(bad) == len(paths):
        raise UnreadableImageError(
            f"{where}: none of its {len(paths)} images is readable (e.g. {bad[0][0]}: {bad[0][1]})"
        )
    return [why is None for _, why in problems], [p for p, _ in bad]


def skipped_note(ds, where: str) -> str | None:
    """One line naming (up to 3 of) the images a ``skip_bad`` load left out (relative to the
    folder ``ds.root`` when it has one), or None."""
    root = getattr(ds, "root", None)
    skipped = [os.path.relpath(p, root) if root else str(p) for p in getattr(ds, "skipped", ())]
    if not skipped:
        return None
    names = ", ".join(skipped[:3]) + (f", ... ({len(skipped) - 3} more)" if len(skipped) > 3 else "")
    return f"skipped {len(skipped)} unreadable image{'s' if len(skipped) > 1 else ''} of {where}: {names}"


def image_folder(
    path: str | Path,
    image_size: int | Sequence[int] = 32,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    skip_bad: bool = False,
) -> ImageFolder:
    """A ``torchvision.datasets.ImageFolder`` (``path/<class>/<image>``) resized to
    ``image_size``, normalised by ``mean``/``std`` (default: ``[-1, 1]``); ``.domain`` is set.

    Every file is checked up front: an unreadable one (not an image, a truncated file) raises
    :class:`UnreadableImageError` naming it, or with ``skip_bad`` is left out (listed in ``.skipped``).
    """
    from torchvision.datasets import ImageFolder

    p = Path(path).expanduser()
    if not p.is_dir():
        raise DatasetNotFoundError(
            f"image folder {str(p)!r} does not exist. Point it at a directory with one "
            "sub-directory per class, e.g. data/train/cat/001.png, data/train/dog/002.png."
        )
    transform, domain = normalize_transform(mean, std, image_size)
    try:
        ds = ImageFolder(str(p), transform=transform, loader=_load_rgb)
    except (FileNotFoundError, RuntimeError) as exc:
        raise DatasetNotFoundError(
            f"no images found under {str(p)!r} ({exc}). Expected one sub-directory per class "
            "holding .png/.jpg files, e.g. data/train/cat/001.png."
        ) from exc
    keep, skipped = _readable([s for s, _ in ds.samples], f"image folder {str(p)!r}", skip_bad)
    if skipped:
        ds.samples = [s for s, k in zip(ds.samples, keep) if k]
        ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    ds.skipped = skipped
    return _with_domain(ds, domain, ds.classes)


class _ImageFiles(Dataset):
    """Image files without labels (every label 0): an OOD set."""

    def __init__(self, root: str | Path, paths: Sequence[str], transform) -> None:
        self.root, self.paths, self.transform = str(root), list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.transform(_load_rgb(self.paths[i])), 0


def image_files(
    path: str | Path,
    image_size: int | Sequence[int] = 32,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    skip_bad: bool = False,
) -> _ImageFiles:
    """Every image under ``path`` (directly in it or in sub-folders of any depth), unlabelled
    (label 0), resized and normalised as :func:`image_folder`: an out-of-distribution set, which
    has no classes. ``.domain`` and ``.skipped`` are set as there."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    p = Path(path).expanduser()
    if not p.is_dir():
        raise DatasetNotFoundError(f"image folder {str(p)!r} does not exist; give a directory of images")
    files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(IMG_EXTENSIONS))
    if not files:
        raise DatasetNotFoundError(
            f"no images found under {str(p)!r} (looked for {', '.join(IMG_EXTENSIONS)} files, sub-folders included)"
        )
    keep, skipped = _readable(files, f"image folder {str(p)!r}", skip_bad)
    transform, domain = normalize_transform(mean, std, image_size)
    ds = _ImageFiles(p, [f for f, k in zip(files, keep) if k], transform)
    ds.skipped = skipped  # type: ignore[attr-defined]  # the unreadable files travel with the dataset
    return _with_domain(ds, domain)


def cifar10(
    root: str | Path, train: bool = True, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> CIFAR10:
    """CIFAR-10 from a LOCAL copy (never downloaded), in ``[-1, 1]`` by default; ``.domain`` set.

    ``root`` is the directory holding ``cifar-10-batches-py/`` (the extracted python version
    of the dataset), or that directory itself.
    """
    from torchvision.datasets import CIFAR10

    p = Path(root).expanduser()
    if p.name == "cifar-10-batches-py":
        p = p.parent
    folder = p / "cifar-10-batches-py"
    needed = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
    missing = [f for f in needed if not (folder / f).is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"CIFAR-10 not found: {str(folder)!r} is missing {', '.join(missing)}. jem-plugin never "
            "downloads data; get cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/"
            f"cifar-10-python.tar.gz) and extract it into {str(p)!r} so that {str(folder)!r} "
            "holds data_batch_1..5, test_batch and batches.meta."
        )
    transform, domain = normalize_transform(mean, std, None)
    try:
        ds = CIFAR10(str(p), train=train, transform=transform, download=False)
    except RuntimeError as exc:
        raise DatasetNotFoundError(
            f"CIFAR-10 files under {str(folder)!r} are corrupt or incomplete ({exc}); "
            "re-extract cifar-10-python.tar.gz there."
        ) from exc
    domain = InputDomain(domain.low, domain.high, domain.mean, domain.std, (3, 32, 32))
    return _with_domain(ds, domain, ds.classes)


# ---------------------------------------------------------------------------- example folders
def write_digits_folder(
    root: str | Path, classes: Iterable[int] = range(10), per_class: int = 20, size: int = 16, offset: int = 0
) -> Path:
    """Write bundled digits as an image folder (``root/<digit>/<n>.png``, RGB, ``size`` pixels), to
    try the folder workflow (``jem train --data folder:ROOT``) without images of one's own.
    ``offset`` skips that many images of each class (two calls give disjoint folders)."""
    from PIL import Image

    x, y = _digits_cached()
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


# ---------------------------------------------------------------------------- textures
#: The ten classes of :func:`textures`: a shape family each, drawn in a class-specific hue.
TEXTURE_CLASSES = ("disc", "ring", "bars", "cross", "triangle", "checker", "frame", "crescent", "dots", "star")
# Hue centre of each class (fractions of the colour circle): neighbours on the circle are 0.1 apart and
# each class's hue spreads with _TEX_HUE_STD, so colour narrows a class down without deciding it.
_TEX_HUES = (0.0, 0.5, 0.1, 0.6, 0.2, 0.7, 0.3, 0.8, 0.4, 0.9)
_TEX_HUE_STD = 0.06
_TEX_SUPERSAMPLE = 2


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HSV in [0, 1] (arrays of one shape) -> RGB, stacked on the last axis."""
    h6 = (np.asarray(h) % 1.0) * 6.0
    c = v * s
    x = c * (1.0 - np.abs(h6 % 2.0 - 1.0))
    zero = np.zeros_like(c)
    sector = np.floor(h6).astype(int) % 6
    rgb = np.select(
        [sector[..., None] == k for k in range(6)],
        [np.stack(t, -1) for t in ((c, x, zero), (x, c, zero), (zero, c, x), (zero, x, c), (x, zero, c), (c, zero, x))],
    )
    return rgb + (v - c)[..., None]


def _texture_shape(k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Mask of class ``k``'s shape in its own frame (``u, v`` about [-1, 1] span the shape)."""
    r = np.hypot(u, v)
    inside = (np.abs(u) < 1) & (np.abs(v) < 1)
    if k == 0:  # disc
        return r < 1
    if k == 1:  # ring
        return (r < 1) & (r > 0.6)
    if k == 2:  # three parallel bars
        return inside & (np.floor((v + 1) * 2.5).astype(int) % 2 == 0)
    if k == 3:  # cross
        return ((np.abs(u) < 0.3) & (np.abs(v) < 1)) | ((np.abs(v) < 0.3) & (np.abs(u) < 1))
    if k == 4:  # triangle
        return (v > -0.6) & (v < 1 - np.sqrt(3) * np.abs(u) * 0.95)
    if k == 5:  # 3x3 checker patch
        return inside & ((np.floor((u + 1) * 1.5) + np.floor((v + 1) * 1.5)).astype(int) % 2 == 0)
    if k == 6:  # square frame
        return inside & (np.maximum(np.abs(u), np.abs(v)) > 0.62)
    if k == 7:  # crescent
        return (r < 1) & (np.hypot(u - 0.5, v) > 0.8)
    if k == 8:  # three dots in a row
        return (np.hypot(u + 0.68, v) < 0.32) | (r < 0.32) | (np.hypot(u - 0.68, v) < 0.32)
    # five-pointed star
    phi = np.arctan2(v, u)
    return r < 0.42 + 0.58 * ((1 + np.cos(5 * phi)) / 2) ** 2


def _texture_background(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
    """A procedural background ``[H, W, 3]``: two colours of any hue mixed by smooth noise,
    stripes, a gradient or fine grain. Its colours do not depend on the class."""
    n = yy.shape[0]
    hue = rng.random(2)
    sat = rng.uniform(0.15, 0.9, 2)
    val = rng.uniform(0.1, 0.75, 2)
    cols = _hsv_to_rgb(hue, sat, val)  # [2, 3]
    kind = rng.integers(4)
    t: np.ndarray
    if kind == 0:  # smooth noise: a coarse random grid, bicubically upsampled
        g = int(rng.integers(3, 7))
        coarse = torch.from_numpy(rng.random((1, 1, g, g)).astype(np.float32))
        up = torch.nn.functional.interpolate(coarse, size=(n, n), mode="bicubic", align_corners=True)
        t = up[0, 0].numpy().clip(0, 1)
    elif kind == 1:  # stripes at a random angle and frequency
        a = rng.uniform(0, np.pi)
        f = rng.uniform(1.5, 5.0)
        t = 0.5 + 0.5 * np.sin(2 * np.pi * f * (np.cos(a) * xx + np.sin(a) * yy) / n + rng.uniform(0, 2 * np.pi))
    elif kind == 2:  # linear gradient
        a = rng.uniform(0, 2 * np.pi)
        t = (np.cos(a) * xx + np.sin(a) * yy) / n
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    else:  # fine grain
        t = rng.random((n, n))
    return cols[0] * (1 - t[..., None]) + cols[1] * t[..., None]


def _texture_image(k: int, rng: np.random.Generator, size: int) -> np.ndarray:
    n = size * _TEX_SUPERSAMPLE
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float64) + 0.5
    img = _texture_background(rng, yy, xx)
    # a distractor blob of any hue, half of the time
    if rng.random() < 0.5:
        c = _hsv_to_rgb(rng.random(1), rng.uniform(0.3, 1, 1), rng.uniform(0.4, 1, 1))[0]
        by, bx = rng.uniform(0.1, 0.9, 2) * n
        blob = np.hypot(yy - by, xx - bx) < rng.uniform(0.04, 0.09) * n
        img[blob] = c
    # the class's shape: random place, scale and rotation; a hue around the class's own
    scale = rng.uniform(0.2, 0.34) * n
    cy, cx = rng.uniform(scale * 0.8, n - scale * 0.8, 2)
    a = rng.uniform(0, 2 * np.pi)
    du, dv = (xx - cx) / scale, (yy - cy) / scale
    u, v = np.cos(a) * du + np.sin(a) * dv, -np.sin(a) * du + np.cos(a) * dv
    mask = _texture_shape(k, u, v)
    hue = _TEX_HUES[k] + _TEX_HUE_STD * rng.standard_normal()
    fg = _hsv_to_rgb(np.array([hue]), rng.uniform(0.45, 1.0, 1), rng.uniform(0.55, 1.0, 1))[0]
    shade = 1 + 0.12 * (rng.random((n, n)) - 0.5)  # a grainy fill, not a flat colour
    img = np.where(mask[..., None], fg * shade[..., None], img)
    img = img.reshape(size, _TEX_SUPERSAMPLE, size, _TEX_SUPERSAMPLE, 3).mean(axis=(1, 3))  # anti-aliased
    img = img + 0.02 * rng.standard_normal(img.shape)
    return img.clip(0, 1).transpose(2, 0, 1).astype(np.float32)


def textures(n_per_class: int, size: int = 32, seed: int = 0, offset: int = 0) -> tuple[Tensor, Tensor]:
    """A generated 10-class colour image data set: ``(x [10 n, 3, size, size] in [0, 1], y [10 n])``.

    Each class is a shape family (:data:`TEXTURE_CLASSES`: disc, ring, bars, cross, triangle,
    checker patch, square frame, crescent, three dots, star) drawn at a random position, scale and
    rotation in a hue drawn around the class's own (neighbouring classes' hues overlap), over a
    procedural background whose two colours are of any hue (smooth noise, stripes, a gradient or
    fine grain), with a distractor blob of any colour in half of the images. Neither colour nor
    shape alone is trivial; a small CNN learns it from a few hundred images per class.

    Deterministic: image ``i`` of class ``k`` depends only on ``(seed, k, offset + i)``, so a
    larger ``n_per_class`` extends a smaller one and disjoint ``offset`` ranges give disjoint
    splits. Images are interleaved by class (``y = 0, 1, ..., 9, 0, 1, ...``): every prefix of
    ``10 m`` images holds ``m`` per class.
    """
    if n_per_class < 0 or size < 8:
        raise ValueError(f"n_per_class must be >= 0 and size >= 8, got {n_per_class} and {size}")
    k_count = len(TEXTURE_CLASSES)
    x = np.empty((n_per_class * k_count, 3, size, size), dtype=np.float32)
    for i in range(n_per_class):
        for k in range(k_count):
            rng = np.random.default_rng([int(seed), k, int(offset) + i])
            x[i * k_count + k] = _texture_image(k, rng, size)
    y = torch.arange(k_count).repeat(n_per_class)
    return torch.from_numpy(x), y


def write_textures_folder(
    root: str | Path, per_class: int = 20, size: int = 32, seed: int = 0, offset: int = 0
) -> Path:
    """Write :func:`textures` as an image folder (``root/<k>_<shape>/<n>.png``, RGB) for the folder
    workflow (``jem train --data folder:ROOT``); ``offset`` as in :func:`textures` (disjoint folders)."""
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
