"""How much memory a fitted detector's fit takes, and the refusal of a fit that would exceed the
limit, in one line and before the detector allocates its statistics (never an out-of-memory kill
halfway through the data).

Each detector's estimate (:data:`_ESTIMATES`, by its registered name) is a formula in the fit's
shape (:class:`FitShape`: fit rows, feature width, classes, layer widths, batch rows): the bytes
its running statistics, its end of fit and one fit batch's scratch hold at their peak, on the
device the features live on. It is checked when the fit starts (:func:`check_fit`, from the head's
shape and the row count where the data has one) and again on the first batch (:func:`check_batch`,
from the outputs' own shapes), so a detector whose width is known only from its outputs (layer
outputs, no linear head) is checked before its first statistic is allocated. A bank that grows
with data of unknown length (``knn``, ``nnguide`` without ``max_fit``) is checked as it grows
(:func:`check_growth`).

The limit, in bytes (``None``: none): the detector's ``memory_limit`` attribute
(``jem.ood.detector(name, memory_limit=...)``), else the ``JEM_OOD_MEMORY_LIMIT`` environment
variable, else :data:`DEFAULT_LIMIT`, 2 GiB: a fixed number, so that whether a fit is refused
does not depend on the machine it runs on, and the budget of issue 46 (every detector fits an
ImageNet-size fit in it, or names the setting that does). Most fits stay far under it; short
of ImageNet, ``gmm``'s full per-class covariances of wide features are the exception.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sized
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from ...errors import MemoryLimitError

#: The default memory limit of a fit, in bytes (2 GiB; see the module's docstring for why).
DEFAULT_LIMIT = 2 << 30

#: The environment variable that sets the limit for the process (bytes, e.g. ``8e9``; ``none``:
#: no limit), where the detector has no ``memory_limit`` of its own.
ENV = "JEM_OOD_MEMORY_LIMIT"

_F4, _F8, _I8 = 4, 8, 8  # float32, float64, int64 bytes


@dataclass(frozen=True)
class FitShape:
    """What a fit's memory depends on; ``None`` where not known yet."""

    rows: int | None = None  #: fit rows (inputs)
    dim: int | None = None  #: penultimate feature width ``D``
    classes: int | None = None  #: classes ``K`` (the logits' width)
    layers: tuple[tuple[int, int], ...] | None = None  #: ``(channels, positions)`` per layer read
    batch: int | None = None  #: rows of one fit batch
    on: str = "memory"  #: where the statistics live ("memory" or "GPU memory")


@dataclass
class Estimate:
    """A fit's peak in bytes, what holds most of it, and the setting that shrinks it."""

    bytes: float
    what: str
    fix: str
    extra: dict[str, Any] = field(default_factory=dict)


def limit_of(det: Any) -> float | None:
    """The memory limit of ``det``'s fit in bytes, ``None`` for none (see the module docstring)."""
    if "memory_limit" in getattr(det, "__dict__", {}):
        return _checked_limit(det.__dict__["memory_limit"], "memory_limit")
    env = os.environ.get(ENV)
    if env is not None:
        return _checked_limit(None if env.strip().lower() in ("", "none") else env, ENV)
    return DEFAULT_LIMIT


def _checked_limit(value: Any, what: str) -> float | None:
    if value is None:
        return None
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = math.nan
    if not (limit > 0 and math.isfinite(limit)) or isinstance(value, bool):
        raise ValueError(f"{what} must be a positive number of bytes (e.g. 8e9) or None, got {value!r}")
    return limit


def set_limit(det: Any, limit: Any) -> None:
    """Give ``det`` its own memory limit (bytes, or ``None`` for none), checked now."""
    _checked_limit(limit, "memory_limit")
    det.memory_limit = limit


