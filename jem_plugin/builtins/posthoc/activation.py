"""More activation shaping: LTS scales the logits by the features' top-mass ratio, RankFeat
removes the feature maps' rank-1 part, VRA clips the features on both sides at training
percentiles (fitted), AdaSCALE scales them by a percentile adapted to how much a small input
step moves them (fitted, input gradient). Each scores the energy of the resulting logits."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..._outputs import Outputs, forward_outputs
from ...errors import NoFeaturesError
from ...model import as_jem, input_grad_enabled
from . import _memory
from ._base import _energy, _FittedDetector, _head, _Sample, describe
from .shaping import _check_percentile, _kept, _ratio
from .sparsification import _quantile

_FEATURES = frozenset({"logits", "features"})
_MAPS = frozenset({"logits", "feature_maps"})


def _lts(jm: Any, out: Outputs, percentile: float = 95.0) -> Tensor:
    """:func:`lts` of a batch's outputs (its features and logits)."""
    p = _check_percentile(percentile)
    h = out.need("features", "lts").float().relu()
    top = torch.topk(h, _kept(h.shape[1], p), dim=1).values.sum(dim=1)
    s = torch.where(top == 0, torch.ones_like(top), _ratio(h.sum(dim=1), top))
    return torch.logsumexp(out.logits.float() * s.square().unsqueeze(1), dim=1)


@describe(
    name="lts",
    description="LTS: energy of the logits scaled by (sum / top-sum of the ReLU features)^2 (percentile=95)",
    paper="Djurisic et al. 2025, Logit Scaling for Out-of-Distribution Detection",
    reads=_FEATURES,
    score_outputs=_lts,
)
def lts(jm: Any, x: Tensor, percentile: float = 95.0) -> Tensor:
    """Logit scaling (LTS): ``logsumexp(S * f(x))`` with ``S = (sum_j h_j / sum_top h_j)^2``,
    ``h = relu(z)`` the penultimate features and the top sum over their largest
    ``100 - percentile`` % (at least one; rounded as :func:`ash`). Reads the features and logits.

    ``percentile`` in percent as ASH and SCALE take it: 95 is pytorch-ood's ``p = 0.05`` (the top
    fraction kept). The ReLU is the authors' code's (the paper leaves it out); it changes only
    features that can be negative. A row of non-positive features is left unscaled where
    pytorch-ood's ``LTS`` gives NaN; its outlier score is minus ours.
    """
    _check_percentile(percentile)
    return _lts(jm, forward_outputs(as_jem(jm, "lts"), x, _FEATURES), percentile)


def _without_rank1(maps: Tensor) -> Tensor:
    """Each ``[C, H*W]`` map matrix minus its rank-1 part ``s_1 u_1 v_1^T`` (its SVD, float64)."""
    b, c = maps.shape[:2]
    m = maps.reshape(b, c, -1).double()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    rank1 = s[:, :1, None] * u[:, :, :1] @ vh[:, :1, :]
    return (m - rank1).to(maps.dtype).view_as(maps)


def _rankfeat(jm: Any, out: Outputs) -> Tensor:
    """:func:`rankfeat` of a batch's outputs (its feature maps)."""
    maps = out.feature_maps
    if maps is None or out.to_logits is None:
        raise NoFeaturesError(
            "rankfeat removes the rank-1 part of the last feature maps, and this model's adapter gives none "
            "(a ViT, or wrap(model, features=...)); use a CNN, or an adapter that defines feature_maps"
        )
    if maps.dim() >= 3 and maps[0, 0].numel() == 1:  # a C x 1 matrix is all rank 1: nothing would be left
        raise NoFeaturesError(
            f"rankfeat removes the rank-1 part of the last feature maps, and at this input size they are "
            f"{'x'.join(map(str, maps.shape[2:]))} ({tuple(maps.shape[1:])}): nothing is left and every input "
            "would score the same; feed larger inputs (a stride-32 network needs at least 64x64)"
        )
    return torch.logsumexp(out.to_logits(_without_rank1(maps)).float(), dim=1)


