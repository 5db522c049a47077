"""The memory formulas of the post-hoc detectors: each detector's
:meth:`~jem_plugin.ood.Detector.memory_estimate` (declared on its class) calls one of these with
itself and the fit's shape (:class:`~jem_plugin.ood.FitShape`: fit rows, feature width, classes,
layer widths, batch rows): the bytes its running statistics, its end of fit and one fit batch's
scratch hold at their peak, on the device the features live on. The checks against the limit and
the refusal are the base class's (:class:`jem_plugin.ood.Detector`): when the fit starts, again
on the first batch with the outputs' own shapes, and as a bank of data of unknown length grows
(``knn``, ``nnguide`` without ``max_fit``).

The limit (see :meth:`jem_plugin.ood.Detector.memory_limit_bytes`) defaults to 2 GiB: a fixed
number, so that whether a fit is refused does not depend on the machine it runs on, and the
budget of issue 46 (every detector fits an ImageNet-size fit in it, or names the setting that
does). Most fits stay far under it; short of ImageNet, ``gmm``'s full per-class covariances of
wide features are the exception.
"""

from __future__ import annotations

from typing import Any

from ..._detector import DEFAULT_LIMIT, Estimate, FitShape
from ._base import GATHER_VALUES

_F4, _F8, _I8 = 4, 8, 8  # float32, float64, int64 bytes


def limit_hint(det: Any) -> float | None:
    """The limit an estimate's advice sizes itself to (the detector's, without raising)."""
    try:
        return det.memory_limit_bytes()
    except ValueError:
        return None


# -- the estimates -------------------------------------------------------------------------------
#
# Each: (detector, shape) -> Estimate, or None where a width it needs is not known yet. An
# estimate is an upper bound: its coefficients count the arrays the code holds at its peak (the
# running sums, the copies its end of fit makes, one batch's scratch, a batch it keeps a reference
# to), in tensor bytes as torch allocates them; tests/test_posthoc_memory.py measures every fitted
# detector's peak that way and fails where one is over its estimate, and
# benchmarks/bench_posthoc_scale.py does at ImageNet's size.


def _b(shape: FitShape) -> int:
    return shape.batch or 0


def _gaussian(d: int, k: int, b: int) -> float:
    # sums K x D and the D x D outer sum (float64); the end: the outer sum, the within-class
    # covariance and its symmetrised copy, eigh's vectors and work space, the whitener's columns
    # and the whitener (measured: six D x D float64 at the peak, counted seven); a batch in
    # float64, shifted
    return k * d * _F8 * 2 + d * d * _F8 * 7 + b * d * _F8 * 2


