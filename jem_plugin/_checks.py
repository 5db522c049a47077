"""Small helpers every layer shares: one copy each (labels, inputs, random draws, wrappers, devices).

Private: the public entry points call these so that every one of them validates and draws the
same way.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import FrameType
from typing import Any, Literal, Protocol, overload, runtime_checkable

import torch
from torch import Tensor, nn

from .errors import DeviceChangeWarning, InvalidInputError, InvalidLabelError, OutOfDomainWarning

__all__ = [
    "same_device",
    "draw",
    "check_labels",
    "check_label_range",
    "check_count",
    "check_positive",
    "require_num_classes",
    "free_energy",
    "unpack_batch",
    "model_device",
    "INPUT_KEYS",
    "LABEL_KEYS",
    "follow",
    "autocast_cache_off",
    "unwrap_model",
    "unwrap_parallel",
    "check_input",
    "DomainCheck",
    "warn_out_of_domain",
    "user_stacklevel",
]

# Keys a dict batch may hold its inputs / labels under (torchvision, Hugging Face, hand-written).
INPUT_KEYS: tuple[str, ...] = ("x", "input", "inputs", "image", "images", "pixel_values")
LABEL_KEYS: tuple[str, ...] = ("y", "label", "labels")


def _canonical(device: torch.device | str | None) -> torch.device | None:
    """``cuda`` means the current CUDA device: ``torch.device("cuda")`` equals ``cuda:N`` here."""
    if device is None:
        return None
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        mod = getattr(torch, device.type, None)  # torch's backend module (torch.cuda, torch.xpu, ...), if any
        if mod is not None and hasattr(mod, "current_device") and mod.is_available():
            return torch.device(device.type, mod.current_device())
    return device


def same_device(a: torch.device | str | None, b: torch.device | str | None) -> bool:
    """True when ``a`` and ``b`` name the same device (``cuda`` is the current CUDA device)."""
    return _canonical(a) == _canonical(b)


def draw(
    fn: Callable[..., Tensor],
    size: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device | str | None,
    **kwargs,
) -> Tensor:
    """``fn(size, generator=..., device=...)`` (``torch.rand``, ``randn``, ...) on ``device``.

    A generator on another device (a CPU generator driving CUDA chains) draws where it lives and
    the result is moved: seeded runs then repeat whatever the chains' device.
    """
    if generator is None or device is None or same_device(generator.device, device):
        return fn(size, generator=generator, device=device, **kwargs)
    return fn(size, generator=generator, device=generator.device, **kwargs).to(device)


def generator_on(device: torch.device | str | None, generator: torch.Generator, seed: int) -> torch.Generator:
    """``generator`` where it lives on ``device`` (or ``device`` is unknown: ``None``), else a new
    one there seeded with ``seed``.

    SGLD draws its noise where its chain runs, at every step (no copy per step), and refuses a
    generator on another device; a command that seeds one CPU generator for its data draws gives
    its chains this one instead.
    """
    if device is None or same_device(generator.device, device):
        return generator
    return torch.Generator(device=device).manual_seed(seed)


def restore_generator(
    current: torch.Generator | None, state: Tensor, saved_device: str | None, owner: str
) -> torch.Generator:
    """The generator a checkpoint's ``state`` (saved from a generator on ``saved_device``) restores
    into: ``current`` where there is one, else a new one on ``saved_device`` (on the CPU when
    that device is not present here). Across kinds of device (CUDA and CPU generators keep
    different states) it is seeded from ``state`` instead, with a :class:`DeviceChangeWarning`
    naming ``owner``: the run goes on, reproducibly, but not bit for bit."""
    saved = torch.device(saved_device or "cpu")
    if current is None:
        is_available = getattr(getattr(torch, saved.type, None), "is_available", None)  # torch.cuda, torch.mps, ...
        present = saved.type == "cpu" or (callable(is_available) and bool(is_available()))
        current = torch.Generator(device=saved if present else "cpu")
    if current.device.type == saved.type:
        current.set_state(state)
        return current
    seed = int.from_bytes(hashlib.sha256(state.cpu().numpy().tobytes()).digest()[:8], "little") >> 1
    current.manual_seed(seed)
    warnings.warn(
        f"{owner}: the checkpoint's generator ran on {saved}, this one is on {current.device}: it is seeded "
        f"from the saved state instead, so the run goes on, but not bit for bit as on {saved.type}",
        DeviceChangeWarning,
        stacklevel=3,
    )
    return current


# ---------------------------------------------------------------------- labels
def check_labels(
    y: Any,
    n: int | None = None,
    *,
    num_classes: int | None = None,
    device: torch.device | str | None = None,
    what: str = "labels",
) -> Tensor:
    """``y`` as a ``long`` tensor of ``n`` class indices (on ``device``), or :class:`InvalidLabelError`.

    Checks the dtype (integers, not floats/bools/one-hot), the shape ``[n]`` (1-D when ``n`` is
    ``None``) and, when ``num_classes`` is known, the range ``[0, num_classes)`` (one host sync).
    """
    if not isinstance(y, Tensor):
        try:
            y = torch.as_tensor(y)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidLabelError(
                f"{what} must be a tensor of integer class indices, got {type(y).__name__}"
            ) from exc
    if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
        raise InvalidLabelError(
            f"{what} must be integer class indices, got dtype {y.dtype}; use y.long()"
            " (for one-hot labels, y.argmax(1))."
        )
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
        raise InvalidLabelError(
            f"{what} must lie in [0, {num_classes}) for {num_classes} classes; got values from {lo} to {hi}"
        )


def check_count(name: str, v: Any, low: int) -> int:
    """``v`` if it is an int (not a bool) ``>= low``, else a one-line ``ValueError``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


