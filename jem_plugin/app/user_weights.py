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
from ..nets import build_model, is_factory
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


#: Where a training checkpoint may record its input size: top-level keys, or under its hyper-parameters.
SIZE_KEYS = ("image_size", "img_size", "input_size")
HPARAM_KEYS = ("args", "hparams", "hyper_parameters", "config", "cfg")


def _as_size(value: Any) -> int | None:
    """An image size as a checkpoint may write it: 32, [32, 32], (3, 32, 32), tensor(32)."""
    if isinstance(value, Tensor) and value.numel() <= 3:
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        value = value[-1]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def stored_size(path: str) -> tuple[int, str] | None:
    """``(size, where)``: the input size a training checkpoint records beside its weights (a key
    of :data:`SIZE_KEYS`, at its top level or under one of :data:`HPARAM_KEYS`), or None. Read
    ``weights_only`` (memory-mapped where the format allows), as the weights were."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # an old-format file (no mmap) or anything else: read it plainly, or say nothing
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # read_state_dict already read it; a size it cannot find is no error
            return None
    if not isinstance(obj, dict):
        return None
    for holder_key in (None, *HPARAM_KEYS):
        holder = obj if holder_key is None else obj.get(holder_key)
        if not isinstance(holder, dict):
            continue
        for key in SIZE_KEYS:
            size = _as_size(holder.get(key))
            if size is not None:
                return size, f"the weights file's {key}" if holder_key is None else f"its {holder_key}['{key}']"
    return None


def pos_embed_size(state: dict[str, Tensor], net: torch.nn.Module) -> int | None:
    """The square input size a ViT's weights were trained at: the grid of their positional
    embedding (``pos_embed``, less the class/register tokens it holds) times the network's patch
    size; None for weights without one, or a network without a patch embedding."""
    patch = getattr(getattr(net, "patch_embed", None), "patch_size", None)
    embed = next((v for k, v in state.items() if k.rsplit(".", 1)[-1] == "pos_embed"), None)
    if patch is None or embed is None or embed.dim() != 3:
        return None
    prefix = 0 if getattr(net, "no_embed_class", False) else int(getattr(net, "num_prefix_tokens", 1))
    cells = int(embed.shape[1]) - prefix
    grid = round(cells**0.5)
    if grid < 1 or grid * grid != cells:
        return None
    return grid * int(patch[0] if isinstance(patch, (tuple, list)) else patch)


def _numbers(values: Sequence[float]) -> str:
    return ",".join(f"{v:.4g}" for v in values)


def assumed_line(weights: str, size: int, size_from: str, domain: InputDomain, norm_from: str) -> str:
    """The one line ``--weights`` says: the input size, mean, std and range it assumed, and where
    each came from, and how to give others."""
    mean, std = pixel_normalisation(domain)
    low, high = min(domain.low), max(domain.high)
    return (
        f"jem: --weights {weights}: inputs {size}x{size} ({size_from}), mean {_numbers(mean)} and std "
        f"{_numbers(std)} ({norm_from}), so [0, 1] pixels become [{low:.3g}, {high:.3g}]; if it was trained "
        "otherwise, give --image-size, --mean and --std"
    )


def _norm_source(adapter: str, flags: bool) -> str:
    if flags:
        return "--mean/--std"
    return {
        "timm": "timm's pretrained config",
        "torchvision": "torchvision's ImageNet normalisation",
    }.get(adapter, "the default, [-1, 1] pixels")


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
    image_size_from_benchmark: int | None = None
    if openood_benchmark:
        data, classes = f"openood:{openood_benchmark}", None
        k = num_classes or BENCHMARKS[openood_benchmark].num_classes
        image_size_from_benchmark = 32 if openood_benchmark.startswith("cifar") else None
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
    # the size the weights were trained at, where they say it: a ViT's positional embedding, a size
    # stored in the file; a timm ViT built at another size is built again at theirs
    trained: tuple[int, str] | None = None
    grid = pos_embed_size(state, net)
    if grid is not None:
        trained = grid, "the weights' positional embedding"
        built = (wrap(net).domain.input_size or (0,))[-1]
        if grid != built and not is_factory(model):
            import timm

            if timm.is_model(model):
                net = timm.create_model(model, pretrained=False, num_classes=k, in_chans=3, img_size=grid)
    else:
        trained = stored_size(weights)
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
        if grid is not None and grid != (wrap(net).domain.input_size or (0,))[-1]:
            hint += f" (their positional embedding is for {grid}x{grid} inputs: build the network at that size)"
        raise CLIError(f"--weights {weights} do not fit --model {model}{hint}: {detail[:300]}") from exc
    probe = wrap(net)
    said = probe.domain.input_size
    size_from = "--image-size"
    if not image_size:
        if openood_benchmark and image_size_from_benchmark:
            image_size, size_from = image_size_from_benchmark, f"OpenOOD {openood_benchmark}'s size"
        elif data.startswith("cifar10:"):
            image_size, size_from = 32, "CIFAR-10's size"
    if image_size and trained and trained[0] != image_size:
        if grid is not None:  # a ViT runs at its embedding's size only
            raise CLIError(
                f"--weights {weights} were trained at {grid}x{grid} ({trained[1]}), not {size_from} "
                f"{image_size}: give --image-size {grid}"
            )
        size_from += f"; {trained[1]} says {trained[0]}"
    if image_size:
        size = image_size
    elif trained:
        size, size_from = trained
    elif said:  # the size the adapter reads off the model (timm's config, a ViT's patch embedding)
        size, size_from = int(said[-1]), ("timm's pretrained config" if probe.adapter.name == "timm" else "the model's")
    else:
        size, size_from = 224, "the default"
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
    spec["assumed"] = assumed_line(weights, size, size_from, jm.domain, _norm_source(jm.adapter.name, mean is not None))
    if device is not None:
        jm.to(device)
    return jm.eval(), spec