def human(n: float) -> str:
    """Bytes for a person in powers of 1024, named as such: ``2.0 GiB``, ``340.0 MiB``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def rows_of(data: Any) -> int | None:
    """How many fit rows ``data`` holds where that is known without reading it: a tensor, an
    ``(x, y)`` pair, a DataLoader over a sized dataset, :class:`~jem_plugin.ood.Outputs` or a list
    of them (or of ``(outputs, labels)``); ``None`` otherwise (a generator)."""
    from ..._outputs import Outputs

    if isinstance(data, Tensor):
        return int(data.shape[0]) if data.dim() else None
    if isinstance(data, Outputs):
        return len(data)
    if isinstance(data, tuple) and data and isinstance(data[0], (Tensor, Outputs)):
        return rows_of(data[0])
    if isinstance(data, list):
        counts = [rows_of(item) for item in data]
        return sum(c for c in counts if c is not None) if counts and None not in counts else None
    dataset = getattr(data, "dataset", None)
    if isinstance(dataset, Sized) and getattr(data, "batch_size", 1) is not None:
        return len(dataset)
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


def _mahalanobis(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    # the relative variant's background whitener is computed once the class one is kept
    extra = s.dim * s.dim * _F8 if det.name == "relative_mahalanobis" else 0
    return Estimate(
        _gaussian(s.dim, s.classes, _b(s)) + extra,
        f"one {s.dim}x{s.dim} covariance and {s.classes} class means (float64)",
        "use fewer features (a narrower layer)",
    )


def _multi_mahalanobis(det: Any, s: FitShape) -> Estimate | None:
    if s.layers is None or s.classes is None:
        return None
    widths = [c for c, _ in s.layers]
    total = sum(_gaussian(c, s.classes, 0) for c in widths) + _b(s) * sum(widths) * _F8 * 2
    return Estimate(
        total,
        f"one covariance per layer ({' + '.join(f'{c}x{c}' for c in widths)}, float64)",
        "read fewer or narrower layers (layers=[...])",
    )


def _gram(det: Any, s: FitShape) -> Estimate | None:
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


def _gmm(det: Any, s: FitShape) -> Estimate | None:
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
    total = (held + rows) * s.dim * row_bytes + held * (_F4 + _I8) + b * s.dim * _F4 * 2
    return Estimate(
        total,
        f"a bank of {rows} x {s.dim} {what} (float32)",
        f"pass max_fit={max(det.k, int(0.85 * (limit_hint(det) or DEFAULT_LIMIT) / (s.dim * row_bytes * 3)))} "
        "(a uniform subsample; the paper banks 1% of ImageNet)",
    )


def limit_hint(det: Any) -> float | None:
    """The limit an estimate's advice sizes itself to (the detector's, without raising)."""
    try:
        return limit_of(det)
    except ValueError:
        return None


def _knn(det: Any, s: FitShape) -> Estimate | None:
    return _bank(det, s, _F4, "normalised training features")


def _nnguide(det: Any, s: FitShape) -> Estimate | None:
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
    return held * (width * _F4 + _F4 * 2) + kept * (width * _F4 + _F4 * 2 + _I8 * 3)


def _at_most(cap: int | None, n: int | None) -> int:
    """How many a sample of capacity ``cap`` keeps of ``n`` (either unknown: ``None``)."""
    return min(c for c in (cap, n) if c is not None) if (cap, n) != (None, None) else 0


def _react(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None:
        return None
    values = None if s.rows is None else s.rows * s.dim
    sample = _sample_bytes(det.max_values, values, 1, _b(s) * s.dim)
    return Estimate(  # the end sorts the sample: values and indices
        sample + _at_most(det.max_values, values) * (_F4 + _I8),
        "a sample of training activations",
        "pass a smaller max_values",
    )


def _vra(det: Any, s: FitShape) -> Estimate | None:
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


def _vim(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    d, k = s.dim, s.classes
    sample = _sample_bytes(det.max_alpha, s.rows, d, _b(s)) + _at_most(det.max_alpha, s.rows) * d * _F8
    return Estimate(
        d * d * _F8 * 5 + k * d * _F8 * 4 + sample + _b(s) * d * _F8 * 2,
        f"one {d}x{d} moment (float64) and a sample of {det.max_alpha} features",
        "pass a smaller max_alpha",
    )


def _pnml(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None:
        return None
    return Estimate(
        s.dim * s.dim * _F8 * 6 + _b(s) * s.dim * _F8 * 2,
        f"one {s.dim}x{s.dim} moment (float64) and its pseudo-inverse",
        "use fewer features",
    )


def _per_class_means(det: Any, s: FitShape) -> Estimate | None:
    if s.dim is None or s.classes is None:
        return None
    return Estimate(
        s.classes * s.dim * _F8 * 2 + _b(s) * s.dim * _F8 * 2,
        f"{s.classes} class sums of {s.dim} features (float64)",
        "use fewer features",
    )


def _head_sized(det: Any, s: FitShape) -> Estimate | None:
    # dice's contributions sorted (values and indices), nci's copy of the head; the running mean
    if s.dim is None or s.classes is None:
        return None
    return Estimate(
        s.classes * s.dim * (_F4 * 4 + _I8) + _b(s) * s.dim * _F8,
        f"the {s.classes}x{s.dim} head and its contributions",
        "use fewer classes or features",
    )


def _fdbd(det: Any, s: FitShape) -> Estimate | None:
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


def _logit_sums(det: Any, s: FitShape) -> Estimate | None:
    if s.classes is None:
        return None
    k, b = s.classes, _b(s)
    tails = k * (getattr(det, "tailsize", 0) + b) * _F8 * 3 if det.name == "openmax" else 0
    return Estimate(
        k * k * _F8 * 3 + b * k * _F8 * 3 + tails, f"{k}x{k} sums of the logits (float64)", "use fewer classes"
    )


def _adascale(det: Any, s: FitShape) -> Estimate | None:
    # one float64 per fit input, then their sort; a batch's input step: the features and the
    # moved ones, their differences and top units, the gradient, its mask and the moved input
    # (input-sized: counted at the features' width; the network's own activations for the
    # gradient are not counted, as for scoring)
    rows, b, d = s.rows or 0, _b(s), s.dim or 0
    return Estimate(rows * _F8 * 3 + b * d * _F4 * 8, "one statistic per fit input (float64)", "fit on fewer inputs")


def _weiper(det: Any, s: FitShape) -> Estimate | None:
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


#: The estimate of each fitted detector of the package, by its registered name.
_ESTIMATES: dict[str, Callable[[Any, FitShape], Estimate | None]] = {
    "mahalanobis": _mahalanobis,
    "relative_mahalanobis": _mahalanobis,
    "mahalanobis_odin": _mahalanobis,
    "multi_mahalanobis": _multi_mahalanobis,
    "gram": _gram,
    "gmm": _gmm,
    "vim": _vim,
    "knn": _knn,
    "nnguide": _nnguide,
    "react": _react,
    "vra": _vra,
    "openmax": _logit_sums,
    "kl_matching": _logit_sums,
    "she": _per_class_means,
    "dice": _head_sized,
    "nci": _head_sized,
    "fdbd": _fdbd,
    "pnml": _pnml,
    "adascale": _adascale,
    "weiper": _weiper,
}


def estimate(det: Any, shape: FitShape) -> Estimate | None:
    """The peak of ``det``'s fit at ``shape`` (bytes, with what holds it and the setting that
    shrinks it), or ``None`` where the detector has no estimate or a width it needs is unknown."""
    fn = _ESTIMATES.get(getattr(det, "name", ""))
    return None if fn is None else fn(det, shape)


def _refuse(det: Any, est: Estimate, limit: float, shape: FitShape) -> MemoryLimitError:
    name = det.name
    return MemoryLimitError(
        f"{name}: this fit would need about {human(est.bytes)} of {shape.on} for {est.what}, over its "
        f"memory_limit of {human(limit)}: {est.fix}, or raise the limit "
        f"(jem.ood.detector({name!r}, memory_limit=...) or {ENV}=bytes)"
    )


#: What a fit in progress still has to check (kept beside the detectors, not on them: a fitted
#: detector's state is its statistics alone, the same on every rank and in a pickle): the limit
#: and shape the first batch checks again, and for a bank of unknown length its limit and shape.
_PENDING: weakref.WeakKeyDictionary[Any, tuple[float | None, FitShape]] = weakref.WeakKeyDictionary()
_GROWTH: weakref.WeakKeyDictionary[Any, float | None] = weakref.WeakKeyDictionary()
_SHAPE: weakref.WeakKeyDictionary[Any, FitShape] = weakref.WeakKeyDictionary()


def _head_shape(core: Any) -> tuple[int | None, int | None]:
    """``(D, K)`` of the network's head where it is a linear layer, else ``(None, None)``."""
    try:
        head = core.head()
    except Exception:  # an adapter that cannot say: the first batch's shapes will
        return None, None
    weight = getattr(head, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[1]), int(weight.shape[0])
    return None, None