def check_positive(name: str, v: Any, *, allow_zero: bool = False, allow_inf: bool = False) -> float:
    """``v`` as a float ``> 0`` (``>= 0`` with ``allow_zero``) and finite (unless ``allow_inf``),
    else a one-line ``TypeError`` (not a number) or ``ValueError``."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}") from None
    if math.isnan(f) or f < 0 or (f == 0 and not allow_zero) or (math.isinf(f) and not allow_inf):
        raise ValueError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'}{'' if allow_inf else ' and finite'}, got {v!r}"
        )
    return f


@runtime_checkable
class _KnowsClasses(Protocol):
    """A :class:`~jem_plugin.model.JEM` as far as the class count goes (``model`` imports this module)."""

    num_classes: int | None


def require_num_classes(jm: Any, why: str) -> int:
    """``jm.num_classes``, or an error asking for ``wrap(model, num_classes=K)`` when it is unknown."""
    k = jm.num_classes if isinstance(jm, _KnowsClasses) else None
    if k is None:
        raise InvalidLabelError(
            f"{why} needs the number of classes, which is not known for this model; "
            "pass it when wrapping: jem_plugin.wrap(model, num_classes=K)"
        )
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


@overload
def unpack_batch(
    batch: Any,
    *,
    input_key: str | Sequence[str] = ...,
    label_key: str | Sequence[str] = ...,
    need_labels: Literal[True],
) -> tuple[Tensor, Tensor]: ...


@overload
def unpack_batch(
    batch: Any,
    *,
    input_key: str | Sequence[str] = ...,
    label_key: str | Sequence[str] = ...,
    need_labels: bool = ...,
) -> tuple[Tensor, Tensor | None]: ...


def unpack_batch(
    batch: Any,
    *,
    input_key: str | Sequence[str] = INPUT_KEYS,
    label_key: str | Sequence[str] = LABEL_KEYS,
    need_labels: bool = False,
) -> tuple[Tensor, Tensor | None]:
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
            f"an input key ({', '.join(map(repr, _keys(input_key)))}; name yours with input_key=...)"
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
    for b in module.buffers():
        return b.device
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


# ----------------------------------------------------------------------------- wrappers
def unwrap_parallel(module: Any) -> Any:
    """The module under DDP / ``DataParallel`` wrappers (any depth); other objects unchanged.

    Unlike :func:`unwrap_model`, a compiled module stays compiled (its checkpoint keys keep
    their ``_orig_mod.`` prefix): what DDP training samples and saves through.
    """
    while isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        module = module.module
    return module


def unwrap_model(model: Any) -> Any:
    """The user's module inside ``torch.compile`` (``_orig_mod``), DataParallel, DDP and FSDP.

    Wrappers nest (``torch.compile(DDP(m))``), so they are peeled until none is left. Used to
    read a model's type and attributes; calls still go through the wrapper.
    """
    seen = 0
    while seen < 16:  # wrappers nest a few levels at most; a cycle must not hang us
        seen += 1
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = unwrap_parallel(model)
        if inner is model and type(model).__name__ in ("FullyShardedDataParallel", "FSDP") and hasattr(model, "module"):
            inner = model.module
        if inner is model:
            return model
        model = inner
    return model


# ----------------------------------------------------------------------------- inputs
def check_input(x: Any, *, dtype: torch.dtype | None = None, domain: Any = None, what: str = "input") -> Tensor:
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
            f"shape {tuple(x.shape)}"
            + (". Add a batch dimension with x.unsqueeze(0)." if x.dim() == len(size) else ".")
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
        if self.left <= 0 or domain is None or x.numel() == 0 or x.is_meta:
            return
        self.left -= 1
        if warn_out_of_domain(x, domain, where, stacklevel=stacklevel + 1):
            self.left = 0


def warn_out_of_domain(x: Tensor, domain: Any, where: str, stacklevel: int = 2) -> bool:
    """Issue :class:`OutOfDomainWarning` when ``x`` leaves ``domain`` by more than 5% of its width.

    At most once per call site (the frame ``stacklevel`` up), whatever the data. Returns whether
    it warned. One host sync (the observed minimum and maximum), skipped at a site that warned.
    """
    try:
        frame = sys._getframe(stacklevel)
        site = (frame.f_code.co_filename, frame.f_lineno)
    except ValueError:  # fewer frames than stacklevel
        site = None
    if site in _WARNED_SITES:
        return False

    with torch.no_grad():  # reduced in place over every dimension but the channels' (no copy of x)
        xd = x.detach()
        dims = [0, *range(2, x.dim())] if domain.is_per_channel else list(range(x.dim()))
        lo_obs: list[float] = xd.amin(dim=dims).reshape(-1).float().cpu().tolist()
        hi_obs: list[float] = xd.amax(dim=dims).reshape(-1).float().cpu().tolist()
    lows, highs = domain.low, domain.high
    if len(lows) == 1:
        lows, highs = lows * len(lo_obs), highs * len(hi_obs)
    bad = [
        a < lo - DomainCheck.TOLERANCE * (hi - lo) or b > hi + DomainCheck.TOLERANCE * (hi - lo)
        for a, b, lo, hi in zip(lo_obs, hi_obs, lows, highs)
    ]
    if not any(bad):
        return False
    warnings.warn(
        f"{where}: inputs range over [{min(lo_obs):.3g}, {max(hi_obs):.3g}] but the model's domain "
        f"is {domain.describe()}. Scale the data as the model expects (e.g. x / 255, then the "
        "model's mean/std normalisation), or tell jem-plugin the data's domain: "
        "wrap(model, data_range=(low, high)) or wrap(model, mean=..., std=...).",
        OutOfDomainWarning,
        stacklevel=stacklevel + 1,
    )
    if site is not None:
        _WARNED_SITES.add(site)
    return True


_WARNED_SITES: set[tuple[str, int]] = set()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised here at the first caller outside
    jem-plugin (the user's line), however deep in the package the warning is raised."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level
