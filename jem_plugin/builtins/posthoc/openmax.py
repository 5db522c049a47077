"""OpenMax (Bendale & Boult 2016) and the Weibull tail fits it rests on."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ...errors import InvalidInputError
from . import _memory
from ._base import (
    _ClassConditional,
)

#: libMR's shift: a Weibull tail is fitted to the distances moved to start at this value.
_WEIBULL_SHIFT = 10_000.0


def _weibull_fit(x: Tensor, valid: Tensor, iters: int = 100) -> tuple[Tensor, Tensor]:
    """Maximum-likelihood Weibull fits with location 0 to the rows of ``x`` ``[R, t]`` (positive;
    entries where ``valid`` is False left out): ``(shape, scale)``, ``[R]`` each, float64.

    The shape ``c`` solves ``1/c + mean(log x) - sum(x^c log x) / sum(x^c) = 0`` (its left side
    decreases in ``c``), by bisection in ``log c`` over ``[1e-6, 1e12]``, all rows at once;
    ``scale = mean(x^c)^(1/c)``. scipy's ``weibull_min.fit(x, floc=0)`` and
    ``exponweib.fit(x, floc=0, f0=1)`` (pytorch-ood's) find the same maximum with a generic
    optimiser. A row of equal values has no finite maximum: it gets the largest shape, a step at
    that value."""
    x = x.double()
    m = x.masked_fill(~valid, -math.inf).amax(dim=1, keepdim=True)
    t = torch.where(valid, (x / m).log(), torch.zeros_like(x))  # log(x / max) <= 0: no overflow in x^c
    n = valid.sum(dim=1).to(x.dtype)
    mean_t = t.sum(dim=1) / n
    lo = torch.full_like(mean_t, math.log(1e-6))
    hi = torch.full_like(mean_t, math.log(1e12))
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        c = mid.exp()
        w = torch.softmax((c.unsqueeze(1) * t).masked_fill(~valid, -math.inf), dim=1)  # x^c / sum x^c
        rising = 1.0 / c + mean_t - (w * t).sum(dim=1) > 0
        lo, hi = torch.where(rising, mid, lo), torch.where(rising, hi, mid)
    c = (0.5 * (lo + hi)).exp()
    ct = (c.unsqueeze(1) * t).masked_fill(~valid, -math.inf)
    scale = m.squeeze(1) * ((torch.logsumexp(ct, dim=1) - n.log()) / c).exp()
    return c, scale


def _weibull_cdf(x: Tensor, shape: Tensor, scale: Tensor) -> Tensor:
    """``1 - exp(-(x / scale)^shape)`` for ``x > 0``, else 0 (float64, broadcast)."""
    u = shape * (x.clamp_min(torch.finfo(x.dtype).tiny).log() - scale.log())
    return torch.where(x > 0, -torch.expm1(-u.exp()), torch.zeros_like(x))


class OpenMax(_ClassConditional):
    """OpenMax (Bendale & Boult 2016) on the logits, as pytorch-ood computes it: for each class
    ``c`` the mean logit vector ``mu_c`` of its training inputs (the "mean activation vector")
    and a Weibull fit to the ``tailsize`` largest distances of those inputs to ``mu_c`` (libMR's:
    location 0, the tail moved to start at 10000). A test input's ``alpha`` largest logits
    ``v_j`` (rank ``r = 0, 1, ...``) are revised by ``w_j = (alpha - r) / alpha * CDF_j(dist(v,
    mu_j))``: ``v_j (1 - w_j)`` stays, ``v_0 = sum_j v_j w_j`` is the logit of an "unknown" class;
    the score is minus the softmax probability of that class (in ``[-1, 0]``, higher =
    in-distribution). Distances are ``euclid_weight`` times the Euclidean plus ``1 -
    euclid_weight`` times the cosine distance. Labels as for :class:`Mahalanobis` (all labelled
    inputs, as pytorch-ood; the paper keeps the correctly classified ones).

    The revision assumes activations above zero, as the paper's penultimate-layer vectors are:
    where an input's top logits are far *below* zero (a JEM-trained model gives uniform noise
    logits around -26 where test images have +4), the unknown logit is the most negative of all
    and the input looks in-distribution (AUROC 0.000 against noise on such a model). Use
    ``logpx`` or a feature detector there.

    ``fit`` streams over ``data`` twice (two forward passes): the class sums of the logits
    (``K x K``), then the ``tailsize`` largest distances per class (``K x tailsize``); so the data
    must be iterable twice (a DataLoader, a tensor, a list; not a one-shot generator). The
    Weibull fit is the exact maximum-likelihood one (bisection on the likelihood equation,
    float64), which pytorch-ood's scipy ``exponweib.fit(floc=0, f0=1)`` reaches to its
    optimiser's tolerance.

    Differences from pytorch-ood's ``OpenMax``: its outlier score is ``-score``; it measures the
    distance only to the classes that are the top prediction of some input of the same batch
    (the others count as distance 0, so its scores depend on the batch: equal to ours where each
    of an input's top ``alpha`` classes is predicted for some input of its batch, e.g. always at
    ``alpha=1``); it clips the revised logits at 709 before ``exp`` (ours: log-sum-exp, no clip);
    its class means, distances and shifted tails are float32 (ours float64 from the float32
    logits).
    """

    name = "openmax"
    _memory_formula = staticmethod(_memory.logit_sums)  # the fit's peak
    description = "OpenMax: minus the unknown class's probability from Weibull fits of logit distances (fit; tailsize=25, alpha=10)"
    paper = "Bendale & Boult 2016, Towards Open Set Deep Networks (CVPR)"
    reads = frozenset({"logits"})  # the logits alone: any classifier, whatever its head

    def __init__(self, tailsize: int = 25, alpha: int = 10, euclid_weight: float = 1.0, labels: str = "true") -> None:
        super().__init__()
        self._set_labels(labels)
        for what, v in (("tailsize", tailsize), ("alpha", alpha)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}")
        e = float(euclid_weight)
        if not 0.0 <= e <= 1.0:
            raise ValueError(f"euclid_weight must be in [0, 1], got {euclid_weight!r}")
        self.tailsize, self.alpha, self.euclid_weight = tailsize, alpha, e

    def _options(self) -> dict[str, Any]:
        return {
            "tailsize": self.tailsize,
            "alpha": self.alpha,
            "euclid_weight": self.euclid_weight,
            **super()._options(),
        }

    def _check_reiterable(self, data: Any) -> None:
        if isinstance(data, Iterator):
            raise InvalidInputError(
                "openmax streams over the fit data twice (class means, then the distances to them) and "
                f"got a one-shot iterator ({type(data).__name__}): pass a DataLoader, a list of batches or tensors"
            )

    def _fit_desc(self) -> str:
        return f"fit openmax ({'1/2: class means' if self._tails is None else '2/2: distance tails'})"

    def _begin(self, jm: Any) -> None:
        self._sums: Tensor | None = None
        self._counts: Tensor | None = None
        self._tails: Tensor | None = None  # the second pass's: set once the class means are

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        if self._tails is not None:
            self._add_tail(logits, y)
            return
        k = logits.shape[1]
        y = self._labels(logits, logits, y)
        v = logits.double()
        if self._sums is None:
            self._sums, self._counts = v.new_zeros(k, k), v.new_zeros(k)
        assert self._counts is not None
        self._sums.index_add_(0, y, v)
        self._counts += torch.bincount(y, minlength=k).to(v.dtype)

    def _another_pass(self, jm: Any) -> bool:
        """After the first pass (class means), a second one for the distance tails."""
        if self._tails is None:
            self._set_centres()
            return True
        return False

    def _rank_statistics(self) -> tuple[tuple[str | tuple[str, str], str], ...]:
        """The class sums in the first pass; the distance tails (the largest of every rank's) in the second."""
        return (("_sums", "sum"), ("_counts", "sum")) if self._tails is None else (("_tails", "top"),)

    def _set_centres(self) -> None:
        assert self._sums is not None and self._counts is not None
        self._present = self._counts > 0
        self._centres = self._sums / self._counts.clamp_min(1.0).unsqueeze(1)  # absent classes: 0, never used
        self._tails = torch.full(
            (self._sums.shape[0], self.tailsize), -math.inf, dtype=self._sums.dtype, device=self._sums.device
        )

    def _distance(self, v: Tensor, centres: Tensor) -> Tensor:
        """Distances of the rows of ``v`` to ``centres`` along the last dimension (broadcast)."""
        e = self.euclid_weight
        out = e * (v - centres).norm(dim=-1) if e > 0 else None
        if e < 1:  # NaN for an all-zero row, as pytorch-ood's
            cos = 1.0 - (v * centres).sum(dim=-1) / (v.norm(dim=-1) * centres.norm(dim=-1))
            out = (1.0 - e) * cos if out is None else out + (1.0 - e) * cos
        assert out is not None
        return out

    def _add_tail(self, logits: Tensor, y: Tensor | None) -> None:
        assert self._tails is not None
        y = self._labels(logits, logits, y)
        v = logits.double()
        d = self._distance(v, self._centres[y])
        by_class = v.new_full((self._tails.shape[0], v.shape[0]), -math.inf)
        by_class[y, torch.arange(v.shape[0], device=v.device)] = d
        self._tails = torch.cat([self._tails, by_class], dim=1).topk(self.tailsize, dim=1).values

    def _finish(self, jm: Any) -> None:
        tails = self._tails
        assert tails is not None, "the second pass set the tails"
        valid = tails > -math.inf
        lowest = tails.masked_fill(~valid, math.inf).amin(dim=1)
        present = self._present
        shape, scale = _weibull_fit(tails[present] + _WEIBULL_SHIFT - lowest[present].unsqueeze(1), valid[present])
        nan = torch.full_like(lowest, math.nan)
        self.classes = present.nonzero().squeeze(1)
        self.n_fit = int(self._counts.sum().item())  # type: ignore[union-attr]  # set by _add
        self.weibull_shape = nan.masked_scatter(present, shape)
        self.weibull_scale = nan.masked_scatter(present, scale)
        self.tail_min = nan.masked_scatter(present, lowest[present])
        del self._tails, self._sums, self._counts

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        v = logits.double()
        a = min(self.alpha, v.shape[1])
        act, top = v.topk(a, dim=1)  # descending
        dev = v.device
        d = self._distance(v.unsqueeze(1), self._centres.to(dev)[top])  # [B, a]
        cdf = _weibull_cdf(
            d + _WEIBULL_SHIFT - self.tail_min.to(dev)[top],
            self.weibull_shape.to(dev)[top],
            self.weibull_scale.to(dev)[top],
        )
        cdf = torch.where(self._present.to(dev)[top], cdf, torch.ones_like(cdf))  # a class never fitted: unknown
        w = cdf * (a - torch.arange(a, device=dev, dtype=v.dtype)) / a
        unknown = (act * w).sum(dim=1, keepdim=True)
        revised = torch.cat([unknown, v.scatter(1, top, act * (1.0 - w))], dim=1)
        return -torch.softmax(revised, dim=1)[:, 0].float()
