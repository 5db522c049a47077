"""scikit-learn's bundled 8x8 handwritten digits, in [-1, 1]."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ...adapter import InputDomain
from ._common import _with_domain

#: Domain of the embedded digits: one channel, 8x8, values in [-1, 1].
DIGITS_DOMAIN = InputDomain.from_range(-1.0, 1.0, input_size=(1, 8, 8))
DIGITS_CLASSES = tuple(str(i) for i in range(10))


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