@describe(
    name="rankfeat",
    description="RankFeat: energy of the logits from the last feature maps minus their rank-1 part (needs feature maps)",
    paper="Song et al. 2022, RankFeat: Rank-1 Feature Removal for Out-of-distribution Detection (NeurIPS)",
    reads=_MAPS,
    score_outputs=_rankfeat,
)
def rankfeat(jm: Any, x: Tensor) -> Tensor:
    """RankFeat (Song et al. 2022): each input's last feature maps, as a ``C x HW`` matrix, lose
    their rank-1 part ``s_1 u_1 v_1^T`` (exact SVD), and the score is the energy of the logits the
    rest of the network gives from them (:meth:`jem_plugin.JEM.feature_maps`). Reads the feature
    maps; a network whose adapter gives none (a ViT: its penultimate features are one vector, all
    rank 1) is refused in one line, and so are maps of one pixel (a stride-32 network at 32x32),
    from which the removal leaves nothing, so that every input would score the same.

    As pytorch-ood's ``RankFeat`` on the same maps (its outlier score is minus ours). The paper
    also averages the logits of the same removal at the block before (OpenOOD's default), which
    needs that block's maps and the layers after it; not done here.
    """
    return _rankfeat(jm, forward_outputs(as_jem(jm, "rankfeat"), x, _MAPS))


