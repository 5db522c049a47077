"""timm adapter: reads the model itself (channels, image size) and its pretrained config (mean/std).

timm models expect normalised images, so the domain is ``[0, 1]`` pixels after the model's
``(x - mean) / std``: the space a standard timm data pipeline yields. The channel count is the
first convolution's (``in_chans``); the image size is the patch embedding's when the model fixes
one (ViTs built with ``img_size=32``), else the pretrained config's (CNNs take any size).
"""

from __future__ import annotations

from jem_plugin.adapter import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Adapter,
    InputDomain,
    built_by,
    domain_from_options,
    first_conv_channels,
    with_channels,
)
from jem_plugin.plugins import hookimpl


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
    cfg = dict(getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {})
    default = InputDomain.from_normalization(
        cfg.get("mean", IMAGENET_MEAN), cfg.get("std", IMAGENET_STD), input_size=_input_size(model, cfg)
    )
    channels = getattr(model, "in_chans", None) or first_conv_channels(model)
    return Adapter(
        "timm",
        domain=domain_from_options(options, with_channels(default, channels)),
        num_classes=options.get("num_classes", getattr(model, "num_classes", None)) or None,
        logits=options.get("logits"),
    )
