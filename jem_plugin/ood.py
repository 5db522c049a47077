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
:mod:`jem_plugin.builtins.ood_scores`.

Metrics (:func:`evaluate`) come from scikit-learn, the maintained reference, not hand-written
curves; ``fpr95`` follows pytorch-ood's ``fpr_at_tpr`` exactly (first ROC point whose TPR is
at least 95%, no interpolation).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from ._checks import INPUT_KEYS, DomainCheck, check_input, model_device, same_device, unpack_batch
from .errors import InvalidInputError, InvalidScoresError
from .model import as_jem, sampling_mode
from .plugins import collect, lookup

__all__ = ["score", "available_scores", "evaluate", "evaluate_all"]

_HOOK = "jem_register_ood_scores"


def available_scores() -> dict[str, str]:
    """``{name: description}`` of every OOD score registered through the plugin hook, sorted."""
    entries = collect(_HOOK)
    return {name: entries[name].get("description", "") for name in sorted(entries)}


def _batches(data: Any, batch_size: int, input_key: str | None = None) -> tuple[Iterable[Tensor], int | None, bool]:
    """``(iterator over input batches, number of batches or None, data was one tensor)``."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, Tensor):
        if data.dim() < 2:
            raise InvalidInputError(f"expected a batch of inputs [N, ...], got a tensor of shape {tuple(data.shape)}")
        return data.split(batch_size), -(-data.shape[0] // batch_size), True
    if not hasattr(data, "__iter__"):
        raise InvalidInputError(
            f"data must be a tensor or an iterable of batches (e.g. a DataLoader), got {type(data).__name__}"
        )
    try:
        n = len(data)
    except TypeError:
        n = None
    keys = INPUT_KEYS if input_key is None else input_key
    return (unpack_batch(item, input_key=keys)[0] for item in data), n, False


def _check_kwargs(name: str, fn, kwargs: dict) -> None:
    if not kwargs:
        return
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [p for p in list(params)[2:]]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"OOD score {name!r} does not take option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted) or '(none)'}"
        )


def score(
    jm,
    data: Any,
    method: str = "logpx",
    *,
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
        ``"max_logit"``, ``"grad_norm"``, ``"logpx_sgld"``, ...).
    progress: show a tqdm progress bar over batches. Default (``None``): never for a tensor;
        for an iterable only when stderr is a terminal.
    input_key: the key of the inputs in dict batches (default: the first of ``"x"``,
        ``"input"``, ``"inputs"``, ``"image"``, ``"images"``, ``"pixel_values"`` present).
    **kwargs: options of the score, e.g. ``temperature=1000.0`` for ``"msp"``.

    The model runs in :func:`jem_plugin.model.sampling_mode` (eval mode, frozen parameters;
    both restored afterwards). Scores that need no input gradient run
    under ``torch.no_grad()``; gradient scores work inside ``torch.no_grad()`` and
    ``torch.inference_mode()`` too. The result lives on the input's device for a tensor, on
    the CPU for an iterable.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    entry = lookup(_HOOK, method, "OOD score")
    fn, needs_grad = entry["item"], bool(entry.get("needs_grad", False))
    _check_kwargs(method, fn, kwargs)

    jm = as_jem(jm, "ood.score")
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
            if not isinstance(s, Tensor) or s.shape != (x.shape[0],):
                raise InvalidScoresError(
                    f"OOD score {method!r} returned "
                    f"{tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__} for a "
                    f"batch of {x.shape[0]} inputs; a score function must return a [B] tensor"
                )
            results.append(s.detach().to(out_device, torch.float32))
            bar.update(1)
    if not results:
        raise InvalidInputError("no inputs to score: the data is empty")
    return torch.cat(results)


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


def evaluate_all(
    jm,
    data_in: Any,
    data_out: Mapping[str, Any],
    methods: Sequence[str] = ("logpx", "msp", "max_logit", "grad_norm"),
    *,
    method_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    positive: str = "in",
    batch_size: int = 256,
    progress: bool | None = None,
    return_scores: bool = False,
):
    """Every score in ``methods`` against every OOD set: ``{method: {set name: evaluate(...)}}``.

    ``data_in`` and each value of ``data_out`` are anything :func:`score` takes. The
    in-distribution data is scored once per method. ``method_kwargs`` gives per-method
    options, e.g. ``{"msp": {"temperature": 1000.0}}``. With ``return_scores=True`` the result
    is ``(metrics, scores)`` with ``scores[method] = {"in": Tensor, name: Tensor, ...}``, ready
    for :func:`jem_plugin.viz.plot_histograms` and :func:`jem_plugin.viz.plot_roc`.
    """
    if not isinstance(data_out, Mapping) or not data_out:
        raise InvalidInputError("data_out must be a non-empty dict {name: OOD data}")
    method_kwargs = dict(method_kwargs or {})
    unknown = sorted(set(method_kwargs) - set(methods))
    if unknown:
        raise ValueError(f"method_kwargs names methods not in methods: {', '.join(unknown)}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    scores: dict[str, dict[str, Tensor]] = {}
    for method in methods:
        kw = dict(method_kwargs.get(method, {}))
        s = {"in": score(jm, data_in, method, batch_size=batch_size, progress=progress, **kw)}
        for name, data in data_out.items():
            s[str(name)] = score(jm, data, method, batch_size=batch_size, progress=progress, **kw)
        scores[method] = s
        results[method] = {name: evaluate(s["in"], v, positive=positive) for name, v in s.items() if name != "in"}
    return (results, scores) if return_scores else results
