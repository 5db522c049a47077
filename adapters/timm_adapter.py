"""timm adapter: reads the model's pretrained config (mean/std, input size, num_classes).

timm models expect normalised images, so the domain is ``[0, 1]`` pixels after the model's
``(x - mean) / std``: the space a standard timm data pipeline yields.
"""
from __future__ import annotations

from jem_plugin.adapter import (IMAGENET_MEAN, IMAGENET_STD, Adapter, InputDomain,
                                domain_from_options, wants)
from jem_plugin.plugins import hookimpl


def is_timm_model(model) -> bool:
    return type(model).__module__.startswith("timm.") or hasattr(model, "pretrained_cfg")


@hookimpl
def jem_adapter(model, options):
    if not wants(options, "timm") or not is_timm_model(model):
        return None
    cfg = dict(getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {})
    default = InputDomain.from_normalization(
        cfg.get("mean", IMAGENET_MEAN), cfg.get("std", IMAGENET_STD), input_size=cfg.get("input_size")
    )
    return Adapter(
        "timm",
        domain=domain_from_options(options, default),
        num_classes=options.get("num_classes", getattr(model, "num_classes", None)) or None,
        logits=options.get("logits"),
    )
