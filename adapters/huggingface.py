"""Hugging Face adapter: image classifiers whose outputs carry ``.logits``.

Active for ``transformers`` models (and duck-typed stand-ins with a ``config.num_labels``):
``ImageClassifierOutput.logits`` are the logits. Hugging Face image processors mostly
normalise with mean = std = 0.5, i.e. inputs in ``[-1, 1]``; pass ``mean``/``std`` for others.
"""
from __future__ import annotations

from jem_plugin.adapter import Adapter, InputDomain, domain_from_options, wants
from jem_plugin.plugins import hookimpl


def is_hf_model(model) -> bool:
    if type(model).__module__.startswith("transformers."):
        return True
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "num_labels") and hasattr(config, "id2label")


@hookimpl
def jem_adapter(model, options):
    if not wants(options, "huggingface") or not is_hf_model(model):
        return None
    default = InputDomain.from_normalization((0.5,), (0.5,))
    return Adapter(
        "huggingface",
        domain=domain_from_options(options, default),
        num_classes=options.get("num_classes", getattr(model.config, "num_labels", None)),
        logits=options.get("logits", "logits"),
    )
