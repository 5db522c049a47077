"""The Gram-matrix detector (Sastry & Oore 2020) and its per-class running bounds."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._outputs import Outputs
from ...distributed import rank_seed
from ...model import as_jem
from . import _memory
from ._base import (
    _checked_layers,
    _ClassConditional,
    _Sample,
)

#: Map entries per chunk of :func:`_gram_rows` (float64: 256 MB, three copies live): a batch of
#: 256 ResNet-50 ``layer1`` maps at 224x224 (205M entries) is done in 7 chunks, not at once.
_GRAM_CHUNK_ENTRIES = 1 << 25

#: Statistics per block of the running bounds' update (:func:`_widen_two`'s temporaries are
#: classes x block).
_WIDEN_BLOCK = 4096


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
    _memory_formula = staticmethod(_memory.gram)  # the fit's peak
    # the scratch bounds the memory estimate reads (_memory, which cannot import this module: _base imports it)
    chunk_entries = _GRAM_CHUNK_ENTRIES
    widen_block = _WIDEN_BLOCK
    reads = frozenset({"logits", "layers"})
    description = (
        "Gram matrices of several depths against per-class training bounds (fit; layers=, powers=10, held_out=0.1)"
    )
    paper = "Sastry & Oore 2020, Detecting Out-of-Distribution Examples with In-distribution Examples and Gram Matrices (ICML)"

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
        # on the CPU: the same draw on any device; each rank its own (rank_seed: the seed itself on one)
        self._draw = torch.Generator().manual_seed(rank_seed(self.seed))
        self._seen = 0

    @property
    def layers_read(self) -> list[str]:
        return list(self.__dict__.get("layer_names", []))

    def _rank_statistics(self) -> tuple[tuple[str | tuple[str, str], str], ...]:
        """Bounds min/max-reduced with their runners-up (leave-one-out), or with the bounds
        without the held-out images and the held-out sample (a fraction held out)."""
        if self.held_out is None:
            return ((("_lo", "_runners_up.0"), "low2"), (("_hi", "_runners_up.1"), "high2"), ("_seen", "sum"))
        return (
            ("_lo", "min"),
            ("_hi", "max"),
            ("_others.0", "min"),
            ("_others.1", "max"),
            ("_held", "sample"),
            ("_seen", "sum"),
        )

    def _take(self, out: Outputs) -> tuple[Tensor, Tensor]:
        """The Gram statistics of every layer and power side by side (``[B, sum_l P C_l]``) and the logits."""
        rows = [_gram_rows(out.layer(name, self.name), self.powers).flatten(1) for name in self.layer_names]
        self._dims = [r.shape[1] for r in rows]
        return torch.cat(rows, dim=1), out.logits

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
            # a block of statistics at a time: the update's K x block temporaries, not K x all of
            # them (ImageNet's 1000 classes x 38400 statistics: 150 MB per temporary, not 6x that)
            for start in range(0, feats.shape[1], _WIDEN_BLOCK):
                c = slice(start, start + _WIDEN_BLOCK)
                _widen_two((self._lo[:, c], lo2[:, c]), (self._hi[:, c], hi2[:, c]), feats[:, c], y)
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
