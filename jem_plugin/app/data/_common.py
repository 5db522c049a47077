"""What the data sources share: a dataset carries its input domain and class names; draws are seeded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch.utils.data import Dataset

from ...adapter import InputDomain

_DS = TypeVar("_DS", bound=Dataset)


def _with_domain(ds: _DS, domain: InputDomain, classes: Sequence[str] | None = None) -> _DS:
    ds.domain = domain  # type: ignore[attr-defined]  # the input domain travels with the dataset
    if classes is not None:
        ds.classes = list(classes)  # type: ignore[attr-defined]  # class names on a plain dataset, as torchvision's datasets carry them
    return ds


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))
