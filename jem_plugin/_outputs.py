"""What a network computes for a batch, as the post-hoc detectors read it, from one forward.

The feature level of :mod:`jem_plugin.ood`: :class:`Outputs` holds a batch's logits and whichever
of its penultimate features, last feature maps and layer outputs were asked for;
:func:`outputs` computes them in one forward of the network (:meth:`jem_plugin.adapter.Adapter.outputs`).
Detectors fit from and score these (``fit_outputs``, ``score_outputs``), so that many detectors
share one forward per batch (:func:`jem_plugin.ood.evaluate_all`), or a user scores outputs
computed elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ._checks import INPUT_KEYS, DomainCheck, check_input, model_device, same_device, unpack_batch
from .errors import InvalidInputError, NoFeaturesError
from .model import as_jem, sampling_mode

__all__ = ["KINDS", "Outputs", "outputs", "forward_outputs", "labelled_batches", "fit_inputs"]

#: The kinds of output a detector reads (its ``reads``), each computed only when some detector
#: asks for it: ``"logits"`` (always there), ``"features"`` (the penultimate features,
#: :meth:`jem_plugin.JEM.features`), ``"feature_maps"`` (the last feature maps and the function
#: from them to the logits, :meth:`jem_plugin.JEM.feature_maps`) and ``"layers"`` (several
#: layers' outputs, :meth:`jem_plugin.JEM.layer_maps`).
KINDS = ("logits", "features", "feature_maps", "layers")

_HOW = {
    "features": "penultimate features",
    "feature_maps": "feature maps",
    "layers": "layer outputs",
}


def _value(v: Any) -> Any:
    """A kind's value, or raise the error that kept it from being read."""
    if isinstance(v, BaseException):
        raise v
    return v


class Outputs:
    """One batch's outputs of a network, what the detectors fit from and score (the feature
    level, as pytorch-ood's ``fit_features``/``predict_features`` take features).

    - ``logits``: ``[B, K]``.
    - ``features``: ``[B, D]``, the penultimate features (the input of the classifier layer).
    - ``feature_maps``: ``[B, C, H, W]``, the last feature maps before the classifier pools
      them, with ``to_logits``, the function from maps of that shape to the logits (the
      activation-shaping detectors shape them); ``None`` where the network has none.
    - ``layers``: ``{dotted layer name: [B, C, P]}``, several layers' outputs, channels first
      with their ``P`` positions or tokens flattened (the multi-layer detectors read these).

    Leave out what no detector of yours reads. Build them from tensors computed anywhere, or
    with :func:`outputs` (one forward of a wrapped network). A kind the network could not give
    is kept as its error, raised when a detector reads it.
    """

    def __init__(
        self,
        logits: Tensor,
        features: Tensor | None = None,
        feature_maps: Tensor | None = None,
        to_logits: Callable[[Tensor], Tensor] | None = None,
        layers: Mapping[str, Tensor] | None = None,
    ) -> None:
        if not isinstance(logits, Tensor) or logits.dim() != 2:
            raise InvalidInputError(f"logits must be a [B, K] tensor, got {_shape(logits)}")
        self.logits = logits
        self._features: Any = features
        self._maps: Any = feature_maps
        self.to_logits = to_logits
        self._layers: Any = dict(layers) if isinstance(layers, Mapping) else layers

    def __repr__(self) -> str:
        held = [f"logits={tuple(self.logits.shape)}"]
        for kind, v in (("features", self._features), ("feature_maps", self._maps)):
            if v is not None:
                held.append(f"{kind}={_shape(v)}")
        if self._layers:
            held.append(f"layers={list(self._layers) if isinstance(self._layers, dict) else _shape(self._layers)}")
        return f"Outputs({', '.join(held)})"

    def __len__(self) -> int:
        return int(self.logits.shape[0])

    @property
    def features(self) -> Tensor | None:
        """The penultimate features ``[B, D]``, or ``None`` where not computed."""
        return _value(self._features)

    @property
    def feature_maps(self) -> Tensor | None:
        """The last feature maps ``[B, C, H, W]``, or ``None`` (not computed, or none in the network)."""
        return _value(self._maps)

    @property
    def layers(self) -> dict[str, Tensor]:
        """``{layer name: [B, C, P]}`` (empty where not computed)."""
        return _value(self._layers) or {}

    def need(self, kind: str, who: str) -> Any:
        """The value of ``kind`` for the detector ``who``; raises where it was not computed."""
        value = self.logits if kind == "logits" else getattr(self, kind)
        if value is None or (kind == "layers" and not value):
            raise NoFeaturesError(
                f"{who} reads the {_HOW.get(kind, kind)} and these outputs hold none: compute them "
                f"with jem.ood.outputs(jm, x, reads=detector.reads) or pass Outputs({kind}=...)"
            )
        return value

    def layer(self, name: str, who: str) -> Tensor:
        """The output ``[B, C, P]`` of the layer ``name``; raises where it is not held."""
        layers = self.need("layers", who)
        if name not in layers:
            raise NoFeaturesError(
                f"{who} reads the layer {name!r} and these outputs hold {sorted(layers)}: compute them with "
                "jem.ood.outputs(jm, x, reads=detector.reads, layers=detector.layers_read)"
            )
        return layers[name]


