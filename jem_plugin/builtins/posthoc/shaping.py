"""Activation shaping: ASH-S and SCALE (no fit), ReAct (a clipping percentile fitted on training
activations); each scores the energy of the logits recomputed from the shaped activations."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..._outputs import Outputs, forward_outputs
from ...errors import NotFittedError
from ...model import as_jem
from . import _memory
from ._base import (
    _energy,
    _FittedDetector,
    _head,
    _Sample,
    describe,
)


def _check_percentile(p: float, name: str = "percentile") -> float:
    value = float(p)
    if not 0.0 <= value < 100.0:
        raise ValueError(f"{name} must be in [0, 100) (a percentage, as in the papers: 90, not 0.9), got {p!r}")
    return value


def _kept(d: int, percentile: float) -> int:
    """How many of ``d`` activations the top ``100 - percentile`` % are (at least one), rounded
    as the ASH and SCALE reference code rounds (``np.round``: half to even)."""
    return max(1, d - int(np.round(d * percentile / 100.0)))


def _ratio(s1: Tensor, s2: Tensor) -> Tensor:
    """``s1 / s2``, and 0 where ``s2 == 0`` (a row of all-zero activations is left unscaled, not NaN)."""
    return torch.where(s2 == 0, torch.zeros_like(s1), s1 / s2)


def _ash_s(h: Tensor, percentile: float) -> Tensor:
    """ASH-S on rows: the largest ``100 - percentile`` % of each row kept and scaled by
    ``exp(sum / kept sum)``, the rest zeroed."""
    v, i = torch.topk(h, _kept(h.shape[1], percentile), dim=1)
    return torch.zeros_like(h).scatter_(1, i, v * torch.exp(_ratio(h.sum(dim=1), v.sum(dim=1))).unsqueeze(1))


def _scale_rows(h: Tensor, percentile: float) -> Tensor:
    """SCALE on rows: each row times ``exp(sum / sum of its top 100 - percentile %)``, nothing pruned."""
    s2 = torch.topk(h, _kept(h.shape[1], percentile), dim=1).values.sum(dim=1)
    return h * torch.exp(_ratio(h.sum(dim=1), s2)).unsqueeze(1)


#: What the activation-shaping scores read: the last feature maps, else the penultimate features.
_SHAPED = frozenset({"logits", "feature_maps", "features"})


def _shaped_energy(jm: Any, out: Outputs, what: str, shape: Callable[[Tensor], Tensor]) -> Tensor:
    """The energy ``logsumexp`` of the logits once ``shape`` has reshaped each input's activations:
    its last feature maps, flattened over ``C x H x W``, where the outputs hold them
    (:meth:`jem_plugin.JEM.feature_maps`, the layer the ASH and SCALE papers shape); else its
    penultimate features, through the head."""
    maps = out.feature_maps
    if maps is not None and out.to_logits is not None:
        return torch.logsumexp(out.to_logits(shape(maps.flatten(1)).view_as(maps)).float(), dim=1)
    head = _head(jm, what)
    return _energy(head, shape(out.need("features", what)))


def _ash(jm: Any, out: Outputs, percentile: float = 90.0) -> Tensor:
    """:func:`ash` of a batch's outputs."""
    p = _check_percentile(percentile)
    return _shaped_energy(jm, out, "ash", lambda h: _ash_s(h, p))


def _scale(jm: Any, out: Outputs, percentile: float = 85.0) -> Tensor:
    """:func:`scale` of a batch's outputs."""
    p = _check_percentile(percentile)
    return _shaped_energy(jm, out, "scale", lambda h: _scale_rows(h, p))


