"""Comparing scores: :func:`evaluate_all`, every score against every OOD set in one call, and
the scheduler behind it that runs the network once per batch for every score without an input
gradient (fits and scoring from shared outputs). Public through :mod:`jem_plugin.ood`."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ._checks import DomainCheck, check_input, model_device, same_device
from ._detector import Detector, as_detector
from ._ood_metrics import _METRICS, OODTable, evaluate
from ._ood_score import _HOOK, _batches, _check_batch_scores, _check_method_kwargs, _method_names, detector, score
from ._outputs import Outputs, fit_inputs, forward_outputs
from .errors import InvalidInputError
from .model import as_jem, sampling_mode
from .plugins import collect


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def _non_finite(s_in: Tensor, s_out: Tensor) -> str | None:
    bad_in, bad_out = int((~torch.isfinite(s_in)).sum()), int((~torch.isfinite(s_out)).sum())
    if not bad_in and not bad_out:
        return None
    parts = [
        f"{b} of {len(s)} {w} scores" for b, s, w in ((bad_in, s_in, "in-distribution"), (bad_out, s_out, "OOD")) if b
    ]
    return " and ".join(parts) + " are NaN/inf"


def _run_method(
    jm, method: Any, needs_fit: bool, kw: dict, data_in, data_out, fit_data, batch_size, progress, input_key
) -> tuple[dict[str, Tensor], float, float]:
    """Scores of one method (a registered name, or a detector object) on the in-distribution data
    and every OOD set: ``(scores, fit seconds, scoring seconds)``. A detector that needs fitting
    (a fit-able name is built here) is fitted once, first, with the model in
    :func:`~jem_plugin.model.sampling_mode` as for scoring."""
    fit_s, options = 0.0, kw
    if needs_fit:
        t0 = time.perf_counter()
        if isinstance(method, str):
            method, options = as_detector(detector(method, **kw)), {}
        with sampling_mode(jm):  # eval mode: BatchNorm statistics and Dropout as when scoring
            method.fit(
                jm,
                fit_data,
                batch_size=batch_size,
                progress=progress,
                **({"input_key": input_key} if input_key else {}),
            )
        fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    s: dict[str, Tensor] = {}
    for name, data in [("in", data_in), *data_out.items()]:
        s[str(name)] = score(jm, data, method, batch_size=batch_size, progress=progress, input_key=input_key, **options)
    return s, fit_s, time.perf_counter() - t0


class _Shared:
    """A score run from the outputs of a forward shared with others: how it scores a batch's
    outputs, the detector to fit first (if any), and what came of it."""

    def __init__(self, label: str, reads: Any, score: Any, det: Detector | None = None) -> None:
        self.label, self.reads, self.score, self.det = label, frozenset(reads), score, det
        self.error: BaseException | None = None
        self.fit_s = self.score_s = 0.0
        self.scores: dict[str, list[Tensor]] = {}

    @property
    def fitter(self) -> Detector:
        """The detector to fit (an item that has one)."""
        assert self.det is not None
        return self.det

    @property
    def layers(self) -> list[str]:
        return self.det.layers_read if self.det is not None and "layers" in self.reads else []

    def run(self, elapsed: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, its time added to ``elapsed`` (``"fit_s"``/``"score_s"``); an error is kept
        as this score's failure (``None`` returned), except bad data, which is the user's to see."""
        from .errors import NotWrappedError

        if self.error is not None:
            return None
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except (InvalidInputError, NotWrappedError):
            raise
        except Exception as exc:  # a broken detector is a row of the table, not the end of it
            self.error = exc
            return None
        finally:
            setattr(self, elapsed, getattr(self, elapsed) + time.perf_counter() - t0)


def _shared(label: str, method: Any, entry: Mapping[str, Any] | None, kw: dict, needs_fit: bool) -> _Shared | None:
    """``method`` as a score run from shared outputs, or ``None`` where it keeps its own passes
    (an input gradient, or a plugin's score or detector without an outputs form)."""
    if isinstance(method, str):
        assert entry is not None
        if entry.get("needs_grad", False):
            return None
        if not needs_fit:
            fn = entry.get("score_outputs")
            reads = entry.get("reads")
            return None if fn is None or reads is None else _Shared(label, reads, lambda jm, out: fn(jm, out, **kw))
        method = as_detector(detector(label, **kw))
    if method is None or method.needs_grad or not method.shares_forward:
        return None
    return _Shared(label, method.reads, method.score_outputs, method if needs_fit else None)


def _union(items: Sequence[_Shared]) -> tuple[frozenset[str], list[str]]:
    """The kinds and layers some of ``items`` read: what one forward computes for all of them."""
    reads = frozenset().union(*(i.reads for i in items))
    return reads, list(dict.fromkeys(n for i in items for n in i.layers))