def check_fit(det: Any, core: Any, rows: int | None = None) -> None:
    """At the start of ``det``'s fit on the network ``core`` (``rows`` fit rows where known):
    raise :class:`~jem_plugin.errors.MemoryLimitError` where its estimate is over its limit;
    where a width it needs is known only from the outputs, check on the first batch instead."""
    limit = limit_of(det)
    _GROWTH.pop(det, None)
    d, k = _head_shape(core) if "features" in det.reads or "logits" in det.reads else (None, None)
    shape = FitShape(rows=rows, dim=d, classes=k)
    _PENDING[det] = (limit, shape)  # the first batch checks again, with its own shapes
    _check(det, limit, shape)


def check_batch(det: Any, outputs: Any) -> None:
    """On a fit's first batch (a no-op after it): the check of :func:`check_fit` again, with the
    widths and batch size of the outputs themselves, before the detector keeps anything of them."""
    pending = _PENDING.pop(det, None)
    if pending is None:
        return
    limit, shape = pending
    logits = outputs.logits
    feats = outputs._features if isinstance(outputs._features, Tensor) else None
    layers = outputs._layers if isinstance(outputs._layers, dict) else {}
    names = list(getattr(det, "layers_read", [])) or list(layers)
    shape = replace(
        shape,
        classes=int(logits.shape[1]),
        dim=int(feats.shape[1]) if feats is not None and feats.dim() == 2 else shape.dim,
        layers=tuple((int(layers[n].shape[1]), int(math.prod(layers[n].shape[2:]))) for n in names if n in layers)
        or None,
        batch=int(logits.shape[0]),
        on="GPU memory" if logits.is_cuda else "memory",
    )
    _SHAPE[det] = shape
    _check(det, limit, shape)


def _check(det: Any, limit: float | None, shape: FitShape) -> None:
    est = estimate(det, shape)
    if est is None:
        return
    if est.extra.get("grows"):
        _GROWTH[det] = limit
        return
    if limit is not None and est.bytes > limit:
        _PENDING.pop(det, None)
        raise _refuse(det, est, limit, shape)


def check_growth(det: Any, held_rows: int) -> None:
    """For a bank of data of unknown length: refuse once holding ``held_rows`` rows (and
    concatenating them at the end) would exceed the limit, before the bank grows past it."""
    limit, shape = _GROWTH.get(det), _SHAPE.get(det)
    if limit is None or shape is None:
        return
    est = estimate(det, replace(shape, rows=held_rows))
    if est is not None and est.bytes > limit:
        raise _refuse(det, est, limit, replace(shape, rows=held_rows))
