"""The model-agnostic contract between a classifier and jem-plugin.

An :class:`Adapter` answers three questions about a user's model, whatever library built it:
where the logits are in its output, how many classes it has, and what inputs it expects
(:class:`InputDomain`: the value range of the tensors the user's data loader yields, and the
normalisation those tensors carry). Samplers initialise and clamp chains in that domain, so
SGLD works in the same space as the user's loader.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from ._checks import draw
from .errors import NoLogitsError

__all__ = ["InputDomain", "Adapter", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _as_tuple(v: float | Sequence[float]) -> tuple[float, ...]:
    if isinstance(v, (int, float)):
        return (float(v),)
    return tuple(float(a) for a in v)


@dataclass(frozen=True)
class InputDomain:
    """Value range of model inputs, per channel, in the space the user's loader yields.

    ``low``/``high`` are scalars or per-channel sequences (channel = dim 1 of the input).
    ``mean``/``std`` record the normalisation already applied to the inputs (``None`` when
    the inputs are not normalised); they let plots map samples back to ``[0, 1]`` pixels.
    """

    low: tuple[float, ...] = (-1.0,)
    high: tuple[float, ...] = (1.0,)
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    input_size: tuple[int, ...] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_range(
        cls, low: float | Sequence[float], high: float | Sequence[float], input_size=None
    ) -> "InputDomain":
        lo, hi = _as_tuple(low), _as_tuple(high)
        if len(lo) != len(hi) or any(a >= b for a, b in zip(lo, hi)):
            raise ValueError(f"data range needs low < high per channel, got {lo} and {hi}")
        return cls(low=lo, high=hi, input_size=tuple(input_size) if input_size else None)

    @classmethod
    def from_normalization(
        cls,
        mean: Sequence[float],
        std: Sequence[float],
        pixel_range: tuple[float, float] = (0.0, 1.0),
        input_size=None,
    ) -> "InputDomain":
        """Domain of images in ``pixel_range`` after ``(x - mean) / std``."""
        mean, std = _as_tuple(mean), _as_tuple(std)
        lo = tuple((pixel_range[0] - m) / s for m, s in zip(mean, std))
        hi = tuple((pixel_range[1] - m) / s for m, s in zip(mean, std))
        return cls(low=lo, high=hi, mean=mean, std=std,
                   input_size=tuple(input_size) if input_size else None)

    @property
    def is_per_channel(self) -> bool:
        return len(self.low) > 1

    def bounds(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """``(low, high)`` as tensors broadcastable against ``like`` (cached per device/dtype)."""
        key = (like.device, like.dtype, like.dim())
        if key not in self._cache:
            shape = (1, -1) + (1,) * (like.dim() - 2) if self.is_per_channel else (1,)
            lo = torch.tensor(self.low, device=like.device, dtype=like.dtype).reshape(shape)
            hi = torch.tensor(self.high, device=like.device, dtype=like.dtype).reshape(shape)
            self._cache[key] = (lo, hi)
        return self._cache[key]

    def clamp(self, x: Tensor) -> Tensor:
        """Clamp ``x`` into the domain (in place on ``x``; returns it)."""
        if self.is_per_channel:
            lo, hi = self.bounds(x)
            return x.clamp_(lo, hi)
        return x.clamp_(self.low[0], self.high[0])

    def uniform(self, n: int, shape: Sequence[int], *, generator: torch.Generator | None = None,
                device=None, dtype=torch.float32) -> Tensor:
        """``n`` samples uniform over the domain."""
        u = draw(torch.rand, (n, *shape), generator, device, dtype=dtype)
        lo, hi = self.bounds(u)
        return u.mul_(hi - lo).add_(lo)

    def to_unit(self, x: Tensor) -> Tensor:
        """Map inputs to ``[0, 1]`` pixels for display (undo normalisation, then rescale)."""
        lo, hi = self.bounds(x)
        return ((x - lo) / (hi - lo)).clamp(0, 1)


class Adapter:
    """How jem-plugin reads one model. Subclass or instantiate directly.

    Parameters
    ----------
    name: short name shown in ``repr`` and ``jem plugins``.
    domain: the :class:`InputDomain` of the model's inputs.
    num_classes: number of logits, or ``None`` when unknown until the first forward.
    logits: where the logits are in the model's output: ``None`` (the output is the logits,
        or carries a ``.logits`` attribute / ``"logits"`` key), a key or attribute name, a
        tuple index, or a callable ``output -> Tensor``.
    """

    def __init__(self, name: str, domain: InputDomain | None = None,
                 num_classes: int | None = None, logits: Any = None) -> None:
        self.name = name
        self.domain = domain or InputDomain()
        self.num_classes = num_classes
        self.logits_spec = logits

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_classes={self.num_classes}, domain={self.domain})"

    def logits(self, output: Any) -> Tensor:
        """Extract the ``[B, K]`` logits tensor from the model's raw output."""
        spec = self.logits_spec
        if isinstance(output, Tensor) and spec is None:
            return output
        try:
            if callable(spec):
                out = spec(output)
            elif isinstance(spec, int):
                out = output[spec]
            elif isinstance(spec, str):
                out = output[spec] if isinstance(output, dict) else getattr(output, spec)
            elif isinstance(output, dict) and "logits" in output:
                out = output["logits"]
            elif hasattr(output, "logits"):
                out = output.logits
            else:
                raise NoLogitsError(
                    f"the model returned {_describe(output)}, not a [B, K] logits tensor. "
                    "Tell jem-plugin where the logits are: wrap(model, logits=0) for a tuple "
                    "index, wrap(model, logits='name') for a dict key or attribute, or "
                    "wrap(model, logits=lambda out: ...)."
                )
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            raise NoLogitsError(
                f"could not read logits {spec!r} from the model's output ({_describe(output)}): {exc}. "
                "Pass wrap(model, logits=...) with a valid index, key, attribute or callable."
            ) from exc
        if not isinstance(out, Tensor):
            raise NoLogitsError(
                f"the logits selected from the model's output are {_describe(out)}, not a tensor; "
                "pass wrap(model, logits=...) pointing at the [B, K] logits tensor."
            )
        return out


def _describe(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items ({', '.join(_describe(o) for o in obj[:4])})"
    if isinstance(obj, dict):
        return f"a dict with keys {list(obj)[:8]}"
    return f"an object of type {type(obj).__name__}"


def domain_from_options(options: dict, default: InputDomain) -> InputDomain:
    """Apply the user's ``data_range`` / ``mean`` + ``std`` / ``input_size`` options to a default domain."""
    input_size = options.get("input_size", default.input_size)
    if options.get("data_range") is not None:
        lo, hi = options["data_range"]
        return InputDomain.from_range(lo, hi, input_size=input_size)
    if options.get("mean") is not None or options.get("std") is not None:
        if options.get("mean") is None or options.get("std") is None:
            raise ValueError("pass both mean= and std= (the normalisation your loader applies)")
        return InputDomain.from_normalization(options["mean"], options["std"], input_size=input_size)
    if input_size != default.input_size:
        return InputDomain(default.low, default.high, default.mean, default.std,
                           tuple(input_size) if input_size else None)
    return default


def wants(options: dict, name: str) -> bool:
    """True unless the user forced a different adapter with ``wrap(..., adapter=...)``."""
    return options.get("adapter") in (None, name)