#: The logits of the fit data kept from the first pass for a detector that streams it again and
#: reads nothing else (openmax), up to this many bytes: that pass then runs no forward.
_REPLAY_BYTES = 1 << 28


def _fit_shared(jm: Any, items: Sequence[_Shared], fit_data: Any, batch_size: int, progress, input_key) -> None:
    """Fit the detectors of ``items`` on ``fit_data``, one forward per batch for all of them. A
    detector asking for another pass gets it, with the others that ask; where they read the
    logits alone, from the first pass's logits when those were small enough to keep."""
    todo = [i for i in items if i.det is not None]
    for i in todo:
        i.run("fit_s", i.fitter.begin_fit, jm)
    kept: list[tuple[Outputs | None, Tensor | None]] | None = []
    held, passes = 0, 0
    while todo := [i for i in todo if i.error is None]:
        replay = passes > 0 and kept is not None and all(i.reads <= {"logits"} for i in todo)
        if passes and not replay and isinstance(fit_data, Iterator):
            for i in todo:
                i.error = InvalidInputError(
                    f"{i.label} streams over the fit data {passes + 1} times and fit_data is a one-shot "
                    f"iterator ({type(fit_data).__name__}): pass a DataLoader, a list of batches or tensors"
                )
            return
        clock = [0.0]
        batches = (
            kept
            if replay and kept is not None
            else _fit_batches(todo, jm, fit_data, batch_size, progress, input_key, clock)
        )
        for out, y in batches:
            if passes == 0 and kept is not None and out is not None:
                held += out.logits.numel() * out.logits.element_size()
                if held <= _REPLAY_BYTES:
                    kept.append((Outputs(out.logits), y))
                else:
                    kept = None
            for i in todo:
                i.run("fit_s", i.fitter.add_outputs, out, y)
        for i in todo:
            i.fit_s += clock[0]
        todo = [i for i in todo if i.run("fit_s", i.fitter.end_fit, jm) is False]
        passes += 1


def _fit_batches(
    items: Sequence[_Shared], jm: Any, fit_data: Any, batch_size: int, progress, input_key, clock: list[float]
) -> Iterator[tuple[Outputs | None, Tensor | None]]:
    """``(outputs, labels)`` of every batch of ``fit_data``: one forward for all of ``items``, its
    time added to ``clock[0]``."""
    desc = f"fit {', '.join(i.label for i in items)}"
    for x, y in fit_inputs(
        jm, fit_data, batch_size=batch_size, progress=progress, input_key=input_key, desc=desc[:60], stacklevel=5
    ):
        t0 = time.perf_counter()
        out = _outputs_for(items, jm, x)
        clock[0] += time.perf_counter() - t0
        yield out, y


def _outputs_for(items: Sequence[_Shared], jm: Any, x: Tensor) -> Outputs | None:
    """The outputs of ``x`` that ``items`` read, from one forward; where it fails (not a kind the
    network lacks: those are kept in the outputs), every item fails with it."""
    from .errors import NotWrappedError

    live = [i for i in items if i.error is None]
    reads, layers = _union(live)
    try:
        return forward_outputs(jm, x, reads, layers)
    except (InvalidInputError, NotWrappedError):
        raise
    except Exception as exc:
        for i in live:
            i.error = exc
        return None


def _score_shared(
    jm: Any, items: Sequence[_Shared], sets: Sequence[tuple[str, Any]], batch_size: int, progress, input_key
) -> None:
    """Score every set with the scores of ``items``, one forward per batch for all of them."""
    for name, data in sets:
        live = [i for i in items if i.error is None]
        if not live:
            return
        batches, n_batches, was_tensor = _batches(data, batch_size, input_key)
        if progress is None:
            progress = not was_tensor and sys.stderr.isatty()
        out_device = data.device if was_tensor else torch.device("cpu")
        device, dtype, domain_check = model_device(jm), jm.param_dtype(), DomainCheck(batches=1)
        seen = 0
        desc = f"ood scores ({len(live)} sharing a forward) {name}"
        with (
            sampling_mode(jm),
            torch.no_grad(),
            tqdm(total=n_batches, desc=desc, unit="batch", disable=not progress, leave=False) as bar,
        ):
            for x in batches:
                if device is not None and not same_device(x.device, device):
                    x = x.to(device, non_blocking=True)
                x = check_input(x, dtype=dtype, domain=jm.domain)
                domain_check(x, jm.domain, "ood.evaluate_all", stacklevel=3)
                seen += x.shape[0]
                t0 = time.perf_counter()
                out = _outputs_for(live, jm, x)
                forward = time.perf_counter() - t0
                for i in live:
                    s = i.run("score_s", _batch_scores, i, jm, out, x.shape[0])
                    i.score_s += forward
                    if s is not None:
                        i.scores.setdefault(name, []).append(s.detach().to(out_device, torch.float32))
                bar.update(1)
        if not seen:
            raise InvalidInputError("no inputs to score: the data is empty")


