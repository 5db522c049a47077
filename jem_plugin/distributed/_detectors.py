"""Fits across ranks: each rank of an initialised ``torch.distributed`` process group streams its
own shard of the fit data, and at the end of each pass the fitted detectors combine what they
accumulated before they finish, so that every rank ends with the state of one fit on the union
of the shards (in rank order).

A detector says what it accumulates and how it combines, on its class
(:attr:`jem_plugin.ood.Detector._rank_stats`, or :meth:`~jem_plugin.ood.Detector._rank_statistics`
where it depends on the pass): pairs
``(path, how)``, ``path`` a dotted attribute path (``"_running._sum"``, ``"_per_layer.0._moments"``)
or, for the paired kinds, two of them. ``how``:

- ``"sum"``, ``"min"``, ``"max"``: all-reduced (a tensor or a number);
- ``"moments"``: running class moments (the post-hoc package's ``_ClassMoments``), moved to rank 0's
  shift, then all-reduced (float64 sums, counts and sums of outer products);
- ``"sample"``: a bounded uniform sample (the post-hoc package's ``_Sample``): every rank's rows (and keys)
  gathered in rank order, then cut to the capacity by the keys;
- ``"gather"``: rows gathered in rank order (a tensor, or a list of tensors: one tensor after);
- ``"top"``: the largest values along the last dimension (OpenMax's tails): gathered, the
  largest kept;
- ``"low2"``, ``"high2"``: the two smallest (largest) values and their runners-up (Gram's
  leave-one-out bounds): gathered, the two smallest (largest) kept.

Collectives run on the device the backend needs (CUDA for NCCL, the CPU otherwise) and the
results go back where the statistic lives. Imported only where a fit runs in a process group of
several ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import InvalidInputError

KINDS = frozenset({"sum", "min", "max", "moments", "sample", "gather", "top", "low2", "high2"})
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set(obj: Any, path: str, value: Any) -> None:
    """Put ``value`` at ``path``: in place where the old value is a tensor of the same shape (so
    that a tensor inside a tuple is set too), else by attribute or list index."""
    parent, _, last = path.rpartition(".")
    holder = _get(obj, parent) if parent else obj
    old = holder[int(last)] if last.isdigit() else getattr(holder, last)
    if isinstance(old, Tensor) and isinstance(value, Tensor) and old.shape == value.shape:
        old.copy_(value)
    elif last.isdigit():
        holder[int(last)] = value
    else:
        setattr(holder, last, value)


def _comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: CUDA for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: Tensor, how: str) -> Tensor:
    """``t`` reduced over the ranks; in place where it lives on the collective's device (a
    ``K x D x D`` moment is not copied)."""
    out = t.to(_comm_device()).contiguous()
    dist.all_reduce(out, op=_OPS[how])
    return out.to(t.device)


def _reduce_value(value: Any, how: str) -> Any:
    """A tensor, int or float all-reduced by ``how``; a number comes back as its own type."""
    if isinstance(value, Tensor):
        return _all_reduce(value, how)
    dtype = torch.int64 if isinstance(value, int) and not isinstance(value, bool) else torch.float64
    return type(value)(_all_reduce(torch.tensor(value, dtype=dtype), how).item())


def _all_gather_same(t: Tensor) -> list[Tensor]:
    """Every rank's ``t`` (the same shape on every rank), in rank order."""
    local = t.to(_comm_device()).contiguous()
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [o.to(t.device) for o in out]


