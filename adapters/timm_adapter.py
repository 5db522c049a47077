"""timm adapter: reads the model itself (channels, image size) and its pretrained config (mean/std).

timm models expect normalised images, so the domain is ``[0, 1]`` pixels after the model's
``(x - mean) / std``: the space a standard timm data pipeline yields. The channel count is the
first convolution's (``in_chans``); the image size is the patch embedding's when the model fixes
one (ViTs built with ``img_size=32``), else the pretrained config's (CNNs take any size).

Penultimate features (:meth:`jem_plugin.JEM.features`) are timm's own
``forward_head(forward_features(x), pre_logits=True)``, and the logits that classifier
(``get_classifier()``) applied to them: one forward, exactly ``model(x)`` for the models whose
``forward`` is ``forward_head(forward_features(x))`` (all of timm's classifiers). A CNN's
feature maps (:meth:`jem_plugin.JEM.feature_maps`, what ASH and SCALE shape) are
``forward_features(x)``, mapped to the logits by ``forward_head``; a ViT's are its pre-logits
features as ``1 x 1`` maps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from jem_plugin._checks import unwrap_model
from jem_plugin.adapter import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Adapter,
    InputDomain,
    built_by,
    domain_from_options,
    first_conv_channels,
    kind_or_error,
    layer_modules,
    layer_outputs,
    refuse_removed_classifier,
    watched_call,
    with_channels,
)
from jem_plugin.plugins import hookimpl


class TimmAdapter(Adapter):
    """:class:`Adapter` reading features through timm's ``forward_features``/``forward_head``."""

    def _parts(self, model: Any) -> tuple[Any, nn.Module] | None:
        core = unwrap_model(model)
        if self.features_spec is not None or not all(
            callable(getattr(core, a, None)) for a in ("forward_features", "forward_head", "get_classifier")
        ):
            return None
        classifier = core.get_classifier()
        return (core, classifier) if isinstance(classifier, nn.Module) else None  # distilled heads: a tuple

    def head(self, model: Any) -> nn.Module | None:
        """timm's ``get_classifier()``; the generic answer for models without one."""
        parts = self._parts(model)
        return parts[1] if parts is not None else super().head(model)

    def features(self, model: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """``forward_head(forward_features(x), pre_logits=True)`` and the classifier on it."""
        parts = self._parts(model)
        if parts is None:
            return super().features(model, x)
        core, classifier = parts
        feats = core.forward_head(core.forward_features(x), pre_logits=True)
        logits = classifier(feats)
        return (feats.flatten(1) if feats.dim() != 2 else feats), self.logits(logits)

    def feature_maps(self, model: Any, x: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]] | None:
        """A CNN's ``forward_features(x)`` and ``forward_head`` (pooling, any pre-logits layers and
        the classifier) as ``to_logits``. A token model (ViT) has no spatial maps: its pre-logits
        features (:meth:`features`) as ``[B, D, 1, 1]`` maps and the classifier, from the same
        forward, so a detector that shapes them runs the model once."""
        parts = self._parts(model)
        if parts is None:
            return super().feature_maps(model, x)
        core, classifier = parts
        maps = core.forward_features(x)
        if isinstance(maps, Tensor) and maps.dim() == 4:
            return maps, lambda m: self.logits(core.forward_head(m))
        feats = core.forward_head(maps, pre_logits=True)
        if not isinstance(feats, Tensor) or feats.dim() != 2:
            return None
        return feats[:, :, None, None], lambda m: self.logits(classifier(m.flatten(1)))

    def outputs(
        self,
        model: Any,
        x: Tensor,
        *,
        features: bool = False,
        feature_maps: bool = False,
        layers: Sequence[str] = (),
    ) -> dict[str, Any]:
        """:meth:`features` and :meth:`feature_maps` from one ``forward_features`` and
        ``forward_head``, the layers caught by forward hooks during them (see
        :meth:`jem_plugin.adapter.Adapter.outputs`); the generic reading for a model that is not
        timm's or where neither is asked."""
        parts = self._parts(model)
        if parts is None or not (features or feature_maps):
            return super().outputs(model, x, features=features, feature_maps=feature_maps, layers=layers)
        core, classifier = parts
        modules = kind_or_error(lambda: layer_modules(model, layers)) if layers else []
        watch = modules if isinstance(modules, list) else []

        def forward() -> tuple[Any, Any, Any]:
            maps = core.forward_features(x)
            feats = core.forward_head(maps, pre_logits=True)
            return maps, feats, classifier(feats)

        seen, (maps, feats, out) = watched_call(watch, forward)
        result: dict[str, Any] = {"logits": self.logits(out)}
        if features:
            result["features"] = feats.flatten(1) if feats.dim() != 2 else feats
        if feature_maps:
            if isinstance(maps, Tensor) and maps.dim() == 4:
                result["feature_maps"] = (maps, lambda m: self.logits(core.forward_head(m)))
            elif isinstance(feats, Tensor) and feats.dim() == 2:
                result["feature_maps"] = (feats[:, :, None, None], lambda m: self.logits(classifier(m.flatten(1))))
            else:
                result["feature_maps"] = None
        if layers:
            result["layers"] = (
                kind_or_error(lambda: layer_outputs(model, layers, watch, seen))
                if isinstance(modules, list)
                else modules
            )
        return result


def is_timm_model(model) -> bool:
    """True for models built by timm (or carrying a timm ``pretrained_cfg``)."""
    return built_by(model, "timm") or hasattr(model, "pretrained_cfg")


def _input_size(model, cfg: dict) -> tuple[int, ...] | None:
    size = tuple(cfg.get("input_size") or ()) or None
    img = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if img is not None and not getattr(model.patch_embed, "dynamic_img_size", False):
        img = (img, img) if isinstance(img, int) else tuple(img)
        size = (size[0] if size else 3, *img)
    return size


@hookimpl
def jem_adapter(model, options):
    """The timm adapter for models built by ``timm.create_model``."""
    if not is_timm_model(model):
        return None
    if callable(getattr(model, "get_classifier", None)):
        refuse_removed_classifier(
            model,
            model.get_classifier(),
            "get_classifier()",
            "create it with num_classes=K (timm.create_model(name, num_classes=K)) or call model.reset_classifier(K)",
            options,
        )
    cfg = dict(getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {})
    default = InputDomain.from_normalization(
        cfg.get("mean", IMAGENET_MEAN), cfg.get("std", IMAGENET_STD), input_size=_input_size(model, cfg)
    )
    channels = getattr(model, "in_chans", None) or first_conv_channels(model)
    return TimmAdapter(
        "timm",
        domain=domain_from_options(options, with_channels(default, channels)),
        num_classes=options.get("num_classes", getattr(model, "num_classes", None)) or None,
        logits=options.get("logits"),
        features=options.get("features"),
    )
