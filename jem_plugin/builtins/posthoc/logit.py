"""Scores of the logits alone: the softmax entropy, the weighted energy of VOS, and KL matching
to the typical posterior of each predicted class (fitted)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..._checks import unwrap_model
from ..._outputs import Outputs
from ...errors import InvalidInputError
from ...model import as_jem
from . import _memory
from ._base import _FittedDetector, describe


def _entropy(jm: Any, out: Outputs) -> Tensor:
    """:func:`entropy` of a batch's outputs (its logits)."""
    logp = torch.log_softmax(out.logits.double(), dim=1)
    return (logp.exp() * logp).sum(dim=1).float()


@describe(
    name="entropy",
    description="minus the entropy of the softmax probabilities, sum_j p_j log p_j",
    paper="Chan et al. 2021, Entropy Maximization and Meta Classification for Out-of-Distribution Detection in Semantic Segmentation (ICCV)",
    reads=("logits",),
    score_outputs=_entropy,
)
def entropy(jm: Any, x: Tensor) -> Tensor:
    """Minus the Shannon entropy of the softmax probabilities, ``sum_j p_j log p_j`` (Chan et al.
    2021): a flat posterior (high entropy) scores low. Reads the logits.

    Computed from ``log_softmax`` in float64, exactly; pytorch-ood's ``Entropy`` clips the
    probabilities at ``1e-7`` before the log, which moves the score by less than ``K * 1e-6``
    (``K`` classes): ours = -theirs to that accuracy.
    """
    return _entropy(jm, Outputs(as_jem(jm, "entropy").logits(x)))


def _class_weights(jm: Any, weights: Any, k: int) -> Tensor:
    """weighted_ebo's ``[K]`` weights: a tensor, a module whose ``weight`` holds them (VOS's
    ``nn.Linear(K, 1)``), or ``None`` for the model's own ``weight_energy`` layer where it has one,
    else ones."""
    if weights is None:
        weights = getattr(unwrap_model(as_jem(jm, "weighted_ebo").model), "weight_energy", None)
        if weights is None:
            return torch.ones(k)
    if isinstance(weights, nn.Module):
        weights = getattr(weights, "weight", None)
    if not isinstance(weights, Tensor):
        weights = torch.as_tensor(weights, dtype=torch.float32) if weights is not None else None
    if weights is None or weights.numel() != k or weights.dim() > 2:
        shape = None if weights is None else tuple(weights.shape)
        raise InvalidInputError(
            f"weighted_ebo needs one weight per class: a [{k}] or [1, {k}] tensor or an nn.Linear({k}, 1), got {shape}"
        )
    return weights.detach().reshape(-1)


def _weighted_ebo(jm: Any, out: Outputs, weights: Any = None) -> Tensor:
    """:func:`weighted_ebo` of a batch's outputs (its logits)."""
    logits = out.logits.float()
    w = _class_weights(jm, weights, logits.shape[1]).to(logits.device, torch.float32).relu()
    if not bool((w > 0).any()):
        raise InvalidInputError("weighted_ebo: every class weight is 0 or negative, so the weighted energy is -inf")
    return torch.logsumexp(logits + w.log(), dim=1)


@describe(
    name="weighted_ebo",
    description="VOS's weighted energy log sum_j relu(w_j) exp f_j (weights=; default the model's weight_energy, else ones)",
    paper="Du et al. 2022, VOS: Learning What You Don't Know by Virtual Outlier Synthesis (ICLR)",
    reads=("logits",),
    score_outputs=_weighted_ebo,
)
def weighted_ebo(jm: Any, x: Tensor, weights: Any = None) -> Tensor:
    """VOS's weighted energy (Du et al. 2022): ``log sum_j relu(w_j) exp f_j(x)``, the energy of
    the logits with a learned non-negative weight per class. Reads the logits.

    ``weights``: ``[K]`` or ``[1, K]`` (a tensor, or VOS's ``nn.Linear(K, 1)`` whose ``weight``
    they are). ``None`` (the default) reads the layer the VOS code trains, the model's
    ``weight_energy`` attribute, where it has one; otherwise every weight is 1 and the score is
    the energy (``logpx``). Computed as ``logsumexp(f + log relu(w))``, so large logits do not
    overflow where pytorch-ood's ``WeightedEBO`` (``log sum w exp f``, outlier score = -ours)
    returns ``inf``.
    """
    return _weighted_ebo(jm, Outputs(as_jem(jm, "weighted_ebo").logits(x)), weights)


class KLMatching(_FittedDetector):
    """KL matching (Hendrycks et al. 2022): ``score = -min_k KL(p(x) || d_k)``, ``d_k`` the mean
    softmax posterior of the fit inputs the model predicts as class ``k`` (no labels needed: a
    validation set of in-distribution images is what the paper fits on), the minimum over the
    classes predicted at least once. Reads the logits.

    ``fit`` streams the per-class sums of the posteriors (``K x K``, float64). pytorch-ood's
    ``KLMatching`` fits the same ``d_k`` and returns ``min_k KL``: ours = -theirs.
    """

    name = "kl_matching"
    _memory_formula = staticmethod(_memory.logit_sums)  # the fit's peak
    description = "minus the KL divergence of the posterior to the mean posterior of its predicted class (fit)"
    paper = "Hendrycks et al. 2022, Scaling Out-of-Distribution Detection for Real-World Settings (ICML)"
    reads = frozenset({"logits"})  # the logits alone: any classifier, whatever its head
    _rank_stats = (("_sums", "sum"), ("_counts", "sum"))

    def _begin(self, jm: Any) -> None:
        self._sums: Tensor | None = None
        self._counts: Tensor | None = None

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        p = torch.softmax(logits.double(), dim=1)
        k = p.shape[1]
        if self._sums is None or self._counts is None:
            self._sums, self._counts = p.new_zeros(k, k), p.new_zeros(k)
        pred = p.argmax(dim=1)
        self._sums.index_add_(0, pred, p)
        self._counts += torch.bincount(pred, minlength=k).to(p.dtype)

    def _finish(self, jm: Any) -> None:
        assert self._sums is not None and self._counts is not None
        present = self._counts > 0
        self.classes = present.nonzero().squeeze(1)
        self.posteriors = self._sums[present] / self._counts[present].unsqueeze(1)
        # log 0 (a class no fit input gives any probability): the smallest normal float64 instead,
        # so that a probability of 0 adds nothing and a positive one a near-infinite divergence
        self._log_post = self.posteriors.clamp_min(torch.finfo(torch.float64).tiny).log()
        del self._sums, self._counts

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        logp = torch.log_softmax(logits.double(), dim=1)
        p = logp.exp()
        kl = (p * logp).sum(dim=1, keepdim=True) - p @ self._log_post.to(p.device).T
        return -kl.min(dim=1).values.float()