class VRA(_FittedDetector):
    """Variational rectified activation (Xu et al. 2023), as OpenOOD runs it: the penultimate
    features clipped to ``[lo, hi]``, the ``lower`` and ``upper`` percentiles of the training
    activations, then the energy of the head on them (ReAct clipped on both sides).

    ``per_unit=False`` (default, the paper's and OpenOOD's): one ``lo`` and one ``hi`` over every
    unit of every training input. ``per_unit=True``: a pair per unit, pytorch-ood's ``VRA`` (which
    clips each element of the maps it is given between its own percentiles; on features as
    ``1 x 1`` maps, ours with ``per_unit=True`` at the same percentiles). The paper's full
    rectification also zeroes activations below ``lo`` and shifts those between by a constant;
    OpenOOD and pytorch-ood clip, and so do we.

    ``lower=10``, ``upper=90`` are OpenOOD's defaults (pytorch-ood's are 1 and 99), kept after a
    study that tuned them on ``bench_posthoc``'s tune network and judged them on its others
    (``benchmarks/tune_posthoc_option.py --study vra_percentiles``,
    ``benchmarks/results/vra_percentiles.json``, mean AUROC over each network's OOD sets): the tune
    network (resnet10t) chose 10/75 (0.989, against 10/90's 0.970 and 1/99's 0.925), but on the
    networks no choice read 10/75 was below 10/90 on lcnet_050 (0.673 against 0.812) and test_vit
    (0.779 against 0.781), above it only on convnext_atto (0.828 against 0.821): a setting only the
    tuned network favours, so not the default. pytorch-ood's 1/99 did best on lcnet_050 and
    test_vit (0.895, 0.824) and worst on resnet10t; taking it because of that would be choosing on
    the judged networks. Where the two percentiles are equal (say both 0: at least ``upper - lower``
    percent of the training activations are 0), every input would score the same, and ``fit``
    refuses (:class:`~jem_plugin.errors.NoFeaturesError`, a failed row in ``evaluate_all``).

    ``fit`` keeps a uniform sample of at most ``max_values`` activations (``per_unit``: of
    ``max_values / D`` training inputs), all when there are fewer, so the percentiles are exact
    for small sets. The head must map the features to the logits (:meth:`jem_plugin.JEM.head`).
    """

    name = "vra"
    _memory_formula = staticmethod(_memory.vra)  # the fit's peak
    description = (
        "VRA: energy of the features clipped between two training percentiles "
        "(fit; lower=10, upper=90, OpenOOD's; per_unit=False)"
    )
    paper = "Xu et al. 2023, VRA: Variational Rectified Activation for Out-of-distribution Detection (NeurIPS)"
    _rank_stats = (("_sample", "sample"),)
    across_ranks = "gather"

    def __init__(
        self,
        lower: float = 10.0,
        upper: float = 90.0,
        per_unit: bool = False,
        max_values: int | None = 10_000_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.lower, self.upper = _check_percentile(lower, "lower"), float(upper)
        if not self.lower <= self.upper <= 100.0:
            raise ValueError(
                f"upper must be in [lower, 100] (percentages: 90, not 0.9), got lower={lower!r}, upper={upper!r}"
            )
        if max_values is not None and (
            isinstance(max_values, bool) or not isinstance(max_values, int) or max_values < 1
        ):
            raise ValueError(f"max_values must be a positive integer or None, got {max_values!r}")
        self.per_unit, self.max_values, self.seed = bool(per_unit), max_values, seed

    def _options(self) -> dict[str, Any]:
        return {"lower": self.lower, "upper": self.upper, "per_unit": self.per_unit, "max_values": self.max_values}

    def _begin(self, jm: Any) -> None:
        _head(jm, self.name)
        self._sample: _Sample | None = None

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        if self._sample is None:
            cap = self.max_values
            if cap is not None and self.per_unit:
                cap = max(1, cap // feats.shape[1])
            self._sample = _Sample(cap, self.seed)
        self._sample.add(feats if self.per_unit else feats.reshape(-1))

    def _finish(self, jm: Any) -> None:
        assert self._sample is not None
        values = self._sample.values().sort(dim=0).values
        self.low = _quantile(values, self.lower / 100.0)
        self.high = _quantile(values, self.upper / 100.0)
        del self._sample
        if bool((self.high <= self.low).all()):  # every feature clipped to one value: one score for all
            both = "equal for every unit" if self.per_unit else f"both {float(self.low):g}"
            raise NoFeaturesError(
                f"vra clips the features between the {self.lower:g}th and {self.upper:g}th percentiles of the "
                f"training activations, and they are {both} (at least {self.upper - self.lower:g}% of the activations "
                "hold one value): every input would score the same; raise upper (e.g. upper=99), or use react"
            )

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        lo, hi = self.low.to(feats.device), self.high.to(feats.device)
        return _energy(_head(jm, self.name), torch.minimum(torch.maximum(feats, lo), hi))


def _ada_scale(h: Tensor, percentiles: Tensor) -> Tensor:
    """``sum h / sum of its top k`` per row, ``k = D - round(D * percentile / 100)`` (at least
    1) from each row's own percentile, rounded half to even as OpenOOD's ``torch.round``."""
    d = h.shape[1]
    ks = (d - torch.round(d * percentiles.double() / 100.0)).long().clamp(1, d)
    top = torch.topk(h, int(ks.max()), dim=1).values
    kept = torch.arange(top.shape[1], device=h.device).unsqueeze(0) < ks.unsqueeze(1)
    return _ratio(h.sum(dim=1), (top * kept).sum(dim=1))


class AdaSCALE(_FittedDetector):
    """AdaSCALE (Regmi et al. 2025): SCALE with a percentile per input, higher for inputs that
    look out-of-distribution, judged by how much a small input step moves their features.

    1. The input's ``o`` fraction of least sensitive elements (smallest ``|d f_yhat / dx|``) move
       by ``eps`` along the gradient's sign (``eps`` in ``[0, 1]``-pixel units, per channel of the
       model's domain, as :func:`odin`'s); ``z'`` are the features of the moved input.
    2. ``Q = sum_{top k1 of z} relu(z') + lambda * sum_{top k2 of z} |z - z'|`` (``k1``, ``k2`` in
       percent of the ``D`` features, at least one each).
    3. The percentile is ``p = p_min + (1 - F(Q)) (p_max - p_min)``, ``F`` the empirical CDF of
       ``Q`` on the fit data.
    4. ``h = relu(z)``, ``s = sum h / sum of its top (100 - p) %``; ``variant="a"``: the energy of
       the head on ``z * exp(s)``; ``variant="l"``: the energy of ``s^2 * f(x)``.

    Defaults are OpenOOD's (``percentiles=(75, 85)``, ``k1=5``, ``k2=1``, ``lam=10``, ``o=0.05``),
    and its step of 0.5 in ImageNet-normalised input units, ``0.5 * std``, is ``eps = 0.113``
    (the mean of ImageNet's stds times 0.5); not tuned here. OpenOOD takes ``int(D * k / 100)``
    units, 0 for ``D < 100 / k``; ours at least one. ``fit`` keeps ``Q`` of every fit input
    (one float each); fitting and scoring cost an input gradient and a second forward pass.
    pytorch-ood has no AdaSCALE.
    """

    name = "adascale"
    _memory_formula = staticmethod(_memory.adascale)  # the fit's peak
    needs_grad = True
    reads = frozenset({"logits"})  # the fit's own forward: the statistic comes from _saw_inputs
    description = "AdaSCALE: SCALE at a percentile set by how far a small input step moves the features (fit; input grad; variant='a')"
    paper = "Regmi et al. 2025, AdaSCALE: Adaptive Scaling for OOD Detection"
    _rank_stats = (("_qs", "gather"),)  # one float per fit input
    across_ranks = "gather"

    def __init__(
        self,
        percentiles: tuple[float, float] = (75.0, 85.0),
        k1: float = 5.0,
        k2: float = 1.0,
        lam: float = 10.0,
        o: float = 0.05,
        eps: float = 0.113,
        variant: str = "a",
    ) -> None:
        super().__init__()
        lo, hi = (float(p) for p in percentiles)
        if not 0.0 < lo <= hi < 100.0:
            raise ValueError(f"percentiles must be (low, high) with 0 < low <= high < 100, got {percentiles!r}")
        for name, v in (("k1", k1), ("k2", k2)):
            if not 0.0 < float(v) <= 100.0:
                raise ValueError(f"{name} must be a percentage of the features in (0, 100], got {v!r}")
        if not 0.0 < float(o) <= 1.0:
            raise ValueError(f"o must be the fraction of input elements to move, in (0, 1], got {o!r}")
        if not (float(eps) >= 0.0 and math.isfinite(float(eps))) or not math.isfinite(float(lam)):
            raise ValueError(f"eps must be a non-negative finite number and lam finite, got eps={eps!r}, lam={lam!r}")
        if variant not in ("a", "l"):
            raise ValueError(f"variant must be 'a' (activation scaling) or 'l' (logit scaling), got {variant!r}")
        self.percentiles = (lo, hi)
        self.k1, self.k2, self.lam, self.o, self.eps, self.variant = (
            float(k1),
            float(k2),
            float(lam),
            float(o),
            float(eps),
            variant,
        )

    def _options(self) -> dict[str, Any]:
        return {
            "percentiles": self.percentiles,
            "k1": self.k1,
            "k2": self.k2,
            "lam": self.lam,
            "o": self.o,
            "eps": self.eps,
            "variant": self.variant,
        }

    def _moved(self, core: Any, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(z, z', logits)``: the features of the batch and of its moved copy, and its logits."""
        with input_grad_enabled(x) as xg:
            z, logits = core.features(xg)
            (g,) = torch.autograd.grad(logits.max(dim=1).values.sum(), xg)
        flat = g.detach().abs().flatten(1)
        n = max(1, int(flat.shape[1] * self.o))
        mask = torch.zeros_like(flat).scatter_(1, flat.topk(n, dim=1, largest=False).indices, 1.0).view_as(g)
        lo, hi = core.domain.bounds(x) if x.dim() >= 2 else (0.0, 1.0)
        moved = x.detach() + self.eps * g.sign() * mask * (hi - lo)
        with torch.no_grad():
            z_moved, _ = core.features(moved)
        return z.detach().float(), z_moved.float(), logits.detach().float()

    def _q(self, z: Tensor, z_moved: Tensor) -> Tensor:
        d = z.shape[1]
        k1, k2 = (max(1, int(d * k / 100.0)) for k in (self.k1, self.k2))
        q1 = z_moved.relu().gather(1, z.topk(k1, dim=1).indices).sum(dim=1)
        q2 = (z - z_moved).abs().gather(1, z.topk(k2, dim=1).indices).sum(dim=1)
        return q1.double() + self.lam * q2.double()

    def _begin(self, jm: Any) -> None:
        if self.variant == "a":
            _head(jm, self.name)
        self._core = jm  # the fit's network, for the input step of each batch (_saw_inputs)
        self._qs: list[Tensor] = []

    def _saw_inputs(self, x: Tensor) -> None:
        z, z_moved, _ = self._moved(self._core, x)
        self._qs.append(self._q(z, z_moved))

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        """Nothing: each fit batch's statistic needs its inputs (:meth:`_saw_inputs`)."""

    def _finish(self, jm: Any) -> None:
        self.q_fit = torch.cat(self._qs).sort().values
        del self._qs, self._core

    def _scores(self, jm: Any, z: Tensor, z_moved: Tensor, logits: Tensor) -> Tensor:
        q = self._q(z, z_moved)
        ref = self.q_fit.to(q.device)
        cdf = torch.searchsorted(ref, q, right=True).double() / ref.shape[0]
        lo, hi = self.percentiles
        scale = _ada_scale(z.relu(), lo + (1.0 - cdf) * (hi - lo))
        if self.variant == "a":
            return _energy(_head(jm, self.name), z * torch.exp(scale).unsqueeze(1))
        return torch.logsumexp(logits * scale.square().unsqueeze(1), dim=1)

    def score(self, jm: Any, x: Tensor) -> Tensor:
        """``[B]`` scores of the batch ``x``, higher = more in-distribution (an input gradient,
        taken under ``no_grad`` and ``inference_mode`` too; no autograd graph is returned)."""
        core = as_jem(jm, f"{self.name}.score")
        self._check_fitted(core)
        z, z_moved, logits = self._moved(core, x)
        with torch.no_grad():
            return self._scores(core, z, z_moved, logits)

    def score_outputs(self, jm: Any, outputs: Outputs) -> Tensor:
        """Raises: the score needs the inputs themselves (their gradient); score inputs with :meth:`score`."""
        raise ValueError(
            f"{self.name} moves the inputs along their gradient before scoring them: score inputs with .score(jm, x)"
        )