def _batch_scores(item: _Shared, jm: Any, out: Outputs, n: int) -> Tensor:
    s = item.score(jm, out)
    _check_batch_scores(s, n, item.label)
    return s


def _methods_to_run(methods: Any) -> dict[str, Any]:
    """``{row label: registered name or detector object}`` for :func:`evaluate_all`: names are
    checked against the registry, a detector object is labelled by its ``name`` (or class)."""
    if isinstance(methods, str):
        return {m: m for m in _method_names(methods)}
    items = list(methods)
    if not items:
        raise ValueError("methods is empty: name at least one score, or 'all'")
    seen: dict[int, Detector] = {}  # one view per object given (the same object twice is one method)
    for m in items:
        if isinstance(m, str):
            continue
        det = seen.get(id(m)) or as_detector(m)
        if det is None:
            raise TypeError(
                f"methods holds {type(m).__name__}: give score names or detector objects with .score(jm, x)"
            )
        seen[id(m)] = det
    if any(isinstance(m, str) for m in items):
        _method_names([m for m in items if isinstance(m, str)])  # unknown names: one line, first
    out: dict[str, Any] = {}
    for item in items:
        m = item if isinstance(item, str) else seen[id(item)]
        label = m if isinstance(m, str) else m.name
        if label in out and out[label] is not m and not (isinstance(m, str) and out[label] == m):
            raise ValueError(
                f"two methods are labelled {label!r}: give a detector object a distinct name "
                f"(det.name = '{label}_2') to compare it beside the other"
            )
        out[label] = m
    return out


