"""Typed choices of a replay buffer's init distribution: what a chain starts from.

``ReplayBuffer(init=Gaussian(covariance=Stationary()), num_classes=K)`` names the distribution
and its options as one frozen value, printable and stored as plain data in a checkpoint. Each
spec names a distribution registered through the ``jem_register_init_distributions`` hook
(``kind``) and the keyword arguments its factory takes (:func:`init_options`); a third party's
distribution is still chosen by its registered name, ``ReplayBuffer(init="mine")``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from .covariance import COVARIANCE_KINDS, Covariance, Diagonal

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor

    from .adapter import InputDomain

__all__ = [
    "Uniform",
    "Gaussian",
    "Normal",
    "InitSpec",
    "INIT_SPECS",
    "InitDistribution",
    "FittedFromData",
    "PoolsMissingClasses",
    "init_options",
    "init_spec_to_dict",
    "init_spec_from_dict",
]


@dataclass(frozen=True)
class Uniform:
    """Uniform over the model's input domain (JEM)."""

    kind: ClassVar[str] = "uniform"


@dataclass(frozen=True)
class Gaussian:
    """A per-class Gaussian fitted from the data (JEM++): ``covariance`` is one of
    :class:`~jem_plugin.covariance.Diagonal`, ``Full``, ``LowRank(rank, residual)``, ``Stationary``;
    ``jitter`` is added to the variances; ``scale`` multiplies the standard deviations of draws;
    ``coarse``: the share of draws that are coarse images instead (images only: constant or
    low-resolution greys and colours, upsampled; :func:`~jem_plugin.builtins.init_distributions.coarse_images`),
    so that chains also start at the simple inputs a likelihood may rate above the data."""

    covariance: Covariance = field(default_factory=Diagonal)
    jitter: float = 1e-4
    scale: float = 1.0
    coarse: float = field(
        default=0.0,
        metadata={
            "help": "share of chain starts that are coarse images (constant or low-resolution greys and colours) "
            "instead of Gaussian draws: chains that also visit the simple inputs a likelihood may favour"
        },
    )
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        if not isinstance(self.covariance, tuple(COVARIANCE_KINDS.values())):
            raise TypeError(
                f"Gaussian covariance must be Diagonal(), Full(), LowRank(rank, residual) or Stationary() "
                f"from jem_plugin.covariance, got {self.covariance!r}"
            )
        for name in ("jitter", "scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Gaussian {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.coarse, (int, float)) and not isinstance(self.coarse, bool) and 0 <= self.coarse <= 1):
            raise ValueError(f"Gaussian coarse is a share in [0, 1], got {self.coarse!r}")


@dataclass(frozen=True)
class Normal:
    """``N(mean, std^2)`` per input value, clamped to the domain."""

    mean: float = 0.0
    std: float = 1.0
    kind: ClassVar[str] = "normal"


InitSpec = Uniform | Gaussian | Normal
INIT_SPECS: dict[str, type] = {c.kind: c for c in (Uniform, Gaussian, Normal)}


# ---------------------------------------------------------------- what a distribution object offers
@runtime_checkable
class InitDistribution(Protocol):
    """What a replay buffer draws chain starts from (the object a registered factory returns)."""

    def sample(
        self,
        n: int,
        shape: Sequence[int],
        domain: InputDomain,
        generator: torch.Generator | None = None,
        device: Any = None,
        y: Tensor | None = None,
    ) -> Tensor: ...


@runtime_checkable
class FittedFromData(Protocol):
    """An init distribution fitted from data (``fit(x, y)``) that says whether it has been
    (``fitted``): a buffer whose init says ``False`` cannot draw yet (the per-class Gaussian)."""

    @property
    def fitted(self) -> bool: ...

    def fit(self, x: Tensor, y: Tensor, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class PoolsMissingClasses(Protocol):
    """An init whose ``fit(..., pool_missing=True)`` gives the classes without examples the
    distribution of all examples, declared by ``pools_missing_classes = True`` (the per-class
    Gaussian does; for others, :meth:`ReplayBuffer.fit(missing_classes="pool")
    <jem_plugin.buffer.ReplayBuffer.fit>` fits one copy of the examples per missing class)."""

    pools_missing_classes: bool

    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None, *, pool_missing: bool = False) -> Any: ...


def init_options(spec: InitSpec) -> tuple[str, dict[str, Any]]:
    """The registered name of ``spec``'s distribution and the keyword arguments of its factory."""
    return spec.kind, {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value).kind  # type: ignore[attr-defined]  # every spec and covariance class has one
        return {"kind": kind, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return value


def init_spec_to_dict(spec: InitSpec) -> dict[str, Any]:
    """``spec`` as plain data (``{"kind": "gaussian", "covariance": {"kind": "lowrank", ...}}``)."""
    return _plain(spec)


def init_spec_from_dict(data: dict[str, Any]) -> InitSpec:
    """The spec :func:`init_spec_to_dict` wrote."""
    data = dict(data)
    cls = INIT_SPECS[data.pop("kind")]
    if "covariance" in data and isinstance(data["covariance"], dict):
        cov = dict(data["covariance"])
        data["covariance"] = COVARIANCE_KINDS[cov.pop("kind")](**cov)
    return cls(**data)