def _shape(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"shape {tuple(v.shape)}"
    if isinstance(v, BaseException):
        return f"unavailable ({type(v).__name__})"
    return type(v).__name__


def checked_reads(reads: Collection[str] | str) -> frozenset[str]:
    """``reads`` as a set of :data:`KINDS`; unknown kinds raise ``ValueError`` in one line."""
    kinds = frozenset([reads] if isinstance(reads, str) else reads)
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        raise ValueError(f"unknown output kind(s) {', '.join(map(repr, unknown))}; the kinds are {', '.join(KINDS)}")
    return kinds


def outputs(
    jm: Any, x: Tensor, reads: Collection[str] | str = ("logits",), layers: Sequence[str] | None = None
) -> Outputs:
    """The outputs of the batch ``x`` that ``reads`` names (:data:`KINDS`; a detector's
    ``reads``), from ONE forward of the network (:meth:`jem_plugin.adapter.Adapter.outputs`):
    what :meth:`~jem_plugin.JEM.features`, :meth:`~jem_plugin.JEM.feature_maps` and
    :meth:`~jem_plugin.JEM.layer_maps` give, in their checks and dtypes. ``layers``: the layer
    names for ``"layers"`` (default: :meth:`~jem_plugin.JEM.feature_layers`; a detector's
    ``layers_read``). The model runs in :func:`~jem_plugin.model.sampling_mode` (eval mode,
    frozen, restored after), without autograd. A kind the network cannot give is kept as its
    error (:class:`Outputs`), raised where a detector reads it."""
    core = as_jem(jm, "ood.outputs")
    with sampling_mode(core), torch.no_grad():
        return forward_outputs(core, x, reads, layers)


def forward_outputs(
    core: Any, x: Tensor, reads: Collection[str] | str = ("logits",), layers: Sequence[str] | None = None
) -> Outputs:
    """:func:`outputs` with the model in the mode it is in and autograd as it is (the detectors'
    own fit and score, and :func:`jem_plugin.ood.evaluate_all`, set both once for a whole pass)."""
    kinds = checked_reads(reads)
    names = core._layer_names(layers) if "layers" in kinds else []
    x = core._check_input(x)
    raw = core.adapter.outputs(
        core.model, x, features="features" in kinds, feature_maps="feature_maps" in kinds, layers=names
    )
    logits = core._checked_logits(x, raw["logits"])
    feats = raw.get("features")
    if isinstance(feats, Tensor):
        feats = core._checked_features(x, feats)
    found = raw.get("feature_maps")
    maps: Any = found
    to_logits = None
    if isinstance(found, tuple):
        maps, to_logits = core._checked_maps(x, found) or (None, None)
    layer_maps = raw.get("layers")
    return Outputs(
        logits,
        features=feats,
        feature_maps=maps,
        to_logits=to_logits,
        layers=dict(zip(names, layer_maps)) if isinstance(layer_maps, list) else layer_maps,
    )


def labelled_batches(data: Any, batch_size: int, input_key: str | None) -> tuple[Iterator, int | None, bool]:
    """``(iterator of (x, y or None), number of batches or None, data was in memory)`` of fit
    data: a tensor, an ``(x, y)`` pair of tensors, or an iterable of batches (a DataLoader)."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(t, Tensor) for t in data)
        and data[1].dim() == 1
        and data[0].dim() >= 2
        and data[0].shape[0] == data[1].shape[0]
    ):
        x_all, y_all = data
        return zip(x_all.split(batch_size), y_all.split(batch_size)), -(-x_all.shape[0] // batch_size), True
    if isinstance(data, Tensor):
        if data.dim() < 2:
            raise InvalidInputError(f"expected a batch of inputs [N, ...], got a tensor of shape {tuple(data.shape)}")
        return ((x, None) for x in data.split(batch_size)), -(-data.shape[0] // batch_size), True
    if not hasattr(data, "__iter__"):
        raise InvalidInputError(
            "fit data must be a tensor, an (x, y) pair of tensors or an iterable of batches (e.g. a "
            f"DataLoader), got {type(data).__name__}"
        )
    try:
        n: int | None = len(data)
    except TypeError:
        n = None
    keys = INPUT_KEYS if input_key is None else input_key
    return (unpack_batch(item, input_key=keys) for item in data), n, False


def fit_inputs(
    jm: Any,
    data: Any,
    *,
    batch_size: int,
    progress: bool | None,
    input_key: str | None,
    desc: str,
    stacklevel: int = 3,
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """``(x, labels or None)`` of every batch of fit ``data``, ``x`` checked and on the model's
    device, the model in :func:`~jem_plugin.model.sampling_mode` (eval, frozen) and no autograd
    graph while the caller reads the batch. Empty data raises. ``stacklevel``: where an
    out-of-domain warning points, counted from this generator (3: the line that called the
    function iterating it)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batches, n, in_memory = labelled_batches(data, batch_size, input_key)
    if progress is None:
        progress = not in_memory and sys.stderr.isatty()
    device, dtype, domain_check = model_device(jm), jm.param_dtype(), DomainCheck(batches=1)
    seen = 0
    with (
        sampling_mode(jm),
        torch.no_grad(),
        tqdm(total=n, desc=desc, unit="batch", disable=not progress, leave=False) as bar,
    ):
        for x, y in batches:
            if device is not None and not same_device(x.device, device):
                x = x.to(device, non_blocking=True)
            x = check_input(x, dtype=dtype, domain=jm.domain)
            domain_check(x, jm.domain, desc, stacklevel=stacklevel)
            seen += x.shape[0]
            yield x, None if y is None else y.to(x.device)
            bar.update(1)
    if not seen:
        raise InvalidInputError(f"{desc}: no inputs to fit on, the data is empty")
