"""Generic adapter: any module (or callable) returning logits; asked last.

The output may be a ``[B, K]`` tensor, a dict with a ``"logits"`` key, an object with a
``.logits`` attribute, or anything else the user points at with ``wrap(model, logits=...)``.
Inputs default to the paper's domain ``[-1, 1]``; override with ``data_range`` or ``mean``/``std``.
The input shape, unless given as ``input_size=``, is fixed by the first batch the model sees.
Penultimate features (:meth:`jem_plugin.JEM.features`) are the input of the model's last
``nn.Linear``, caught by a forward hook; ``wrap(model, features="name")`` names another layer.
"""

from __future__ import annotations

from jem_plugin.adapter import Adapter, InputDomain, domain_from_options
from jem_plugin.plugins import hookimpl


@hookimpl(trylast=True)
def jem_adapter(model, options):
    """Accept any model: the ``[-1, 1]`` domain unless the options say otherwise."""
    return Adapter(
        "generic",
        domain=domain_from_options(options, InputDomain()),
        num_classes=options.get("num_classes"),
        logits=options.get("logits"),
        features=options.get("features"),
    )
