"""OpenOOD-style benchmark directories, read from a local path (nothing is downloaded).

OpenOOD v1.5 (Zhang et al. 2023, https://github.com/Jingkang50/OpenOOD) keeps every benchmark
as image lists plus image folders under one data directory::

    ROOT/benchmark_imglist/cifar10/train_cifar10.txt     ID training images
    ROOT/benchmark_imglist/cifar10/test_cifar10.txt      ID test images
    ROOT/benchmark_imglist/cifar10/test_cifar100.txt     near-OOD (also test_tin.txt)
    ROOT/benchmark_imglist/cifar10/test_mnist.txt        far-OOD (also svhn, texture, places365)
    ROOT/images_classic/cifar10/test/airplane/0001.png   the images the lists name

Each list line is ``relative/path label`` (the path relative to the image folder; OOD images
carry label -1 or 0, which is ignored). :func:`load_openood` gives the training set, the ID test
set and the near/far OOD sets of one benchmark as datasets yielding ``(image, label)``, images
resized to the model's size and scaled to its input domain (default ``[-1, 1]``, as every
dataset of :mod:`jem_plugin.app.data`). With them, the CIFAR-10 protocol is one call::

    train, test, ood = load_openood("openood/data", "cifar10")
    table = jem.ood.evaluate_all(jm, DataLoader(test, 256), {**ood["near"], **ood["far"]}, fit_data=...)

or one command: ``jem ood model.pt --openood openood/data --benchmark cifar10 --scores all``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from ..adapter import InputDomain
from ..errors import DatasetNotFoundError

__all__ = ["BENCHMARKS", "OpenOODBenchmark", "ImageList", "load_openood", "read_image_list"]


@dataclass(frozen=True)
class OpenOODBenchmark:
    """The files of one OpenOOD v1.5 benchmark: its image lists and image folders."""

    name: str
    num_classes: int
    near: tuple[str, ...]
    far: tuple[str, ...]
    images: str = "images_classic"
    #: OOD sets whose images live in another folder than ``images`` (ImageNet's textures).
    images_of: tuple[tuple[str, str], ...] = ()

    def list_path(self, root: Path, split: str, name: str | None = None) -> Path:
        """``root/benchmark_imglist/<benchmark>/<split>_<name>.txt`` (``name`` defaults to the benchmark)."""
        return root / "benchmark_imglist" / self.name / f"{split}_{name or self.name}.txt"

    def image_dir(self, root: Path, name: str | None = None) -> Path:
        """The folder the list of ``name`` (default: the ID data) is relative to."""
        return root / dict(self.images_of).get(name or self.name, self.images)


#: The benchmarks of OpenOOD v1.5, as its evaluation API lays them out.
BENCHMARKS: dict[str, OpenOODBenchmark] = {
    "cifar10": OpenOODBenchmark("cifar10", 10, ("cifar100", "tin"), ("mnist", "svhn", "texture", "places365")),
    "cifar100": OpenOODBenchmark("cifar100", 100, ("cifar10", "tin"), ("mnist", "svhn", "texture", "places365")),
    "imagenet200": OpenOODBenchmark(
        "imagenet200",
        200,
        ("ssb_hard", "ninco"),
        ("inaturalist", "textures", "openimage_o"),
        images="images_largescale",
        images_of=(("textures", "images_classic"),),
    ),
    "imagenet": OpenOODBenchmark(
        "imagenet",
        1000,
        ("ssb_hard", "ninco"),
        ("inaturalist", "textures", "openimage_o"),
        images="images_largescale",
        images_of=(("textures", "images_classic"),),
    ),
}


def _label(extra: str) -> int:
    extra = extra.strip()
    if not extra:
        return -1
    try:
        return int(extra)
    except ValueError:
        pass
    try:  # OpenOOD allows a dict of extras, e.g. {'label': 3, ...}
        value = ast.literal_eval(extra)
    except (ValueError, SyntaxError):
        return -1
    return int(value.get("label", -1)) if isinstance(value, dict) else -1


def read_image_list(path: str | Path) -> list[tuple[str, int]]:
    """``[(relative image path, label)]`` of an OpenOOD image list (``path label`` per line)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetNotFoundError(
            f"image list {str(p)!r} does not exist: expected a text file of lines "
            "'relative/path/to/image.png label' (OpenOOD's benchmark_imglist)"
        )
    items = []
    for line in p.read_text().splitlines():
        if line.strip():
            name, _, extra = line.strip().partition(" ")
            items.append((name, _label(extra)))
    if not items:
        raise DatasetNotFoundError(f"image list {str(p)!r} is empty: expected lines 'relative/path label'")
    return items