def evaluate_all(
    jm,
    data_in: Any,
    data_out: Mapping[str, Any],
    methods: str | Sequence[str] = "all",
    *,
    fit_data: Any = None,
    method_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    positive: str = "in",
    batch_size: int = 256,
    progress: bool | None = None,
    input_key: str | None = None,
) -> OODTable:
    """Compare OOD scores: every score in ``methods`` against every OOD set, in one call.

    Returns an :class:`OODTable`: the dict ``{method: {set name: evaluate(...)}}``
    with rows for every pair (metrics, status, reason, scoring time per 1000 images),
    :meth:`~OODTable.best` per set, :meth:`~OODTable.to_csv`, and a printable table
    (``print(table)``) marking the best score per set. Draw it with
    :func:`jem_plugin.viz.plot_ood_table`.

    - ``methods``: ``"all"`` (default: every registered score, :func:`available_scores`), a
      list of names, or one name / comma-separated names. Unknown names raise
      :class:`~jem_plugin.errors.UnknownNameError` (one line listing the available ones)
      before anything is scored. The list may also hold detector objects
      (:class:`Detector`: ``jem.ood.detector("knn", k=5)``, fitted or not, or your own),
      labelled by their ``name``; an unfitted one is fitted on ``fit_data``.
    - ``fit_data``: in-distribution *training* data (a loader or tensor) for the scores that
      need fitting (Mahalanobis, ViM, KNN, ...): each is fitted once, streaming over it, then
      scores every set. Without it those scores are listed as ``skipped`` with the reason.
    - A score that raises, or gives NaN/inf scores, is reported in its rows (``failed`` /
      ``non-finite`` with a one-line reason) and the comparison goes on. Bad data
      (:class:`~jem_plugin.errors.InvalidInputError`) still raises.
    - One forward per batch: every score without an input gradient (all but ``odin``,
      ``mahalanobis_odin`` and the JEM gradient scores) fits and scores from the outputs of one
      forward of each batch (:func:`outputs`: the kinds some of them read, computed once), and
      ``openmax`` streams the fit data a second time; the gradient scores, and a plugin's score
      or detector without an outputs form (:class:`Detector`), keep their own passes.
      ``seconds_per_1000`` of a score that shares the forward counts its own work and the
      forward's whole time (what it would cost alone).
    - ``data_in`` and each value of ``data_out`` are anything :func:`score` takes; the
      in-distribution data is scored once per method (once for all the scores that share it). ``method_kwargs`` gives per-method
      options, e.g. ``{"msp": {"temperature": 1000.0}}`` (a detector's go to its constructor).
    - ``table.scores[method] = {"in": Tensor, name: Tensor, ...}``: the scores themselves, ready
      for :func:`jem_plugin.viz.plot_histograms` / ``plot_roc``.
    """
    from .errors import NotWrappedError

    if not isinstance(data_out, Mapping) or not data_out:
        raise InvalidInputError("data_out must be a non-empty dict {name: OOD data}")
    to_run = _methods_to_run(methods)
    names = list(to_run)
    method_kwargs = dict(method_kwargs or {})
    unknown = sorted(set(method_kwargs) - {k for k, m in to_run.items() if isinstance(m, str)})
    if unknown:
        raise ValueError(
            f"method_kwargs names methods not in methods (a detector object takes its options when built): "
            f"{', '.join(unknown)}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    jm = as_jem(jm, "ood.evaluate_all")
    entries = collect(_HOOK)
    sets = [str(k) for k in data_out]
    if "in" in sets or len(set(sets)) != len(sets):
        raise ValueError(f"OOD set names must be distinct and not 'in' (the in-distribution data), got {sets}")
    # Every option is checked before the first score runs: a typo is an error, not a failed row.
    _check_method_kwargs(method_kwargs, entries)

    records: list[dict[str, Any]] = []
    timing: dict[str, dict[str, float]] = {}
    scores: dict[str, dict[str, Tensor]] = {}

    def add(m: str, name: str, status: str, reason: str = "", metrics: Mapping[str, float] | None = None) -> None:
        nan = float("nan")
        t = timing.get(m, {})
        records.append(
            {
                "score": m,
                "set": name,
                "status": status,
                "reason": reason,
                **{k: (metrics or {}).get(k, nan) for k in _METRICS},
                "seconds_per_1000": t.get("seconds_per_1000", nan),
                "fit_seconds": t.get("fit_seconds", nan),
            }
        )

    if isinstance(data_in, Tensor) and len(data_in) and "logpx" in entries:
        # One warm-up batch, so that the first score's time per 1000 images excludes one-off costs.
        try:
            score(jm, data_in[:batch_size], "logpx", batch_size=batch_size, progress=False)
        except Exception:  # a failure here is reported by the scores themselves, below
            pass
    # Every score without an input gradient runs from the outputs of one forward per batch,
    # shared by all of them (fit and scoring); the others keep their own passes.
    plan: dict[str, tuple[Any, dict[str, Any], bool]] = {}
    shared: dict[str, _Shared] = {}
    failed: dict[str, BaseException] = {}
    for m in names:
        method, kw = to_run[m], dict(method_kwargs.get(m, {}))
        if isinstance(method, str):
            needs_fit = bool(entries[m].get("needs_fit", False))
        else:  # a detector object: fitted here only where it is not fitted yet
            needs_fit = method.needs_fit and not method.fitted
        plan[m] = (method, kw, needs_fit)
        if needs_fit and fit_data is None:
            continue
        try:
            item = _shared(m, method, entries.get(m) if isinstance(method, str) else None, kw, needs_fit)
        except (InvalidInputError, NotWrappedError):
            raise
        except Exception as exc:  # a detector that cannot be built: its rows say why
            failed[m] = exc
            continue
        if item is not None:
            shared[m] = item
    if shared:
        items = list(shared.values())
        if fit_data is not None:
            _fit_shared(jm, items, fit_data, batch_size, progress, input_key)
        _score_shared(
            jm, items, [("in", data_in), *((str(k), v) for k, v in data_out.items())], batch_size, progress, input_key
        )
    for m in names:
        method, kw, needs_fit = plan[m]
        if needs_fit and fit_data is None:
            for name in sets:
                add(m, name, "skipped", "needs fit_data (in-distribution training data) to be fitted")
            continue
        error = shared[m].error if m in shared else None
        if error is not None:
            failed[m] = error
        if m in failed:
            for name in sets:
                add(m, name, "failed", _one_line(failed[m]))
            continue
        if m in shared:
            s = {name: torch.cat(v) for name, v in shared[m].scores.items()}
            fit_s, elapsed = shared[m].fit_s, shared[m].score_s
        else:
            try:
                s, fit_s, elapsed = _run_method(
                    jm, method, needs_fit, kw, data_in, data_out, fit_data, batch_size, progress, input_key
                )
            except (InvalidInputError, NotWrappedError):
                raise
            except Exception as exc:  # a broken detector is a row of the table, not the end of it
                for name in sets:
                    add(m, name, "failed", _one_line(exc))
                continue
        n_images = sum(len(v) for v in s.values())
        timing[m] = {"seconds_per_1000": 1000.0 * elapsed / n_images, "fit_seconds": fit_s, "n_images": n_images}
        scores[m] = s
        for name in sets:
            bad = _non_finite(s["in"], s[name])
            if bad:
                add(m, name, "non-finite", bad)
            else:
                add(m, name, "ok", metrics=evaluate(s["in"], s[name], positive=positive))
    return OODTable(records, names, sets, timing, scores)
