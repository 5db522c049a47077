"""Post-hoc out-of-distribution scoring and evaluation for any wrapped classifier.

Convention, used by every score and metric here: **higher score = more in-distribution**.
(pytorch-ood returns *outlier* scores, higher = more OOD; ours are their negatives.)

>>> import jem_plugin as jem
>>> jm = jem.wrap(model)
>>> s_in = jem.ood.score(jm, test_loader, method="logpx")      # DataLoader or tensor
>>> s_out = jem.ood.score(jm, svhn_loader, method="logpx")
>>> jem.ood.evaluate(s_in, s_out)
{'auroc': 0.91, 'aupr_in': 0.93, 'aupr_out': 0.88, 'fpr95': 0.41}

Scores are looked up by name through the ``jem_register_ood_scores`` plugin hook, so a third
party adds one with ``register(name, fn, needs_grad=..., description=...)`` in a
``@jem_plugin.hookimpl``; :func:`available_scores` lists what is loaded. The built-ins live in
:mod:`jem_plugin.builtins.ood_scores` (the energy scores) and :mod:`jem_plugin.builtins.posthoc`
(the field's post-hoc detectors: ODIN, GEN, ASH, SCALE, and, fitted on in-distribution data,
Mahalanobis, relative Mahalanobis, ViM, KNN, ReAct).

Detectors that need training data are registered with ``needs_fit=True``; give the data with
``fit_data=`` (it is streamed, never held in memory), or fit one yourself and pass it::

    s = jem.ood.score(jm, test_loader, "mahalanobis", fit_data=train_loader)
    det = jem.ood.detector("knn", k=50).fit(jm, train_loader)
    s_in, s_out = jem.ood.score(jm, test_loader, det), jem.ood.score(jm, svhn_loader, det)

One forward for many detectors: :func:`outputs` computes a batch's logits, penultimate
features, last feature maps and layer outputs (only the kinds asked for) in one forward, and
detectors fit from and score them, as pytorch-ood's ``fit_features``/``predict_features`` do;
:func:`evaluate_all` does so for every score without an input gradient::

    out = jem.ood.outputs(jm, x, reads=det.reads, layers=det.layers_read)
    s = jem.ood.score_outputs(jm, out, det)          # or a name: score_outputs(jm, out, "msp")

Metrics (:func:`evaluate`) come from scikit-learn, the maintained reference, not hand-written
curves; ``fpr95`` follows pytorch-ood's ``fpr_at_tpr`` exactly (first ROC point whose TPR is
at least 95%, no interpolation).
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ._checks import INPUT_KEYS, DomainCheck, check_input, model_device, same_device, unpack_batch
from ._outputs import KINDS, Outputs, fit_inputs, forward_outputs, outputs
from .errors import InvalidInputError, InvalidScoresError, NotFittedError
from .model import as_jem, sampling_mode
from .plugins import collect, lookup

__all__ = [
    "score",
    "available_scores",
    "score_info",
    "detector",
    "Detector",
    "evaluate",
    "evaluate_all",
    "Outputs",
    "outputs",
    "score_outputs",
    "KINDS",
]

_HOOK = "jem_register_ood_scores"


def available_scores() -> dict[str, str]:
    """``{name: description}`` of every OOD score registered through the plugin hook, sorted."""
    entries = collect(_HOOK)
    return {name: entries[name].get("description", "") for name in sorted(entries)}


def score_info(name: str) -> dict[str, Any]:
    """What the registered score ``name`` needs: ``{"needs_grad", "needs_fit", "description",
    "assumes_jem", "reads", "across_ranks"}`` (``assumes_jem``: it reads ``log p(x)`` as a trained
    density and warns on a model not trained as a JEM; ``reads``: the kinds of output, :data:`KINDS`, it
    scores from, what :func:`outputs` computes for it, or ``None`` where it reads the inputs
    themselves; ``across_ranks``: for a detector fitted under ``torchrun``, ``"reduce"`` where its
    fit keeps statistics of a fixed size, reduced across the ranks, ``"gather"`` where it keeps
    rows of the fit data, gathered onto every rank, ``None`` where it says nothing). Unknown names
    raise :class:`~jem_plugin.errors.UnknownNameError`."""
    entry = lookup(_HOOK, name, "OOD score")
    reads = entry.get("reads", getattr(entry["item"], "reads", None) if entry.get("needs_fit") else None)
    return {
        "needs_grad": bool(entry.get("needs_grad", False)),
        "needs_fit": bool(entry.get("needs_fit", False)),
        "description": str(entry.get("description", "")),
        "assumes_jem": bool(entry.get("assumes_jem", False)),
        "reads": None if reads is None or entry.get("needs_grad") else frozenset(reads),
        "across_ranks": getattr(entry["item"], "across_ranks", None) if entry.get("needs_fit") else None,
    }


@runtime_checkable
class Detector(Protocol):
    """A detector object, what :func:`score` takes as ``method`` besides a name: the fitted
    detectors of :func:`detector` (Mahalanobis, ViM, KNN, ...) and a plugin's or user's own.

    Optional class attributes: ``name`` (shown in progress bars and tables) and ``needs_grad``
    (``True`` when ``score`` takes input gradients). Detectors that need fitting also have
    ``fit(jm, data, *, batch_size, progress, input_key)``.

    A detector that works from outputs already computed (:class:`Outputs`; every built-in one
    without an input gradient) also has, so that :func:`evaluate_all` runs the network once per
    batch for all of them:

    - ``reads``: the kinds of output it reads (:data:`KINDS`), and ``layers_read``: the layer
      names for ``"layers"`` (known once its fit began);
    - ``shares_forward``: ``True`` where it needs nothing but outputs;
    - ``score_outputs(jm, outputs)``: its ``[B]`` scores of a batch's outputs;
    - to be fitted: ``begin_fit(jm)``, ``add_outputs(outputs, labels)`` per batch, and
      ``end_fit(jm)``, ``True`` once fitted (``False``: stream the same data again); and
      ``fit_outputs(jm, data)`` doing all three over ``(outputs, labels)`` batches.
    """

    def score(self, jm: Any, x: Tensor) -> Tensor:
        """One score per input of the batch ``x``, ``[B]``: higher means more in-distribution."""
        ...


def detector(name: str, *, memory_limit: Any = "default", **kwargs: Any) -> Any:
    """A new, unfitted detector of the registered score ``name`` that needs fitting
    (``needs_fit=True``: ``"mahalanobis"``, ``"relative_mahalanobis"``, ``"mahalanobis_odin"``,
    ``"gmm"``, ``"vim"``, ``"knn"``, ``"react"``, ``"openmax"``, ...), built with ``kwargs``. Fit it with ``.fit(jm, train_loader)``, then pass
    it to :func:`score` as ``method`` or call ``.score(jm, x)`` on batches.

    ``memory_limit``: the most memory its fit may take, in bytes (``None``: no limit); a fit
    whose estimate is over it is refused before it allocates
    (:class:`~jem_plugin.errors.MemoryLimitError`, one line naming the setting that fits).
    Default: the ``JEM_OOD_MEMORY_LIMIT`` environment variable, else 2 GiB (see the post-hoc
    guide's "Large data")."""
    entry = lookup(_HOOK, name, "OOD score")
    if not entry.get("needs_fit", False):
        raise ValueError(
            f"OOD score {name!r} needs no fitting, so it has no detector object; call "
            f"jem.ood.score(jm, data, {name!r}) directly"
        )
    cls = entry["item"]
    _check_kwargs(name, cls, kwargs, skip=0)
    det = cls(**kwargs)
    if memory_limit != "default":
        # the detector's own setter (the built-ins' base class has one): core does not reach into a plugin
        setter = getattr(det, "set_memory_limit", None)
        if setter is None:
            raise InvalidInputError(f"OOD score {name!r} takes no memory_limit (its detector has no set_memory_limit)")
        setter(memory_limit)
    return det


def _batches(data: Any, batch_size: int, input_key: str | None = None) -> tuple[Iterable[Tensor], int | None, bool]:
    """``(iterator over input batches, number of batches or None, data was one tensor)``."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, Tensor):
        if data.dim() < 2:
            raise InvalidInputError(f"expected a batch of inputs [N, ...], got a tensor of shape {tuple(data.shape)}")
        return data.split(batch_size), -(-data.shape[0] // batch_size), True
    if not hasattr(data, "__iter__"):  # the user's data
        raise InvalidInputError(
            f"data must be a tensor or an iterable of batches (e.g. a DataLoader), got {type(data).__name__}"
        )
    try:
        n = len(data)
    except TypeError:
        n = None
    keys = INPUT_KEYS if input_key is None else input_key
    return (unpack_batch(item, input_key=keys)[0] for item in data), n, False


def _check_kwargs(name: str, fn, kwargs: dict, skip: int = 2) -> None:
    if not kwargs:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in list(params)[skip:]]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"OOD score {name!r} does not take option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted) or '(none)'}"
        )


def _check_method_kwargs(method_kwargs: Mapping[str, Mapping[str, Any]], entries: Mapping[str, Any]) -> None:
    """Each registered score's options against what it accepts (a detector's go to its
    constructor): ``TypeError`` in one line naming the ones it takes."""
    for m, kwargs in method_kwargs.items():
        fit_able = entries[m].get("needs_fit", False)
        options = {k: v for k, v in kwargs.items() if not (fit_able and k == "memory_limit")}  # detector()'s own
        _check_kwargs(m, entries[m]["item"], options, skip=0 if fit_able else 2)


def score(
    jm,
    data: Any,
    method: Any = "logpx",
    *,
    fit_data: Any = None,
    batch_size: int = 256,
    progress: bool | None = None,
    input_key: str | None = None,
    **kwargs: Any,
) -> Tensor:
    """OOD score of every input in ``data``: a ``[N]`` float tensor, higher = more in-distribution.

    Parameters
    ----------
    jm: a wrapped classifier (:func:`jem_plugin.wrap`), also inside ``torch.compile`` or DDP.
        No training needed. A raw classifier raises :class:`~jem_plugin.errors.NotWrappedError`:
        it is never wrapped implicitly, since its input domain would be guessed unseen.
    data: a ``[N, ...]`` tensor (scored in chunks of ``batch_size``), or an iterable such as a
        ``DataLoader`` yielding tensors, ``(x, y, ...)`` tuples or dicts with an ``"x"`` /
        ``"image"`` / ``"pixel_values"`` key. Batches are moved to the model's device.
    method: a registered score name, see :func:`available_scores` (``"logpx"``, ``"msp"``,
        ``"max_logit"``, ``"grad_norm"``, ``"logpx_sgld"``, ``"odin"``, ``"mahalanobis"``, ...),
        or a detector object (``.score(jm, x)``, e.g. a fitted :func:`detector`).
    fit_data: in-distribution training data for a detector that needs fitting
        (:func:`score_info` says which), streamed batch by batch like ``data`` (a tensor, an
        ``(x, y)`` pair of tensors, a DataLoader; labelled for the Mahalanobis detectors). The
        detector is fitted, then scores ``data``. Required for those (a detector object passed
        as ``method`` is fitted on it when given); ignored by scores that need no fitting.
    progress: show a tqdm progress bar over batches. Default (``None``): never for a tensor;
        for an iterable only when stderr is a terminal.
    input_key: the key of the inputs in dict batches (default: the first of ``"x"``,
        ``"input"``, ``"inputs"``, ``"image"``, ``"images"``, ``"pixel_values"`` present).
    **kwargs: options of the score, e.g. ``temperature=1000.0`` for ``"msp"``; for a detector
        that needs fitting, the options it is built with (``k=50`` for ``"knn"``).

    The model runs in :func:`jem_plugin.model.sampling_mode` (eval mode, frozen parameters;
    both restored afterwards). Scores that need no input gradient run
    under ``torch.no_grad()``; gradient scores work inside ``torch.no_grad()`` and
    ``torch.inference_mode()`` too. The result lives on the input's device for a tensor, on
    the CPU for an iterable.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    det: Any = None
    if isinstance(method, str):
        entry = lookup(_HOOK, method, "OOD score")
        if entry.get("needs_fit", False):
            if fit_data is None:
                raise NotFittedError(
                    f"OOD score {method!r} is fitted on in-distribution training data: pass "
                    f"fit_data=<train loader or tensor>, or a fitted jem.ood.detector({method!r}) as method"
                )
            det, kwargs = detector(method, **kwargs), {}
        else:
            fn, needs_grad = entry["item"], bool(entry.get("needs_grad", False))
            _check_kwargs(method, fn, kwargs)
    elif isinstance(method, Detector):
        det = method
        if kwargs:
            raise TypeError(
                f"options {', '.join(sorted(kwargs))} were given with a detector object; build the "
                "detector with them instead (jem.ood.detector(name, **options))"
            )
    else:
        raise TypeError(
            f"method must be a registered score name or a detector with .score(jm, x), got {type(method).__name__}"
        )

    jm = as_jem(jm, "ood.score")
    if det is not None:
        if fit_data is not None:
            fit_options: dict[str, Any] = {"batch_size": batch_size, "progress": progress}
            if input_key is not None:
                fit_options["input_key"] = input_key
            det.fit(jm, fit_data, **fit_options)
        # name and needs_grad are optional on a detector of a plugin's or the user's own
        fn, needs_grad = (lambda jm, x: det.score(jm, x)), bool(getattr(det, "needs_grad", False))
        method = getattr(det, "name", type(det).__name__)
    batches, n_batches, was_tensor = _batches(data, batch_size, input_key)
    if progress is None:
        progress = not was_tensor and sys.stderr.isatty()
    out_device = data.device if was_tensor else torch.device("cpu")
    device = model_device(jm)
    dtype, domain_check = jm.param_dtype(), DomainCheck(batches=1)
    results: list[Tensor] = []
    with (
        sampling_mode(jm),
        tqdm(total=n_batches, desc=f"ood score {method}", unit="batch", disable=not progress, leave=False) as bar,
    ):
        for x in batches:
            if device is not None and not same_device(x.device, device):
                x = x.to(device, non_blocking=True)
            x = check_input(x, dtype=dtype, domain=jm.domain)
            domain_check(x, jm.domain, f"ood.score(method={method!r})")
            if needs_grad:
                s = fn(jm, x, **kwargs)
            else:
                with torch.no_grad():
                    s = fn(jm, x, **kwargs)
            _check_batch_scores(s, x.shape[0], method)
            results.append(s.detach().to(out_device, torch.float32))
            bar.update(1)
    if not results:
        raise InvalidInputError("no inputs to score: the data is empty")
    return torch.cat(results)


