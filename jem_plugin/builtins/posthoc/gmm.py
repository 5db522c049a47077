"""Class-conditional Gaussian mixture, one covariance per class."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._moments import _GaussianDetector


class GMM(_GaussianDetector):
    """Class-conditional Gaussian mixture: one Gaussian per class, with its own mean ``mu_c`` and
    covariance ``Sigma_c`` (the squared deviations from the class mean over ``N_c``, plus ``reg I``),
    weighted by the class frequency ``pi_c = N_c / N``; the score is the log-likelihood of the
    features under the mixture, ``log sum_c pi_c N(z | mu_c, Sigma_c)``. Unlike
    :class:`Mahalanobis` (one shared covariance, the closest class), each class has its own shape
    and all classes count.

    ``fit`` keeps per-class sums and one ``D x D`` sum of outer products per class, in float64
    around the first batch's mean (``K x D x D``, independent of the data's size), and ends with a
    Cholesky factorisation per class; a covariance that is not positive definite even with
    ``reg`` raises ``ValueError``. Scoring is in float32 (the whitening ``L_c^-T`` of each class,
    classes in chunks: memory ``B x chunk_classes x D``). Labels as for :class:`Mahalanobis`;
    classes absent from the fit data are left out of the mixture.

    The same as pytorch-ood's ``GMM`` (its outlier score is ``-score``: its defaults, the same
    ``reg`` and covariances), which holds every training feature and scores in float64: ours agree
    to float32 rounding (relative ~1e-7 on the scores here).
    """

    name = "gmm"
    description = "log-likelihood under class-conditional Gaussians, one covariance per class (fit; reg=1e-6, labels=)"
    paper = "class-conditional Gaussian discriminant analysis, as pytorch-ood's GMM (no single paper)"
    per_class_covariance = True

    def __init__(self, reg: float = 1e-6, labels: str = "true", chunk_classes: int | None = None) -> None:
        super().__init__()
        self._set_labels(labels)
        value = float(reg)
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"reg must be a non-negative finite number, got {reg!r}")
        if chunk_classes is not None and (not isinstance(chunk_classes, int) or chunk_classes < 1):
            raise ValueError(f"chunk_classes must be a positive integer or None, got {chunk_classes!r}")
        self.reg, self.chunk_classes = value, chunk_classes

    def _options(self) -> dict[str, Any]:
        return {"reg": self.reg, **super()._options()}

    def _finish(self, jm: Any) -> None:
        m = self._moments
        assert m.shift is not None, "fit saw no data"
        present = (m.counts > 0).nonzero().squeeze(1)
        d = m.outer.shape[1]
        eye = torch.eye(d, dtype=m.outer.dtype, device=m.outer.device)
        whiten, log_det = [], []
        for c in present.tolist():  # one class at a time: one D x D float64 matrix of scratch
            n_c = m.counts[c]
            mean = m.sums[c] / n_c
            cov = m.outer[c] / n_c - torch.outer(mean, mean)
            cov = 0.5 * (cov + cov.T) + self.reg * eye
            chol, info = torch.linalg.cholesky_ex(cov)
            if int(info) != 0:
                raise ValueError(
                    f"gmm: the covariance of class {c} is not positive definite ({int(n_c.item())} fit inputs, "
                    f"{d}-d features); increase reg (now {self.reg:g})"
                )
            inv = torch.linalg.solve_triangular(chol, eye, upper=False)  # L^-1: |L^-1 v|^2 = v^T Sigma^-1 v
            whiten.append(inv.T.float())
            log_det.append(2.0 * chol.diagonal().log().sum())
        counts = m.counts[present]
        n = counts.sum()
        self.classes = present
        self.n_fit = int(n.item())
        self._centre = m.shift.float()
        self._means = (m.sums[present] / counts.unsqueeze(1)).float()  # around the centre
        self._whiten = torch.stack(whiten)
        self._const = ((counts / n).log() - 0.5 * (torch.stack(log_det) + d * math.log(2.0 * math.pi))).float()
        del self._moments

    def log_likelihoods(self, feats: Tensor) -> Tensor:
        """``[B, C]``: ``log pi_c + log N(z | mu_c, Sigma_c)`` of each feature row and fitted class
        (:attr:`classes`); the score is their ``logsumexp``."""
        z = feats.float() - self._centre.to(feats.device)
        means, whiten = self._means.to(feats.device), self._whiten.to(feats.device)
        n_cls, d = whiten.shape[0], whiten.shape[1]
        chunk = self.chunk_classes or max(1, (1 << 24) // max(1, z.shape[0] * d))
        maha = []
        for i in range(0, n_cls, chunk):
            diff = z.unsqueeze(0) - means[i : i + chunk].unsqueeze(1)  # [c, B, D]
            maha.append(torch.bmm(diff, whiten[i : i + chunk]).pow(2).sum(dim=2).T)
        return self._const.to(feats.device) - 0.5 * torch.cat(maha, dim=1)

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        return torch.logsumexp(self.log_likelihoods(feats), dim=1)