class ImageList(Dataset):
    """Images named by an OpenOOD image list, relative to ``image_dir``: ``(image, label)`` pairs.

    Images are opened with PIL, converted to RGB (as OpenOOD does: MNIST becomes grey RGB) and
    passed through ``transform``. ``.name``, ``.list_path``, ``.domain`` and ``.targets`` are set.
    """

    #: The input domain ``transform`` maps images to (``None`` when only the user's transform knows).
    domain: InputDomain | None = None

    def __init__(
        self, list_path: str | Path, image_dir: str | Path, transform: Callable | None, name: str = ""
    ) -> None:
        self.list_path, self.image_dir, self.name = Path(list_path), Path(image_dir), name or Path(list_path).stem
        self.items = read_image_list(self.list_path)
        self.transform = transform
        self.targets = [label for _, label in self.items]
        if not self.image_dir.is_dir():
            raise DatasetNotFoundError(
                f"image folder {str(self.image_dir)!r} does not exist: {str(self.list_path)!r} names images "
                f"relative to it (e.g. {self.items[0][0]!r})"
            )
        for rel, _ in (self.items[0], self.items[-1]):  # cheap check of the layout up front
            self._path(rel)

    def _path(self, rel: str) -> Path:
        p = self.image_dir / rel
        if not p.is_file():
            raise DatasetNotFoundError(
                f"image {str(p)!r} named in {str(self.list_path)!r} does not exist: the list's paths are "
                f"relative to {str(self.image_dir)!r}"
            )
        return p

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        rel, label = self.items[i]
        with Image.open(self._path(rel)) as im:
            img = im.convert("RGB")
        return (self.transform(img) if self.transform is not None else img), label


def _data_root(root: str | Path) -> Path:
    p = Path(root).expanduser()
    if not (p / "benchmark_imglist").is_dir() and (p / "data" / "benchmark_imglist").is_dir():
        return p / "data"  # the OpenOOD checkout itself
    if not (p / "benchmark_imglist").is_dir():
        raise DatasetNotFoundError(
            f"{str(p / 'benchmark_imglist')!r} does not exist: give the OpenOOD data directory holding "
            "benchmark_imglist/ and images_classic/ (OpenOOD's scripts/download/download.py fills it; "
            "jem-plugin never downloads data)"
        )
    return p


def load_openood(
    root: str | Path,
    benchmark: str = "cifar10",
    image_size: int = 32,
    transform: Callable | None = None,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> tuple[ImageList, ImageList, dict[str, dict[str, ImageList]]]:
    """``(train, test_id, {"near": {name: dataset}, "far": {name: dataset}})`` of an OpenOOD v1.5
    benchmark (``cifar10``, ``cifar100``, ``imagenet200``, ``imagenet``) under ``root``.

    ``root`` is OpenOOD's data directory (holding ``benchmark_imglist/`` and ``images_classic/``),
    or the OpenOOD checkout holding it as ``data/``. Each dataset yields ``(image, label)``;
    ``transform`` defaults to resize + centre-crop to ``image_size``, ``ToTensor`` and
    ``Normalize(mean, std)`` (default ``[-1, 1]``, the domain of jem-plugin's own datasets; pass a
    model's ``mean``/``std`` to match it); each dataset's ``.domain`` says which. Every list file,
    and the first and last image of each list, is checked before anything is returned: a missing
    one is one line naming the path and what is expected there.
    """
    from .data import normalize_transform

    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown OpenOOD benchmark {benchmark!r}; choose one of {', '.join(BENCHMARKS)}")
    b = BENCHMARKS[benchmark]
    data = _data_root(root)
    domain: InputDomain | None
    if transform is None:
        transform, domain = normalize_transform(mean, std, image_size)
    else:
        domain = None

    def load(split: str, name: str | None = None) -> ImageList:
        ds = ImageList(b.list_path(data, split, name), b.image_dir(data, name), transform, name or b.name)
        ds.domain = domain
        return ds

    train, test = load("train"), load("test")
    ood = {"near": {n: load("test", n) for n in b.near}, "far": {n: load("test", n) for n in b.far}}
    return train, test, ood