def score_outputs(jm: Any, outputs: Outputs, method: Any = "logpx", **kwargs: Any) -> Tensor:
    """OOD scores of a batch's outputs already computed, ``[B]``, higher = more in-distribution:
    what :func:`score` gives for the inputs they came from, without running the network again
    (pytorch-ood's ``predict_features``).

    ``outputs``: an :class:`Outputs` holding what the score reads (:func:`outputs` computes
    them; or build one from the logits and features you keep). ``method``: a registered score
    that reads outputs (:func:`score_info`; every built-in one without an input gradient), or a
    detector object with ``score_outputs`` (a fitted :func:`detector`: fit it with
    ``.fit_outputs(jm, (outputs, labels))`` or ``.fit(jm, data)``). ``jm``: the network they came
    from (the head of the scores that recompute logits). ``**kwargs``: the score's options.
    """
    if not isinstance(outputs, Outputs):
        raise TypeError(f"outputs must be a jem.ood.Outputs (jem.ood.outputs(jm, x)), got {type(outputs).__name__}")
    jm = as_jem(jm, "ood.score_outputs")
    if isinstance(method, str):
        entry = lookup(_HOOK, method, "OOD score")
        if entry.get("needs_fit", False):
            raise NotFittedError(
                f"OOD score {method!r} is fitted on in-distribution data: fit "
                f"jem.ood.detector({method!r}).fit_outputs(jm, (train_outputs, labels)) and pass it as method"
            )
        fn = entry.get("score_outputs")
        if fn is None:
            raise ValueError(
                f"OOD score {method!r} reads the inputs themselves (an input gradient, or a plugin's "
                "score without an outputs form): score inputs with jem.ood.score(jm, x, ...)"
            )
        _check_kwargs(method, entry["item"], kwargs)
        with torch.no_grad():
            s = fn(jm, outputs, **kwargs)
    elif callable(getattr(method, "score_outputs", None)):
        if kwargs:
            raise TypeError(
                f"options {', '.join(sorted(kwargs))} were given with a detector object; build it with them"
            )
        s = method.score_outputs(jm, outputs)
        method = getattr(method, "name", type(method).__name__)
    else:
        raise TypeError(
            f"method must be a registered score name or a detector with .score_outputs(jm, outputs), "
            f"got {type(method).__name__}"
        )
    _check_batch_scores(s, len(outputs), method)
    return s


