"""Class-conditional Gaussian mixture, one covariance per class."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import _memory
from ._moments import _ClassMoments, _GaussianDetector


class GMM(_GaussianDetector):
    """Class-conditional Gaussian mixture: one Gaussian per class, with its own mean ``mu_c`` and
    covariance ``Sigma_c`` (the squared deviations from the class mean over ``N_c``, plus ``reg I``),
    weighted by the class frequency ``pi_c = N_c / N``; the score is the log-likelihood of the
    features under the mixture, ``log sum_c pi_c N(z | mu_c, Sigma_c)``. Unlike
    :class:`Mahalanobis` (one shared covariance, the closest class), each class has its own shape
    and all classes count.

    ``covariance`` (scikit-learn's ``GaussianMixture`` names): ``"full"`` (default, one
    covariance per class, as above), ``"tied"`` (one covariance shared by the classes, the
    within-class covariance, as :class:`Mahalanobis`'s but with every class's likelihood summed)
    or ``"diag"`` (per class, the diagonal only: the features taken as independent given the
    class). ``"full"`` holds ``K x D x D`` floats: 1000 classes of 2048 features (ImageNet on a
    ResNet-50) need 34 GB, which the fit refuses before it starts (``memory_limit``, see the
    post-hoc guide's "Large data"); ``"tied"`` holds one ``D x D``, ``"diag"`` ``K x D``.

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
    _memory_formula = staticmethod(_memory.gmm)  # the fit's peak
    description = "log-likelihood under class-conditional Gaussians, one covariance per class (fit; reg=1e-6, labels=)"
    paper = "class-conditional Gaussian discriminant analysis, as pytorch-ood's GMM (no single paper)"

    def __init__(
        self, reg: float = 1e-6, labels: str = "true", chunk_classes: int | None = None, covariance: str = "full"
    ) -> None:
        super().__init__()
        self._set_labels(labels)
        if covariance not in ("full", "tied", "diag"):
            raise ValueError(f"covariance must be 'full', 'tied' or 'diag', got {covariance!r}")
        self.covariance = covariance
        value = float(reg)
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"reg must be a non-negative finite number, got {reg!r}")
        if chunk_classes is not None and (not isinstance(chunk_classes, int) or chunk_classes < 1):
            raise ValueError(f"chunk_classes must be a positive integer or None, got {chunk_classes!r}")
        self.reg, self.chunk_classes = value, chunk_classes

    def _options(self) -> dict[str, Any]:
        return {
            "reg": self.reg,
            **({"covariance": self.covariance} if self.covariance != "full" else {}),
            **super()._options(),
        }

    def _begin(self, jm: Any) -> None:
        self._moments = _ClassMoments(per_class_outer=self.covariance == "full", diagonal=self.covariance == "diag")

    def _whitener(self, cov: Tensor, eye: Tensor, what: str, n_c: float) -> tuple[Tensor, Tensor]:
        """``(L^-T, log det)`` of ``cov + reg I`` (``L`` its Cholesky factor), float64."""
        cov = 0.5 * (cov + cov.T) + self.reg * eye
        chol, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0:
            raise ValueError(
                f"gmm: the covariance of {what} is not positive definite ({int(n_c)} fit inputs, "
                f"{cov.shape[0]}-d features); increase reg (now {self.reg:g})"
            )
        inv = torch.linalg.solve_triangular(chol, eye, upper=False)  # L^-1: |L^-1 v|^2 = v^T Sigma^-1 v
        return inv.T, 2.0 * chol.diagonal().log().sum()

    def _finish(self, jm: Any) -> None:
        m = self._moments
        assert m.shift is not None, "fit saw no data"
        present = (m.counts > 0).nonzero().squeeze(1)
        counts = m.counts[present]
        n = counts.sum()
        d = m.sums.shape[1]
        means = m.sums[present] / counts.unsqueeze(1)  # around the shift
        eye = torch.eye(d, dtype=m.sums.dtype, device=m.sums.device) if self.covariance != "diag" else None
        if self.covariance == "full":
            whiten, log_det = [], []
            for i, c in enumerate(present.tolist()):  # one class at a time: one D x D float64 matrix of scratch
                n_c = m.counts[c]
                assert eye is not None
                w, ld = self._whitener(
                    m.outer[c] / n_c - torch.outer(means[i], means[i]), eye, f"class {c}", float(n_c)
                )
                whiten.append(w.float())
                log_det.append(ld)
            self._whiten = torch.stack(whiten)
            dets = torch.stack(log_det)
        elif self.covariance == "tied":  # the within-class covariance, as mahalanobis's
            assert eye is not None
            w, ld = self._whitener((m.outer - m.sums[present].T @ means) / n, eye, "the classes", float(n))
            self._whiten = w.float().unsqueeze(0)
            dets = ld.expand(len(present))
        else:  # per class, the variances alone
            var = m.outer[present] / counts.unsqueeze(1) - means.square() + self.reg
            if bool((var <= 0).any()):
                raise ValueError(f"gmm: a feature does not vary within its class; increase reg (now {self.reg:g})")
            self._whiten = var.rsqrt().float()  # [C, D]: the whitening is elementwise
            dets = var.log().sum(dim=1)
        self.classes = present
        self.n_fit = int(n.item())
        self._centre = m.shift.float()
        self._means = means.float()  # around the centre
        self._const = ((counts / n).log() - 0.5 * (dets + d * math.log(2.0 * math.pi))).float()
        del self._moments

    def log_likelihoods(self, feats: Tensor) -> Tensor:
        """``[B, C]``: ``log pi_c + log N(z | mu_c, Sigma_c)`` of each feature row and fitted class
        (:attr:`classes`); the score is their ``logsumexp``."""
        z = feats.float() - self._centre.to(feats.device)
        means, whiten = self._means.to(feats.device), self._whiten.to(feats.device)
        const = self._const.to(feats.device)
        if self.covariance == "tied":  # one whitening: squared distances of whitened rows
            zw, mw = z @ whiten[0], means @ whiten[0]
            sq = zw.pow(2).sum(1, keepdim=True) - 2.0 * zw @ mw.T + mw.pow(2).sum(1).unsqueeze(0)
            return const - 0.5 * sq.clamp_min(0.0)
        if self.covariance == "diag":  # sum_j ((z_j - mu_cj) / s_cj)^2, expanded: three matmuls
            w2 = whiten.square()
            sq = z.square() @ w2.T - 2.0 * z @ (means * w2).T + (means.square() * w2).sum(1).unsqueeze(0)
            return const - 0.5 * sq.clamp_min(0.0)
        n_cls, d = whiten.shape[0], whiten.shape[1]
        chunk = self.chunk_classes or max(1, (1 << 24) // max(1, z.shape[0] * d))
        maha = []
        for i in range(0, n_cls, chunk):
            diff = z.unsqueeze(0) - means[i : i + chunk].unsqueeze(1)  # [c, B, D]
            maha.append(torch.bmm(diff, whiten[i : i + chunk]).pow(2).sum(dim=2).T)
        return const - 0.5 * torch.cat(maha, dim=1)

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        return torch.logsumexp(self.log_likelihoods(feats), dim=1)
