"""torchvision adapter: classification models from ``torchvision.models``.

All torchvision classification weights use ImageNet normalisation, so the domain is ``[0, 1]``
pixels after ImageNet ``(x - mean) / std``, with the first convolution's channel count (a
1-channel model gets the channel-averaged ImageNet statistics). The class count is read off the
last linear layer. Inception/GoogLeNet auxiliary outputs in training mode are handled (their
``.logits``).

Penultimate features (:meth:`jem_plugin.JEM.features`) are the input of the last ``nn.Linear``
(``fc`` of ResNets, the last layer of ``classifier`` of MobileNets/EfficientNets, ``heads.head``
of ViTs), caught by a forward hook during the one forward. SqueezeNet's classifier is a
convolution, so it has none unless ``wrap(model, features=...)`` says where.
"""

from __future__ import annotations

from torch import nn

from jem_plugin.adapter import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Adapter,
    InputDomain,
    built_by,
    domain_from_options,
    first_conv_channels,
    refuse_removed_classifier,
    with_channels,
)
from jem_plugin.plugins import hookimpl


def _last_linear_out(model: nn.Module) -> int | None:
    out = None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            out = m.out_features
        elif isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1):
            out = m.out_channels  # SqueezeNet's classifier is a 1x1 conv
    return out


@hookimpl
def jem_adapter(model, options):
    """The torchvision adapter for ``torchvision.models`` classifiers."""
    if not built_by(model, "torchvision.models"):
        return None
    name = next(
        (n for n in ("fc", "classifier", "heads", "head") if isinstance(getattr(model, n, None), nn.Module)), None
    )
    if name is not None:
        refuse_removed_classifier(
            model,
            getattr(model, name),
            f"model.{name}",
            f"put back a layer with one output per class in model.{name}",
            options,
        )
    # Spatial size is flexible for torchvision CNNs; 224 is what sampling uses without shape=.
    default = InputDomain.from_normalization(IMAGENET_MEAN, IMAGENET_STD, input_size=(3, 224, 224))
    return Adapter(
        "torchvision",
        domain=domain_from_options(options, with_channels(default, first_conv_channels(model))),
        num_classes=options.get("num_classes", _last_linear_out(model)),
        logits=options.get("logits"),
        features=options.get("features"),
    )
