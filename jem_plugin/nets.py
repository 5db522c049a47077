"""Small reference networks, and the network a model file's ``--model`` spec names.

:func:`build_model` turns a spec (a built-in net here, a timm name, or ``module:factory``) into an
``nn.Module``: ``jem train`` builds its network with it, and :func:`jem_plugin.load` rebuilds a
model file's network with it, so the library reads back what the ``jem`` command writes without
importing the command.

The nets are ordinary classifiers (``model(x) -> logits``); ``jem.wrap`` makes them JEMs. Two
choices matter for energy-based training: no BatchNorm (its batch statistics differ between
data and SGLD samples, the JEM paper drops it too) and activations whose input gradient never
vanishes (LeakyReLU as in JEM's Wide-ResNet, or SiLU/ELU): SGLD follows input gradients, and
ReLU zeroes them wherever a unit is off.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from .errors import UnknownNameError

__all__ = ["DigitsCNN", "ToyMLP", "WideResNet", "build_model", "is_factory", "BUILTIN_NETS", "WRN_SPEC"]

#: The built-in networks a ``--model`` spec names, besides timm names and ``module:factory``.
BUILTIN_NETS = ("digits-cnn", "toy-mlp", "wrn28-10", "wrn-D-K")
#: ``wrn28-10``, ``wrn-16-8``: the paper's WideResNet(depth, widen_factor).
WRN_SPEC = re.compile(r"wrn-?(\d+)-(\d+)")


def _act(name: str) -> nn.Module:
    acts: dict[str, Callable[[], nn.Module]] = {
        "silu": nn.SiLU,
        "swish": nn.SiLU,
        "elu": nn.ELU,
        "gelu": nn.GELU,
        "leaky_relu": lambda: nn.LeakyReLU(0.2),
        "relu": nn.ReLU,
        "softplus": nn.Softplus,
    }
    if name not in acts:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(acts)}")
    return acts[name]()


class DigitsCNN(nn.Module):
    """A tiny CNN for ``[B, 1, 8, 8]`` digits (or any ``in_channels`` x 8 x 8 input).

    Two blocks of two 3x3 convolutions (``width`` then ``2 * width`` channels), each followed by
    2x2 pooling (8x8 -> 4x4 -> 2x2), and a linear head. No BatchNorm. LeakyReLU(0.2) as in
    JEM's Wide-ResNet by default. Measured on the digits (Adam 1e-4, 150 epochs): 0.978 test
    accuracy, against 0.94 for the same network with SiLU, average pooling and a hidden FC layer
    (which learns much more slowly at the paper's learning rate).
    """

    def __init__(
        self, num_classes: int = 10, width: int = 32, in_channels: int = 1, act: str = "leaky_relu", pool: str = "max"
    ) -> None:
        super().__init__()
        if pool not in ("max", "avg"):
            raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
        w = width
        Pool = nn.MaxPool2d if pool == "max" else nn.AvgPool2d
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1),
            _act(act),
            nn.Conv2d(w, w, 3, padding=1),
            _act(act),
            Pool(2),  # 8 -> 4
            nn.Conv2d(w, 2 * w, 3, padding=1),
            _act(act),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            _act(act),
            Pool(2),  # 4 -> 2
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 4, num_classes))
        self.num_classes = num_classes
        # the blocks' outputs in timm's convention, for the detectors that read several depths
        self.feature_info = [{"module": "features.4", "num_chs": w}, {"module": "features.9", "num_chs": 2 * w}]

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class ToyMLP(nn.Module):
    """An MLP for 2D (or any ``in_dim``) toy data: ``depth`` hidden layers of ``hidden`` units
    with Swish (SiLU) or ELU, then ``num_classes`` logits (``num_classes=1``: a plain EBM whose
    single logit is ``-E(x)``)."""

    def __init__(
        self, in_dim: int = 2, num_classes: int = 8, hidden: int = 128, depth: int = 3, act: str = "silu"
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), _act(act)]
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def _norm(kind: str | None, channels: int) -> nn.Module:
    if kind is None:
        return nn.Identity()
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"norm must be None or 'batch', got {kind!r}")


class _WideBlock(nn.Module):
    """Pre-activation wide basic block of JEM's Wide-ResNet (biased 3x3 convolutions)."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str | None, leak: float, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(norm, c_in), _norm(norm, c_out)
        self.act = nn.LeakyReLU(leak)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=stride, padding=1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = self.dropout(self.conv1(self.act(self.norm1(x))))
        out = self.conv2(self.act(self.norm2(out)))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    """The Wide-ResNet of the JEM paper (``WRN-depth-widen_factor``; the paper uses WRN-28-10).

    As in the authors' code (wgrathwohl/JEM ``wideresnet.py``): pre-activation wide basic blocks
    with biased convolutions, LeakyReLU(``leak``), no normalisation by default (``norm="batch"``
    adds BatchNorm), stages of ``16k, 32k, 64k`` channels with ``(depth - 4) / 6`` blocks each,
    global average pooling (8x8 on 32x32 inputs) and a linear head.
    """

    def __init__(
        self,
        depth: int = 28,
        widen_factor: int = 10,
        num_classes: int = 10,
        *,
        in_channels: int = 3,
        norm: str | None = None,
        leak: float = 0.2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
            raise ValueError(f"WideResNet depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, ...), got {depth!r}")
        if not isinstance(widen_factor, int) or widen_factor < 1:
            raise ValueError(f"widen_factor must be a positive int, got {widen_factor!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        _norm(norm, 1)  # validate now
        n, k = (depth - 4) // 6, widen_factor
        widths = [16, 16 * k, 32 * k, 64 * k]
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1)
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for stage, stride in zip(widths[1:], (1, 2, 2)):
            for i in range(n):
                blocks.append(_WideBlock(c_in, stage, stride if i == 0 else 1, norm, leak, dropout))
                c_in = stage
        self.blocks = nn.Sequential(*blocks)
        self.norm = _norm(norm, c_in)
        self.act = nn.LeakyReLU(leak)
        self.linear = nn.Linear(c_in, num_classes)
        self.num_classes = num_classes
        # each stage's last block in timm's convention, for the detectors that read several depths
        self.feature_info = [{"module": f"blocks.{(s + 1) * n - 1}", "num_chs": widths[s + 1]} for s in range(3)]
        self.depth, self.widen_factor = depth, widen_factor

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.norm(self.blocks(self.conv1(x))))
        return self.linear(F.adaptive_avg_pool2d(out, 1).flatten(1))


# ---------------------------------------------------------------------- the network a spec names
def is_factory(spec: str) -> bool:
    """Whether a ``--model`` spec is a ``module:factory``: building it imports that module and calls
    the factory (code outside jem-plugin), where a built-in net or a timm name runs only registered
    constructors."""
    return ":" in spec


def build_model(
    spec: str,
    num_classes: int,
    in_chans: int,
    options: dict[str, Any] | None = None,
    *,
    factory: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """An ``nn.Module`` for a ``--model`` spec: a built-in net, a timm name, or ``module:factory``.

    ``options``: constructor keywords of a built-in net (e.g. ``{"width": 16}`` for digits-cnn).
    ``wrn28-10`` / ``wrn-D-K``: the JEM paper's Wide-ResNet (depth D, widen factor K, no normalisation).
    ``module:factory`` is called as ``factory(num_classes=K)`` and must return an ``nn.Module``
    whose output is ``[batch, K]`` logits; modules in the current directory are found.
    ``factory``: the callable to use for a ``module:factory`` spec instead of importing it.

    Raises :class:`~jem_plugin.errors.UnknownNameError`, one line saying what to write instead, for
    a spec that names no network that can be built (a factory that cannot be imported keeps the
    ``ImportError``/``AttributeError`` as its ``__cause__``).
    """
    if spec == "digits-cnn":
        return DigitsCNN(num_classes=num_classes, **(options or {}))
    if spec == "toy-mlp":
        return ToyMLP(num_classes=num_classes, **(options or {}))
    wrn = WRN_SPEC.fullmatch(spec)
    if wrn:
        try:
            return WideResNet(int(wrn[1]), int(wrn[2]), num_classes, in_channels=in_chans, **(options or {}))
        except ValueError as exc:
            raise UnknownNameError(f"--model {spec}: {exc}") from exc
    if is_factory(spec):
        return _call_factory(spec, factory or _import_factory(spec), num_classes, options)
    import timm

    if not timm.is_model(spec):
        named = [n for n in BUILTIN_NETS if n != "wrn-D-K"] + timm.list_models()
        raise UnknownNameError(
            f"unknown --model {spec!r}{UnknownNameError.did_you_mean(spec, named)}: not a built-in "
            f"({', '.join(BUILTIN_NETS)}), not a timm model name (see timm.list_models()), and not a "
            "module:factory path"
        )
    return timm.create_model(spec, pretrained=False, num_classes=num_classes, in_chans=in_chans)


def _import_factory(spec: str) -> Callable[..., nn.Module]:
    if os.getcwd() not in sys.path:  # `jem train --model mynet:build` run next to mynet.py
        sys.path.insert(0, os.getcwd())
    modname, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(modname), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownNameError(
            f"cannot load --model {spec!r}: {exc} (run jem from the directory holding "
            f"{modname.replace('.', '/')}.py, or put it on PYTHONPATH)"
        ) from exc


def _call_factory(
    spec: str, factory: Callable[..., nn.Module], num_classes: int, options: dict[str, Any] | None
) -> nn.Module:
    attr = spec.partition(":")[2]
    usage = f"def {attr}(num_classes, **options): return an nn.Module giving [batch, num_classes] logits"
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and "num_classes" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise UnknownNameError(f"--model {spec!r}: {attr}() takes no num_classes argument; write it as `{usage}`")
    return factory(num_classes=num_classes, **(options or {}))
