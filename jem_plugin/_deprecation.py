"""Old keyword spellings kept for one release: a ``**deprecated`` catch-all read here."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


def old_spellings(
    where: str, deprecated: Mapping[str, Any], new: Mapping[str, str], stacklevel: int = 3
) -> dict[str, Any]:
    """The old keywords in ``deprecated``, announced with one :class:`DeprecationWarning`.

    ``new`` maps every accepted old keyword to its new spelling (``{"max_abs_energy":
    "limits=GuardLimits(max_abs_energy=...)"}``); any other keyword is a ``TypeError``, as it
    would be without the catch-all. ``stacklevel`` 3 points at the caller of ``where``.
    """
    unknown = sorted(set(deprecated) - set(new))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if deprecated:
        olds = ", ".join(f"{k}=..." for k in deprecated)
        news = "; ".join(dict.fromkeys(new[k] for k in deprecated))  # each new spelling once, in order
        warnings.warn(
            f"{where}({olds}) is deprecated and goes in the next release; write {news}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return dict(deprecated)
