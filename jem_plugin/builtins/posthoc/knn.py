"""Deep nearest neighbours (Sun et al. 2022)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._base import (
    _FittedDetector,
    _Sample,
)


class KNN(_FittedDetector):
    """Deep nearest neighbours (Sun et al. 2022): ``score(z) = -||z/|z| - n_k||``, minus the
    Euclidean distance from the normalised features to their ``k``-th nearest normalised training
    feature. ``fit`` keeps the normalised training features (``N x D`` floats), or a uniform
    subsample of ``max_fit`` of them (the paper uses 1% of ImageNet). Neighbours are searched in
    chunks of ``chunk`` training rows, so scoring memory stays ``B x chunk``; the distance of the
    chosen neighbour is then computed directly (not from the dot product)."""

    name = "knn"
    description = "minus the distance to the k-th nearest normalised training feature (fit; k=50, max_fit=)"
    paper = "Sun et al. 2022, Out-of-Distribution Detection with Deep Nearest Neighbors (ICML)"
    _rank_stats = (("_sample", "sample"),)  # across ranks: the bank gathered, every rank holds it all
    across_ranks = "gather"

    def __init__(self, k: int = 50, max_fit: int | None = None, seed: int = 0, chunk: int = 65536) -> None:
        super().__init__()
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        self.k, self.max_fit, self.seed, self.chunk = k, max_fit, seed, int(chunk)

    def _options(self) -> dict[str, Any]:
        return {"k": self.k, "max_fit": self.max_fit}

    def _begin(self, jm: Any) -> None:
        self._sample = _Sample(self.max_fit, self.seed)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._sample.add(F.normalize(feats, dim=1))

    def _finish(self, jm: Any) -> None:
        bank = self._sample.values()
        if bank.shape[0] < self.k:
            raise ValueError(f"knn needs at least k={self.k} training inputs, the fit data has {bank.shape[0]}")
        self.bank = bank
        del self._sample

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        z = F.normalize(feats, dim=1)
        bank = self.bank.to(z.device)
        best_sim: Tensor | None = None
        best_idx: Tensor | None = None
        for start in range(0, bank.shape[0], self.chunk):
            sims = z @ bank[start : start + self.chunk].T
            kk = min(self.k, sims.shape[1])
            s, i = sims.topk(kk, dim=1)
            i = i + start
            if best_sim is not None and best_idx is not None:
                s, j = torch.cat([best_sim, s], 1).topk(min(self.k, best_sim.shape[1] + kk), dim=1)
                i = torch.cat([best_idx, i], 1).gather(1, j)
            best_sim, best_idx = s, i
        assert best_idx is not None
        kth = bank[best_idx[:, self.k - 1]]
        return -(z - kth).norm(dim=1)
