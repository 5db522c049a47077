"""Small helpers every layer shares: one copy each (labels, inputs, random draws, wrappers, devices).

Private: the public entry points call these so that every one of them validates and draws the
same way.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["same_device", "draw", "follow", "autocast_cache_off"]


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


def follow(module: torch.nn.Module, device: torch.device | str | None) -> None:
    """Move ``module`` (a replay buffer) to ``device`` when its tensors live elsewhere.

    Called once per draw, so a buffer created on the CPU (lazily, or restored from a checkpoint)
    joins the chains on their first use instead of crossing the bus every iteration.
    """
    if device is None or not isinstance(module, torch.nn.Module):
        return
    t = next(module.buffers(), None)
    if t is None:
        t = next(module.parameters(), None)
    if t is not None and not same_device(t.device, device):
        module.to(device)


def autocast_cache_off(device_type: str) -> AbstractContextManager:
    """The caller's autocast with its cast cache off (a no-op context outside autocast).

    Autocast caches the low-precision copy of a leaf that requires grad. An SGLD chain is such a
    leaf, updated in place every step: with the cache on, every step after the first would see
    the cast of the chain's start (the chain would extrapolate its first gradient).
    """
    try:
        if not torch.is_autocast_enabled(device_type):
            return nullcontext()
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
