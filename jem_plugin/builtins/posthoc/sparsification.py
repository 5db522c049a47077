"""Weight sparsification: DICE keeps the head's weights that contribute most on training data."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _memory
from ._base import _FeatureMean
from .feature_space import _linear_head
from .shaping import _check_percentile


def _quantile(sorted_values: Tensor, q: float) -> Tensor:
    """The ``q``-quantile (``q`` in [0, 1]) along dim 0 of values sorted along it, interpolated
    linearly between the two nearest ranks (``numpy.quantile``'s and ``torch.quantile``'s
    default), with no limit on the input's size (``torch.quantile`` takes at most 2^24 values)."""
    n = sorted_values.shape[0]
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class DICE(_FeatureMean):
    """DICE (Sun & Li 2022): the head's weights sparsified, then the energy of the logits. The
    contribution of weight ``W_cj`` is ``W_cj * m_j``, ``m`` the mean training features; the
    ``p`` % of the ``K x D`` contributions that are smallest are masked out (the ``p``-th
    percentile of the contributions, linear interpolation, is the cut: weights above it are
    kept), and ``score(z) = logsumexp((W * mask) z + b)``.

    ``p`` in percent as the paper (pytorch-ood's ``p`` is a fraction: ``p / 100``); 90 is the
    paper's and OpenOOD's choice for CIFAR (the paper uses 70 on ImageNet). ``fit`` streams the
    mean (float64); set ``p`` after fitting and the mask follows, no refit. The head must be
    linear. pytorch-ood's ``DICE`` returns minus ours.
    """

    name = "dice"
    _memory_formula = staticmethod(_memory.head_sized)  # the fit's peak
    description = "DICE: energy of the logits from the head with its p% least contributing weights masked (fit; p=90)"
    paper = "Sun & Li 2022, DICE: Leveraging Sparsification for Out-of-Distribution Detection (ECCV)"

    def __init__(self, p: float = 90.0) -> None:
        super().__init__()
        self.p = _check_percentile(p, "p")

    def _options(self) -> dict[str, Any]:
        return {"p": self.p}

    def _begin(self, jm: Any) -> None:
        super()._begin(jm)
        w, b = _linear_head(jm, self.name)
        self._weight, self._bias = w.float(), b.float()

    def _finish(self, jm: Any) -> None:
        self.mean_activation = self._take_mean().to(self._weight.device)
        self._masked: tuple[float, Tensor] | None = None

    @property
    def masked_weight(self) -> Tensor:
        """The head's weight with the ``p`` % least contributing entries set to 0."""
        self._check_fitted()
        p = _check_percentile(self.p, "p")
        cached = self.__dict__.get("_masked")
        if cached is not None and cached[0] == p:
            return cached[1]
        contrib = self.mean_activation.unsqueeze(0) * self._weight
        cut = _quantile(contrib.flatten().sort().values, p / 100.0)
        masked = torch.where(contrib > cut, self._weight, torch.zeros_like(self._weight))
        self._masked = (p, masked)
        return masked

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        w = self.masked_weight.to(feats.device)
        return torch.logsumexp(feats @ w.T + self._bias.to(feats.device), dim=1)
