"""Virtual-logit matching (ViM, Wang et al. 2022)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from ..._checks import user_stacklevel
from ...errors import NoFeaturesError
from . import _memory
from ._base import (
    _FittedDetector,
    _head,
    _Sample,
)


class ViM(_FittedDetector):
    """Virtual-logit matching (Wang et al. 2022): ``score = logsumexp f(x) - alpha * ||(z - u) R||``
    with ``u = -pinv(W) b`` the origin the head ``f = W z + b`` defines, ``R`` the eigenvectors of
    ``(z - u)^T (z - u) / N`` outside the ``dim`` principal ones, and ``alpha`` the mean training
    max-logit over the mean training residual norm.

    ``fit`` streams the ``D x D`` moment (float64) and the max-logit sum; the residual norms need
    ``R``, known only at the end, so they are measured on a uniform subsample of at most
    ``max_alpha`` training features (all of them when there are fewer; ``None``: always all).
    ``dim`` defaults to the paper's choices: 1000 for ``D >= 2048``, 512 for ``D >= 768``, else
    ``D // 2``. The head must be linear (``weight``, optional ``bias``). Where the features vary
    in ``dim`` directions or fewer (dead units: a unit always 0 adds a direction without variance),
    the residual holds no training variance and its norms are rounding: the fit warns in one line
    naming a ``dim`` that fits.
    """

    name = "vim"
    _memory_formula = staticmethod(_memory.vim)  # the fit's peak
    description = "ViM: energy minus the scaled residual norm (fit; dim=, max_alpha=)"
    paper = "Wang et al. 2022, ViM: Out-Of-Distribution with Virtual-logit Matching (CVPR)"
    _rank_stats = (("_moment", "sum"), ("_n", "sum"), ("_max_logit_sum", "sum"), ("_sample", "sample"))
    across_ranks = "gather"

    def __init__(self, dim: int | None = None, max_alpha: int | None = 10_000, seed: int = 0) -> None:
        super().__init__()
        if dim is not None and (not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be a positive integer or None, got {dim!r}")
        self.dim, self.max_alpha, self.seed = dim, max_alpha, seed

    def _options(self) -> dict[str, Any]:
        return {"dim": self.dim, "max_alpha": self.max_alpha}

    def _begin(self, jm: Any) -> None:
        head = _head(jm, "vim")
        weight = getattr(head, "weight", None)  # the user's classifier head: nn.Linear or anything alike
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise NoFeaturesError(f"vim needs a linear head (a weight matrix), got {type(head).__name__}")
        bias = getattr(head, "bias", None)
        w = weight.detach().double()
        b = bias.detach().double() if isinstance(bias, Tensor) else w.new_zeros(w.shape[0])
        self._u = -(torch.linalg.pinv(w) @ b)
        self._moment = w.new_zeros(w.shape[1], w.shape[1])
        self._n = 0
        self._max_logit_sum = w.new_zeros(())
        self._sample = _Sample(self.max_alpha, self.seed)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        x = feats.double() - self._u.to(feats.device)
        self._moment = self._moment.to(feats.device).addmm_(x.T, x)
        self._n += feats.shape[0]
        self._max_logit_sum = self._max_logit_sum.to(feats.device) + logits.max(dim=1).values.double().sum()
        self._sample.add(feats)

    def _finish(self, jm: Any) -> None:
        d_all = self._moment.shape[0]
        dim = self.dim if self.dim is not None else (1000 if d_all >= 2048 else 512 if d_all >= 768 else d_all // 2)
        if not 1 <= dim < d_all:
            raise ValueError(f"vim's principal dimension must be in [1, {d_all}) for {d_all}-d features, got {dim}")
        evals, evecs = torch.linalg.eigh(self._moment / self._n)
        residual = evecs[:, : d_all - dim]  # eigh sorts ascending: the smallest D - dim directions
        raw = self._sample.values()
        _warn_dead_cut(evals, dim, raw.dtype, self._n)
        sample = raw.double() - self._u.to(self._moment.device)
        alpha = (self._max_logit_sum / self._n) / (sample @ residual).norm(dim=1).mean()
        self.principal_dim = dim
        self.alpha = float(alpha.item())
        self._residual = residual.float()
        self._origin = self._u.float().to(residual.device)
        del self._moment, self._sample

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        vlogit = ((feats - self._origin.to(feats.device)) @ self._residual.to(feats.device)).norm(dim=1)
        return torch.logsumexp(logits, dim=1) - self.alpha * vlogit


def _warn_dead_cut(evals: Tensor, dim: int, feature_dtype: torch.dtype, n: int) -> None:
    """Warn where ViM's cut at ``dim`` leaves only near-zero eigenvalues (``evals``, ascending, of
    the features' moment) in the residual: directions the fit features do not vary in (dead units,
    units that copy others), whose residual norms are rounding and differ between two fits of the
    same data (two ranks against one process)."""
    d = evals.shape[0]
    top = float(evals[-1].clamp_min(0.0))
    eps = torch.finfo(feature_dtype if feature_dtype.is_floating_point else torch.float32).eps
    # Near zero: below the variance the features' own rounding puts in every direction (ten units in
    # the last place, relative to their mean square, which the largest eigenvalue bounds; times how
    # far N x D noise's largest singular value exceeds sqrt(N)), or float64's rank tolerance.
    tol = top * max((10.0 * eps) ** 2 * (1.0 + math.sqrt(d / max(n, 1))) ** 2, d * torch.finfo(torch.float64).eps)
    live = int((evals > tol).sum())
    if live > dim:
        return
    fix = (
        f"pass dim={max(1, live // 2)} (any dim below {live})"
        if live >= 2
        else "vim needs features that vary in at least two directions"
    )
    warnings.warn(
        f"vim: the fit features vary in {live} of {d} directions (the other {d - live} are dead units or copies "
        f"of others), so the cut at dim={dim} leaves a residual without training variance, whose norms are "
        f"rounding and its scores arbitrary; {fix}",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )
