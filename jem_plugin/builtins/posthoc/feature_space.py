"""Scores of the penultimate features against what the classifier head and the training features
define: SHE (class patterns), NNGuide (energy-weighted neighbours), fDBD (decision-boundary
distances), NCI (neural-collapse alignment) and pNML (the regret of a predictive normalised
maximum likelihood learner)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._checks import user_stacklevel
from ...errors import NoFeaturesError
from . import _memory
from ._base import _ClassConditional, _FeatureMean, _FittedDetector, _head, _RowBank


def _linear_head(jm: Any, what: str) -> tuple[Tensor, Tensor]:
    """``(W [K, D], b [K])`` of the model's classifier head, detached; raises where the head
    is not linear (a weight matrix and an optional bias)."""
    head = _head(jm, what)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise NoFeaturesError(f"{what} needs a linear head (a weight matrix), got {type(head).__name__}")
    bias = getattr(head, "bias", None)
    w = weight.detach()
    return w, bias.detach() if isinstance(bias, Tensor) else w.new_zeros(w.shape[0])


def _top_k_similarities(z: Tensor, bank: Tensor, k: int, chunk: int) -> Tensor:
    """The ``k`` largest inner products of each row of ``z`` with the rows of ``bank`` ``[B, k]``,
    searched in chunks of ``chunk`` bank rows (memory ``B x chunk``)."""
    top = z.new_empty(z.shape[0], 0)
    for start in range(0, bank.shape[0], chunk):
        sims = z @ bank[start : start + chunk].to(z.device, z.dtype).T
        top = torch.cat([top, sims], dim=1).topk(min(k, top.shape[1] + sims.shape[1]), dim=1).values
    return top


class SHE(_ClassConditional):
    """Simplified Hopfield energy (Zhang et al. 2023): ``score(z) = <z, S_yhat>``, the inner
    product of the penultimate features with the pattern of the predicted class, ``S_c`` the mean
    features of the fit inputs of class ``c`` that the model classifies correctly.

    ``labels="true"`` (default) reads the labels of ``(x, y)`` fit batches, as the paper;
    ``labels="predicted"`` takes every fit input as classified correctly (unlabelled data). A
    class with no correctly classified fit input has no pattern: the fit warns in one line,
    naming it, and an input predicted as it is scored against the stored pattern it matches best
    (the memory a Hopfield network would retrieve), where pytorch-ood's ``SHE`` refuses the fit; a
    fit with no correctly classified input at all is refused. ``fit`` streams the per-class sums
    (``K x D``, float64). pytorch-ood's outlier score is minus ours.
    """

    name = "she"
    _memory_formula = staticmethod(_memory.per_class_means)  # the fit's peak
    description = "SHE: inner product of the features with the mean correctly-classified features of the predicted class (fit; labels=)"
    paper = "Zhang et al. 2023, Out-of-Distribution Detection based on In-Distribution Data Patterns Memorization with Modern Hopfield Energy (ICLR)"
    _rank_stats = (("_sums", "sum"), ("_counts", "sum"))

    def __init__(self, labels: str = "true") -> None:
        super().__init__()
        self._set_labels(labels)

    def _begin(self, jm: Any) -> None:
        self._sums: Tensor | None = None
        self._counts: Tensor | None = None

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        k = logits.shape[1]
        labels = self._labels(feats, logits, y)
        right = logits.argmax(dim=1) == labels
        z = feats.double()
        if self._sums is None or self._counts is None:
            self._sums, self._counts = z.new_zeros(k, z.shape[1]), z.new_zeros(k)
        self._sums.index_add_(0, labels[right], z[right])
        self._counts += torch.bincount(labels[right], minlength=k).to(z.dtype)

    def _finish(self, jm: Any) -> None:
        assert self._sums is not None and self._counts is not None
        self.has_pattern = self._counts > 0
        missing = (~self.has_pattern).nonzero().squeeze(1).tolist()
        if len(missing) == len(self._counts):
            raise ValueError(
                "she: no fit input is classified correctly, so no class has a pattern; fit on labelled data "
                "the model classifies (or labels='predicted')"
            )
        if missing:
            warnings.warn(
                f"she: no fit input of class(es) {missing[:10]}{' ...' if len(missing) > 10 else ''} is classified "
                "correctly, so they have no pattern; inputs predicted as them are scored against the closest "
                "pattern of the others. Fit on more data of every class",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        self.patterns = (self._sums / self._counts.clamp_min(1.0).unsqueeze(1)).float()
        del self._sums, self._counts

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        has = self.has_pattern.to(feats.device)
        pred = logits.argmax(dim=1)
        own = (feats * self.patterns.to(feats.device)[pred]).sum(dim=1)
        if bool(has.all()):
            return own
        best = (feats @ self.patterns.to(feats.device)[has].T).max(dim=1).values
        return torch.where(has[pred], own, best)


class NNGuide(_RowBank):
    """Nearest-neighbour guidance (Park et al. 2023): ``score(x) = E(x) * mean_k <z/|z|, b_i>``,
    the energy ``E = logsumexp f(x)`` times the mean of the ``k`` largest inner products of the
    normalised features with a bank ``b_i = E(x_i) z_i/|z_i|`` of training features, each scaled
    by its own energy.

    ``fit`` keeps the bank (``N x D`` floats), or a uniform subsample of ``max_fit`` of it (the
    paper banks 1% of ImageNet). Neighbours are searched in chunks of ``chunk`` bank rows. ``k``
    defaults to pytorch-ood's 10 (the paper and OpenOOD: 100 on a 1% ImageNet bank); not tuned
    here. pytorch-ood's ``NNGuide`` returns minus ours.
    """

    name = "nnguide"
    _memory_formula = staticmethod(_memory.nnguide)  # the fit's peak
    description = "NNGuide: energy times the mean similarity to the k nearest energy-scaled training features (fit; k=10, max_fit=)"
    paper = "Park et al. 2023, Nearest Neighbor Guidance for Out-of-Distribution Detection (ICCV)"

    def __init__(self, k: int = 10, max_fit: int | None = None, seed: int = 0, chunk: int = 65536) -> None:
        super().__init__()
        self.k, self.max_fit, self.seed, self.chunk = self._checked_k(k), max_fit, seed, int(chunk)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._bank_add(F.normalize(feats, dim=1) * torch.logsumexp(logits, dim=1, keepdim=True))

    def _finish(self, jm: Any) -> None:
        self.bank = self._take_bank()

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        guidance = _top_k_similarities(F.normalize(feats, dim=1), self.bank, self.k, self.chunk).mean(dim=1)
        return guidance * torch.logsumexp(logits, dim=1)


class FDBD(_FeatureMean):
    """Fast decision-boundary distance (Liu & Qin 2024): the mean, over the classes ``c`` other
    than the predicted ``yhat``, of the distance of the features to the boundary between them,
    ``|f_yhat - f_c| / |w_yhat - w_c|``, divided by the distance ``|z - mu|`` of the features to
    the mean training features. Hyperparameter-free; the head must be linear (``f = W z + b``).

    ``fit`` streams the mean (float64). pytorch-ood's ``fDBD`` returns minus ours. Two classes
    with equal weight rows have no boundary: their term is infinite, as in pytorch-ood.
    """

    name = "fdbd"
    _memory_formula = staticmethod(_memory.fdbd)  # the fit's peak
    description = "fDBD: mean distance to the decision boundaries over the distance to the training mean (fit)"
    paper = "Liu & Qin 2024, Fast Decision Boundary based Out-of-Distribution Detector (ICML)"

    def _begin(self, jm: Any) -> None:
        super()._begin(jm)
        w, _ = _linear_head(jm, self.name)
        # |w_i - w_j| for every pair, one row block at a time: K x K floats, never the K x K x D
        # differences (8 GB for ImageNet's 1000 classes of 2048 features)
        wf = w.float()
        gaps = torch.cat([(block.unsqueeze(1) - wf.unsqueeze(0)).norm(dim=2) for block in wf.split(16)])
        self._gaps = gaps.fill_diagonal_(1.0)  # the predicted class's own term is 0 / 1

    def _finish(self, jm: Any) -> None:
        self.train_mean = self._take_mean()

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        top, pred = logits.max(dim=1)
        gaps = self._gaps.to(feats.device)[pred]
        boundary = ((top.unsqueeze(1) - logits).abs() / gaps).sum(dim=1)
        dist = (feats - self.train_mean.to(feats.device)).norm(dim=1).clamp_min(1e-8)
        return boundary / ((logits.shape[1] - 1) * dist)


class NCI(_FeatureMean):
    """Neural-collapse inspired detector (Liu & Qin 2025): ``score(z) = (z - mu) . w_yhat / |z - mu|
    + alpha |z|_1``, the alignment of the centred features with the head's weight row of the
    predicted class (``mu`` the mean training features), plus ``alpha`` times their L1 norm.

    ``alpha`` defaults to pytorch-ood's 0 (the alignment alone): it weighs a norm whose scale
    depends on the network, and the paper tunes it per network (OpenOOD: 1e-4 on its ResNets); it
    was not tuned here. ``fit`` streams the mean (float64). pytorch-ood's ``NCI`` returns minus
    ours. The head must be linear. Features at the training mean (features constant across inputs)
    have alignment 0, where pytorch-ood's gives NaN (or a constant, where its float32 mean rounds).
    """

    name = "nci"
    _memory_formula = staticmethod(_memory.head_sized)  # the fit's peak
    description = "NCI: alignment of the centred features with the predicted class's weights, plus alpha times their L1 norm (fit; alpha=0)"
    paper = "Liu & Qin 2025, Detecting Out-of-distribution through the Lens of Neural Collapse (CVPR)"

    def __init__(self, alpha: float = 0.0) -> None:
        super().__init__()
        a = float(alpha)
        if not (a >= 0.0 and math.isfinite(a)):
            raise ValueError(f"alpha must be a non-negative finite number, got {alpha!r}")
        self.alpha = a

    def _options(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def _begin(self, jm: Any) -> None:
        super()._begin(jm)
        self._weight = _linear_head(jm, self.name)[0].float()

    def _finish(self, jm: Any) -> None:
        self.train_mean = self._take_mean()

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        centred = feats - self.train_mean.to(feats.device)
        w = self._weight.to(feats.device)[logits.argmax(dim=1)]
        # features at the training mean (constant features: every input) have no direction; their
        # alignment is 0, not 0 / 0
        norm = centred.norm(dim=1).clamp_min(torch.finfo(centred.dtype).tiny)
        score = (centred * w).sum(dim=1) / norm
        return score + self.alpha * feats.abs().sum(dim=1) if self.alpha > 0 else score


class PNML(_FittedDetector):
    """The pNML regret (Bibas et al. 2021), negated: with ``x = z/|z|`` the normalised features,
    ``P = pinv(X^T X)`` over the normalised training features, ``g = x^T P x / (1 + x^T P x)``
    and ``p`` the softmax of the head applied to ``x``,

    ``score = -log(sum_j p_j / (p_j + (1 - p_j) p_j^g)) / log K``.

    Low where the training features span the input's direction and the classifier is sure.
    ``fit`` streams ``X^T X`` (``D x D``, float64); its pseudo-inverse drops the directions whose
    eigenvalue is below ``D`` float32 epsilons of the largest (the features' rounding, as a
    float32 pseudo-inverse does). The probabilities are clamped to
    ``[eps, 1 - eps]``. As pytorch-ood's ``PNML`` (whose outlier score is minus ours); the
    authors' code also appends a constant 1 to the features before normalising and takes the
    larger of ``g`` and the input's energy outside the training span, which is 0 once the fit set
    has more images than features.
    """

    name = "pnml"
    _memory_formula = staticmethod(_memory.pnml)  # the fit's peak
    description = "minus the pNML regret of the head on the normalised features (fit)"
    paper = "Bibas et al. 2021, Single Layer Predictive Normalized Maximum Likelihood for Out-of-Distribution Detection (NeurIPS)"
    _rank_stats = (("_moment", "sum"),)

    def __init__(self, eps: float = 1e-12) -> None:
        super().__init__()
        e = float(eps)
        if not 0.0 <= e < 0.5:
            raise ValueError(f"eps must be in [0, 0.5), got {eps!r}")
        self.eps = e

    def _begin(self, jm: Any) -> None:
        _head(jm, self.name)
        self._moment: Tensor | None = None

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        x = F.normalize(feats.double(), dim=1)
        self._moment = x.T @ x if self._moment is None else self._moment.addmm_(x.T, x)

    def _finish(self, jm: Any) -> None:
        assert self._moment is not None
        # directions below D * eps of the largest (eps: float32's, the features' precision here)
        # are the features' rounding, not their spread: dropped, as a float32 pseudo-inverse drops
        # them (pytorch-ood's); kept, they would dominate x^T P x
        rtol = self._moment.shape[0] * torch.finfo(torch.float32).eps
        self.projector = torch.linalg.pinv(self._moment, hermitian=True, rtol=rtol)
        del self._moment

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        head = _head(jm, self.name)
        x = F.normalize(feats, dim=1)
        w = next(head.parameters(), None)
        p = torch.softmax(head(x if w is None else x.to(w.dtype)).double(), dim=1).clamp(self.eps, 1.0 - self.eps)
        xd = x.double()
        proj = (xd @ self.projector.to(xd.device) * xd).sum(dim=1)
        g = (proj / (1.0 + proj)).unsqueeze(1)
        regret = torch.log((p / (p + (1.0 - p) * p.pow(g))).sum(dim=1)) / math.log(p.shape[1])
        return -regret.float()
