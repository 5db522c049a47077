"""Running class moments (per-class sums and sums of outer products, float64) and the whitening
that the Gaussian detectors (:mod:`.gaussian`, :mod:`.gmm`) fit from them."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..._checks import (
    user_stacklevel,
)
from ._base import (
    _ClassConditional,
)


def _whitener(cov: Tensor, noise_floor: float = 0.0) -> Tensor:
    """``W`` with ``W W^T = pinv(cov)`` (``[D, rank]``, from the eigendecomposition): squared
    Mahalanobis distances are squared Euclidean distances after ``@ W``. Directions with variance
    below ``D * eps * largest`` are dropped, as ``torch.linalg.pinv`` drops them (dead units), and
    so are those at or below ``noise_floor``, the variance that the features' own rounding puts in
    every direction (see :meth:`_ClassMoments.rounding_floor`)."""
    evals, evecs = torch.linalg.eigh(cov)
    tol = evals.max().clamp_min(0) * cov.shape[0] * torch.finfo(cov.dtype).eps
    keep = evals > max(float(tol), noise_floor)
    return evecs[:, keep] / evals[keep].sqrt()


def _warn_flat(name: str, n_fit: int, n_classes: int) -> None:
    """Warn that a Gaussian detector's fit features do not vary within their classes."""
    warnings.warn(
        f"{name}: the fit features do not vary within their classes ({n_fit} images, {n_classes} classes), "
        "so its distances to the class means are all 0; fit on more images per class",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_few(name: str, n_fit: int, n_classes: int, widths: Mapping[str, int]) -> None:
    """Warn that a Gaussian detector saw fewer fit images than features (``widths``: the feature
    count of each layer that has more than ``n_fit - n_classes``)."""
    span = max(n_fit - n_classes, 0)
    where = ", ".join(f"{layer} ({d} features)" if layer else f"{d} features" for layer, d in widths.items())
    warnings.warn(
        f"{name}: {n_fit} fit images in {n_classes} classes for {where}: the within-class covariance "
        f"spans at most {span} directions and the distances ignore the others, in which inputs can "
        f"differ unseen; fit on at least {max(widths.values()) + n_classes} images",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


class _ClassMoments:
    """Running per-class sums and counts of features and their sums of outer products (one shared
    ``D x D`` sum, or one per class), in float64 around the first batch's mean: what the Gaussian
    detectors fit, in memory that does not grow with the data."""

    def __init__(self, per_class_outer: bool, diagonal: bool = False) -> None:
        self.per_class_outer = per_class_outer
        self.diagonal = diagonal  # per-class sums of squares (K x D) instead of outer products
        self.shift: Tensor | None = None
        self.sums = self.counts = self.outer = torch.empty(0)
        self.eps = 0.0  # the coarsest machine epsilon of the features seen, for the rounding floor

    def add(self, feats: Tensor, y: Tensor, k: int) -> None:
        self.eps = max(self.eps, torch.finfo(feats.dtype).eps)
        z = feats.double()
        if self.shift is None:
            d = z.shape[1]
            self.shift = z.mean(dim=0)
            self.sums, self.counts = z.new_zeros(k, d), z.new_zeros(k)
            self.outer = z.new_zeros((k, d) if self.diagonal else (k, d, d) if self.per_class_outer else (d, d))
        z = z - self.shift
        self.sums.index_add_(0, y, z)
        counts = torch.bincount(y, minlength=k)
        self.counts += counts.to(z.dtype)
        if self.diagonal:
            self.outer.index_add_(0, y, z * z)
            return
        if not self.per_class_outer:
            self.outer.addmm_(z.T, z)
            return
        present = counts.nonzero().squeeze(1)
        # the batch sorted by class, one outer-product update per class in it
        for c, zc in zip(present.tolist(), z[y.argsort()].split(counts[present].tolist())):
            self.outer[c].addmm_(zc.T, zc)

    def rounding_floor(self) -> float:
        """The variance that rounding the features to their dtype puts in every direction of their
        covariance, times 100 (ten units in the last place: a network's features carry several
        roundings): ``(10 eps)^2 ms (1 + sqrt(D / N))^2``, with ``ms`` the features' mean square
        (rounding is relative to a value's size, not its spread) and the last factor how far the
        largest singular value of ``N x D`` noise exceeds ``sqrt(N)`` times its entries' size.
        Directions below it are the features' rounding, not their spread: on an untrained timm
        ResNet, 13 such directions in one layer (channels that are exact linear functions of
        others, up to float32 rounding) moved ``multi_mahalanobis`` by 10% between the CPU and the
        GPU, and by 5% when the inputs moved by one part in 10^6."""
        n, d = float(self.counts.sum()), self.sums.shape[1]
        if n == 0 or d == 0 or self.shift is None:
            return 0.0
        # sum z^2 from the sums around the shift s: sum (z - s)^2 + 2 s . sum (z - s) + N s^2
        around = self.outer.diagonal(dim1=-2, dim2=-1).sum()
        squares = around + 2.0 * self.shift @ self.sums.sum(dim=0) + n * self.shift @ self.shift
        mean_square = float(squares) / (n * d)
        return (10.0 * self.eps) ** 2 * mean_square * (1.0 + math.sqrt(d / n)) ** 2


class _GaussianDetector(_ClassConditional):
    """A class-conditional detector fitted from the running class moments of the features."""

    per_class_covariance = False
    _rank_stats = (("_moments", "moments"),)

    def _begin(self, jm: Any) -> None:
        self._moments = _ClassMoments(per_class_outer=self.per_class_covariance)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._moments.add(feats, self._labels(feats, logits, y), logits.shape[1])
