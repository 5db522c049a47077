"""The field's post-hoc OOD detectors, registered through the ``jem_register_ood_scores`` hook.

A built-in plugin like :mod:`jem_plugin.builtins.ood_scores`: :mod:`jem_plugin.plugins` registers
it at start-up and :func:`jem_plugin.ood.score` finds these by name. Same convention as every
score of the library: **higher = more in-distribution** (pytorch-ood's detectors return outlier
scores, the negatives of ours up to the scale noted per detector).

Logit and feature scores that need no training data are functions ``fn(jm, x, **options)``:

=======  ===================================================================  ===========
name     score                                                                input grad
=======  ===================================================================  ===========
odin     ``max softmax(f(x') / T)`` at ``x' = x - eps * sign(-d log S_y/dx)``  yes
         (Liang et al. 2018; ``eps`` in [0, 1]-pixel units)
gen      ``-sum_j p_j^g (1 - p_j)^g`` over the ``M`` largest probabilities    no
         (generalized entropy, Liu et al. 2023; ``gamma = 0.1``,
         ``M = min(K, 100)``)
ash      energy of the logits from ASH-S activations: the top ``100 - p`` %    no
         kept and scaled by ``exp(sum / kept sum)`` (Djurisic et al. 2023;
         ``percentile = 90``); on the last feature maps where the adapter
         gives them, else the penultimate features
scale    energy of the logits from ``h * exp(sum h / top sum h)`` (SCALE,      no
         Xu et al. 2024; ``percentile = 85``); the same activations as ash
=======  ===================================================================  ===========

Feature detectors fitted on in-distribution training data are classes (registered with
``needs_fit=True``): ``Detector(**options).fit(jm, data).score(jm, x)``. ``fit`` *streams* over
``data`` (a DataLoader, any iterable of batches, a tensor, or an ``(x, y)`` pair of tensors): it
keeps running sums, never the whole set, except KNN's bank of normalised features (``max_fit=``
keeps a uniform subsample) and a bounded uniform subsample where a statistic needs the data
itself (ReAct's percentile, ViM's alpha). OpenMax streams twice (class means, then the distances
to them), so its data must be iterable twice (not a one-shot generator).

====================  ==============================================================  ==========
name                  score                                                           fit keeps
====================  ==============================================================  ==========
mahalanobis           ``-min_c (z - mu_c)^T S^+ (z - mu_c)``, class means and shared   ``D x D``
                      covariance (Lee et al. 2018, no input preprocessing)
relative_mahalanobis  mahalanobis minus the distance under one Gaussian of all data     ``D x D``
                      (Ren et al. 2021)
vim                   ``logsumexp f - alpha ||P_res (z - u)||`` (Wang et al. 2022)      ``D x D``
knn                   ``-||z/|z| - n_k||``, distance to the k-th nearest normalised    ``N x D``
                      training feature (Sun et al. 2022; ``k = 50``)
react                 energy of the head on features clipped at the ``p``-th            a sample
                      percentile of training activations (Sun et al. 2021; ``p = 90``)
mahalanobis_odin      mahalanobis at ``x' = x - eps sign(d/dx min_c d_c(x))``, Lee      ``D x D``
                      et al.'s input preprocessing (input gradient; ``eps = 0.002``)
gmm                   ``log sum_c pi_c N(z | mu_c, S_c + reg I)``, one covariance       ``K x D x D``
                      per class, ``pi_c`` the class frequencies (``reg = 1e-6``)
openmax               ``-P(unknown)`` once the top ``alpha`` logits are revised by      ``K x K``
                      per-class Weibull fits of their distances to the class mean
                      logits (Bendale & Boult 2016; ``tailsize = 25``, ``alpha = 10``)
multi_mahalanobis     ``-sum_l w_l min_c`` Mahalanobis distance of layer ``l``'s         ``C_l x C_l``
                      pooled output, Lee et al.'s feature ensemble (``weights="dof"``:    per layer
                      ``w_l = 1 / sqrt(2 rank_l)``)
gram                  ``-sum_l delta_l / E_l``, how far the Gram-matrix row sums of       ``K x sum C_l``
                      layer ``l``'s maps fall outside the per-class training range       per power
                      (Sastry & Oore 2020; ``powers = 10``)
====================  ==============================================================  ==========

Features are :meth:`jem_plugin.JEM.features` (penultimate, ``[B, D]``), or for
``multi_mahalanobis`` :meth:`jem_plugin.JEM.layer_features` (several layers, pooled), for ``gram``
:meth:`jem_plugin.JEM.layer_maps` (the same layers, unpooled); the "head" is
:meth:`jem_plugin.JEM.head`, the layer that maps them to the logits. Feature maps are
:meth:`jem_plugin.JEM.feature_maps` (``[B, C, H, W]`` before the classifier's pooling).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .._checks import (
    INPUT_KEYS,
    DomainCheck,
    check_input,
    check_label_range,
    model_device,
    same_device,
    unpack_batch,
    unwrap_model,
    user_stacklevel,
)
from ..errors import InvalidInputError, InvalidLabelError, NoFeaturesError, NotFittedError
from ..model import as_jem, input_grad_enabled, sampling_mode
from ..plugins import hookimpl

__all__ = [
    "odin",
    "gen",
    "ash",
    "scale",
    "Mahalanobis",
    "RelativeMahalanobis",
    "MahalanobisODIN",
    "MultiMahalanobis",
    "Gram",
    "GMM",
    "ViM",
    "KNN",
    "ReAct",
    "OpenMax",
]


# ---------------------------------------------------------------------- helpers
def _check_percentile(p: float, name: str = "percentile") -> float:
    value = float(p)
    if not 0.0 <= value < 100.0:
        raise ValueError(f"{name} must be in [0, 100) (a percentage, as in the papers: 90, not 0.9), got {p!r}")
    return value


def _head(jm: Any, what: str) -> nn.Module:
    head = as_jem(jm, what).head()
    if head is None:
        raise NoFeaturesError(
            f"{what} recomputes the logits from the features and needs the layer mapping them to the "
            "logits; this model's adapter knows none (features read by a callable). Wrap the model "
            "with wrap(model, features='name.of.classifier') instead"
        )
    return head


def _energy(head: nn.Module, h: Tensor) -> Tensor:
    """``logsumexp(head(h))`` in fp32, ``h`` cast to the head's dtype."""
    w = next(head.parameters(), None)
    logits = head(h if w is None or w.dtype == h.dtype else h.to(w.dtype))
    return torch.logsumexp(logits.float(), dim=1)


def _kept(d: int, percentile: float) -> int:
    """How many of ``d`` activations the top ``100 - percentile`` % are (at least one), rounded
    as the ASH and SCALE reference code rounds (``np.round``: half to even)."""
    return max(1, d - int(np.round(d * percentile / 100.0)))


