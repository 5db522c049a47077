"""A classifier the user trained elsewhere, for ``jem ood --model SPEC --weights FILE``.

The network is built from its ``--model`` spec as ``jem train`` builds one (a timm name, a
``module:factory`` such as ``torchvision.models:resnet18``, a built-in net), its weights read from
a state-dict file (``weights_only``: no code runs), and it is wrapped with the normalisation its
adapter knows (timm's pretrained mean/std, ImageNet's for torchvision, ``[-1, 1]`` otherwise) or
the one given by ``--mean``/``--std``. The result is the same ``(jm, spec)`` pair a ``jem train``
model file gives, so the rest of ``jem ood`` reads both alike: the spec's ``mean``/``std`` tell the
data loaders how to normalise the images.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import wrap
from ..adapter import InputDomain
from ..nets import build_model
from . import CLIError
from .model_files import model_spec
from .openood import BENCHMARKS

#: Where a training script's checkpoint keeps the weights when the file is not the state dict
#: itself (timm's train.py, Lightning, most hand-written loops).
STATE_KEYS = ("state_dict", "model_state_dict", "model", "net", "state_dict_ema")
#: Name prefixes a wrapped model adds to every key: DDP / DataParallel, torch.compile, Lightning.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")


def read_state_dict(path: str) -> dict[str, Tensor]:
    """The weights in ``path``: a state dict, or one under a training checkpoint's usual key. One
    line for a missing file or one that needs code to load."""
    if not Path(path).is_file():
        raise CLIError(f"--weights {path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        why = (
            "it holds objects that need code to load (a pickled model or class), not tensors alone"
            if "Unsupported global" in str(exc)
            else "it is not a file of torch.save"
        )
        raise CLIError(
            f"--weights {path} cannot be read as weights: {why}; save them with torch.save(model.state_dict(), path)"
        ) from exc
    state = obj
    if isinstance(obj, dict) and not _is_state(obj):
        state = next((obj[k] for k in STATE_KEYS if isinstance(obj.get(k), dict) and _is_state(obj[k])), None)
    if not isinstance(state, dict) or not _is_state(state):
        keys = ", ".join(list(obj)[:6]) if isinstance(obj, dict) else type(obj).__name__
        raise CLIError(
            f"--weights {path} holds no state dict (found: {keys}); save the weights with "
            "torch.save(model.state_dict(), path)"
        )
    return state


def load_weights(net: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """``net.load_state_dict(state)``, strictly; where the keys do not fit, again without a
    wrapper's prefix that every key carries (``module.`` of DDP, ``_orig_mod.`` of torch.compile,
    ``model.`` of a Lightning module). Raises the first attempt's error when none fits."""
    first: RuntimeError | None = None
    for prefix in ("", *WRAPPER_PREFIXES):
        if prefix and not all(k.startswith(prefix) for k in state):
            continue
        try:
            net.load_state_dict({k[len(prefix) :]: v for k, v in state.items()})
            return
        except RuntimeError as exc:
            first = first or exc
    assert first is not None
    raise first


def _is_state(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in d.items())


def data_classes(data: str) -> list[str] | None:
    """A folder's class names without reading its images: torchvision's ``find_classes``, which
    ``ImageFolder`` labels by; ``None`` for other specs and folders without class sub-folders."""
    from torchvision.datasets.folder import find_classes

    kind, _, arg = data.partition(":")
    if kind != "folder" or not arg or not Path(arg).expanduser().is_dir():
        return None
    try:
        return find_classes(Path(arg).expanduser())[0]
    except FileNotFoundError:
        return None


def pixel_normalisation(domain: InputDomain) -> tuple[list[float], list[float]]:
    """``(mean, std)`` that maps ``[0, 1]`` pixels into ``domain``: its own normalisation, or for a
    range ``[low, high]`` the affine map onto it (``[-1, 1]``: 0.5, 0.5)."""
    if domain.mean is not None and domain.std is not None:
        return list(domain.mean), list(domain.std)
    low, high = list(domain.low), list(domain.high)
    if len(low) == 1:
        low, high = low * 3, high * 3
    return [-lo / (hi - lo) for lo, hi in zip(low, high)], [1.0 / (hi - lo) for lo, hi in zip(low, high)]


def load_user_model(
    model: str,
    weights: str,
    data: str | None,
    *,
    openood_benchmark: str | None = None,
    num_classes: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    image_size: int | None = None,
    device: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """``(jm, spec)`` for the user's own classifier: ``model`` built with ``num_classes`` (default:
    the class count of ``data``, or of the OpenOOD benchmark), ``weights`` loaded strictly, wrapped
    with ``mean``/``std`` or its adapter's normalisation, in eval mode. Its log p(x) is taken as
    untrained (a cross-entropy model): the JEM-only scores warn."""
    if (mean is None) != (std is None):  # before the weights file is read: a mistake costs nothing
        raise CLIError("give both --mean and --std (the normalisation your training applied)")
    if openood_benchmark:
        data, classes = f"openood:{openood_benchmark}", None
        k = num_classes or BENCHMARKS[openood_benchmark].num_classes
        image_size = image_size or (32 if openood_benchmark.startswith("cifar") else None)
    else:
        if not data or not data.startswith(("folder:", "cifar10:")):
            raise CLIError(
                "--model/--weights score your own classifier on images: give --data folder:PATH (its test "
                "images, one sub-folder per class), --data cifar10:PATH or --openood ROOT"
            )
        classes = data_classes(data)
        count = 10 if data.startswith("cifar10:") else len(classes or ())
        if not (num_classes or count):
            raise CLIError(f"--data {data} holds no class folders to count: give --num-classes K")
        k = num_classes or count
    state = read_state_dict(weights)
    net = build_model(model, k, in_chans=3)
    try:
        load_weights(net, state)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = "; ".join(lines[1:3]) or lines[0]
        hint = (
            ""
            if num_classes
            else f" (built for {k} classes, the folders of --data; --num-classes K if it has another count)"
        )
        raise CLIError(f"--weights {weights} do not fit --model {model}{hint}: {detail[:300]}") from exc
    if not image_size and data.startswith("cifar10:"):
        image_size = 32
    # the size the adapter reads off the model (timm's config, a ViT's patch embedding), else 224
    said = wrap(net).domain.input_size
    size = image_size or (int(said[-1]) if said else 224)
    options: dict[str, Any] = {"input_size": (3, size, size)}
    if mean is not None and std is not None:
        options.update(mean=tuple(mean), std=tuple(std))
    try:
        jm = wrap(net, **options)
    except (ValueError, TypeError) as exc:
        raise CLIError(f"--mean/--std: {exc}") from exc
    jm.trained_px = False
    pixel_mean, pixel_std = pixel_normalisation(jm.domain)
    domain = InputDomain.from_normalization(pixel_mean, pixel_std, input_size=(3, size, size))
    spec = model_spec(model, data, k, (3, size, size), domain)
    # the data's class names where they are the model's; else none (a subset of its classes)
    spec["classes"] = classes if classes and len(classes) == k else None
    spec["weights"] = str(weights)
    if device is not None:
        jm.to(device)
    return jm.eval(), spec