def mahalanobis(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    # the relative variant's background whitener is computed once the class one is kept
    extra = s.dim * s.dim * _F8 if det.name == "relative_mahalanobis" else 0
    return Estimate(
        _gaussian(s.dim, s.classes, _b(s)) + extra,
        f"one {s.dim}x{s.dim} covariance and {s.classes} class means (float64)",
        "use fewer features (a narrower layer)",
    )


def multi_mahalanobis(det: Any, s: FitShape) -> Estimate | None:
    if s.layers is None or s.classes is None:
        return None
    widths = [c for c, _ in s.layers]
    total = sum(_gaussian(c, s.classes, 0) for c in widths) + _b(s) * sum(widths) * _F8 * 2
    return Estimate(
        total,
        f"one covariance per layer ({' + '.join(f'{c}x{c}' for c in widths)}, float64)",
        "read fewer or narrower layers (layers=[...])",
    )


def gram(det: Any, s: FitShape) -> Estimate | None:
    if s.layers is None or s.classes is None:
        return None
    stats = sum(c for c, _ in s.layers) * len(det.powers)
    k, b = s.classes, _b(s)
    # bounds and runners-up (or bounds of the others), K x stats float32 each, and the update's
    # temporaries of a block of statistics; a batch's statistics, indices and masks; the Gram rows of
    # the widest layer's maps, float64, in chunks of at most 2^25 entries, three copies live
    maps = min(b * max(c * p for c, p in s.layers), det.chunk_entries) * _F8 * 3
    held = det.max_held_out * stats * _F4 * 3 if det.held_out is not None else 0
    # the four bounds, then the larger of a batch's update (K x block and batch x block
    # temporaries) and the end's leave-one-out gaps (about six K x stats temporaries)
    block = min(stats, det.widen_block)
    update = k * block * _F4 * 8 + b * stats * _F4 * 2 + b * block * (_F4 * 5 + _I8 + 1) + maps
    return Estimate(
        k * stats * _F4 * 4 + max(update, k * stats * _F4 * 6) + held,
        f"per-class bounds of {stats} statistics for {k} classes (float32, with their runners-up) and a batch of {b}",
        "read fewer layers (layers=[...]) or powers (powers=...), or fit in smaller batches",
    )


def gmm(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    d, k, b = s.dim, s.classes, _b(s)
    cov = getattr(det, "covariance", "full")
    if cov == "full":
        # K x D x D float64 sums; the end stacks K float32 whiteners (a list, then the stack)
        total: float = k * d * d * (_F8 + 2 * _F4) + d * d * _F8 * 6 + k * d * _F8 * 2 + b * d * _F8 * 3
        what = f"one {d}x{d} covariance per class for {k} classes (float64)"
    elif cov == "tied":
        total = _gaussian(d, k, b)
        what = f"one shared {d}x{d} covariance (float64)"
    else:
        total = k * d * _F8 * 4 + b * d * _F8 * 3
        what = f"a diagonal covariance per class for {k} classes"
    return Estimate(total, what, "use covariance='tied' (one shared) or 'diag' (diagonal per class)")


def _bank(det: Any, s: FitShape, row_bytes: int, what: str) -> Estimate | None:
    if s.dim is None:
        return None
    cap = det.max_fit
    rows = s.rows if cap is None else (cap if s.rows is None else min(cap, s.rows))
    if rows is None:  # data of unknown length: checked as the bank grows (check_growth)
        return Estimate(0.0, what, "", {"grows": True})
    b = _b(s)
    # a sample of at most max_fit rows holds up to twice that (and their keys) before it compacts,
    # then copies the rows it keeps; all rows: the batches, then their concatenation
    sampled = cap is not None and s.rows is not None and s.rows > cap
    held = rows * 2 + b if sampled else rows
    gather = _gather_bytes(rows, s.dim) if sampled else 0
    total = (held + rows) * s.dim * row_bytes + held * (_F4 + _I8) + b * s.dim * _F4 * 2 + gather
    return Estimate(
        total,
        f"a bank of {rows} x {s.dim} {what} (float32)",
        f"pass max_fit={max(det.k, int(0.85 * (limit_hint(det) or DEFAULT_LIMIT) / (s.dim * row_bytes * 3)))} "
        "(a uniform subsample; the paper banks 1% of ImageNet)",
    )


def knn(det: Any, s: FitShape) -> Estimate | None:
    return _bank(det, s, _F4, "normalised training features")


def nnguide(det: Any, s: FitShape) -> Estimate | None:
    return _bank(det, s, _F4, "energy-scaled training features")


def _sample_bytes(cap: int | None, rows_values: int | None, width: int, added: int) -> float:
    """A bounded uniform sample (:class:`._base._Sample`) of ``cap`` rows of ``width`` float32
    values (all rows where ``cap`` is None), ``rows_values`` rows in the data, ``added`` rows per
    batch: before it compacts it holds up to twice the capacity and the batch just added (the
    caller's batch itself, kept by reference) with their keys; compacting concatenates the keys,
    finds the kept ones (values, indices, their order) and copies the kept rows and keys out. All
    rows: the batches, then their concatenation."""
    if cap is None:
        return (rows_values or 0) * width * _F4 * 2
    held = 2 * cap + added if rows_values is None else min(rows_values, 2 * cap + added)
    kept = min(cap, held)
    return held * (width * _F4 + _F4 * 2) + kept * (width * _F4 + _F4 * 2 + _I8 * 3) + _gather_bytes(kept, width)


def _gather_bytes(kept: int, width: int) -> float:
    """The compaction's copy of the rows it selects from one chunk, at most ``GATHER_VALUES``
    values at a time (:meth:`._base._Sample._gather`)."""
    return min(kept, max(1, GATHER_VALUES // max(1, width))) * width * _F4


def _at_most(cap: int | None, n: int | None) -> int:
    """How many a sample of capacity ``cap`` keeps of ``n`` (either unknown: ``None``)."""
    return min(c for c in (cap, n) if c is not None) if (cap, n) != (None, None) else 0


def react(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None:
        return None
    values = None if s.rows is None else s.rows * s.dim
    sample = _sample_bytes(det.max_values, values, 1, _b(s) * s.dim)
    return Estimate(  # the end sorts the sample: values and indices
        sample + _at_most(det.max_values, values) * (_F4 + _I8),
        "a sample of training activations",
        "pass a smaller max_values",
    )


def vra(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None:
        return None
    if det.per_unit:
        cap = None if det.max_values is None else max(1, det.max_values // s.dim)
        sample = _sample_bytes(cap, s.rows, s.dim, _b(s))
        kept = _at_most(cap, s.rows) * s.dim
    else:
        values = None if s.rows is None else s.rows * s.dim
        sample = _sample_bytes(det.max_values, values, 1, _b(s) * s.dim)
        kept = _at_most(det.max_values, values)
    return Estimate(sample + kept * (_F4 + _I8), "a sample of training activations", "pass a smaller max_values")


def vim(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    d, k = s.dim, s.classes
    sample = _sample_bytes(det.max_alpha, s.rows, d, _b(s)) + _at_most(det.max_alpha, s.rows) * d * _F8
    return Estimate(
        d * d * _F8 * 5 + k * d * _F8 * 4 + sample + _b(s) * d * _F8 * 2,
        f"one {d}x{d} moment (float64) and a sample of {det.max_alpha} features",
        "pass a smaller max_alpha",
    )


def pnml(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None:
        return None
    return Estimate(
        s.dim * s.dim * _F8 * 6 + _b(s) * s.dim * _F8 * 2,
        f"one {s.dim}x{s.dim} moment (float64) and its pseudo-inverse",
        "use fewer features",
    )


def per_class_means(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    return Estimate(
        s.classes * s.dim * _F8 * 2 + _b(s) * s.dim * _F8 * 2,
        f"{s.classes} class sums of {s.dim} features (float64)",
        "use fewer features",
    )


def head_sized(det: Any, s: FitShape) -> Estimate | None:
    # dice's contributions sorted (values and indices), nci's copy of the head; the running mean
    if s.dim is None or s.classes is None:
        return None
    return Estimate(
        s.classes * s.dim * (_F4 * 4 + _I8) + _b(s) * s.dim * _F8,
        f"the {s.classes}x{s.dim} head and its contributions",
        "use fewer classes or features",
    )


def fdbd(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    # the distances computed 16 head rows at a time: 16 x K x D differences
    return Estimate(
        s.classes * s.classes * _F4 * 3
        + s.classes * s.dim * _F4 * 2
        + 16 * s.classes * s.dim * _F4
        + _b(s) * s.dim * _F8,
        f"the {s.classes}x{s.classes} distances between the head's rows",
        "use fewer classes",
    )


def logit_sums(det: Any, s: FitShape) -> Estimate | None:
    if s.classes is None:
        return None
    k, b = s.classes, _b(s)
    tails = k * (getattr(det, "tailsize", 0) + b) * _F8 * 3 if det.name == "openmax" else 0
    return Estimate(
        k * k * _F8 * 3 + b * k * _F8 * 3 + tails, f"{k}x{k} sums of the logits (float64)", "use fewer classes"
    )


def adascale(det: Any, s: FitShape) -> Estimate | None:
    # one float64 per fit input, then their sort; a batch's input step: the features and the
    # moved ones, their differences and top units, the gradient, its mask and the moved input
    # (input-sized: counted at the features' width; the network's own activations for the
    # gradient are not counted, as for scoring)
    rows, b, d = s.rows or 0, _b(s), s.dim or 0
    return Estimate(rows * _F8 * 3 + b * d * _F4 * 8, "one statistic per fit input (float64)", "fit on fewer inputs")


def weiper(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    d, k, r, b = s.dim, s.classes, det.repeats, _b(s)
    # per repeat: its copy of the head, a batch's perturbed logits (and their softmax), the end's
    # histograms of 256-row chunks (logits, float64, indices); then the head and the sample
    per_repeat = k * d * _F4 + b * k * _F4 * 2 + 256 * k * (_F4 + _F8 + _I8)
    rest = k * d * _F4 * 3 + _sample_bytes(det.max_fit, s.rows, d, _b(s))
    fits = max(1, int(((limit_hint(det) or DEFAULT_LIMIT) - rest) // per_repeat))
    return Estimate(
        r * per_repeat + rest,
        f"{r} perturbed copies of the {k}x{d} head (float32) and their logits for a batch of {b}",
        f"use fewer repeats (repeats={fits}) or fit in smaller batches",
    )