def _check_batch_scores(s: Any, n: int, method: Any) -> None:
    if not isinstance(s, Tensor) or s.shape != (n,):
        raise InvalidScoresError(
            f"OOD score {method!r} returned "
            f"{tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__} for a "
            f"batch of {n} inputs; a score function must return a [B] tensor"
        )


# ---------------------------------------------------------------------- metrics
def _as_scores(s: Any, what: str) -> np.ndarray:
    if isinstance(s, Tensor):
        s = s.detach().cpu().double().numpy()
    try:
        a = np.asarray(s, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidScoresError(f"{what} must be a 1-D array of numbers: {exc}") from exc
    if a.ndim != 1:
        raise InvalidScoresError(
            f"{what} must be 1-D (one score per input), got shape {a.shape}"
            + ("; flatten it with .reshape(-1)" if a.size and max(a.shape) == a.size else "")
        )
    if a.size == 0:
        raise InvalidScoresError(f"{what} is empty: need at least one score on each side")
    bad = ~np.isfinite(a)
    if bad.any():
        raise InvalidScoresError(
            f"{what} contains {int(bad.sum())} non-finite value(s) (NaN/inf) out of {a.size}; "
            "check the model's logits on those inputs (jm.logits raises on non-finite logits)"
        )
    return a


def _fpr_at_tpr(y_true: np.ndarray, y_score: np.ndarray, level: float) -> float:
    from sklearn.metrics import roc_curve

    # drop_intermediate=False: every distinct threshold is a point, so "the first point with
    # TPR >= level" is the same one pytorch-ood's fpr_at_tpr picks (dropping collinear points
    # could skip it on a diagonal tie segment).
    fpr, tpr, _ = roc_curve(y_true, y_score, drop_intermediate=False)
    return float(fpr[np.searchsorted(tpr, level, side="left")])


def evaluate(
    scores_in: Any, scores_out: Any, *, positive: str = "in", aupr: str = "average_precision"
) -> dict[str, float]:
    """Separation of in- and out-of-distribution scores (higher score = more in-distribution).

    Returns ``{"auroc", "aupr_in", "aupr_out", "fpr95"}``:

    - ``auroc``: area under the ROC curve (the same for either positive class).
    - ``aupr_in`` / ``aupr_out``: area under the precision-recall curve with in- / out-of-
      distribution as the positive class. ``aupr="average_precision"`` (default) is
      scikit-learn's ``average_precision_score``, as in the reference code of Hendrycks et al.
      and Liu et al.; ``aupr="trapezoid"`` is the trapezoidal area of the PR curve, as
      pytorch-ood's ``OODMetrics`` computes it.
    - ``fpr95``: false positive rate at 95% true positive rate. With ``positive="in"``
      (default; Liu et al.'s convention) the threshold keeps 95% of in-distribution inputs and
      ``fpr95`` is the fraction of OOD inputs still accepted. With ``positive="out"`` the
      threshold catches 95% of OOD inputs and ``fpr95`` is the fraction of in-distribution
      inputs rejected (pytorch-ood's convention).

    Scores may be tensors, arrays or lists; the two sets may differ in size. Empty, non-1-D
    or non-finite scores raise :class:`jem_plugin.errors.InvalidScoresError`.
    """
    from sklearn.metrics import auc, average_precision_score, precision_recall_curve, roc_auc_score

    if positive not in ("in", "out"):
        raise ValueError(f"positive must be 'in' or 'out', got {positive!r}")
    if aupr not in ("average_precision", "trapezoid"):
        raise ValueError(f"aupr must be 'average_precision' or 'trapezoid', got {aupr!r}")
    s_in = _as_scores(scores_in, "scores_in")
    s_out = _as_scores(scores_out, "scores_out")
    s = np.concatenate([s_in, s_out])
    is_in = np.concatenate([np.ones(s_in.size, dtype=np.int64), np.zeros(s_out.size, dtype=np.int64)])

    def area_pr(y: np.ndarray, v: np.ndarray) -> float:
        if aupr == "average_precision":
            return float(average_precision_score(y, v))
        precision, recall, _ = precision_recall_curve(y, v, drop_intermediate=False)
        return float(auc(recall, precision))

    if positive == "in":
        fpr95 = _fpr_at_tpr(is_in, s, 0.95)
    else:
        fpr95 = _fpr_at_tpr(1 - is_in, -s, 0.95)
    return {
        "auroc": float(roc_auc_score(is_in, s)),
        "aupr_in": area_pr(is_in, s),
        "aupr_out": area_pr(1 - is_in, -s),
        "fpr95": fpr95,
    }


# ---------------------------------------------------------------------- comparing scores
__all__ += ["OODTable", "Best"]


class Best(str):
    """One set's best score name in :meth:`OODTable.best`, the first in table order, which says
    whether others tie with it: :attr:`tied` holds every score at the best value (itself first),
    ``len(tied) > 1`` on a tie. A ``str``: it indexes the table and compares as the name; its
    ``repr`` marks a tie (``'fdbd' (tied with 12: msp, ...)``), so a printed ``best()`` shows it."""

    tied: tuple[str, ...]

    def __new__(cls, tied: Sequence[str]) -> Best:
        if not tied:
            raise ValueError("Best needs at least one score name")
        self = super().__new__(cls, tied[0])
        self.tied = tuple(tied)
        return self

    @property
    def is_tie(self) -> bool:
        """Whether other scores share the best value."""
        return len(self.tied) > 1

    def __repr__(self) -> str:
        if not self.is_tie:
            return super().__repr__()
        others = self.tied[1:]
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return f"{super().__repr__()} (tied with {len(others)}: {shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Best, (self.tied,))


_METRICS = ("auroc", "aupr_in", "aupr_out", "fpr95")
_LOWER_IS_BETTER = {"fpr95"}
_STATUS_WORD = {"skipped": "skip", "failed": "FAIL", "non-finite": "NaN"}


class OODTable(dict):
    """The result of :func:`evaluate_all`: every score against every OOD set.

    It *is* the mapping ``{score: {set: {"auroc", "aupr_in", "aupr_out", "fpr95"}}}`` that
    :func:`evaluate_all` always returned (a ``dict``: indexing, iteration, ``json.dumps`` and
    comparison with a plain dict work as before), holding the rows that were measured. On top:

    - :meth:`rows`: one record per (score, set), *every* requested pair, with ``status``
      (``"ok"``, ``"skipped"``, ``"failed"``, ``"non-finite"``), a one-line ``reason`` and the
      scoring time per 1000 images; skipped and failed pairs are there, not in the mapping;
    - :meth:`best`: the best score per set; :meth:`to_text` (also ``str(table)``): a printable
      table marking it with ``*``; :meth:`to_csv`; :func:`jem_plugin.viz.plot_ood_table` draws it;
    - ``scores``: the raw scores, ``{score: {"in": Tensor, set: Tensor, ...}}`` for every score
      that ran, ready for :func:`jem_plugin.viz.plot_histograms` / ``plot_roc``.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]] = (),
        methods: Sequence[str] = (),
        sets: Sequence[str] = (),
        timing: Mapping[str, Mapping[str, float]] | None = None,
        scores: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = [dict(r) for r in records]
        self.methods: list[str] = list(methods) or list(dict.fromkeys(r["score"] for r in self.records))
        self.sets: list[str] = list(sets) or list(dict.fromkeys(r["set"] for r in self.records))
        #: ``{score: {"seconds_per_1000", "fit_seconds", "n_images"}}`` of the scores that ran.
        self.timing: dict[str, dict[str, float]] = {k: dict(v) for k, v in (timing or {}).items()}
        #: ``{score: {"in": Tensor, set name: Tensor, ...}}``: the scores behind the table.
        self.scores: dict[str, dict[str, Tensor]] = {k: dict(v) for k, v in (scores or {}).items()}
        for r in self.records:
            if r["status"] == "ok":
                self.setdefault(r["score"], {})[r["set"]] = {m: r[m] for m in _METRICS}

    def rows(self) -> list[dict[str, Any]]:
        """One record per (score, set), in table order: ``score``, ``set``, ``status``,
        ``reason``, the four metrics (NaN unless ``status == "ok"``), ``seconds_per_1000``
        (scoring time of that score per 1000 images, the in-distribution and every OOD set
        together; fitting excluded), ``fit_seconds`` and ``best`` (best AUROC of its set)."""
        best = {s: set(v) for s, v in self._best_sets("auroc").items()}
        return [{**r, "best": r["score"] in best.get(r["set"], set())} for r in self.records]

    def _best_sets(self, metric: str) -> dict[str, list[str]]:
        if metric not in _METRICS:
            raise ValueError(f"metric must be one of {', '.join(_METRICS)}, got {metric!r}")
        sign = -1.0 if metric in _LOWER_IS_BETTER else 1.0
        out: dict[str, list[str]] = {}
        for name in self.sets:
            values = {m: sign * v[name][metric] for m, v in self.items() if name in v}
            if values:
                top = max(values.values())
                out[name] = [m for m, v in values.items() if v == top]
        return out

    def best(self, metric: str = "auroc") -> dict[str, Best]:
        """``{set: score}``: the best score on each OOD set by ``metric`` (highest AUROC / AUPR,
        lowest FPR95). Each value is a :class:`Best`, a ``str`` naming the first best score in
        table order, whose ``tied`` lists every score at exactly that value: on a set where 13
        scores reach an AUROC of 1.0, ``best()["noise"].tied`` names all 13 and its ``repr``
        says so. Sets no score measured are left out."""
        return {name: Best(tops) for name, tops in self._best_sets(metric).items()}

    def mean(self, metric: str = "auroc") -> dict[str, float]:
        """``{score: mean of metric over the OOD sets}`` for the scores measured on every set."""
        return {
            m: float(np.mean([v[s][metric] for s in self.sets]))
            for m, v in self.items()
            if all(s in v for s in self.sets)
        }

    def failures(self) -> dict[str, str]:
        """``{score: "status: reason"}`` of every score with a pair not measured (skipped,
        failed or non-finite); one line each, the first set's reason."""
        out: dict[str, str] = {}
        for r in self.records:
            if r["status"] != "ok" and r["score"] not in out:
                out[r["score"]] = f"{r['status']}: {r['reason']}"
        return out

    def to_csv(self, path: str | Any) -> str:
        """Write :meth:`rows` as CSV (one line per score and set, every metric); returns the path."""
        import csv
        from pathlib import Path

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fields = ["score", "set", "status", *_METRICS, "seconds_per_1000", "fit_seconds", "best", "reason"]
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            for r in self.rows():
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
        return str(p)

    def to_text(self, metric: str = "auroc") -> str:
        """A plain-text table: one line per score, ``metric`` per OOD set, its mean over the
        sets and the scoring time per 1000 images; ``*`` marks the best score of each set,
        unmeasured cells say why in one word (``skip``, ``FAIL``, ``NaN``) with the reasons below."""
        best = self._best_sets(metric)
        by_pair = {(r["score"], r["set"]): r for r in self.records}
        means = self.mean(metric)
        width = max([len("score"), *map(len, self.methods)])
        cols = [max(7, len(s)) for s in self.sets]
        header = (
            f"{'score':<{width}}  "
            + "  ".join(f"{s:>{c}}" for s, c in zip(self.sets, cols))
            + f"  {'mean':>6}  {'s/1000':>7}"
        )
        lines = [header, "-" * len(header)]
        for m in self.methods:
            cells = []
            for s, c in zip(self.sets, cols):
                r = by_pair.get((m, s))
                if r is None:
                    cell = "-"
                elif r["status"] == "ok":
                    cell = f"{r[metric]:.3f}" + ("*" if m in best.get(s, ()) else " ")
                else:
                    cell = _STATUS_WORD.get(r["status"], r["status"]) + " "
                cells.append(f"{cell:>{c}}")
            t = self.timing.get(m, {}).get("seconds_per_1000")
            mean = f"{means[m]:.3f}" if m in means else "-"
            lines.append(f"{m:<{width}}  " + "  ".join(cells) + f"  {mean:>6}  {'-' if t is None else f'{t:.3g}':>7}")
        direction = "lower is better" if metric in _LOWER_IS_BETTER else "in-distribution positive"
        lines.append(f"{metric} ({direction}); * best per set; s/1000: scoring seconds per 1000 images")
        ties = [f"{len(tops)} on {s}" for s, tops in best.items() if len(tops) > 1]
        if ties:
            lines.append(f"  * ties for best (the same {metric}): {', '.join(ties)}")
        lines += [f"  {m}: {why}" for m, why in self.failures().items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def _method_names(methods: str | Sequence[str]) -> list[str]:
    """The requested score names, checked against the registry before anything is scored."""
    from .errors import UnknownNameError

    available = sorted(collect(_HOOK))
    if isinstance(methods, str):
        names = available if methods == "all" else [m.strip() for m in methods.split(",") if m.strip()]
    else:
        names = [str(m) for m in methods]
    if not names:
        raise ValueError("methods is empty: name at least one score, or 'all'")
    unknown = [m for m in dict.fromkeys(names) if m not in available]
    if unknown:
        named = ", ".join(repr(m) + UnknownNameError.did_you_mean(m, available) for m in unknown)
        raise UnknownNameError(
            f"unknown OOD score{'s' if len(unknown) > 1 else ''} {named}; available: {', '.join(available)} (or 'all')"
        )
    return list(dict.fromkeys(names))


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
            method, options = detector(method, **kw), {}
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

    def __init__(self, label: str, reads: Any, score: Any, det: Any = None) -> None:
        self.label, self.reads, self.score, self.det = label, frozenset(reads), score, det
        self.error: BaseException | None = None
        self.fit_s = self.score_s = 0.0
        self.scores: dict[str, list[Tensor]] = {}

    @property
    def layers(self) -> list[str]:
        return list(getattr(self.det, "layers_read", None) or []) if "layers" in self.reads else []

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
        method = detector(label, **kw)
    if getattr(method, "needs_grad", False) or not getattr(method, "shares_forward", False):
        return None
    needed = ("score_outputs", *(("begin_fit", "add_outputs", "end_fit") if needs_fit else ()))
    if not all(callable(getattr(method, a, None)) for a in needed) or getattr(method, "reads", None) is None:
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
        i.run("fit_s", i.det.begin_fit, jm)
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
                i.run("fit_s", i.det.add_outputs, out, y)
        for i in todo:
            i.fit_s += clock[0]
        todo = [i for i in todo if i.run("fit_s", i.det.end_fit, jm) is False]
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
    for m in items:
        if not isinstance(m, (str, Detector)):
            raise TypeError(
                f"methods holds {type(m).__name__}: give score names or detector objects with .score(jm, x)"
            )
    if any(isinstance(m, str) for m in items):
        _method_names([m for m in items if isinstance(m, str)])  # unknown names: one line, first
    out: dict[str, Any] = {}
    for m in items:
        label = m if isinstance(m, str) else str(getattr(m, "name", type(m).__name__))
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
        else:  # a detector object: fitted here only where it says it is not fitted yet
            needs_fit = callable(getattr(method, "fit", None)) and getattr(method, "fitted", True) is False
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
