"""Local image data: a folder of class sub-folders, a folder of unlabelled images, CIFAR-10 from a
local copy. Nothing is downloaded."""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch.utils.data import Dataset

from ...adapter import InputDomain
from ...adapter import image_as_mode as _as_mode  # one copy: jm.preprocessing() reads files as training did
from ...errors import DatasetNotFoundError, JEMError
from ._common import _with_domain

if TYPE_CHECKING:
    from torchvision.datasets import CIFAR10, ImageFolder

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


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


def _image_problem(path: str | Path) -> tuple[str | None, str]:
    """``(why path is not a readable image or None, its PIL mode)``. Cheap: the header is parsed
    and PIL's ``verify`` run (a PNG's chunks are checked); a JPEG must end with its end-of-image
    marker (a truncated JPEG passes ``verify`` and fails only when decoded)."""
    from PIL import Image, UnidentifiedImageError

    mode = ""
    try:
        with Image.open(path) as im:
            fmt, mode = im.format, im.mode
            im.verify()
    except UnidentifiedImageError:
        return "not an image file PIL can identify", mode
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return str(exc) or type(exc).__name__, mode
    if fmt == "JPEG":
        with open(path, "rb") as f:
            f.seek(max(0, Path(path).stat().st_size - 4096))
            if b"\xff\xd9" not in f.read():
                return "image file is truncated: no JPEG end-of-image marker", mode
    return None, mode


#: PIL modes with one channel of grey (16/32-bit integer and float ones included).
_GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})


def _load_as(path: str, mode: str = "RGB"):
    """An image file as a PIL image of ``mode`` (see :func:`_as_mode`); an unreadable file names
    itself (the error of a file that passed the up-front check but fails to decode, e.g. in the
    middle of training)."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            im = Image.open(f)
            im.load()  # decoded while the file is open: an image already in ``mode`` is returned as is
        return _as_mode(im, mode)
    except (OSError, SyntaxError, ValueError) as exc:
        raise UnreadableImageError(
            f"{path}: not a readable image ({str(exc) or type(exc).__name__}); remove or replace it"
        ) from exc


def _target_mode(modes: Sequence[str], channels: int | None) -> str:
    """The one mode a folder's images are read in: the model's ``channels`` (1 -> "L", 3 ->
    "RGB"), else the majority's (grey or colour; a tie keeps colour, which loses nothing)."""
    if channels is not None:
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grey) or 3 (RGB), not {channels}")
        return "L" if channels == 1 else "RGB"
    grey = sum(m in _GREY_MODES for m in modes)
    return "L" if grey > len(modes) - grey else "RGB"


def conversion_note(ds, where: str) -> str | None:
    """One line saying how many of ``ds``'s images were read in a mode other than their own, and
    from which modes (``ds.converted``, set by :func:`image_folder`), or None when none was."""
    converted: dict[str, int] = getattr(ds, "converted", {})
    n = sum(converted.values())
    if not n:
        return None
    total = n + getattr(ds, "unconverted", 0)
    modes = ", ".join(f"{c} {m}" for m, c in sorted(converted.items(), key=lambda mc: (-mc[1], mc[0])))
    return f"converted {n} of the {total} images of {where} to {ds.mode} ({modes}); every image is read as {ds.mode}"


def _readable(paths: Sequence[str], where: str, skip_bad: bool) -> tuple[list[bool], list[str], list[str]]:
    """``(keep mask, skipped paths, modes of the kept files)``: every file checked up front; an
    unreadable one ends the load in one line naming it, unless ``skip_bad``."""
    checked = [(p, *_image_problem(p)) for p in paths]
    problems = [(p, why) for p, why, _ in checked]
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
    keep = [why is None for _, why in problems]
    return keep, [p for p, _ in bad], [m for (_, _, m), k in zip(checked, keep) if k]


