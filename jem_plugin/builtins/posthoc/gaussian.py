"""Class-conditional Gaussians with a shared covariance: Mahalanobis, its relative and
input-preprocessed variants, and Lee et al.'s multi-layer feature ensemble."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..._checks import (
    model_device,
)
from ..._outputs import Outputs
from ...model import as_jem, input_grad_enabled, sampling_mode
from . import _memory
from ._base import (
    _checked_layers,
    _ClassConditional,
    _input_step,
)
from ._moments import _GaussianDetector, _warn_few, _warn_flat, _whitener


def _sq_dists(a: Tensor, b: Tensor) -> Tensor:
    """``[A, B]`` squared Euclidean distances, by the expansion (one matmul, no ``[A, B, D]``)."""
    d = a.pow(2).sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.pow(2).sum(1).unsqueeze(0)
    return d.clamp_min_(0.0)


class Mahalanobis(_GaussianDetector):
    """Mahalanobis distance to the closest class mean under a shared covariance (Lee et al. 2018),
    on the penultimate features, without input preprocessing or feature ensembles:
    ``score(z) = -min_c (z - mu_c)^T Sigma^+ (z - mu_c)`` with ``Sigma`` the within-class
    covariance (the sum of squared deviations from each class mean over ``N``, as scikit-learn's
    ``EmpiricalCovariance`` of the centred features in the authors' code) and ``^+`` its
    pseudo-inverse (directions of zero variance, such as dead ReLU units, are ignored, and so are
    those whose variance is no more than the features' own rounding: see
    :meth:`_ClassMoments.rounding_floor`).

    ``fit`` keeps per-class sums and one ``D x D`` sum of outer products, accumulated in float64
    around the first batch's mean, so the memory does not grow with the data. Labels come from the
    data (``(x, y)`` batches); ``labels="predicted"`` uses the model's predictions instead, for
    unlabelled data. Classes absent from the fit data are left out of the minimum.

    pytorch-ood's ``Mahalanobis`` returns ``0.5 * min_c d_c`` computed with the *sum* of squared
    deviations (not divided by ``N``) plus ``1e-6 I``: its outlier score is ``-score / (2 N)``.
    """

    name = "mahalanobis"
    _memory_formula = staticmethod(_memory.mahalanobis)  # the fit's peak
    description = "class-conditional Mahalanobis distance, shared covariance (fit; labels=)"
    paper = "Lee et al. 2018, A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks (NeurIPS)"
    #: warn when the fit features do not vary within their classes or the fit has fewer images
    #: than features (:class:`MultiMahalanobis` turns it off for its per-layer parts and warns once
    #: for all layers)
    warn_fit = True

    def __init__(self, labels: str = "true") -> None:
        super().__init__()
        self._set_labels(labels)

    def _finish(self, jm: Any) -> None:
        m = self._moments
        assert m.shift is not None, "fit saw no data"
        present = m.counts > 0
        sums, counts = m.sums[present], m.counts[present]
        n = counts.sum()
        means = sums / counts.unsqueeze(1)  # around the shift
        within = (m.outer - sums.T @ means) / n
        w = _whitener(0.5 * (within + within.T), m.rounding_floor())
        self.classes = present.nonzero().squeeze(1)
        self.n_fit = int(n.item())
        if self.warn_fit and w.shape[1] == 0:
            _warn_flat(self.name, self.n_fit, len(self.classes))
        elif self.warn_fit and self.n_fit - len(self.classes) < w.shape[0]:
            _warn_few(self.name, self.n_fit, len(self.classes), {"": w.shape[0]})
        self._w = w.float()
        self._centre = m.shift.float()
        self._means_w = (means @ w).float()
        self._total = (m.sums.sum(0), n)  # for the relative variant
        del self._moments

    def _class_dists(self, feats: Tensor) -> Tensor:
        zw = (feats - self._centre.to(feats.device)) @ self._w.to(feats.device)
        return _sq_dists(zw, self._means_w.to(feats.device))

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        return -self._class_dists(feats).min(dim=1).values


class RelativeMahalanobis(Mahalanobis):
    """Relative Mahalanobis distance (Ren et al. 2021): the class-conditional distance minus the
    distance under one Gaussian fitted to all the data (``mu_0``, ``Sigma_0``):
    ``score(z) = -min_c [MD_c(z) - MD_0(z)]``. Same streaming fit as :class:`Mahalanobis` (the
    background covariance comes from the same sums). pytorch-ood's ``RMD`` uses sums of squared
    deviations, not covariances: its outlier score is ``-score / N``."""

    name = "relative_mahalanobis"
    description = "Mahalanobis minus the distance under one Gaussian of all data (fit; labels=)"
    paper = "Ren et al. 2021, A Simple Fix to Mahalanobis Distance for Improving Near-OOD Detection (arXiv:2106.09022)"

    def _finish(self, jm: Any) -> None:
        outer = self._moments.outer  # the finish below lets go of the running sums
        floor = self._moments.rounding_floor()
        super()._finish(jm)
        total, n = self._total
        mean0 = total / n
        cov0 = outer / n - torch.outer(mean0, mean0)
        w0 = _whitener(0.5 * (cov0 + cov0.T), floor)
        self._w0 = w0.float()
        self._mean0_w = (mean0 @ w0).float()

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        z0 = (feats - self._centre.to(feats.device)) @ self._w0.to(feats.device)
        md0 = (z0 - self._mean0_w.to(feats.device)).pow(2).sum(dim=1)
        return -(self._class_dists(feats).min(dim=1).values - md0)


class MahalanobisODIN(Mahalanobis):
    """:class:`Mahalanobis` with Lee et al.'s input preprocessing (2018): the input is moved by
    ``eps`` against the gradient sign of its squared distance to the closest class mean,
    ``x' = x - eps * sign(d/dx (z(x) - mu_c)^T Sigma^+ (z(x) - mu_c))``, and scored as
    :class:`Mahalanobis` scores ``x'``. Fitted as :class:`Mahalanobis` (the same streaming fit and
    state); scoring costs a forward and a backward pass more (an input gradient: ``needs_grad``).

    ``eps`` is in units of the ``[0, 1]`` pixel range, as :func:`odin`'s: the step is
    ``eps * (high - low)`` per channel of the model's domain, i.e. pytorch-ood's ``eps`` with
    ``norm_std`` for normalised images; its default (0.002) is pytorch-ood's. ``eps=0`` is
    :class:`Mahalanobis`.

    pytorch-ood's ``MahalanobisODIN`` returns its ``Mahalanobis`` score of ``x'``: ours is ``-2 N``
    times its outlier score (the scale of :class:`Mahalanobis`). It takes the gradient with its
    ridge-regularised inverse of the summed covariance, ours with the pseudo-inverse of the
    covariance: the same step where the features span their space, a different one where units
    are dead or collinear (its ridge then weighs the empty directions by ~1e6).
    """

    name = "mahalanobis_odin"
    description = "Mahalanobis after an eps input step towards the closest class mean (fit; eps=0.002, labels=)"
    paper = "Lee et al. 2018, A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks (NeurIPS)"
    needs_grad = True

    def __init__(self, eps: float = 0.002, labels: str = "true") -> None:
        super().__init__(labels)
        value = float(eps)
        if not (value >= 0.0 and math.isfinite(value)):
            raise ValueError(f"eps must be a non-negative finite number, got {eps!r}")
        self.eps = value

    def _options(self) -> dict[str, Any]:
        return {"eps": self.eps, **super()._options()}

    def perturb(self, jm: Any, x: Tensor) -> Tensor:
        """``x'``: the batch moved by ``eps`` towards its closest class mean (the model in the
        mode it is in; works under ``no_grad`` and ``inference_mode``)."""
        core = as_jem(jm, f"{self.name}.score")
        self._check_fitted(core)
        with input_grad_enabled(x) as xg:
            feats, _ = core.features(xg)
            zw = (feats.float() - self._centre.to(feats.device)) @ self._w.to(feats.device)
            means_w = self._means_w.to(feats.device)
            nearest = _sq_dists(zw.detach(), means_w).argmin(dim=1)
            loss = (zw - means_w[nearest]).pow(2).sum()
            (g,) = torch.autograd.grad(loss, xg)
        return _input_step(core, x, g, self.eps)

    def score(self, jm: Any, x: Tensor) -> Tensor:
        """``[B]`` scores of the preprocessed batch ``x'`` (see :meth:`perturb`), higher = more
        in-distribution."""
        self._check_fitted()
        return super().score(jm, self.perturb(jm, x) if self.eps > 0 else x)

    def score_outputs(self, jm: Any, outputs: Outputs) -> Tensor:
        """:class:`Mahalanobis`'s score of outputs where ``eps=0``; otherwise the step needs the
        inputs themselves (their gradient): raises, score inputs with :meth:`score`."""
        if self.eps > 0:
            raise ValueError(
                f"{self.name} moves the inputs along their gradient before scoring them: score inputs "
                "with .score(jm, x), or outputs with eps=0 (plain mahalanobis)"
            )
        return super().score_outputs(jm, outputs)


class MultiMahalanobis(_ClassConditional):
    """Lee et al.'s feature ensemble (2018): :class:`Mahalanobis` at several depths of the network,
    summed. Each layer's output is averaged over its spatial positions (or tokens) to ``z_l``, a
    class-conditional Gaussian with a shared covariance is fitted to it, and

    ``score(x) = -sum_l w_l min_c (z_l - mu_lc)^T Sigma_l^+ (z_l - mu_lc)``.

    Early layers see what the penultimate features discard (brightness, contrast, texture), so the
    sum catches low-level shifts such as inverted or noisy images that a classifier maps onto its
    classes; on semantic shifts (unseen classes) it can be worse than :class:`Mahalanobis`.

    ``layers``: dotted submodule names, shallow to deep (default: the adapter's
    :meth:`~jem_plugin.JEM.feature_layers`, a timm model's ``feature_info`` stages or a ResNet's
    ``layer1``... ``layerN``). ``weights``, how the layers count:

    - ``"dof"`` (default) divides each layer's squared distance by ``sqrt(2 r_l)``, its standard
      deviation at in-distribution inputs (chi-squared with ``r_l``, the rank of ``Sigma_l``,
      degrees of freedom), so that a wide layer does not outweigh a narrow one;
    - ``"uniform"`` sums them as they are (pytorch-ood's default, ``alpha = 1``);
    - ``"adversarial"`` learns them as Lee et al. do without OOD data: the coefficients of a
      logistic regression of the per-layer distances that tells the first
      ``adversarial_images`` fit images from their FGSM versions (one step of ``adversarial_eps``
      in ``[0, 1]``-pixel units up the sign of the cross-entropy's input gradient; Lee et al.'s
      0.05), so the layers that a small perturbation moves count the most. A layer whose
      coefficient comes out negative (its distance would count as evidence of in-distribution) is
      left out and the regression refitted on the others; Lee et al.'s code keeps such weights.
      The images are kept on the CPU until the end of the fit (512 at 3x224x224: 300 MB), and the
      fit takes one backward pass over them. It is tuned to perturbation-like shifts: on the
      tuning split of ``benchmarks/check_multi_mahalanobis_combine.py`` it beats ``"dof"`` (from
      lcnet_050's noise sets), but it weighs down the layers that see blur and lost contrast
      (``tests/test_multi_mahalanobis.py``'s digits CNN), so it is not the default;
    - or one number per layer.

    :attr:`layer_weights` holds the weights used. No input preprocessing.

    ``fit`` streams as :class:`Mahalanobis` does: one ``C_l x C_l`` sum per layer, one forward per
    batch (forward hooks on the layers). pytorch-ood's ``MultiMahalanobis`` with ``alpha = 1``
    is ``-1 / (2 N)`` times ours with ``weights="uniform"`` where the features span their space
    (its ridge-regularised inverse of the summed covariance against our pseudo-inverse, as for
    :class:`Mahalanobis`); it runs the network once per layer.
    """

    name = "multi_mahalanobis"
    _memory_formula = staticmethod(_memory.multi_mahalanobis)  # the fit's peak
    reads = frozenset({"logits", "layers"})
    description = (
        "Mahalanobis summed over several depths, Lee et al.'s feature ensemble (fit; layers=, weights='dof', labels=)"
    )
    paper = "Lee et al. 2018, A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial Attacks (NeurIPS)"

    def __init__(
        self,
        layers: Sequence[str] | None = None,
        weights: str | Sequence[float] = "dof",
        labels: str = "true",
        adversarial_eps: float = 0.05,
        adversarial_images: int = 512,
    ) -> None:
        super().__init__()
        self._set_labels(labels)
        if not (isinstance(adversarial_eps, (int, float)) and math.isfinite(adversarial_eps) and adversarial_eps > 0):
            raise ValueError(f"adversarial_eps must be a positive number, got {adversarial_eps!r}")
        if not isinstance(adversarial_images, int) or adversarial_images < 2:
            raise ValueError(f"adversarial_images must be an integer of at least 2, got {adversarial_images!r}")
        self.adversarial_eps, self.adversarial_images = float(adversarial_eps), adversarial_images
        self._kept: list[Tensor] | None = None  # fit images kept for the adversarial weights
        self._kept_labels: list[Tensor] = []
        if isinstance(weights, str):
            if weights not in ("dof", "uniform", "adversarial"):
                raise ValueError(
                    f"weights must be 'dof', 'uniform', 'adversarial' or one number per layer, got {weights!r}"
                )
        elif not all(isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 for w in weights):
            raise ValueError(f"weights must be non-negative finite numbers, one per layer, got {weights!r}")
        self.layers = _checked_layers(layers)
        self.weights: str | list[float] = weights if isinstance(weights, str) else [float(w) for w in weights]

    def _options(self) -> dict[str, Any]:
        extra = {"adversarial_eps": self.adversarial_eps, "adversarial_images": self.adversarial_images}
        return {
            "layers": self.layers,
            "weights": self.weights,
            **(extra if self.weights == "adversarial" else {}),
            **super()._options(),
        }

    def _begin(self, jm: Any) -> None:
        names = jm._layer_names(self.layers, f"jem.ood.detector({self.name!r}, layers=['name.of.block1', ...])")
        if not isinstance(self.weights, str) and len(self.weights) != len(names):
            raise ValueError(f"weights gives {len(self.weights)} number(s) for {len(names)} layers ({names})")
        self.layer_names = names
        self._per_layer = [Mahalanobis(self.labels) for _ in names]
        for m in self._per_layer:
            m.warn_fit = False
            m._begin(jm)
        # the first fit images and labels, for the adversarial weights (filled by _saw_inputs and _add)
        self._kept = [] if self.weights == "adversarial" else None
        self._kept_labels = []

    @property
    def layers_read(self) -> list[str]:
        return list(self.__dict__.get("layer_names", []))

    @property
    def shares_forward(self) -> bool:
        # the adversarial weights need the fit images themselves (their input gradients)
        return self.weights != "adversarial"

    def _rank_statistics(self) -> tuple[tuple[str | tuple[str, str], str], ...]:
        """Each layer's class moments; the first fit images too, for the adversarial weights."""
        kept = (("_kept", "gather"), ("_kept_labels", "gather")) if self._kept is not None else ()
        return (*((f"_per_layer.{i}._moments", "moments") for i in range(len(self._per_layer))), *kept)

    def _saw_inputs(self, x: Tensor) -> None:
        if self._kept is not None:  # the first fit images, for the adversarial weights
            room = self.adversarial_images - sum(len(k) for k in self._kept)
            self._kept.append(x[:room].detach().cpu())

    def _take(self, out: Outputs) -> tuple[Tensor, Tensor]:
        """The layers' pooled features side by side (``[B, sum C_l]``: each layer's outputs
        averaged over its positions, :meth:`~jem_plugin.JEM.layer_features`) and the logits."""
        feats = [out.layer(name, self.name).mean(dim=2) for name in self.layer_names]
        self._dims = [f.shape[1] for f in feats]
        # in the layers' own dtype (bfloat16 under autocast): the fit's rounding floor depends on it
        dtype = functools.reduce(torch.promote_types, [f.dtype for f in feats])
        return torch.cat([f.to(dtype) for f in feats], dim=1), out.logits

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        y = self._labels(feats, logits, y)
        for m, z in zip(self._per_layer, feats.split(self._dims, dim=1)):
            m._moments.add(z, y, logits.shape[1])
        if self._kept is not None:
            self._kept_labels.append(y[: len(self._kept[-1])].cpu())

    def _finish(self, jm: Any) -> None:
        for m in self._per_layer:
            m._finish(jm)
        self.ranks = [int(m._w.shape[1]) for m in self._per_layer]
        if isinstance(self.weights, list):
            self.layer_weights = list(self.weights)
        elif self.weights == "adversarial":
            self.layer_weights = self._adversarial_weights(jm)
        elif self.weights == "uniform":
            self.layer_weights = [1.0] * len(self.ranks)
        else:
            self.layer_weights = self._dof_weights()
        self.classes = self._per_layer[0].classes
        self.n_fit = self._per_layer[0].n_fit
        if not any(self.ranks):
            _warn_flat(self.name, self.n_fit, len(self.classes))
            return
        wide = {layer: d for layer, d in zip(self.layer_names, self._dims) if self.n_fit - len(self.classes) < d}
        if wide:
            _warn_few(self.name, self.n_fit, len(self.classes), wide)

    def layer_scores(self, jm: Any, x: Tensor) -> Tensor:
        """``[B, L]``: each layer's ``-min_c`` squared distance of the batch ``x``, unweighted (what
        the score sums with :attr:`layer_weights`), to see which depth flags an input."""
        core = as_jem(jm, f"{self.name}.layer_scores")
        self._check_fitted(core)
        return self._layer_scores(core, x)

    def _layer_scores(self, core: Any, x: Tensor) -> Tensor:
        with torch.no_grad():
            feats, _ = self._read(core, x)
            return -self._layer_dists(feats.float().split(self._dims, dim=1))

    def _layer_dists(self, parts: Sequence[Tensor]) -> Tensor:
        """``[B, L]``: each layer's squared distance to its closest class (``parts``: the layers'
        pooled features)."""
        return torch.stack([m._class_dists(z).min(dim=1).values for m, z in zip(self._per_layer, parts)], dim=1)

    def _adversarial_weights(self, core: Any) -> list[float]:
        """Lee et al.'s weights: the coefficients of a logistic regression (on standardised
        per-layer scores, then scaled back) telling the kept fit images from their FGSM versions."""
        from sklearn.linear_model import LogisticRegression

        assert self._kept is not None
        n = self.adversarial_images  # the first images of the union where the ranks' were gathered
        x, y = torch.cat(self._kept)[:n], torch.cat(self._kept_labels)[:n]
        self._kept, self._kept_labels = None, []  # the images are not kept past the fit
        device = model_device(core)
        clean, perturbed = [], []
        with sampling_mode(core):
            for xb, yb in zip(x.split(128), y.split(128)):
                xb = xb.to(device) if device is not None else xb
                with input_grad_enabled(xb) as xg:  # one forward: the clean distances and the gradient
                    layers, logits = core.layer_features(xg, self.layer_names)
                    loss = F.cross_entropy(logits.float(), yb.to(xb.device))
                    (g,) = torch.autograd.grad(loss, xg)
                clean.append(-self._layer_dists([f.detach().float() for f in layers]).double().cpu())
                perturbed.append(
                    self._layer_scores(core, _input_step(core, xb, -g, self.adversarial_eps)).double().cpu()
                )
        feats = torch.cat([torch.cat(clean), torch.cat(perturbed)]).numpy()
        spread = feats.std(axis=0)
        spread[spread == 0] = 1.0  # a layer that does not vary gets no weight from the fit anyway
        target = np.r_[np.ones(len(x)), np.zeros(len(x))]
        standard = (feats - feats.mean(axis=0)) / spread
        weights = np.zeros(feats.shape[1])
        kept = np.arange(feats.shape[1])
        while kept.size:  # a negative weight would count distance as in-distribution: refit without it
            coef = LogisticRegression(max_iter=2000).fit(standard[:, kept], target).coef_[0]
            if (coef >= 0).all():
                weights[kept] = coef / spread[kept]
                break
            kept = kept[coef >= 0]
        if not kept.size:
            warnings.warn(
                f"{self.name}: no layer's distance tells the fit images from their FGSM versions; "
                "falling back to weights='dof'",
                RuntimeWarning,
                stacklevel=4,
            )
            return self._dof_weights()
        return [float(w) for w in weights]

    def _dof_weights(self) -> list[float]:
        # a layer of zero rank measures nothing (its distances are all 0): weight 0, not 1/0
        return [1.0 / math.sqrt(2.0 * r) if r else 0.0 for r in self.ranks]

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        feats = feats.float()
        weights = torch.tensor(self.layer_weights, dtype=feats.dtype, device=feats.device)
        return -(self._layer_dists(feats.split(self._dims, dim=1)) * weights).sum(dim=1)
