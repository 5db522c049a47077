"""Small helpers every layer shares: one copy each (labels, inputs, random draws, wrappers, devices).

Private: the public entry points call these so that every one of them validates and draws the
same way.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .errors import InvalidInputError, OutOfDomainWarning

__all__ = ["same_device", "draw", "unwrap_model", "check_input", "DomainCheck", "warn_out_of_domain"]


def _canonical(device: torch.device | str | None) -> torch.device | None:
    """``cuda`` means the current CUDA device: ``torch.device("cuda")`` equals ``cuda:N`` here."""
    if device is None:
        return None
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "current_device") and mod.is_available():
            return torch.device(device.type, mod.current_device())
    return device


def same_device(a: torch.device | str | None, b: torch.device | str | None) -> bool:
    """True when ``a`` and ``b`` name the same device (``cuda`` is the current CUDA device)."""
    return _canonical(a) == _canonical(b)


def draw(fn: Callable[..., Tensor], size: Sequence[int], generator: torch.Generator | None,
         device: torch.device | str | None, **kwargs) -> Tensor:
    """``fn(size, generator=..., device=...)`` (``torch.rand``, ``randn``, ...) on ``device``.

    A generator on another device (a CPU generator driving CUDA chains) draws where it lives and
    the result is moved: seeded runs then repeat whatever the chains' device.
    """
    if generator is None or device is None or same_device(generator.device, device):
        return fn(size, generator=generator, device=device, **kwargs)
    return fn(size, generator=generator, device=generator.device, **kwargs).to(device)


# ----------------------------------------------------------------------------- wrappers
def unwrap_model(model: Any) -> Any:
    """The user's module inside ``torch.compile`` (``_orig_mod``), DataParallel, DDP and FSDP.

    Wrappers nest (``torch.compile(DDP(m))``), so they are peeled until none is left. Used to
    read a model's type and attributes; calls still go through the wrapper.
    """
    from torch import nn

    seen = 0
    while seen < 16:  # wrappers nest a few levels at most; a cycle must not hang us
        seen += 1
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            continue
        name = type(model).__name__
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)) or (
                name in ("FullyShardedDataParallel", "FSDP") and hasattr(model, "module")):
            model = model.module
            continue
        return model
    return model


# ----------------------------------------------------------------------------- inputs
def check_input(x: Any, *, dtype: torch.dtype | None = None, domain: Any = None,
                what: str = "input") -> Tensor:
    """The one input check: a floating tensor ``[B, ...]`` whose channels match ``domain``.

    Floating inputs of any precision are cast to ``dtype`` (the model's parameter dtype);
    integer, bool and complex inputs raise :class:`InvalidInputError` (scale them first). No
    host sync: only metadata is read.
    """
    if not isinstance(x, Tensor):
        raise InvalidInputError(f"expected a torch.Tensor {what}, got {type(x).__name__}")
    if not x.is_floating_point():
        rng = f" ({domain.describe()})" if domain is not None else ""
        raise InvalidInputError(
            f"expected a floating-point {what}, got dtype {x.dtype}. Convert it with x.float() "
            f"and scale it into the model's domain{rng}, e.g. x.float() / 255 for 8-bit images "
            "followed by the model's normalisation."
        )
    if x.dim() < 2:
        raise InvalidInputError(
            f"expected a batch [B, ...] with a leading batch dimension, got shape {tuple(x.shape)}; "
            "add one with x.unsqueeze(0)"
        )
    size = domain.input_size if domain is not None else None
    if size is not None and x.dim() != len(size) + 1:
        raise InvalidInputError(
            f"expected a batch of shape [B, {', '.join(map(str, size))}] (rank {len(size) + 1}), got "
            f"shape {tuple(x.shape)}" + (". Add a batch dimension with x.unsqueeze(0)."
                                         if x.dim() == len(size) else ".")
        )
    if domain is not None:
        channels = domain.channels
        if channels is not None and x.shape[1] != channels:
            raise InvalidInputError(
                f"the {what} has {x.shape[1]} channels (shape {tuple(x.shape)}) but the model's "
                f"domain has {channels} channels ({domain.describe()}); give the data {channels} "
                "channels "
                f"(e.g. x.mean(1, keepdim=True) for a grayscale model), or, if the domain is wrong, "
                "set it: wrap(model, mean=..., std=...) or wrap(model, data_range=(low, high))"
            )
    if dtype is not None and x.dtype != dtype and dtype.is_floating_point:
        x = x.to(dtype)
    return x


class DomainCheck:
    """Warns once per call site when inputs lie outside the model's domain; checks only the
    first ``batches`` it sees (each check costs one small host sync, so hot loops stay free)."""

    TOLERANCE = 0.05  # fraction of the domain's width: augmentation and data noise stay quiet

    def __init__(self, batches: int = 2) -> None:
        self.left = batches

    def __call__(self, x: Tensor, domain: Any, where: str, stacklevel: int = 2) -> None:
        """Check ``x`` if this is one of the first batches; ``stacklevel`` counts from the function
        that calls this check (2: the user's line calling that function)."""
        if self.left <= 0 or domain is None or x.numel() == 0:
            return
        self.left -= 1
        if warn_out_of_domain(x, domain, where, stacklevel=stacklevel + 1):
            self.left = 0


def warn_out_of_domain(x: Tensor, domain: Any, where: str, stacklevel: int = 2) -> bool:
    """Issue :class:`OutOfDomainWarning` when ``x`` leaves ``domain`` by more than 5% of its width.

    At most once per call site (the frame ``stacklevel`` up), whatever the data. Returns whether
    it warned. One host sync (the observed minimum and maximum), skipped at a site that warned.
    """
    import sys
    import warnings

    try:
        frame = sys._getframe(stacklevel)
        site = (frame.f_code.co_filename, frame.f_lineno)
    except ValueError:  # fewer frames than stacklevel
        site = None
    if site in _WARNED_SITES:
        return False

    with torch.no_grad():
        flat = x.detach().transpose(0, 1).reshape(x.shape[1], -1) if domain.is_per_channel \
            else x.detach().reshape(1, -1)
        lo_obs, hi_obs = flat.amin(1).float(), flat.amax(1).float()
        lo_obs, hi_obs = lo_obs.cpu().tolist(), hi_obs.cpu().tolist()
    lows, highs = domain.low, domain.high
    if len(lows) == 1:
        lows, highs = lows * len(lo_obs), highs * len(hi_obs)
    bad = [a < lo - DomainCheck.TOLERANCE * (hi - lo) or b > hi + DomainCheck.TOLERANCE * (hi - lo)
           for a, b, lo, hi in zip(lo_obs, hi_obs, lows, highs)]
    if not any(bad):
        return False
    warnings.warn(
        f"{where}: inputs range over [{min(lo_obs):.3g}, {max(hi_obs):.3g}] but the model's domain "
        f"is {domain.describe()}. Scale the data as the model expects (e.g. x / 255, then the "
        "model's mean/std normalisation), or tell jem-plugin the data's domain: "
        "wrap(model, data_range=(low, high)) or wrap(model, mean=..., std=...).",
        OutOfDomainWarning, stacklevel=stacklevel + 1)
    if site is not None:
        _WARNED_SITES.add(site)
    return True


_WARNED_SITES: set[tuple[str, int]] = set()