def _count_conversions(ds, modes: Sequence[str], target: str) -> None:
    """Record on ``ds`` the mode it is read in and how many images of each other mode it converts."""
    ds.mode = target
    ds.converted = dict(Counter(m for m in modes if m != target))
    ds.unconverted = sum(m == target for m in modes)


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
    channels: int | None = None,
) -> ImageFolder:
    """A ``torchvision.datasets.ImageFolder`` (``path/<class>/<image>``) resized to
    ``image_size``, normalised by ``mean``/``std`` (default: ``[-1, 1]``); ``.domain`` is set.

    Every file is checked up front: an unreadable one (not an image, a truncated file) raises
    :class:`UnreadableImageError` naming it, or with ``skip_bad`` is left out (listed in ``.skipped``).

    Every image is read in one mode (``.mode``): ``"L"`` for ``channels=1``, ``"RGB"`` for
    ``channels=3`` (the model's input channels), or by default the majority's (a tie reads RGB);
    ``mean``/``std`` of one or three values also fix it. 16-bit grey is scaled to 8 bits and
    transparency composited on black. ``.converted`` counts the images read in another mode than
    their own, by their own mode; :func:`conversion_note` says it in one line.
    """
    from torchvision.datasets import ImageFolder

    p = Path(path).expanduser()
    if not p.is_dir():
        raise DatasetNotFoundError(
            f"image folder {str(p)!r} does not exist. Point it at a directory with one "
            "sub-directory per class, e.g. data/train/cat/001.png, data/train/dog/002.png."
        )
    try:
        ds = ImageFolder(str(p), loader=_load_as)
    except (FileNotFoundError, RuntimeError) as exc:
        raise DatasetNotFoundError(
            f"no images found under {str(p)!r} ({exc}). Expected one sub-directory per class "
            "holding .png/.jpg files, e.g. data/train/cat/001.png."
        ) from exc
    keep, skipped, modes = _readable([s for s, _ in ds.samples], f"image folder {str(p)!r}", skip_bad)
    if skipped:
        ds.samples = [s for s, k in zip(ds.samples, keep) if k]
        ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    ds.skipped = skipped
    target = _target_mode(modes, channels if mean is None else len(tuple(mean)))
    _count_conversions(ds, modes, target)
    ds.loader = functools.partial(_load_as, mode=target)  # a partial, not a lambda: DataLoader workers pickle it
    transform, domain = normalize_transform(mean, std, image_size, channels=1 if target == "L" else 3)
    ds.transform = transform
    return _with_domain(ds, domain, ds.classes)


class _ImageFiles(Dataset):
    """Image files without labels (every label 0): an OOD set."""

    def __init__(self, root: str | Path, paths: Sequence[str], transform, mode: str = "RGB") -> None:
        self.root, self.paths, self.transform, self.mode = str(root), list(paths), transform, mode

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.transform(_load_as(self.paths[i], self.mode)), 0


def image_files(
    path: str | Path,
    image_size: int | Sequence[int] = 32,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    skip_bad: bool = False,
    channels: int | None = None,
) -> _ImageFiles:
    """Every image under ``path`` (directly in it or in sub-folders of any depth), unlabelled
    (label 0), resized and normalised as :func:`image_folder`: an out-of-distribution set, which
    has no classes. ``.domain``, ``.skipped``, ``.mode`` and ``.converted`` are set as there, and
    the images are read in one mode as there: the scoring model's ``channels``, else ``mean``'s,
    else the majority's."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    p = Path(path).expanduser()
    if not p.is_dir():
        raise DatasetNotFoundError(f"image folder {str(p)!r} does not exist; give a directory of images")
    files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(IMG_EXTENSIONS))
    if not files:
        raise DatasetNotFoundError(
            f"no images found under {str(p)!r} (looked for {', '.join(IMG_EXTENSIONS)} files, sub-folders included)"
        )
    keep, skipped, modes = _readable(files, f"image folder {str(p)!r}", skip_bad)
    target = _target_mode(modes, channels if mean is None else len(tuple(mean)))
    transform, domain = normalize_transform(mean, std, image_size, channels=1 if target == "L" else 3)
    ds = _ImageFiles(p, [f for f, k in zip(files, keep) if k], transform, mode=target)
    ds.skipped = skipped  # type: ignore[attr-defined]  # the unreadable files travel with the dataset
    _count_conversions(ds, modes, target)
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
