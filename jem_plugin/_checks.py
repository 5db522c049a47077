"""Small helpers every layer shares: one copy each (labels, inputs, random draws, wrappers, devices).

Private: the public entry points call these so that every one of them validates and draws the
same way.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from .errors import InvalidInputError, InvalidLabelError

__all__ = ["same_device", "draw", "check_labels", "check_label_range", "require_num_classes", "free_energy",
           "unpack_batch", "model_device", "INPUT_KEYS", "LABEL_KEYS", "follow", "autocast_cache_off"]

# Keys a dict batch may hold its inputs / labels under (torchvision, Hugging Face, hand-written).
INPUT_KEYS: tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values")
LABEL_KEYS: tuple[str, ...] = ("y", "label", "labels")


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


# ---------------------------------------------------------------------- labels
def check_labels(y: Any, n: int | None = None, *, num_classes: int | None = None,
                 device: torch.device | str | None = None, what: str = "labels") -> Tensor:
    """``y`` as a ``long`` tensor of ``n`` class indices (on ``device``), or :class:`InvalidLabelError`.

    Checks the dtype (integers, not floats/bools/one-hot), the shape ``[n]`` (1-D when ``n`` is
    ``None``) and, when ``num_classes`` is known, the range ``[0, num_classes)`` (one host sync).
    """
    if not isinstance(y, Tensor):
        try:
            y = torch.as_tensor(y)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidLabelError(f"{what} must be a tensor of integer class indices, got "
                                    f"{type(y).__name__}") from exc
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
        raise InvalidLabelError(f"{what} must be integer class indices, got dtype {y.dtype}; use y.long()"
                                " (for one-hot labels, y.argmax(1)).")
    if (n is not None and tuple(y.shape) != (n,)) or (n is None and y.dim() != 1):
        want = f"[{n}]" if n is not None else "[N] (1-D)"
        raise InvalidLabelError(f"expected {what} of shape {want}, got {tuple(y.shape)}")
    y = y.to(device=device if device is not None else y.device, dtype=torch.long)
    if num_classes is not None:
        check_label_range(y, num_classes, what=what)
    return y


def check_label_range(y: Tensor, num_classes: int, *, what: str = "labels") -> None:
    """:class:`InvalidLabelError` unless every value of ``y`` lies in ``[0, num_classes)`` (one host sync)."""
    if not y.numel():
        return
    lo, hi = torch.stack(list(torch.aminmax(y))).tolist()  # one transfer for both bounds
    if lo < 0 or hi >= num_classes:
        raise InvalidLabelError(f"{what} must lie in [0, {num_classes}) for {num_classes} classes; got "
                                f"values from {lo} to {hi}")


def require_num_classes(jm: Any, why: str) -> int:
    """``jm.num_classes``, or an error asking for ``wrap(model, num_classes=K)`` when it is unknown."""
    k = getattr(jm, "num_classes", None)
    if k is None:
        raise InvalidLabelError(f"{why} needs the number of classes, which is not known for this model; "
                                "pass it when wrapping: jem_plugin.wrap(model, num_classes=K)")
    return int(k)


# ---------------------------------------------------------------------- energies
def free_energy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Free energy ``E(x) = -T * logsumexp(f(x) / T)`` per row (``[B]``); JEM's ``E(x)`` at ``T = 1``."""
    if temperature == 1.0:
        return -torch.logsumexp(logits, dim=1)
    return -temperature * torch.logsumexp(logits / temperature, dim=1)


# ---------------------------------------------------------------------- batches and devices
def _keys(key: str | Sequence[str]) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def unpack_batch(batch: Any, *, input_key: str | Sequence[str] = INPUT_KEYS,
                 label_key: str | Sequence[str] = LABEL_KEYS,
                 need_labels: bool = False) -> tuple[Tensor, Tensor | None]:
    """``(x, y)`` of one loader item: a tensor (``y`` is ``None``), ``(x, y, ...)``, or a dict.

    A dict holds the inputs under the first of ``input_key`` present and the labels under the
    first of ``label_key``; pass a name (or names) to read other keys. ``need_labels=True`` makes
    a batch without labels an error.
    """
    x = y = None
    if isinstance(batch, Tensor):
        x = batch
    elif isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        x = batch[0]
        y = batch[1] if len(batch) > 1 else None
    elif isinstance(batch, Mapping):
        x = next((batch[k] for k in _keys(input_key) if isinstance(batch.get(k), Tensor)), None)
        y = next((batch[k] for k in _keys(label_key) if batch.get(k) is not None), None)
    if x is None:
        raise InvalidInputError(
            f"cannot find the input tensor in a batch of type {type(batch).__name__}; the data must be a "
            "tensor, or an iterable (e.g. a DataLoader) yielding tensors, (x, y) tuples or dicts with "
            f"an input key ({', '.join(map(repr, _keys(input_key)))})"
        )
    if need_labels and y is None:
        raise InvalidLabelError(
            f"this batch ({type(batch).__name__}) holds no labels; yield (x, y) pairs or dicts with a "
            f"label key ({', '.join(map(repr, _keys(label_key)))})"
        )
    return x, y


def model_device(module: nn.Module, default: torch.device | str | None = None) -> torch.device | None:
    """The device of ``module``'s first parameter (or buffer); ``default`` for a stateless module."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device(default) if default is not None else None
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