def _ratio(s1: Tensor, s2: Tensor) -> Tensor:
    """``s1 / s2``, and 0 where ``s2 == 0`` (a row of all-zero activations is left unscaled, not NaN)."""
    return torch.where(s2 == 0, torch.zeros_like(s1), s1 / s2)


class _Sample:
    """A uniform sample without replacement of at most ``capacity`` rows of a stream (all rows
    when ``capacity`` is None): each row gets a random key, the ``capacity`` smallest keys are
    kept (bottom-k sampling). Compacted only when twice the capacity is held, so adding costs
    O(1) amortised per row; seeded, so a fit repeats."""

    def __init__(self, capacity: int | None, seed: int) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"the sample size must be a positive integer or None, got {capacity!r}")
        self.capacity, self.seed = capacity, seed
        self.rows: list[Tensor] = []
        self.keys: list[Tensor] = []
        self.held = 0
        self.gen: torch.Generator | None = None

    def add(self, rows: Tensor) -> None:
        self.rows.append(rows)
        self.held += rows.shape[0]
        if self.capacity is None:
            return
        if self.gen is None:
            self.gen = torch.Generator(device=rows.device).manual_seed(self.seed)
        self.keys.append(torch.rand(rows.shape[0], generator=self.gen, device=rows.device))
        if self.held > 2 * self.capacity:
            self._compact()

    def _compact(self) -> None:
        rows, keys = torch.cat(self.rows), torch.cat(self.keys)
        if self.capacity is not None and rows.shape[0] > self.capacity:
            idx = torch.topk(keys, self.capacity, largest=False, sorted=False).indices
            rows, keys = rows[idx], keys[idx]
        self.rows, self.keys, self.held = [rows], [keys], rows.shape[0]

    def values(self) -> Tensor:
        if self.capacity is not None and self.rows:
            self._compact()
        return torch.cat(self.rows) if self.rows else torch.empty(0)