@describe(
    name="ash",
    description="ASH-S: energy of pruned, rescaled feature maps (penultimate features without maps; percentile=90)",
    paper="Djurisic et al. 2023, Extremely Simple Activation Shaping for Out-of-Distribution Detection (ICLR)",
    reads=_SHAPED,
    score_outputs=_ash,
)
def ash(jm: Any, x: Tensor, percentile: float = 90.0) -> Tensor:
    """ASH-S (Djurisic et al. 2023): the largest ``100 - percentile`` % of each input's activations
    kept, the rest zeroed, the kept ones scaled by ``exp(sum / kept sum)``; the score is the
    energy ``logsumexp`` of the logits computed from them. The activations are the last feature
    maps (``C x H x W`` per input, as the paper and pytorch-ood shape them) where the adapter
    gives them (:meth:`jem_plugin.JEM.feature_maps`: timm CNNs, torchvision ResNets), else the
    penultimate features (ViTs). Designed for non-negative (post-ReLU) activations."""
    _check_percentile(percentile)
    return _ash(jm, forward_outputs(as_jem(jm, "ash"), x, _SHAPED), percentile)


@describe(
    name="scale",
    description="SCALE: energy of rescaled feature maps (penultimate features without maps; percentile=85)",
    paper="Xu et al. 2024, Scaling for Training Time and Post-hoc Out-of-distribution Detection Enhancement (ICLR)",
    reads=_SHAPED,
    score_outputs=_scale,
)
def scale(jm: Any, x: Tensor, percentile: float = 85.0) -> Tensor:
    """SCALE (Xu et al. 2024): each input's activations scaled by ``exp(sum / sum of the top
    100 - percentile %)``, nothing pruned; the score is the energy of the logits computed from
    them. The activations are the feature maps where the adapter gives them, as for :func:`ash`."""
    _check_percentile(percentile)
    return _scale(jm, forward_outputs(as_jem(jm, "scale"), x, _SHAPED), percentile)


class ReAct(_FittedDetector):
    """ReAct (Sun et al. 2021): the penultimate features clipped at ``c``, the ``percentile``-th
    percentile of the training activations (every unit of every training input), then the
    energy ``logsumexp`` of the head on them.

    ``fit`` keeps a uniform sample of at most ``max_values`` activations (all when there are
    fewer), so the percentile is exact for small sets and within a few 1e-4 quantiles otherwise.
    The sample stays with the detector: set ``percentile`` after fitting and :attr:`threshold`
    follows, no refit (pytorch-ood's ``ReAct`` percentile is ``percentile / 100``).
    """

    name = "react"
    _memory_formula = staticmethod(_memory.react)  # the fit's peak
    description = "ReAct: energy of features clipped at a training percentile (fit; percentile=90)"
    paper = "Sun et al. 2021, ReAct: Out-of-distribution Detection With Rectified Activations (NeurIPS)"
    _rank_stats = (("_sample", "sample"),)
    across_ranks = "gather"

    def __init__(self, percentile: float = 90.0, max_values: int | None = 1_000_000, seed: int = 0) -> None:
        super().__init__()
        self.percentile = _check_percentile(percentile)
        self.max_values, self.seed = max_values, seed

    def _options(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "max_values": self.max_values}

    def _begin(self, jm: Any) -> None:
        _head(jm, "react")
        self._sample = _Sample(self.max_values, self.seed)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._sample.add(feats.reshape(-1))

    def _finish(self, jm: Any) -> None:
        self.activations = self._sample.values().sort().values
        self._threshold: tuple[float, float] | None = None
        del self._sample

    @property
    def threshold(self) -> float:
        """The clipping value: the ``percentile``-th percentile of the fitted activations
        (linear interpolation, as ``numpy.percentile``)."""
        if not self.fitted:
            raise NotFittedError("the react detector is not fitted: call .fit(jm, train_loader) first")
        p = _check_percentile(self.percentile)
        cached = self.__dict__.get("_threshold")
        if cached is not None and cached[0] == p:
            return cached[1]
        a = self.activations
        pos = p / 100.0 * (a.shape[0] - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, a.shape[0] - 1)
        v_lo, v_hi = float(a[lo]), float(a[hi])  # two host syncs, once per percentile
        value = v_lo + (v_hi - v_lo) * (pos - lo)
        self._threshold = (p, value)
        return value

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        return _energy(_head(jm, "react"), feats.clamp(max=self.threshold))
