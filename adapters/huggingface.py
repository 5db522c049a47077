"""Hugging Face adapter: image classifiers whose outputs carry ``.logits``.

Active for ``transformers`` models (and duck-typed stand-ins with a ``config.num_labels``):
``ImageClassifierOutput.logits`` are the logits. Pass the model's image processor,
``wrap(model, processor=AutoImageProcessor.from_pretrained(...))``, to take the normalisation
(``image_mean``/``image_std``) and image size from it. Without one the domain is ``[-1, 1]``
(mean = std = 0.5, ViT's processors); ResNet and ConvNeXt processors use ImageNet statistics,
so pass the processor (or ``mean``/``std``) for those. Channels and image size come from
``config.num_channels`` / ``config.image_size``.

Penultimate features (:meth:`jem_plugin.JEM.features`) are the classifier's input: the pooled
output (ResNet, ConvNeXt, Swin) or the normalised class token (ViT), caught by a forward hook on
the last ``nn.Linear`` of ``model.classifier`` during the one forward. A ResNet's feature maps
(for ASH and SCALE) are its pooler's input. The layers ``multi_mahalanobis`` reads are the
encoder's stages or blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from jem_plugin._checks import unwrap_model
from jem_plugin.adapter import (
    Adapter,
    InputDomain,
    built_by,
    domain_from_options,
    last_linear,
    refuse_removed_classifier,
    with_channels,
)
from jem_plugin.plugins import hookimpl


class HuggingFaceAdapter(Adapter):
    """:class:`Adapter` whose features are the input of the model's ``classifier`` head."""

    def head(self, model: Any) -> nn.Module | None:
        """The last ``nn.Linear`` of ``model.classifier`` (ResNet's is ``Flatten`` + ``Linear``)."""
        if self.features_spec is None:
            classifier = getattr(unwrap_model(model), "classifier", None)
            found = last_linear(classifier)
            if found is not None:
                return found
        return super().head(model)

    def _pool_and_head(self, model: Any) -> tuple[nn.Module, Callable[[Tensor], Tensor]] | None:
        """Feature maps (:meth:`~jem_plugin.adapter.Adapter.feature_maps`) of a CNN whose base
        model pools with an ``nn.AdaptiveAvgPool2d`` named ``pooler`` (ResNet): the pooler's input
        and ``classifier(pooler(maps))``, given only where that reproduces the logits. Others
        (ViT's class token, ConvNeXt's normalised mean) have none."""
        core = unwrap_model(model)
        base = getattr(core, getattr(core, "base_model_prefix", "") or "", None)
        pool = getattr(base, "pooler", None)
        classifier = getattr(core, "classifier", None)
        if self.features_spec is not None or not isinstance(pool, nn.AdaptiveAvgPool2d) or classifier is None:
            return None
        return pool, lambda m: classifier(pool(m))

    def feature_layers(self, model: Any) -> list[str] | None:
        """The blocks of the encoder: the elements of the first ``nn.ModuleList`` named
        ``stages``, ``layers`` or ``layer`` (ResNet's and ConvNeXt's stages, Swin's layers, a
        ViT's blocks), else the generic answer."""
        core = unwrap_model(model)
        if isinstance(core, nn.Module):
            for name, mod in core.named_modules():
                if (
                    isinstance(mod, nn.ModuleList)
                    and len(mod)
                    and name.rsplit(".", 1)[-1] in ("stages", "layers", "layer")
                ):
                    return [f"{name}.{i}" for i in range(len(mod))]
        return super().feature_layers(model)


def is_hf_model(model) -> bool:
    """True for ``transformers`` models and stand-ins with ``config.num_labels``/``id2label``."""
    if built_by(model, "transformers"):
        return True
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "num_labels") and hasattr(config, "id2label")


def _size(value) -> tuple[int, int] | None:
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (int(value[0]), int(value[1]))
    if value is None:
        return None
    get = value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))  # dict or SizeDict
    height, width = get("height"), get("width")
    if height and width:
        return (int(height), int(width))
    edge = get("shortest_edge") or get("longest_edge")
    return (int(edge), int(edge)) if edge else None


def domain_from_processor(processor, channels: int, size) -> InputDomain:
    """The domain a Hugging Face image processor's outputs live in."""
    size = (
        _size(getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None)
        or _size(getattr(processor, "size", None))
        or size
    )
    input_size = (channels, *size) if size else None
    if getattr(processor, "do_normalize", True) and getattr(processor, "image_mean", None) is not None:
        return InputDomain.from_normalization(processor.image_mean, processor.image_std, input_size=input_size)
    return InputDomain.from_range(0.0, 1.0, input_size=input_size)


@hookimpl
def jem_adapter(model, options):
    """The Hugging Face adapter: ``.logits`` of the output; domain from ``processor=`` if given."""
    if not is_hf_model(model):
        return None
    refuse_removed_classifier(
        model,
        getattr(model, "classifier", None),
        "model.classifier",
        "load it with num_labels=K (from_pretrained(name, num_labels=K))",
        options,
    )
    config = model.config
    channels = int(getattr(config, "num_channels", 3) or 3)
    size = _size(getattr(config, "image_size", None))
    processor = options.get("processor")
    if processor is not None:
        default = domain_from_processor(processor, channels, size)
    else:
        default = InputDomain.from_normalization(
            (0.5,) * channels, (0.5,) * channels, input_size=(channels, *size) if size else None
        )
    return HuggingFaceAdapter(
        "huggingface",
        domain=domain_from_options(options, with_channels(default, channels)),
        num_classes=options.get("num_classes", getattr(config, "num_labels", None)),
        logits=options.get("logits", "logits"),
        features=options.get("features"),
    )
