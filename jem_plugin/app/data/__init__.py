"""Embedded data for experiments, tests and the demo, and local-only image datasets.

Nothing here downloads anything. The digits (scikit-learn's bundled 8x8 handwritten digits)
and the photos behind :func:`photo_patches` (scikit-learn's two bundled sample images) ship
with scikit-learn. :func:`image_folder` and :func:`cifar10` read files the user already has
and say where to put them when they are missing.

Images follow the paper's convention: float ``[N, C, H, W]`` in ``[-1, 1]``, which is the
default :class:`~jem_plugin.adapter.InputDomain` of ``jem.wrap``. Each dataset built here
carries its domain as ``dataset.domain``.
"""

# One private module per source; this namespace is the public one.
from ._digits import DIGITS_CLASSES, DIGITS_DOMAIN, digits_tensors, load_digits
from ._images import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    UnreadableImageError,
    cifar10,
    conversion_note,
    image_files,
    image_folder,
    normalize_transform,
    signed_domain,
    skipped_note,
)
from ._ood_sets import (
    blends,
    digits_ood_sets,
    photo_crops,
    photo_patches,
    transposed,
    uniform_noise,
)
from ._textures import TEXTURE_CLASSES, textures
from ._toy2d import TOY2D_NAMES, gaussian_mixture_logpdf, toy2d, toy2d_logpdf

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
    "conversion_note",
    "cifar10",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "photo_crops",
    "TEXTURE_CLASSES",
    "textures",
]
