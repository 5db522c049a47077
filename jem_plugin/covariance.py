"""The covariance of a per-class Gaussian init distribution, as a typed choice.

``ReplayBuffer(init=Gaussian(covariance=LowRank(rank=8)))``: one frozen value per kind, with
its own options, stored as plain data in a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["Covariance", "Diagonal", "Full", "LowRank", "Stationary", "COVARIANCE_KINDS"]


@dataclass(frozen=True)
class Diagonal:
    """One variance per input value and class: cheap at any input size."""

    kind: ClassVar[str] = "diagonal"


@dataclass(frozen=True)
class Full:
    """A ``D x D`` covariance per class (JEM++); up to about 3x58x58 inputs."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True)
class LowRank:
    """``rank`` principal directions per class, the rest of the variance (times ``residual``) as
    isotropic noise: any input size."""

    rank: int = 32
    residual: float = 1.0
    kind: ClassVar[str] = "lowrank"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LowRank rank must be a positive int, got {self.rank!r}")
        if not (isinstance(self.residual, (int, float)) and 0 <= self.residual <= 1):
            raise ValueError(f"LowRank residual must be a number in [0, 1], got {self.residual!r}")


@dataclass(frozen=True)
class Stationary:
    """Images ``[C, H, W]`` only: each class's power spectrum (a translation-invariant
    covariance, diagonal in the Fourier basis), any image size."""

    kind: ClassVar[str] = "stationary"


Covariance = Diagonal | Full | LowRank | Stationary

COVARIANCE_KINDS: dict[str, type] = {c.kind: c for c in (Diagonal, Full, LowRank, Stationary)}
