"""The model-agnostic contract between a classifier and jem-plugin.

An :class:`Adapter` answers three questions about a user's model, whatever library built it:
where the logits are in its output, how many classes it has, and what inputs it expects
(:class:`InputDomain`: the value range of the tensors the user's data loader yields, and the
normalisation those tensors carry). Samplers initialise and clamp chains in that domain, so
SGLD works in the same space as the user's loader.

An adapter also reads the model's penultimate features next to its logits, in one forward
(:meth:`Adapter.features`), for the feature-space OOD detectors
(:mod:`jem_plugin.builtins.posthoc`): by default the input of the model's last ``nn.Linear``,
caught with a forward hook; the timm and Hugging Face adapters refine that, and a third-party
adapter may override :meth:`Adapter.features` and :meth:`Adapter.head`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ._checks import draw, unwrap_model
from .errors import InvalidInputError, NoFeaturesError, NoLogitsError

__all__ = ["InputDomain", "Preprocess", "Adapter", "IMAGENET_MEAN", "IMAGENET_STD", "WRAP_OPTIONS"]

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
    def from_range(cls, low: float | Sequence[float], high: float | Sequence[float], input_size=None) -> InputDomain:
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
    ) -> InputDomain:
        """Domain of images in ``pixel_range`` after ``(x - mean) / std``."""
        mean, std = _as_tuple(mean), _as_tuple(std)
        lo = tuple((pixel_range[0] - m) / s for m, s in zip(mean, std))
        hi = tuple((pixel_range[1] - m) / s for m, s in zip(mean, std))
        return cls(low=lo, high=hi, mean=mean, std=std, input_size=tuple(input_size) if input_size else None)

    @property
    def is_per_channel(self) -> bool:
        """True when the bounds differ per channel (one entry per channel, dim 1 of the input)."""
        return len(self.low) > 1

    @property
    def channels(self) -> int | None:
        """Channels the inputs must have (dim 1), or ``None`` when the domain does not say."""
        if self.is_per_channel:
            return len(self.low)
        if self.input_size is not None and len(self.input_size) >= 2:
            return int(self.input_size[0])
        return None

    def describe(self) -> str:
        """One line for error messages: the bounds, and the normalisation when known."""
        fmt = lambda v: "(" + ", ".join(f"{a:.3g}" for a in v) + ")" if len(v) > 1 else f"{v[0]:.3g}"
        text = f"[{fmt(self.low)} .. {fmt(self.high)}]"
        if self.mean is not None:
            text += f" = [0, 1] pixels normalised with mean={fmt(self.mean)}, std={fmt(self.std)}"
        return text

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

    def uniform(
        self,
        n: int,
        shape: Sequence[int],
        *,
        generator: torch.Generator | None = None,
        device=None,
        dtype=torch.float32,
    ) -> Tensor:
        """``n`` samples uniform over the domain."""
        u = draw(torch.rand, (n, *shape), generator, device, dtype=dtype)
        lo, hi = self.bounds(u)
        return u.mul_(hi - lo).add_(lo)

    def clamp_plan(self, x: Tensor) -> list[tuple[Tensor, float, float]]:
        """``(view, low, high)`` triples that clamp ``x`` to the domain with scalar bounds.

        Scalar clamps on per-channel views are several times cheaper than one clamp against
        broadcast bound tensors; the views stay valid while ``x`` is updated in place (SGLD chains).
        """
        lows, highs = self.low, self.high
        if len(set(lows)) == 1 and len(set(highs)) == 1:
            return [(x, lows[0], highs[0])]
        if x.dim() < 2 or x.shape[1] != len(lows):
            raise InvalidInputError(
                f"the model's input domain has {len(lows)} channels (bounds {lows} .. {highs}) but the chain "
                f"has shape {tuple(x.shape)}; sample inputs of shape [B, {len(lows)}, ...] or fix the "
                "domain with wrap(model, data_range=...) / mean=, std="
            )
        return [(x[:, c], lo, hi) for c, (lo, hi) in enumerate(zip(lows, highs))]

    def to_unit(self, x: Tensor) -> Tensor:
        """Map inputs to ``[0, 1]`` pixels for display (undo normalisation, then rescale)."""
        lo, hi = self.bounds(x)
        return ((x - lo) / (hi - lo)).clamp(0, 1)


def image_as_mode(im, target: str):
    """The PIL image ``im`` as ``target`` ("L" or "RGB"), keeping what a viewer shows: 16-bit and 32-bit grey
    scaled to 8 bits (PIL's own ``convert`` clips them, so most pixels turn white) and
    transparency composited on black (PIL's ``convert`` drops alpha, showing whatever colour
    the transparent pixels happen to store). How ``jem train`` reads a folder's images and
    :class:`Preprocess` reads yours, so that both give the same input."""
    import numpy as np
    from PIL import Image

    if im.mode == target:
        return im
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        a = np.asarray(im, dtype=np.float64)
        a = a * (255.0 / 65535.0) if im.mode != "F" else a  # integer modes hold 16-bit PNG/TIFF values
        im = Image.fromarray(a.clip(0, 255).round().astype(np.uint8), "L")
    elif im.mode in ("RGBA", "LA", "La", "RGBa", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba)
    return im.convert(target)


class Preprocess:
    """Raw images to a model's input, as ``jem train`` reads a folder of images: what
    :meth:`jem_plugin.JEM.preprocessing` returns (timm's ``resolve_data_config`` +
    ``create_transform`` in one call).

    Each image (an image file's path, a PIL image, or a ``uint8`` array of ``(H, W)`` or ``(H, W, C)``
    pixels in 0..255) is converted to the model's channels (``RGB`` for 3, ``L`` for 1), resized to
    ``size``'s ``(H, W)`` (bilinear, antialiased, no crop), scaled to ``[0, 1]`` and mapped into
    ``domain``: normalised by its ``mean``/``std`` where it has them, else stretched onto its
    ``low..high`` range. One image gives ``[C, H, W]`` (a ``Dataset`` transform); a list of
    images, or a ``uint8`` array ``(B, H, W, C)``, gives ``[B, C, H, W]`` (a batch for ``jm``).
    """

    def __init__(self, domain: InputDomain, size: Sequence[int]) -> None:
        size = tuple(int(s) for s in size)
        if len(size) != 3 or size[0] not in (1, 3):
            raise InvalidInputError(
                f"preprocessing reads images into inputs of shape (C, H, W) with 1 or 3 channels; this model's are "
                f"{size}"
            )
        self.domain, self.size = domain, size
        self.mode = "RGB" if size[0] == 3 else "L"

    def __repr__(self) -> str:
        return (
            f"Preprocess(size={self.size}: {self.mode} images resized to {self.size[1]}x{self.size[2]}, "
            f"then into {self.domain.describe()})"
        )

    def __call__(self, images: Any) -> Tensor:
        import numpy as np

        if isinstance(images, (list, tuple)):
            if not images:
                raise InvalidInputError("preprocessing got an empty list of images")
            return torch.stack([self._one(im) for im in images])
        if isinstance(images, np.ndarray) and images.ndim == 4:
            return torch.stack([self._one(im) for im in images])
        return self._one(images)

    def _one(self, image: Any) -> Tensor:
        import os

        import numpy as np
        from PIL import Image
        from torchvision.transforms import functional as TF

        if isinstance(image, (str, os.PathLike)):
            with Image.open(image) as opened:
                opened.load()  # decoded while open: an image already in the mode comes back as it is
                image = image_as_mode(opened, self.mode)
        elif isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] > 4):
                raise InvalidInputError(
                    f"preprocessing takes uint8 pixel arrays of shape (H, W) or (H, W, C), got a {image.dtype} array "
                    f"of shape {image.shape}: convert it to 0..255 uint8 (channels last), or give the model tensors "
                    f"in its domain {self.domain.describe()} directly"
                )
            image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image)
        elif not isinstance(image, Image.Image):
            raise InvalidInputError(
                f"preprocessing takes image file paths, PIL images or uint8 arrays, got {type(image).__name__}"
            )
        image = TF.resize(image_as_mode(image, self.mode), [self.size[1], self.size[2]])
        x = TF.to_tensor(image)  # [C, H, W] in [0, 1]
        d = self.domain
        if d.mean is not None and d.std is not None:
            return TF.normalize(x, list(d.mean), list(d.std))
        lo, hi = torch.tensor(d.low).view(-1, 1, 1), torch.tensor(d.high).view(-1, 1, 1)
        return lo + x * (hi - lo)


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
    features: where the penultimate features are (``wrap(model, features=...)``): ``None``
        (the adapter's default: the input of the model's last ``nn.Linear``), the dotted name
        of the submodule whose input they are (``"head.fc"``) or that submodule itself, or a
        callable ``(model, x) -> (features, output)`` doing the one forward itself.
    """

    def __init__(
        self,
        name: str,
        domain: InputDomain | None = None,
        num_classes: int | None = None,
        logits: Any = None,
        features: Any = None,
    ) -> None:
        self.name = name
        self.domain = domain or InputDomain()
        self.num_classes = num_classes
        self.logits_spec = logits
        self.features_spec = features

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
                # the user's model output: a dict, a Hugging Face ModelOutput, a namedtuple, ...
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

    # ------------------------------------------------------------------ features
    def head(self, model: Any) -> nn.Module | None:
        """The layer that maps :meth:`features` to the logits (``logits == head(features)``), or
        ``None`` when the adapter does not know one (``features=`` given as a callable).

        Default: the submodule named by ``features=``, else the model's last ``nn.Linear`` (in
        registration order, inside any ``torch.compile``/DDP/FSDP wrapper). Detectors that
        reshape features and recompute logits (ReAct, ASH, SCALE, ViM) call it.
        """
        spec = self.features_spec
        core = unwrap_model(model)
        if isinstance(spec, nn.Module):
            return spec
        if isinstance(spec, str):
            try:
                return core.get_submodule(spec)
            except AttributeError as exc:
                raise NoFeaturesError(
                    f"wrap(model, features={spec!r}) names no submodule of {type(core).__name__}: {exc}"
                ) from exc
        if spec is not None:
            return None
        return last_linear(core)

    def features(self, model: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features [B, D], logits [B, K])`` of ``x`` in ONE forward of ``model``.

        Default: a forward hook on :meth:`head` records its input (flattened to ``[B, D]``) while
        ``model(x)`` runs (through the wrapper, so DDP and ``torch.compile`` see an ordinary call);
        the logits are read from the output as :meth:`logits` does. The model's train/eval mode is
        left as it is. Raises :class:`~jem_plugin.errors.NoFeaturesError` when no layer is found
        or the hooked layer's output is not the logits' shape (it is then not the classifier).
        """
        if self._features_callable():
            feats, out = self.features_spec(model, x)
            return _flat(feats), self.logits(out)
        return hooked_features(self._feature_layer(model), model, x, self.logits)

    def _features_callable(self) -> bool:
        """Whether ``features=`` is a callable doing its own forward (not a name or a module)."""
        spec = self.features_spec
        return callable(spec) and not isinstance(spec, (str, nn.Module))

    def _feature_layer(self, model: Any) -> nn.Module:
        """:meth:`head`, whose input the features are; raises where there is none."""
        layer = self.head(model)
        if layer is None:
            raise NoFeaturesError(
                f"{type(unwrap_model(model)).__name__} has no nn.Linear layer to read features from; tell "
                "jem-plugin where they are: wrap(model, features='name.of.classifier') (its input is "
                "taken) or wrap(model, features=lambda model, x: (features, model_output))"
            )
        return layer

    def feature_maps(self, model: Any, x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
        """``(maps [B, C, H, W], to_logits)``: the model's last feature maps of ``x`` before its
        classifier pools them, from one forward, and the function that maps maps of that shape to
        the logits (``to_logits(maps)`` is the model's output). ``None`` where the adapter knows
        none; activation-shaping detectors (ASH, SCALE) then shape :meth:`features` instead.

        Default: a model with an ``avgpool`` layer and an ``fc`` or ``classifier`` head
        (torchvision's ResNets, MobileNets and EfficientNets, most hand-written CNNs): the pool's
        input, caught by a forward hook, and ``to_logits(m) = head(flatten(avgpool(m)))``, given
        only where it gives back the model's own logits on this batch. ``None`` when
        ``wrap(model, features=...)`` points elsewhere.
        """
        found = self._pool_and_head(model)
        return None if found is None else pooled_maps(model, x, *found, self.logits)

    def _pool_and_head(self, model: Any) -> tuple[nn.Module, Callable[[Tensor], Tensor]] | None:
        """``(pool, to_logits)`` for :meth:`feature_maps`: the layer whose input the maps are and
        the function from maps to logits, or ``None`` where the adapter knows none. Adapters that
        pool elsewhere override this one (the Hugging Face adapter's ``pooler``)."""
        core = unwrap_model(model)
        pool = getattr(core, "avgpool", None)
        head = getattr(core, "fc", None) or getattr(core, "classifier", None)
        if self.features_spec is not None or not isinstance(pool, nn.Module) or not isinstance(head, nn.Module):
            return None
        return pool, lambda m: head(torch.flatten(pool(m), 1))

    def feature_layers(self, model: Any) -> list[str] | None:
        """Dotted names of the submodules whose outputs are the model's intermediate features,
        shallow to deep, for the detectors that read several depths (``multi_mahalanobis``);
        ``None`` where the adapter knows none (the detector then asks for ``layers=``).

        Default, the first rule that finds something:

        1. the modules a timm-style ``feature_info`` lists (every timm model, and any model
           carrying that attribute: ``[{"module": "blocks.2", "num_chs": 64}, ...]``);
        2. ``layer1``, ``layer2``, ... (torchvision's ResNets and most hand-written ones);
        3. the blocks of a sequence named ``features``, ``trunk_output``, ``layers``, ``blocks``
           or ``encoder.layers`` (torchvision's EfficientNets, MobileNets, ConvNeXts, VGGs,
           DenseNets, Swins, RegNets, MNASNets, MaxViTs and ViTs): the end of each resolution
           (the block before each one that downsamples, a pooling layer itself, the last block),
           or every block where none downsamples and all are alike (a transformer's encoder);
        4. the same ends along the model's own children up to its head (GoogLeNet, Inception,
           ShuffleNet, an ``nn.Sequential`` CNN).
        """
        core = unwrap_model(model)
        names = [name for name, _ in _feature_info(core)]
        if names:
            return names
        while isinstance(getattr(core, f"layer{len(names) + 1}", None), nn.Module):
            names.append(f"layer{len(names) + 1}")
        if names or not isinstance(core, nn.Module):
            return names or None
        for path in _BLOCK_SEQUENCES:
            blocks = _optional_submodule(core, path)
            if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) > 1:
                children = list(blocks.named_children())
                ends = _stage_ends([m for _, m in children])
                if ends:
                    return [f"{path}.{children[i][0]}" for i in ends]
        trunk = _trunk(core)
        ends = _stage_ends([m for _, m in trunk])
        return [trunk[i][0] for i in ends] or None

    def layer_maps(self, model: Any, x: Tensor, layers: Sequence[str]) -> tuple[list[Tensor], Tensor]:
        """``([B, C_i, P_i] per layer, logits [B, K])`` of ``x`` in ONE forward of ``model``: the
        output of each named submodule (its last call), channels first with its positions
        flattened: ``[B, C, H, W]`` maps (or channels-last ones where the model's ``output_fmt`` or
        ``feature_info`` says so) as ``[B, C, H*W]``, ``[B, T, C]`` tokens as ``[B, C, T]``, a
        ``[B, C]`` vector as ``[B, C, 1]``. What the Gram-matrix detector (``gram``) reads.

        Raises :class:`~jem_plugin.errors.NoFeaturesError` for a name that is no submodule, a layer
        that did not run, or an output that is not a tensor of 2 to 4 dimensions.
        """
        modules = layer_modules(model, layers)
        seen, out = watched_call(modules, lambda: model(x))
        logits = self.logits(out)
        return layer_outputs(model, layers, modules, seen), logits

    def layer_features(self, model: Any, x: Tensor, layers: Sequence[str]) -> tuple[list[Tensor], Tensor]:
        """``([B, C_i] per layer, logits [B, K])``: :meth:`layer_maps` averaged over each layer's
        spatial positions or tokens, as Lee et al. pool feature maps for their feature ensemble
        (``multi_mahalanobis``)."""
        maps, logits = self.layer_maps(model, x, layers)
        return [m.mean(dim=2) for m in maps], logits

    def outputs(
        self,
        model: Any,
        x: Tensor,
        *,
        features: bool = False,
        feature_maps: bool = False,
        layers: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Several of the outputs above from ONE forward of ``model``, for the post-hoc detectors
        that share it (:func:`jem_plugin.ood.outputs`): ``{"logits": [B, K]}``, with
        ``"features"`` (as :meth:`features`) when ``features``, ``"feature_maps"`` (as
        :meth:`feature_maps`: ``(maps, to_logits)`` or ``None``) when ``feature_maps``, and
        ``"layers"`` (as :meth:`layer_maps`, one per name) when ``layers`` names some.

        A kind that cannot be read (:class:`~jem_plugin.errors.NoFeaturesError`) is given as that
        error, not raised, so that the others still serve: a detector reading it raises it.
        Default: forward hooks on :meth:`head`, on the pool :meth:`feature_maps` reads and on the
        layers, all in one ``model(x)``. A kind this adapter's subclass reads its own way (an
        override of :meth:`features` or :meth:`feature_maps`, or a callable ``features=``) is read
        by that method, with its own forward; an adapter that overrides them overrides this too
        (the timm adapter does).
        """
        own_features = type(self).features is not Adapter.features or self._features_callable()
        own_maps = type(self).feature_maps is not Adapter.feature_maps
        result: dict[str, Any] = {}
        pool = self._pool_and_head(model) if feature_maps and not own_maps else None
        if features and own_features and not layers and pool is None:
            # the adapter's own features are the only forward needed: its logits with them
            got = kind_or_error(lambda: self.features(model, x))
            result["features"], result["logits"] = (
                (got, self.logits(model(x))) if isinstance(got, NoFeaturesError) else got
            )
            if feature_maps:
                result["feature_maps"] = kind_or_error(lambda: self.feature_maps(model, x)) if own_maps else None
            return result
        watch: list[nn.Module] = []
        head: Any = None
        if features and not own_features:
            head = kind_or_error(lambda: self._feature_layer(model))
            if isinstance(head, nn.Module):
                watch.append(head)
        if pool is not None:
            watch.append(pool[0])
        modules: Any = kind_or_error(lambda: layer_modules(model, layers)) if layers else []
        watch += modules if isinstance(modules, list) else []
        seen, out = watched_call(watch, lambda: model(x))
        logits = result["logits"] = self.logits(out)
        calls = dict(zip(map(id, watch), seen))
        if features:
            if own_features:
                result["features"] = kind_or_error(lambda: self.features(model, x)[0])
            elif isinstance(head, nn.Module):
                feats, head_out = calls[id(head)] or (None, None)
                result["features"] = kind_or_error(lambda: checked_head_input(model, head, feats, head_out, logits))
            else:
                result["features"] = head
        if feature_maps:
            if own_maps:
                result["feature_maps"] = kind_or_error(lambda: self.feature_maps(model, x))
            elif pool is not None:
                maps = (calls[id(pool[0])] or (None, None))[0]
                result["feature_maps"] = checked_maps(maps, pool[1], logits)
            else:
                result["feature_maps"] = None
        if layers:
            result["layers"] = (
                kind_or_error(lambda: layer_outputs(model, layers, modules, [calls[id(m)] for m in modules]))
                if isinstance(modules, list)
                else modules
            )
        return result


def pooled_maps(
    model: Any, x: Tensor, pool: nn.Module, to_logits: Callable[[Tensor], Tensor], read_logits: Any
) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
    """``(input of pool, to_logits)`` from one ``model(x)`` (a forward hook on ``pool``), or ``None``
    where that input is not ``[B, C, H, W]`` maps or ``to_logits`` does not give back the model's
    own logits on this batch (a head that does more than the adapter knows: dropout in train
    mode, a normalisation, a rescaling in ``forward``)."""
    maps, _, logits = _last_call(pool, model, x, read_logits)
    return checked_maps(maps, to_logits, logits)


def checked_maps(
    maps: Any, to_logits: Callable[[Tensor], Tensor], logits: Tensor
) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
    """``(maps, to_logits)`` where ``maps`` are ``[B, C, H, W]`` and ``to_logits(maps)`` gives back
    the model's ``logits``; else ``None`` (see :func:`pooled_maps`)."""
    if not isinstance(maps, Tensor) or maps.dim() != 4:
        return None
    try:
        same = torch.allclose(to_logits(maps).float(), logits.float(), rtol=1e-4, atol=1e-4)
    except (RuntimeError, TypeError, ValueError):
        return None
    return (maps, to_logits) if same else None


def kind_or_error(read: Callable[[], Any]) -> Any:
    """``read()``, or the :class:`~jem_plugin.errors.NoFeaturesError` it raised (see
    :meth:`Adapter.outputs`: a kind that cannot be read is handed on as its error)."""
    try:
        return read()
    except NoFeaturesError as exc:
        return exc


def watched_call(modules: Sequence[nn.Module], run: Callable[[], Any]) -> tuple[list[tuple[Any, Any] | None], Any]:
    """``(calls, run())``: for each of ``modules``, its first input and its output in its last call
    while ``run()`` ran (``None`` when it did not run), caught by forward hooks removed after."""
    seen: list[tuple[Any, Any] | None] = [None] * len(modules)

    def hook(i: int) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple, output: Any) -> None:
            seen[i] = (args[0] if args else None, output)

        return record

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        out = run()
    finally:
        for h in handles:
            h.remove()
    return seen, out


def layer_modules(model: Any, layers: Sequence[str]) -> list[nn.Module]:
    core = unwrap_model(model)
    if not isinstance(core, nn.Module):
        raise NoFeaturesError(f"{type(core).__name__} is not an nn.Module: it has no layers to read features from")
    return [_named_submodule(core, name) for name in layers]


def layer_outputs(
    model: Any, layers: Sequence[str], modules: Sequence[nn.Module], seen: Sequence[tuple[Any, Any] | None]
) -> list[Tensor]:
    """The ``[B, C, P]`` maps of :meth:`Adapter.layer_maps` from the layers' calls (:func:`watched_call`)."""
    core = unwrap_model(model)
    channels = dict(_feature_info(core))
    last = getattr(core, "output_fmt", None) == "NHWC"  # timm's channels-last models (Swin, MambaOut)
    maps = []
    for name, module, call in zip(layers, modules, seen):
        if call is None:
            raise NoFeaturesError(f"the layer {name!r} did not run in the model's forward, so it gives no features")
        maps.append(_channels_first(call[1], name, channels.get(name) or _out_channels(module), last))
    return maps


def _feature_info(core: Any) -> list[tuple[str, int | None]]:
    """``(module name, channel count or None)`` of each entry of a timm-style ``feature_info``
    (a list of dicts, or timm's ``FeatureInfo``); ``[]`` where the model carries none."""
    info = getattr(core, "feature_info", None)
    try:
        entries = [(str(f["module"]), f.get("num_chs")) for f in (info or ())]
    except (TypeError, KeyError, AttributeError):
        return []
    return [(name, ch if isinstance(ch, int) else None) for name, ch in entries if name]


def _downsamples(module: nn.Module) -> bool:
    """A strided convolution or pooling, or a Swin patch merging, inside ``module``."""
    for m in module.modules():
        if type(m).__name__.startswith("PatchMerging"):  # halves the resolution with a linear layer: no stride to see
            return True
        if isinstance(m, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            stride = m.stride if isinstance(m.stride, tuple) else (m.stride,)
            if max(int(s) for s in stride) > 1:
                return True
    return False


# Where models keep their chain of blocks (rule 3 of Adapter.feature_layers), searched in this order.
_BLOCK_SEQUENCES = ("features", "trunk_output", "layers", "blocks", "encoder.layers")
# A model's children from the first of these on are its head, not its trunk.
_HEAD_TYPES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear, nn.Dropout)
_HEAD_NAMES = ("fc", "classifier", "head", "heads")


def no_layers_error(model: Any, name_them: str) -> NoFeaturesError:
    """The one error for a model whose intermediate layers no rule of :meth:`Adapter.feature_layers`
    finds; ``name_them`` is the call that names them (``layers=[...]`` of the caller)."""
    return NoFeaturesError(
        f"jem-plugin knows no intermediate layers of {type(unwrap_model(model)).__name__}; name them: "
        f"{name_them} (dotted names in model.named_modules(), shallow to deep)"
    )


def _optional_submodule(core: nn.Module, path: str) -> nn.Module | None:
    try:
        return core.get_submodule(path)
    except AttributeError:
        return None


def _trunk(core: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's children before its head (pooling, flattening or classifier)."""
    trunk = []
    for name, child in core.named_children():
        if name in _HEAD_NAMES or isinstance(child, _HEAD_TYPES):
            break
        trunk.append((name, child))
    return trunk


def _stage_ends(blocks: list[nn.Module]) -> list[int]:
    """The ends of the resolutions along ``blocks``; every block where there is one resolution
    only and the blocks are alike and built of layers (a transformer's encoder); else ``[]``."""
    ends = _resolution_ends(blocks) if blocks else []
    if len(ends) > 1:
        return ends
    alike = len(blocks) > 1 and len({type(b) for b in blocks}) == 1 and any(True for _ in blocks[0].children())
    return list(range(len(blocks))) if alike else []


def _resolution_ends(blocks: list[nn.Module]) -> list[int]:
    """Indices of the blocks that end a resolution: a pooling layer itself (its output is the
    stage's, pooled), the block before one that downsamples otherwise, and the last block."""
    ends = set()
    for i, block in enumerate(blocks):
        if isinstance(block, (nn.MaxPool2d, nn.AvgPool2d)) and _downsamples(block):
            ends.add(i)
        elif i > 0 and _downsamples(block) and not isinstance(blocks[i - 1], (nn.MaxPool2d, nn.AvgPool2d)):
            ends.add(i - 1)
    ends.add(len(blocks) - 1)
    return sorted(ends)


def _out_channels(module: nn.Module) -> int | None:
    """The channel count a module's output most likely has: its last convolution's, linear
    layer's or normalisation's width (to tell channels-last maps from channels-first ones)."""
    found = None
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            found = m.out_channels
        elif isinstance(m, nn.Linear):
            found = m.out_features
        elif isinstance(m, nn.BatchNorm2d):
            found = m.num_features
        elif isinstance(m, nn.GroupNorm):
            found = m.num_channels
        elif isinstance(m, nn.LayerNorm):
            found = int(m.normalized_shape[-1])
    return found


def _named_submodule(core: nn.Module, name: str) -> nn.Module:
    found = _optional_submodule(core, name)
    if found is None:
        top = ", ".join(n for n, _ in core.named_children())
        raise NoFeaturesError(
            f"{type(core).__name__} has no submodule {name!r}; name layers by their dotted names in "
            f"model.named_modules() (its top-level children: {top or 'none'})"
        )
    return found


def _channels_first(out: Any, name: str, channels: int | None, channels_last: bool = False) -> Tensor:
    """``[B, C, P]``: a layer's output, channels first, its spatial positions or tokens flattened
    (``P = 1`` for a ``[B, C]`` output). Maps are ``[B, C, H, W]`` unless the model says its maps
    are channels-last (timm's ``output_fmt``) or only the last dimension matches the layer's known
    channel count."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]  # blocks returning (hidden, extras), as some transformer blocks do
    if not isinstance(out, Tensor) or not 2 <= out.dim() <= 4:
        raise NoFeaturesError(
            f"the layer {name!r} outputs {_describe(out)}; its features must be [B, C], [B, T, C] tokens "
            "or [B, C, H, W] maps"
        )
    if out.dim() == 4:
        last = channels_last or (channels is not None and out.shape[-1] == channels and out.shape[1] != channels)
        out = out.flatten(1, 2).transpose(1, 2) if last else out.flatten(2)
    elif out.dim() == 3:
        out = out.transpose(1, 2)
    else:
        out = out.unsqueeze(2)
    return out.float() if out.dtype in (torch.float16, torch.bfloat16) else out


def _flat(feats: Any) -> Tensor:
    if not isinstance(feats, Tensor) or feats.dim() < 1:
        raise NoFeaturesError(f"features must be a [B, D] tensor, got {_describe(feats)}")
    return feats.flatten(1) if feats.dim() != 2 else feats


def last_linear(model: Any) -> nn.Module | None:
    """The last ``nn.Linear`` of ``model`` in registration order (``None`` when it has none)."""
    found = None
    if isinstance(model, nn.Module):
        for m in model.modules():
            if isinstance(m, nn.Linear):
                found = m
    return found


def hookable_name(model: Any, layer: nn.Module) -> str:
    """The dotted name of ``layer`` inside ``model`` (for messages), or its class name."""
    core = unwrap_model(model)
    if isinstance(core, nn.Module):
        for name, m in core.named_modules():
            if m is layer:
                return name or type(layer).__name__
    return type(layer).__name__


def _last_call(layer: nn.Module, model: Any, x: Tensor, read_logits: Any) -> tuple[Any, Any, Tensor]:
    """``(input, output, logits)``: ``layer``'s first input and its output in its last call during
    one ``model(x)`` (``None`` for both when it did not run), caught by a forward hook, and
    ``read_logits(model output)``."""
    (call,), out = watched_call([layer], lambda: model(x))
    inp, outp = call or (None, None)
    return inp, outp, read_logits(out)


def hooked_features(layer: nn.Module, model: Any, x: Tensor, read_logits: Any) -> tuple[Tensor, Tensor]:
    """``(input of layer, logits)`` from one ``model(x)``: a forward hook on ``layer`` records
    its last call's input and output; ``read_logits(output)`` extracts the logits."""
    feats, head_out, logits = _last_call(layer, model, x, read_logits)
    return checked_head_input(model, layer, feats, head_out, logits), logits


def checked_head_input(model: Any, layer: nn.Module, feats: Any, head_out: Any, logits: Tensor) -> Tensor:
    """The features ``[B, D]``: ``layer``'s input ``feats`` in the forward that gave ``logits``,
    checked to be a tensor and ``layer`` the classifier (its output ``head_out`` the logits)."""
    if not isinstance(feats, Tensor):
        raise NoFeaturesError(
            f"the layer {hookable_name(model, layer)!r} did not run (or got no tensor input) in the model's "
            "forward, so its input cannot be the features; name the classifier layer with "
            "wrap(model, features='name') or pass features=lambda model, x: (features, output)"
        )
    if head_out is not logits and (not isinstance(head_out, Tensor) or head_out.shape != logits.shape):
        raise NoFeaturesError(
            f"the layer whose input was taken as the features ({hookable_name(model, layer)!r}, the last "
            f"nn.Linear) outputs {_describe(head_out)}, not the logits ({_describe(logits)}): it is not the "
            "classifier. Name the classifier with wrap(model, features='name.of.classifier'), or pass "
            "features=lambda model, x: (features, model_output)"
        )
    return _flat(feats)


def _describe(obj: Any) -> str:
    if isinstance(obj, Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} items ({', '.join(_describe(o) for o in obj[:4])})"
    if isinstance(obj, dict):
        return f"a dict with keys {list(obj)[:8]}"
    return f"an object of type {type(obj).__name__}"


#: Every option :func:`jem_plugin.wrap` passes to adapters; anything else is refused.
WRAP_OPTIONS = ("logits", "data_range", "mean", "std", "input_size", "num_classes", "processor", "features")


def check_wrap_options(options: dict) -> None:
    """Refuse unknown and contradictory :func:`jem_plugin.wrap` options, naming the valid ones."""
    unknown = sorted(set(options) - set(WRAP_OPTIONS))
    if unknown:
        raise TypeError(
            f"wrap() got unknown option(s) {', '.join(map(repr, unknown))}; valid options: "
            f"adapter, check_finite, {', '.join(WRAP_OPTIONS)}"
        )
    given = [k for k in ("data_range", "mean", "std", "processor") if options.get(k) is not None]
    if "data_range" in given and len(given) > 1:
        raise ValueError(
            f"wrap() got data_range together with {', '.join(k for k in given if k != 'data_range')}: "
            "they describe the same thing. Pass data_range=(low, high) for unnormalised inputs, or "
            "mean=/std= (or processor=) for normalised images, not both."
        )
    if "processor" in given and ("mean" in given or "std" in given):
        raise ValueError(
            "wrap() got processor= and mean=/std=: the processor already gives the normalisation; pass one of them"
        )


def with_channels(domain: InputDomain, channels: int | None) -> InputDomain:
    """``domain`` for a model with ``channels`` input channels.

    A default normalisation with another channel count (ImageNet's 3 values for a 1-channel
    model) is averaged over its channels and repeated ``channels`` times: grayscale ImageNet
    statistics for a grayscale model. ``input_size`` gets the same channel count.
    """
    if channels is None:
        return domain
    size = domain.input_size
    if size is not None and len(size) >= 2 and size[0] != channels:
        size = (channels, *size[1:])
    if domain.is_per_channel and len(domain.low) != channels:
        if domain.mean is not None and domain.std is not None:
            m, sd = sum(domain.mean) / len(domain.mean), sum(domain.std) / len(domain.std)
            return InputDomain.from_normalization((m,) * channels, (sd,) * channels, input_size=size)
        lo, hi = min(domain.low), max(domain.high)
        return InputDomain.from_range((lo,) * channels, (hi,) * channels, input_size=size)
    if size != domain.input_size:
        return InputDomain(domain.low, domain.high, domain.mean, domain.std, size)
    return domain


def domain_from_options(options: dict, default: InputDomain) -> InputDomain:
    """Apply the user's ``data_range`` / ``mean`` + ``std`` / ``input_size`` options to a default domain.

    A user's normalisation whose channel count differs from the model's raises
    :class:`~jem_plugin.errors.InvalidInputError` naming both.
    """
    input_size = options.get("input_size", default.input_size)
    channels = default.channels
    if options.get("data_range") is not None:
        lo, hi = options["data_range"]
        return InputDomain.from_range(lo, hi, input_size=input_size)
    if options.get("mean") is not None or options.get("std") is not None:
        if options.get("mean") is None or options.get("std") is None:
            raise ValueError("pass both mean= and std= (the normalisation your loader applies)")
        dom = InputDomain.from_normalization(options["mean"], options["std"], input_size=input_size)
        if channels is not None and dom.is_per_channel and len(dom.low) != channels:
            raise InvalidInputError(
                f"mean=/std= give {len(dom.low)} channel(s) but the model takes {channels}; pass "
                f"{channels} value(s) each (or one value for all channels)"
            )
        return dom
    if input_size != default.input_size:
        return InputDomain(
            default.low, default.high, default.mean, default.std, tuple(input_size) if input_size else None
        )
    return default


def built_by(model: Any, package: str) -> bool:
    """True when ``model``'s class, or a class it derives from, is defined in ``package``.

    The base classes count because FSDP2's ``fully_shard`` swaps a module's class for a
    subclass defined elsewhere.
    """
    prefix = package + "."
    return any(c.__module__.startswith(prefix) for c in type(model).__mro__[:-1])


def refuse_removed_classifier(model: Any, classifier: Any, where: str, fix: str, options: dict) -> None:
    """Raise :class:`NoLogitsError` when the classifier at ``where`` was replaced by
    ``nn.Identity`` (timm's ``num_classes=0``, ``model.fc = nn.Identity()``): such a model returns
    its features, which would otherwise be taken for one logit per "class". ``logits=`` in the
    wrap options says where the logits are, and skips the check."""
    if options.get("logits") is not None or not isinstance(classifier, nn.Module):
        return
    last = [m for m in classifier.modules() if not list(m.children())]  # its leaves, in order
    if isinstance(classifier, nn.Identity) or (last and isinstance(last[-1], nn.Identity)):
        raise NoLogitsError(
            f"{type(model).__name__} has no classifier ({where} is, or ends in, nn.Identity), so it returns features, "
            f"not logits: {fix}"
        )


def first_conv_channels(model: Any) -> int | None:
    """Input channels of the model's first convolution (its first ``ConvNd`` in module order)."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return None
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return int(m.in_channels)
    return None