def _labelled_batches(data: Any, batch_size: int, input_key: str | None) -> tuple[Iterator, int | None, bool]:
    """``(iterator of (x, y or None), number of batches or None, data was in memory)``."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(t, Tensor) for t in data)
        and data[1].dim() == 1
        and data[0].dim() >= 2
        and data[0].shape[0] == data[1].shape[0]
    ):
        x_all, y_all = data
        return zip(x_all.split(batch_size), y_all.split(batch_size)), -(-x_all.shape[0] // batch_size), True
    if isinstance(data, Tensor):
        if data.dim() < 2:
            raise InvalidInputError(f"expected a batch of inputs [N, ...], got a tensor of shape {tuple(data.shape)}")
        return ((x, None) for x in data.split(batch_size)), -(-data.shape[0] // batch_size), True
    if not hasattr(data, "__iter__"):
        raise InvalidInputError(
            "fit data must be a tensor, an (x, y) pair of tensors or an iterable of batches (e.g. a "
            f"DataLoader), got {type(data).__name__}"
        )
    try:
        n: int | None = len(data)
    except TypeError:
        n = None
    keys = INPUT_KEYS if input_key is None else input_key
    return (unpack_batch(item, input_key=keys) for item in data), n, False


def _features_of(
    jm: Any,
    data: Any,
    *,
    batch_size: int,
    progress: bool | None,
    input_key: str | None,
    desc: str,
    read: Callable[[Any, Tensor], tuple[Tensor, Tensor]],
) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
    """``(features fp32, logits fp32, labels or None)`` of every batch of ``data``, the first two
    from ``read(jm, x)`` (a detector's :meth:`_FittedDetector._read`): the model in
    :func:`~jem_plugin.model.sampling_mode` (eval, frozen), no autograd graph, batches moved to
    the model's device."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batches, n, in_memory = _labelled_batches(data, batch_size, input_key)
    if progress is None:
        progress = not in_memory and sys.stderr.isatty()
    device, dtype, domain_check = model_device(jm), jm.param_dtype(), DomainCheck(batches=1)
    seen = 0
    with (
        sampling_mode(jm),
        torch.no_grad(),
        tqdm(total=n, desc=desc, unit="batch", disable=not progress, leave=False) as bar,
    ):
        for x, y in batches:
            if device is not None and not same_device(x.device, device):
                x = x.to(device, non_blocking=True)
            x = check_input(x, dtype=dtype, domain=jm.domain)
            domain_check(x, jm.domain, desc, stacklevel=4)
            feats, logits = read(jm, x)
            seen += x.shape[0]
            yield feats.float(), logits.float(), None if y is None else y.to(feats.device)
            bar.update(1)
    if not seen:
        raise InvalidInputError(f"{desc}: no inputs to fit on, the data is empty")


def _features_and_logits(jm: Any, x: Tensor, features: bool) -> tuple[Tensor, Tensor]:
    """``jm.features(x)``, or ``(logits, logits)`` for a detector that reads the logits alone."""
    if features:
        return jm.features(x)
    logits = jm(x)
    return logits, logits


def _whitener(cov: Tensor, noise_floor: float = 0.0) -> Tensor:
    """``W`` with ``W W^T = pinv(cov)`` (``[D, rank]``, from the eigendecomposition): squared
    Mahalanobis distances are squared Euclidean distances after ``@ W``. Directions with variance
    below ``D * eps * largest`` are dropped, as ``torch.linalg.pinv`` drops them (dead units), and
    so are those at or below ``noise_floor``, the variance that the features' own rounding puts in
    every direction (see :meth:`_ClassMoments.rounding_floor`)."""
    evals, evecs = torch.linalg.eigh(cov)
    tol = evals.max().clamp_min(0) * cov.shape[0] * torch.finfo(cov.dtype).eps
    keep = evals > max(float(tol), noise_floor)
    return evecs[:, keep] / evals[keep].sqrt()


def _input_step(core: Any, x: Tensor, g: Tensor, eps: float) -> Tensor:
    """``x - eps * sign(g) * (high - low)``: ODIN's input step against the gradient ``g`` of a loss,
    ``eps`` in units of the ``[0, 1]`` pixel range (``eps / std`` for normalised images, as the
    ODIN and Mahalanobis code divide the gradient sign by the normalisation's std)."""
    xd = x.detach()
    lo, hi = core.domain.bounds(xd) if xd.dim() >= 2 else (0.0, 1.0)
    return xd - float(eps) * g.sign().to(xd.dtype) * (hi - lo)


def _sq_dists(a: Tensor, b: Tensor) -> Tensor:
    """``[A, B]`` squared Euclidean distances, by the expansion (one matmul, no ``[A, B, D]``)."""
    d = a.pow(2).sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.pow(2).sum(1).unsqueeze(0)
    return d.clamp_min_(0.0)


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


# ---------------------------------------------------------------------- function scores
def odin(jm: Any, x: Tensor, temperature: float = 1000.0, eps: float = 0.0014) -> Tensor:
    """ODIN (Liang et al. 2018): the maximum softmax probability at temperature ``T`` of the input
    moved by ``eps`` against the gradient sign of ``-log S_yhat(x; T)``.

    ``eps`` is in units of the ``[0, 1]`` pixel range: the step in input space is
    ``eps * (high - low)`` per channel of the model's domain, i.e. ``eps / std`` for normalised
    images, as the ODIN code divides the gradient by the normalisation's std (pytorch-ood's
    ``norm_std``). Defaults are OpenOOD's (``T = 1000``, ``eps = 0.0014``).
    """
    t = float(temperature)
    if not t > 0 or not math.isfinite(t):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    core = as_jem(jm, "odin")
    with sampling_mode(core), input_grad_enabled(x) as xg:
        logits = core.logits(xg) / t
        loss = F.cross_entropy(logits, logits.argmax(1), reduction="sum")
        (g,) = torch.autograd.grad(loss, xg)
    x_hat = _input_step(core, x, g, eps)
    with torch.no_grad():
        return torch.softmax(core.logits(x_hat) / t, dim=1).max(dim=1).values


def gen(jm: Any, x: Tensor, gamma: float = 0.1, M: int | None = None, clamp: float = 1e-7) -> Tensor:
    """GEN (Liu et al. 2023): ``-sum_{j <= M} p_j^gamma (1 - p_j)^gamma`` over the ``M`` largest
    softmax probabilities (``M = min(K, 100)`` by default), a sum as the authors' code computes it.

    ``p`` is clamped to ``[clamp, 1 - clamp]`` as pytorch-ood does (its scores are then ours
    divided by ``M``): the power transform would otherwise let the far tail of tiny probabilities
    decide; on the four networks of ``benchmarks/bench_posthoc.py`` the clamp was never worse and
    on one better (mean AUROC 0.896 against 0.889 on resnet10t). ``clamp=0`` gives the formula
    exactly. Computed from the logits in log space, in float64, so ``1 - p`` of a top probability
    that rounds to 1 in float32 is the others' probability mass, not 0.
    """
    if not float(gamma) > 0:
        raise ValueError(f"gamma must be positive, got {gamma!r}")
    if not 0.0 <= float(clamp) < 0.5:
        raise ValueError(f"clamp must be in [0, 0.5), got {clamp!r}")
    logp = torch.log_softmax(jm.logits(x).double(), dim=1)
    k = logp.shape[1]
    m = min(k, 100) if M is None else int(M)
    if not 1 <= m <= k:
        raise ValueError(f"M must be in [1, {k}] (the number of classes), got {M!r}")
    top = logp.topk(m, dim=1).values  # descending: column 0 is the top class
    # log(1 - p): log1p(-p) is exact for p <= 1/2, which every class but the top one is; for the top
    # class, the log of the others' summed probabilities.
    log_rest = torch.log1p(-top.exp().clamp(max=0.5))
    others = logp.scatter(1, logp.argmax(dim=1, keepdim=True), float("-inf"))
    log_rest[:, 0] = torch.where(top[:, 0] > -math.log(2.0), torch.logsumexp(others, dim=1), log_rest[:, 0])
    if clamp > 0:  # p and 1 - p both in [clamp, 1 - clamp]
        lo, hi = math.log(clamp), math.log1p(-clamp)
        top, log_rest = top.clamp(lo, hi), log_rest.clamp(lo, hi)
    return -torch.exp(gamma * (top + log_rest)).sum(dim=1).float()


def _ash_s(h: Tensor, percentile: float) -> Tensor:
    """ASH-S on rows: the largest ``100 - percentile`` % of each row kept and scaled by
    ``exp(sum / kept sum)``, the rest zeroed."""
    v, i = torch.topk(h, _kept(h.shape[1], percentile), dim=1)
    return torch.zeros_like(h).scatter_(1, i, v * torch.exp(_ratio(h.sum(dim=1), v.sum(dim=1))).unsqueeze(1))


def _scale_rows(h: Tensor, percentile: float) -> Tensor:
    """SCALE on rows: each row times ``exp(sum / sum of its top 100 - percentile %)``, nothing pruned."""
    s2 = torch.topk(h, _kept(h.shape[1], percentile), dim=1).values.sum(dim=1)
    return h * torch.exp(_ratio(h.sum(dim=1), s2)).unsqueeze(1)


def _shaped_energy(jm: Any, x: Tensor, what: str, shape: Callable[[Tensor], Tensor]) -> Tensor:
    """The energy ``logsumexp`` of the logits once ``shape`` has reshaped each input's activations:
    its last feature maps, flattened over ``C x H x W``, where the adapter gives them
    (:meth:`jem_plugin.JEM.feature_maps`, the layer the ASH and SCALE papers shape); else its
    penultimate features, through the head."""
    core = as_jem(jm, what)
    found = core.feature_maps(x)
    if found is not None:
        maps, to_logits = found
        return torch.logsumexp(to_logits(shape(maps.flatten(1)).view_as(maps)).float(), dim=1)
    head = _head(jm, what)
    h, _ = core.features(x)
    return _energy(head, shape(h))


def ash(jm: Any, x: Tensor, percentile: float = 90.0) -> Tensor:
    """ASH-S (Djurisic et al. 2023): the largest ``100 - percentile`` % of each input's activations
    kept, the rest zeroed, the kept ones scaled by ``exp(sum / kept sum)``; the score is the
    energy ``logsumexp`` of the logits computed from them. The activations are the last feature
    maps (``C x H x W`` per input, as the paper and pytorch-ood shape them) where the adapter
    gives them (:meth:`jem_plugin.JEM.feature_maps`: timm CNNs, torchvision ResNets), else the
    penultimate features (ViTs). Designed for non-negative (post-ReLU) activations."""
    p = _check_percentile(percentile)
    return _shaped_energy(jm, x, "ash", lambda h: _ash_s(h, p))


def scale(jm: Any, x: Tensor, percentile: float = 85.0) -> Tensor:
    """SCALE (Xu et al. 2024): each input's activations scaled by ``exp(sum / sum of the top
    100 - percentile %)``, nothing pruned; the score is the energy of the logits computed from
    them. The activations are the feature maps where the adapter gives them, as for :func:`ash`."""
    p = _check_percentile(percentile)
    return _shaped_energy(jm, x, "scale", lambda h: _scale_rows(h, p))


# ---------------------------------------------------------------------- fitted detectors
def _checked_layers(layers: Sequence[str] | None) -> list[str] | None:
    """A multi-layer detector's ``layers=`` option as a list (``None``: the adapter's default)."""
    if layers is not None and (isinstance(layers, str) or not layers or not all(isinstance(n, str) for n in layers)):
        raise ValueError(f"layers must be a non-empty list of dotted submodule names, got {layers!r}")
    return None if layers is None else list(layers)


class _FittedDetector:
    """Base of the detectors fitted on in-distribution data: ``fit`` streams over the data
    (features of each batch handed to :meth:`_add`), :meth:`_finish` turns the running sums
    into the fitted state, ``score`` maps a batch to ``[B]`` scores, higher = in-distribution."""

    name = "detector"
    needs_grad = False
    #: False for a detector of the logits alone: it then never asks the adapter for features, so
    #: it works on models whose penultimate layer cannot be found (a convolutional head).
    uses_features = True

    def __init__(self) -> None:
        self.fitted = False

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options().items())
        return f"{type(self).__name__}({options}{', fitted' if self.fitted else ''})"

    def _options(self) -> dict[str, Any]:
        return {}

    def fit(
        self,
        jm: Any,
        data: Any,
        *,
        batch_size: int = 256,
        progress: bool | None = None,
        input_key: str | None = None,
    ) -> _FittedDetector:
        """Fit on in-distribution ``data`` (a DataLoader or iterable of batches, a tensor, or an
        ``(x, y)`` pair of tensors), streaming batch by batch; returns ``self``.

        The model runs in eval mode with frozen parameters (restored after), without autograd.
        ``progress``: a tqdm bar over batches (default: only for an iterable on a terminal).
        """
        core = as_jem(jm, f"{self.name}.fit")
        self._begin(core)
        self._stream(core, data, self._add, batch_size=batch_size, progress=progress, input_key=input_key)
        self._finish(core)
        self._fitted_now(core)
        return self

    def _stream(
        self,
        core: Any,
        data: Any,
        add: Callable[[Tensor, Tensor, Tensor | None], None],
        *,
        batch_size: int,
        progress: bool | None,
        input_key: str | None,
        desc: str | None = None,
    ) -> None:
        """One pass over ``data``: ``add(features, logits, labels or None)`` per batch."""
        for feats, logits, y in _features_of(
            core,
            data,
            batch_size=batch_size,
            progress=progress,
            input_key=input_key,
            desc=desc or f"fit {self.name}",
            read=self._read,
        ):
            add(feats, logits, y)

    def _check_fitted(self, core: Any = None) -> None:
        """Raise where the detector is not fitted; warn once where ``core`` wraps another network
        than the one it was fitted on (its statistics are that network's)."""
        if not self.fitted:
            raise NotFittedError(
                f"the {self.name} detector is not fitted: call .fit(jm, train_loader) first, or "
                f"jem.ood.score(jm, data, {self.name!r}, fit_data=train_loader)"
            )
        ref = self.__dict__.get("_fitted_on")
        fitted_on = ref() if ref is not None else None
        if core is not None and fitted_on is not None and fitted_on is not unwrap_model(core.model):
            if not self.__dict__.get("_warned_other_model"):
                self._warned_other_model = True
                warnings.warn(
                    f"this {self.name} detector was fitted on another network "
                    f"({type(fitted_on).__name__}): its statistics are that network's; fit it on this "
                    f"one (.fit(jm, data)) or use a new jem.ood.detector({self.name!r})",
                    UserWarning,
                    stacklevel=3,
                )

    def __getstate__(self) -> dict[str, Any]:
        # pickle/torch.save keep the fitted statistics, not the link to the network (a weak reference)
        state = self.__dict__.copy()
        state.pop("_fitted_on", None)
        return state

    def _fitted_now(self, core: Any) -> None:
        """Mark the detector fitted on ``core``'s network (a weak reference: the detector does not
        keep the network alive)."""
        self.fitted, self._warned_other_model = True, False
        self._fitted_on = weakref.ref(unwrap_model(core.model))

    def score(self, jm: Any, x: Tensor) -> Tensor:
        """``[B]`` scores of the batch ``x``, higher = more in-distribution (no autograd graph).
        The model runs in the mode it is in; :func:`jem_plugin.ood.score` puts it in eval mode."""
        core = as_jem(jm, f"{self.name}.score")
        self._check_fitted(core)
        with torch.no_grad():
            feats, logits = self._read(core, x)
            return self._score(core, feats.float(), logits.float())

    def _read(self, jm: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features, logits)`` of a batch, what :meth:`_add` and :meth:`_score` get: the
        penultimate features, or the logits in both places for a detector of the logits alone
        (it then works on a model whose features cannot be read)."""
        return _features_and_logits(jm, x, self.uses_features)

    # subclasses
    def _begin(self, jm: Any) -> None: ...

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        raise NotImplementedError

    def _finish(self, jm: Any) -> None: ...

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        raise NotImplementedError


class _ClassConditional(_FittedDetector):
    """A detector fitted per class: labels from the data (``labels="true"``, ``(x, y)`` batches)
    or the model's predictions (``labels="predicted"``, for unlabelled data)."""

    labels: str

    def _set_labels(self, labels: str) -> None:
        if labels not in ("true", "predicted"):
            raise ValueError(f"labels must be 'true' (from the data) or 'predicted', got {labels!r}")
        self.labels = labels

    def _options(self) -> dict[str, Any]:
        return {"labels": self.labels}

    def _labels(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> Tensor:
        """The batch's class labels, ``long`` on the features' device, checked against the logits."""
        k = logits.shape[1]
        if self.labels == "predicted":
            y = logits.argmax(dim=1)
        elif y is None:
            raise InvalidLabelError(
                f"{self.name} is class-conditional and the fit data holds no labels: yield (x, y) "
                f"batches, or pass labels='predicted' to use the model's predictions"
            )
        y = y.to(device=feats.device, dtype=torch.long).reshape(-1)
        check_label_range(y, k, what=f"{self.name} fit labels")
        return y


def _warn_flat(name: str, n_fit: int, n_classes: int) -> None:
    """Warn that a Gaussian detector's fit features do not vary within their classes."""
    warnings.warn(
        f"{name}: the fit features do not vary within their classes ({n_fit} images, {n_classes} classes), "
        "so its distances to the class means are all 0; fit on more images per class",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def _warn_few(name: str, n_fit: int, n_classes: int, widths: Mapping[str, int]) -> None:
    """Warn that a Gaussian detector saw fewer fit images than features (``widths``: the feature
    count of each layer that has more than ``n_fit - n_classes``)."""
    span = max(n_fit - n_classes, 0)
    where = ", ".join(f"{layer} ({d} features)" if layer else f"{d} features" for layer, d in widths.items())
    warnings.warn(
        f"{name}: {n_fit} fit images in {n_classes} classes for {where}: the within-class covariance "
        f"spans at most {span} directions and the distances ignore the others, in which inputs can "
        f"differ unseen; fit on at least {max(widths.values()) + n_classes} images",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


class _ClassMoments:
    """Running per-class sums and counts of features and their sums of outer products (one shared
    ``D x D`` sum, or one per class), in float64 around the first batch's mean: what the Gaussian
    detectors fit, in memory that does not grow with the data."""

    def __init__(self, per_class_outer: bool) -> None:
        self.per_class_outer = per_class_outer
        self.shift: Tensor | None = None
        self.sums = self.counts = self.outer = torch.empty(0)
        self.eps = 0.0  # the coarsest machine epsilon of the features seen, for the rounding floor

    def add(self, feats: Tensor, y: Tensor, k: int) -> None:
        self.eps = max(self.eps, torch.finfo(feats.dtype).eps)
        z = feats.double()
        if self.shift is None:
            d = z.shape[1]
            self.shift = z.mean(dim=0)
            self.sums, self.counts = z.new_zeros(k, d), z.new_zeros(k)
            self.outer = z.new_zeros((k, d, d) if self.per_class_outer else (d, d))
        z = z - self.shift
        self.sums.index_add_(0, y, z)
        counts = torch.bincount(y, minlength=k)
        self.counts += counts.to(z.dtype)
        if not self.per_class_outer:
            self.outer.addmm_(z.T, z)
            return
        present = counts.nonzero().squeeze(1)
        # the batch sorted by class, one outer-product update per class in it
        for c, zc in zip(present.tolist(), z[y.argsort()].split(counts[present].tolist())):
            self.outer[c].addmm_(zc.T, zc)

    def rounding_floor(self) -> float:
        """The variance that rounding the features to their dtype puts in every direction of their
        covariance, times 100 (ten units in the last place: a network's features carry several
        roundings): ``(10 eps)^2 ms (1 + sqrt(D / N))^2``, with ``ms`` the features' mean square
        (rounding is relative to a value's size, not its spread) and the last factor how far the
        largest singular value of ``N x D`` noise exceeds ``sqrt(N)`` times its entries' size.
        Directions below it are the features' rounding, not their spread: on an untrained timm
        ResNet, 13 such directions in one layer (channels that are exact linear functions of
        others, up to float32 rounding) moved ``multi_mahalanobis`` by 10% between the CPU and the
        GPU, and by 5% when the inputs moved by one part in 10^6."""
        n, d = float(self.counts.sum()), self.sums.shape[1]
        if n == 0 or d == 0 or self.shift is None:
            return 0.0
        # sum z^2 from the sums around the shift s: sum (z - s)^2 + 2 s . sum (z - s) + N s^2
        around = self.outer.diagonal(dim1=-2, dim2=-1).sum()
        squares = around + 2.0 * self.shift @ self.sums.sum(dim=0) + n * self.shift @ self.shift
        mean_square = float(squares) / (n * d)
        return (10.0 * self.eps) ** 2 * mean_square * (1.0 + math.sqrt(d / n)) ** 2


class _GaussianDetector(_ClassConditional):
    """A class-conditional detector fitted from the running class moments of the features."""

    per_class_covariance = False

    def _begin(self, jm: Any) -> None:
        self._moments = _ClassMoments(per_class_outer=self.per_class_covariance)

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._moments.add(feats, self._labels(feats, logits, y), logits.shape[1])


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
        # the first fit images and labels, for the adversarial weights (filled by _read and _add)
        self._kept = [] if self.weights == "adversarial" else None
        self._kept_labels = []

    def _read(self, jm: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """The layers' pooled features side by side (``[B, sum C_l]``) and the logits."""
        feats, logits = jm.layer_features(x, self.layer_names)
        self._dims = [f.shape[1] for f in feats]
        if self._kept is not None:
            room = self.adversarial_images - sum(len(k) for k in self._kept)
            self._kept.append(x[:room].detach().cpu())
        # in the layers' own dtype (bfloat16 under autocast): the fit's rounding floor depends on it
        dtype = functools.reduce(torch.promote_types, [f.dtype for f in feats])
        return torch.cat([f.to(dtype) for f in feats], dim=1), logits

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
        x, y = torch.cat(self._kept), torch.cat(self._kept_labels)
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


#: Map entries per chunk of :func:`_gram_rows` (float64: 256 MB, three copies live): a batch of
#: 256 ResNet-50 ``layer1`` maps at 224x224 (205M entries) is done in 7 chunks, not at once.
_GRAM_CHUNK_ENTRIES = 1 << 25


def _gram_rows(maps: Tensor, powers: Sequence[int]) -> Tensor:
    """``[B, len(powers), C]``: for each power ``p``, the row sums of the ``p``-th order Gram
    matrix of ``[B, C, P]`` maps, ``r = (F^p)(F^p)^T 1`` (elementwise power), as ``sign(r)
    |r|^(1/p)``. Computed as ``F^p`` times the column sums of ``F^p`` (``O(C P)``, not the ``O(C^2
    P)`` of the matrix), in float64 on maps divided by their largest entry (the result scales by
    its square), so that ``F^10`` neither overflows nor underflows; a few images at a time."""
    per_image = max(1, maps[0].numel())
    if maps.shape[0] * per_image > _GRAM_CHUNK_ENTRIES and maps.shape[0] > 1:
        chunk = max(1, _GRAM_CHUNK_ENTRIES // per_image)
        return torch.cat([_gram_rows(part, powers) for part in maps.split(chunk)])
    dtype = torch.float32 if maps.device.type == "mps" else torch.float64  # MPS has no float64
    f = maps.to(dtype)
    m = f.abs().amax(dim=(1, 2), keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    f = f / m
    rows = []
    fp, q = f, 1  # f^q, raised by one multiplication per power (a general pow costs 2x the whole)
    for p in powers:
        if p < q:
            fp, q = f**p, p
        while q < p:
            fp, q = fp * f, q + 1
        r = torch.bmm(fp, fp.sum(dim=1).unsqueeze(2)).squeeze(2)
        rows.append(r.sign() * r.abs() ** (1.0 / p))
    return (torch.stack(rows, dim=1) * m.squeeze(2).unsqueeze(1) ** 2).float()


def _widen(lo: Tensor, hi: Tensor, stats: Tensor, y: Tensor) -> None:
    """Widen the per-class bounds ``lo``, ``hi`` (``[K, D]``, in place) to cover ``stats`` of classes ``y``."""
    idx = y.unsqueeze(1).expand(-1, stats.shape[1])
    lo.scatter_reduce_(0, idx, stats, "amin")
    hi.scatter_reduce_(0, idx, stats, "amax")


def _two_smallest(stats: Tensor, y: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``[K, D]`` each: per class of ``y`` and column, the smallest value of ``stats`` and the
    second smallest (equal to it where two rows share the smallest; ``inf`` where the class has
    fewer than two rows)."""
    idx = y.unsqueeze(1).expand(-1, stats.shape[1])
    first = stats.new_full((k, stats.shape[1]), math.inf).scatter_reduce(0, idx, stats, "amin")
    at_first = stats == first[y]
    ties = stats.new_zeros(first.shape).scatter_add_(0, idx, at_first.to(stats.dtype))
    rest = torch.where(at_first, torch.full_like(stats, math.inf), stats)
    second = stats.new_full(first.shape, math.inf).scatter_reduce(0, idx, rest, "amin")
    return first, torch.where(ties >= 2, first, second)


def _widen_two(lows: tuple[Tensor, Tensor], highs: tuple[Tensor, Tensor], stats: Tensor, y: Tensor) -> None:
    """Update the running two smallest (``lows``) and two largest (``highs``) values per class and
    column (``[K, D]`` each, in place) with ``stats`` of classes ``y``: the two smallest of two
    sorted pairs ``a1 <= a2`` and ``b1 <= b2`` are ``min(a1, b1)`` and ``min(max(a1, b1), a2, b2)``."""
    k = lows[0].shape[0]
    for (first, second), sign in ((lows, 1.0), (highs, -1.0)):
        b1, b2 = _two_smallest(sign * stats, y, k)
        a1, a2 = sign * first, sign * second
        second.copy_(sign * torch.minimum(torch.maximum(a1, b1), torch.minimum(a2, b2)))
        first.copy_(sign * torch.minimum(a1, b1))


def _fill_absent(lo: Tensor, hi: Tensor) -> bool:
    """Give the classes without bounds (never seen) the bounds of all classes, in place; False
    where no class has any."""
    present = torch.isfinite(lo[:, 0])
    if not present.any():
        return False
    lo[~present], hi[~present] = lo[present].amin(dim=0), hi[present].amax(dim=0)
    return True


class Gram(_ClassConditional):
    """Gram-matrix detector (Sastry & Oore 2020): how far the correlations between an input's
    feature channels fall outside the range that training inputs of its predicted class showed,
    over several depths and orders.

    For each layer ``l`` (its output ``F_l`` as ``C_l`` channels by ``P_l`` positions,
    :meth:`~jem_plugin.JEM.layer_maps`) and power ``p = 1 .. powers``, the statistic is the row
    sums of the ``p``-th order Gram matrix, ``g = sign(r) |r|^(1/p)`` with ``r = (F_l^p)(F_l^p)^T 1``
    (``C_l`` numbers). ``fit`` keeps, per class, the smallest and largest value of each number over
    the fit images; an input's deviation is

    ``delta_l(x) = sum_p sum_i relu(lo_i - g_i) / |lo_i| + relu(g_i - hi_i) / |hi_i|``

    against the bounds of its predicted class (``1e-6`` added to each denominator), and

    ``score(x) = -sum_l delta_l(x) / E_l``,

    where ``E_l``, a layer's typical deviation, is its mean over fit images held out against the
    bounds of the other fit images. By default (``held_out=None``) every fit image is held out in
    turn, leave-one-out, against the other images of its class: an image deviates from those
    bounds only where it is its class's extreme, by the gap to the runner-up, so ``E_l`` comes
    from each class's two smallest and two largest values, ``sum_c sum_i [(lo2_i - lo1_i) /
    |lo2_i| + (hi1_i - hi2_i) / |hi2_i|] / N`` (classes of one image add nothing), with no random
    draw. A fraction ``held_out`` holds each image out with that probability instead (a seeded
    draw, the same for any batching; a uniform sample of at most ``max_held_out`` kept) and
    judges them against the bounds of the images not held out, as the paper's separate
    validation data; ``held_out=0`` sets ``E_l = 1``, as does a layer without deviations. The
    scoring bounds are those of every fit image, as in the paper. Leave-one-out is the default
    because :mod:`benchmarks.check_gram_held_out` chose it on the tuning split (mean AUROC 0.9784
    against 0.9778 for a tenth held out, over four networks and eight folds) and it removes the
    draw, which moved single AUROCs by up to 0.015.

    ``layers``: as for :class:`MultiMahalanobis` (default: the adapter's
    :meth:`~jem_plugin.JEM.feature_layers`); the paper reads every convolution's output.
    ``powers``: the largest power (the paper's 10), or a list of powers.

    Strong on low-level shifts (noise, inverted or transposed images, other textures), which move
    the early layers' statistics out of range; on unseen classes of similar images it is usually
    below the Gaussian detectors. On activations that take both signs (GELU, hard-swish, LayerNorm
    outputs) an odd power's row sum can cancel to about 0, where its root is dominated by rounding
    (``|r|^(1/p)`` of the rounding error), in any implementation.

    ``fit`` streams: two sets of running bounds, ``K x sum_l C_l x powers`` each, with their
    runners-up (or, with a fraction ``held_out``, the bounds without the held-out images and the
    held-out sample). pytorch-ood's ``Gram`` is the same statistic and deviation (its outlier score is
    ``-score``); it sets the scoring bounds without its held-out tenth of each class (a random
    draw), so its bounds and ``E_l`` differ from ours by the sample.
    """

    name = "gram"

    def __init__(
        self,
        layers: Sequence[str] | None = None,
        powers: int | Sequence[int] = 10,
        held_out: float | None = None,
        max_held_out: int = 1000,
        labels: str = "true",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self._set_labels(labels)
        self.layers = _checked_layers(layers)
        if isinstance(powers, bool) or not (
            (isinstance(powers, int) and powers >= 1)
            or (
                isinstance(powers, (list, tuple))
                and powers
                and all(isinstance(q, int) and not isinstance(q, bool) and q >= 1 for q in powers)
            )
        ):
            raise ValueError(f"powers must be a positive integer or a list of them, got {powers!r}")
        self.powers = list(range(1, powers + 1)) if isinstance(powers, int) else list(powers)
        if held_out is not None and (
            isinstance(held_out, bool) or not (isinstance(held_out, (int, float)) and 0 <= held_out < 1)
        ):
            raise ValueError(f"held_out must be None (leave-one-out) or a fraction in [0, 1), got {held_out!r}")
        if not isinstance(max_held_out, int) or max_held_out < 1:
            raise ValueError(f"max_held_out must be a positive integer, got {max_held_out!r}")
        self.held_out = None if held_out is None else float(held_out)
        self.max_held_out, self.seed = max_held_out, seed

    def _options(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "powers": self.powers,
            "held_out": self.held_out,
            "max_held_out": self.max_held_out,
            **super()._options(),
        }

    def _begin(self, jm: Any) -> None:
        self.layer_names = jm._layer_names(
            self.layers, f"jem.ood.detector({self.name!r}, layers=['name.of.block1', ...])"
        )
        self._lo: Tensor | None = None  # bounds over every fit image: what scoring compares with
        self._hi: Tensor | None = None
        # for E_l: the runners-up to the bounds (leave-one-out), or the bounds over the images not
        # held out and a sample of the held-out ones (a fraction held out)
        self._runners_up: tuple[Tensor, Tensor] | None = None
        self._others: tuple[Tensor, Tensor] | None = None
        self._held = _Sample(self.max_held_out, self.seed)
        self._draw = torch.Generator().manual_seed(self.seed)  # on the CPU: the same draw on any device
        self._seen = 0

    def _read(self, jm: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """The Gram statistics of every layer and power side by side (``[B, sum_l P C_l]``) and the logits."""
        maps, logits = jm.layer_maps(x, self.layer_names)
        rows = [_gram_rows(m, self.powers).flatten(1) for m in maps]
        self._dims = [r.shape[1] for r in rows]
        return torch.cat(rows, dim=1), logits

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        y = self._labels(feats, logits, y)
        if self._lo is None:
            k, d = logits.shape[1], feats.shape[1]
            self._lo, self._hi = feats.new_full((k, d), math.inf), feats.new_full((k, d), -math.inf)
            if self.held_out is None:
                self._runners_up = (self._lo.clone(), self._hi.clone())
            else:
                self._others = (self._lo.clone(), self._hi.clone())
        assert self._hi is not None
        self._seen += len(y)
        if self._runners_up is not None:  # before the bounds move: it reads them
            lo2, hi2 = self._runners_up
            _widen_two((self._lo, lo2), (self._hi, hi2), feats, y)
            return
        assert self._others is not None and self.held_out is not None
        _widen(self._lo, self._hi, feats, y)
        held = (torch.rand(len(y), generator=self._draw) < self.held_out).to(feats.device)
        _widen(*self._others, feats[~held], y[~held])
        if held.any():  # the label rides along as column 0 (exact in float32 below 2^24 classes)
            self._held.add(torch.cat([y[held].unsqueeze(1).to(feats.dtype), feats[held]], dim=1))

    def _finish(self, jm: Any) -> None:
        assert self._lo is not None and self._hi is not None, "fit saw no data"
        self.layer_norm = torch.ones(len(self._dims), device=self._lo.device)
        if self._runners_up is not None:  # before the absent classes get bounds
            self._set_layer_norm(self._leave_one_out(*self._runners_up) / self._seen)
        elif self._others is not None:  # a fraction held out: the sample against the others' bounds
            held = self._held.values()
            if held.numel() and _fill_absent(*self._others):
                self._set_layer_norm(self._layer_devs(held[:, 1:], held[:, 0].long(), self._others).mean(dim=0))
        present = torch.isfinite(self._lo[:, 0])
        absent = (~present).nonzero().squeeze(1).tolist()
        if absent:  # a class predicted at scoring needs bounds: those of all classes
            warnings.warn(
                f"{self.name}: the fit data has no image of class(es) {absent[:10]}; inputs predicted as "
                "them are compared with the bounds of all classes",
                RuntimeWarning,
                stacklevel=4,
            )
        _fill_absent(self._lo, self._hi)
        self.classes = present.nonzero().squeeze(1)
        self.n_fit = self._seen
        del self._held, self._others, self._draw, self._runners_up

    def _set_layer_norm(self, typical: Tensor) -> None:
        """``E_l``: the typical deviations, 1 for a layer without any."""
        self.layer_norm = torch.where(typical > 0, typical, self.layer_norm)

    def _leave_one_out(self, lo2: Tensor, hi2: Tensor) -> Tensor:
        """``[L]``: the fit images' deviations, each from the bounds of the other images of its
        class, summed: the gaps between each class's bounds and their runners-up."""
        assert self._lo is not None and self._hi is not None
        two = torch.isfinite(lo2[:, :1])  # classes of at least two images
        gap = (lo2 - self._lo) / (lo2.abs() + 1e-6) + (self._hi - hi2) / (hi2.abs() + 1e-6)
        gap = torch.where(two, gap, torch.zeros_like(gap))
        return torch.stack([g.sum() for g in gap.split(self._dims, dim=1)])

    def _layer_devs(self, stats: Tensor, y: Tensor, bounds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``[B, L]``: each layer's deviation from the bounds of the classes ``y`` (default: the
        scoring bounds)."""
        lo, hi = bounds if bounds is not None else (self._lo, self._hi)
        assert lo is not None and hi is not None
        lo, hi = lo.to(stats.device)[y], hi.to(stats.device)[y]
        dev = F.relu(lo - stats) / (lo.abs() + 1e-6) + F.relu(stats - hi) / (hi.abs() + 1e-6)
        return torch.stack([d.sum(dim=1) for d in dev.split(self._dims, dim=1)], dim=1)

    def layer_scores(self, jm: Any, x: Tensor) -> Tensor:
        """``[B, L]``: each layer's ``-delta_l / E_l`` for the batch ``x`` (the score is their sum),
        to see which depth flags an input."""
        core = as_jem(jm, f"{self.name}.layer_scores")
        self._check_fitted(core)
        with torch.no_grad():
            stats, logits = self._read(core, x)
            return self._layer_scores(stats.float(), logits.float())

    def _layer_scores(self, stats: Tensor, logits: Tensor) -> Tensor:
        devs = self._layer_devs(stats, logits.argmax(dim=1))
        return -devs / self.layer_norm.to(devs.device)

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        return self._layer_scores(feats, logits).sum(dim=1)


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


class ViM(_FittedDetector):
    """Virtual-logit matching (Wang et al. 2022): ``score = logsumexp f(x) - alpha * ||(z - u) R||``
    with ``u = -pinv(W) b`` the origin the head ``f = W z + b`` defines, ``R`` the eigenvectors of
    ``(z - u)^T (z - u) / N`` outside the ``dim`` principal ones, and ``alpha`` the mean training
    max-logit over the mean training residual norm.

    ``fit`` streams the ``D x D`` moment (float64) and the max-logit sum; the residual norms need
    ``R``, known only at the end, so they are measured on a uniform subsample of at most
    ``max_alpha`` training features (all of them when there are fewer; ``None``: always all).
    ``dim`` defaults to the paper's choices: 1000 for ``D >= 2048``, 512 for ``D >= 768``, else
    ``D // 2``. The head must be linear (``weight``, optional ``bias``).
    """

    name = "vim"

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
        _, evecs = torch.linalg.eigh(self._moment / self._n)
        residual = evecs[:, : d_all - dim]  # eigh sorts ascending: the smallest D - dim directions
        sample = self._sample.values().double() - self._u.to(self._moment.device)
        alpha = (self._max_logit_sum / self._n) / (sample @ residual).norm(dim=1).mean()
        self.principal_dim = dim
        self.alpha = float(alpha.item())
        self._residual = residual.float()
        self._origin = self._u.float().to(residual.device)
        del self._moment, self._sample

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        vlogit = ((feats - self._origin.to(feats.device)) @ self._residual.to(feats.device)).norm(dim=1)
        return torch.logsumexp(logits, dim=1) - self.alpha * vlogit


class KNN(_FittedDetector):
    """Deep nearest neighbours (Sun et al. 2022): ``score(z) = -||z/|z| - n_k||``, minus the
    Euclidean distance from the normalised features to their ``k``-th nearest normalised training
    feature. ``fit`` keeps the normalised training features (``N x D`` floats), or a uniform
    subsample of ``max_fit`` of them (the paper uses 1% of ImageNet). Neighbours are searched in
    chunks of ``chunk`` training rows, so scoring memory stays ``B x chunk``; the distance of the
    chosen neighbour is then computed directly (not from the dot product)."""

    name = "knn"

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
    uses_features = False  # the logits alone: any classifier, whatever its head

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

    def fit(
        self,
        jm: Any,
        data: Any,
        *,
        batch_size: int = 256,
        progress: bool | None = None,
        input_key: str | None = None,
    ) -> OpenMax:
        """Fit on in-distribution ``data``, streaming over it twice (class means, then the
        distance tails); returns ``self``. ``data``: a DataLoader or another iterable that can be
        iterated twice, a tensor, or an ``(x, y)`` pair of tensors."""
        if isinstance(data, Iterator):
            raise InvalidInputError(
                "openmax streams over the fit data twice (class means, then the distances to them) and "
                f"got a one-shot iterator ({type(data).__name__}): pass a DataLoader, a list of batches or tensors"
            )
        core = as_jem(jm, f"{self.name}.fit")
        options: dict[str, Any] = {"batch_size": batch_size, "progress": progress, "input_key": input_key}
        self._begin(core)
        self._stream(core, data, self._add, **options, desc="fit openmax (1/2: class means)")
        self._set_centres()
        self._stream(core, data, self._add_tail, **options, desc="fit openmax (2/2: distance tails)")
        self._finish(core)
        self._fitted_now(core)
        return self

    def _begin(self, jm: Any) -> None:
        self._sums: Tensor | None = None
        self._counts: Tensor | None = None

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        k = logits.shape[1]
        y = self._labels(logits, logits, y)
        v = logits.double()
        if self._sums is None:
            self._sums, self._counts = v.new_zeros(k, k), v.new_zeros(k)
        assert self._counts is not None
        self._sums.index_add_(0, y, v)
        self._counts += torch.bincount(y, minlength=k).to(v.dtype)

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

    def _add_tail(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        y = self._labels(logits, logits, y)
        v = logits.double()
        d = self._distance(v, self._centres[y])
        by_class = v.new_full((self._tails.shape[0], v.shape[0]), -math.inf)
        by_class[y, torch.arange(v.shape[0], device=v.device)] = d
        self._tails = torch.cat([self._tails, by_class], dim=1).topk(self.tailsize, dim=1).values

    def _finish(self, jm: Any) -> None:
        valid = self._tails > -math.inf
        lowest = self._tails.masked_fill(~valid, math.inf).amin(dim=1)
        present = self._present
        shape, scale = _weibull_fit(
            self._tails[present] + _WEIBULL_SHIFT - lowest[present].unsqueeze(1), valid[present]
        )
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


@hookimpl
def jem_register_ood_scores(register: Callable[..., None]) -> None:
    register(
        "odin",
        odin,
        needs_grad=True,
        description="ODIN: max softmax at temperature T after an eps input step (temperature=1000, eps=0.0014)",
    )
    register(
        "gen",
        gen,
        needs_grad=False,
        description="GEN generalized entropy of the top-M probabilities (gamma=, M=, clamp=)",
    )
    register(
        "ash",
        ash,
        needs_grad=False,
        description="ASH-S: energy of pruned, rescaled feature maps (penultimate features without maps; percentile=90)",
    )
    register(
        "scale",
        scale,
        needs_grad=False,
        description="SCALE: energy of rescaled feature maps (penultimate features without maps; percentile=85)",
    )
    register(
        "mahalanobis",
        Mahalanobis,
        needs_grad=False,
        needs_fit=True,
        description="class-conditional Mahalanobis distance, shared covariance (fit; labels=)",
    )
    register(
        "relative_mahalanobis",
        RelativeMahalanobis,
        needs_grad=False,
        needs_fit=True,
        description="Mahalanobis minus the distance under one Gaussian of all data (fit; labels=)",
    )
    register(
        "mahalanobis_odin",
        MahalanobisODIN,
        needs_grad=True,
        needs_fit=True,
        description="Mahalanobis after an eps input step towards the closest class mean (fit; eps=0.002, labels=)",
    )
    register(
        "multi_mahalanobis",
        MultiMahalanobis,
        needs_grad=False,
        needs_fit=True,
        description="Mahalanobis summed over several depths, Lee et al.'s feature ensemble (fit; layers=, weights='dof', labels=)",
    )
    register(
        "gram",
        Gram,
        needs_grad=False,
        needs_fit=True,
        description="Gram matrices of several depths against per-class training bounds (fit; layers=, powers=10, held_out=0.1)",
    )
    register(
        "gmm",
        GMM,
        needs_grad=False,
        needs_fit=True,
        description="log-likelihood under class-conditional Gaussians, one covariance per class (fit; reg=1e-6, labels=)",
    )
    register(
        "vim",
        ViM,
        needs_grad=False,
        needs_fit=True,
        description="ViM: energy minus the scaled residual norm (fit; dim=, max_alpha=)",
    )
    register(
        "knn",
        KNN,
        needs_grad=False,
        needs_fit=True,
        description="minus the distance to the k-th nearest normalised training feature (fit; k=50, max_fit=)",
    )
    register(
        "react",
        ReAct,
        needs_grad=False,
        needs_fit=True,
        description="ReAct: energy of features clipped at a training percentile (fit; percentile=90)",
    )
    register(
        "openmax",
        OpenMax,
        needs_grad=False,
        needs_fit=True,
        description="OpenMax: minus the unknown class's probability from Weibull fits of logit distances (fit; tailsize=25, alpha=10)",
    )