def gather_rows(t: Tensor) -> Tensor:
    """Every rank's rows of ``t`` concatenated in rank order (row counts may differ; an empty
    tensor takes the other ranks' row shape and dtype)."""
    shapes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, (tuple(t.shape), t.dtype) if t.numel() else None)
    full = [s for s in shapes if s is not None]
    if not full:
        return t
    row_shape, dtype = full[0][0][1:], full[0][1]
    if not t.numel():
        t = t.new_zeros((0, *row_shape), dtype=dtype)
    counts = [s[0][0] if s is not None else 0 for s in shapes]
    longest = max(counts)
    padded = t.new_zeros((longest, *row_shape))
    padded[: t.shape[0]] = t
    parts = _all_gather_same(padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def _gather(value: Tensor | list[Tensor]) -> Tensor | list[Tensor]:
    if isinstance(value, Tensor):
        return gather_rows(value)
    local = torch.cat(value) if value else torch.empty(0)
    return [gather_rows(local)]


def _top(t: Tensor) -> Tensor:
    """The ``t.shape[-1]`` largest values along the last dimension over every rank's ``t``, descending."""
    return torch.cat(_all_gather_same(t), dim=-1).topk(t.shape[-1], dim=-1).values


def _two_smallest(first: Tensor, second: Tensor, sign: float) -> tuple[Tensor, Tensor]:
    """The two smallest (``sign=1``; largest: ``-1``) values over every rank's pair, elementwise
    (equal where two ranks share the smallest): the two smallest of the union are among each
    rank's two smallest."""
    both = torch.stack([sign * v for p in zip(_all_gather_same(first), _all_gather_same(second)) for v in p])
    two = both.sort(dim=0).values[:2]
    return sign * two[0], sign * two[1]


def _merge_sample(sample: Any) -> None:
    """A bounded uniform sample (``_Sample``) of every rank's rows: gathered in rank order, then the
    ``capacity`` smallest keys kept (each rank draws its keys from its own seed,
    :func:`jem_plugin.distributed.rank_seed`, so they are independent across ranks)."""
    # cut to this rank's capacity first: the union's smallest keys are among each rank's smallest
    rows = gather_rows(sample.values())
    sample.rows, sample.held = ([rows] if rows.numel() else []), rows.shape[0]
    if sample.capacity is not None:
        keys = torch.cat(sample.keys) if sample.keys else torch.empty(0)
        keys = gather_rows(keys.to(rows.device))
        sample.keys = [keys] if keys.numel() else []
        if sample.held > sample.capacity:
            sample._compact()


def _merge_moments(m: Any) -> None:
    """Running class moments (``_ClassMoments``) of every rank's data: each rank's sums moved to rank 0's
    shift ``s`` (``delta = s_r - s``: ``sum (z - s) = S + n delta`` and ``sum (z - s)(z - s)^T =
    O + S delta^T + delta S^T + n delta delta^T``, per class where the outer sums are; their
    diagonal alone for gmm's ``covariance="diag"``), then summed."""
    shift = m.shift.to(_comm_device()).clone()
    dist.broadcast(shift, src=0)
    shift = shift.to(m.shift.device)
    delta = m.shift - shift
    if bool(delta.any()):
        if m.diagonal:  # per-class sums of squares: Q + 2 S delta + n delta^2, elementwise
            m.outer += 2.0 * m.sums * delta + m.counts.unsqueeze(1) * delta.square()
        elif m.per_class_outer:
            for c in m.counts.nonzero().squeeze(1).tolist():  # one D x D update at a time: no K x D x D scratch
                s_c = m.sums[c]
                m.outer[c].addr_(s_c, delta).addr_(delta, s_c).addr_(delta, delta, alpha=float(m.counts[c]))
        else:
            total = m.sums.sum(dim=0)
            m.outer.addr_(total, delta).addr_(delta, total).addr_(delta, delta, alpha=float(m.counts.sum()))
        m.sums += m.counts.unsqueeze(1) * delta
    m.shift = shift
    m.sums, m.counts, m.outer = (_all_reduce(t, "sum") for t in (m.sums, m.counts, m.outer))
    m.eps = _reduce_value(float(m.eps), "max")


def _describe(det: Any, stats: Sequence[tuple[str | tuple[str, str], str]]) -> list[Any]:
    """What this rank holds of each statistic, for the check that every rank can combine: its path
    and kind, and ``None`` where the rank has nothing (it saw no data)."""
    out = []
    for path, how in stats:
        try:
            values = [_get(det, p) for p in (path if isinstance(path, tuple) else (path,))]
        except (AttributeError, IndexError, TypeError):  # inside a statistic never started (None)
            values = [None]
        missing = any(v is None for v in values) or (how == "moments" and values[0].shift is None)
        out.append((path, how, None if missing else "ok"))
    return out


def combine_ranks(det: Any) -> None:
    """Combine the statistics ``det`` accumulated on this rank with every other rank's, in place
    (a collective: every rank of the default group calls it at the same point of its fit)."""
    stats = tuple(det._rank_statistics() or ())
    if not stats:
        raise NotImplementedError(
            f"{det.name} does not say how its fit combines across ranks; fit it with distributed=False "
            "(each rank on its own data)"
        )
    unknown = sorted({how for _, how in stats} - KINDS)
    if unknown:
        raise ValueError(f"{det.name}: unknown ways to combine across ranks {unknown}; known: {sorted(KINDS)}")
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, _describe(det, stats))
    empty = [r for r, v in enumerate(views) if any(s[2] is None for s in v)]
    if empty:
        raise InvalidInputError(
            f"{det.name}: rank(s) {empty} saw no fit data; a fit across ranks needs data on every rank "
            "(a DistributedSampler gives each rank a shard), or fit with distributed=False"
        )
    if any([s[:2] for s in v] != [s[:2] for s in views[0]] for v in views):
        raise InvalidInputError(f"{det.name}: the ranks accumulated different statistics, so they cannot combine")
    for path, how in stats:
        if isinstance(path, tuple):
            first, second = (_get(det, p) for p in path)
            low, runner_up = _two_smallest(first, second, 1.0 if how == "low2" else -1.0)
            _set(det, path[0], low)
            _set(det, path[1], runner_up)
        elif how == "moments":
            _merge_moments(_get(det, path))
        elif how == "sample":
            _merge_sample(_get(det, path))
        elif how == "gather":
            _set(det, path, _gather(_get(det, path)))
        elif how == "top":
            _set(det, path, _top(_get(det, path)))
        else:
            _set(det, path, _reduce_value(_get(det, path), how))
