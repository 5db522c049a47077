"""Scoring inputs and outputs by name or with a detector object: the score registry
(``jem_register_ood_scores``), :func:`score`, :func:`score_outputs`, :func:`detector` and what
each registered score needs (:func:`score_info`). Public through :mod:`jem_plugin.ood`."""

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
from ._detector import Detector, _Foreign, as_detector
from ._outputs import Outputs
from .errors import InvalidInputError, InvalidScoresError, NotFittedError
from .model import as_jem, sampling_mode
from .plugins import collect, lookup

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
    item = entry["item"]
    # a fitted detector's class declares what it reads and keeps (the contract, Detector)
    declared = item if entry.get("needs_fit") and isinstance(item, type) and issubclass(item, Detector) else None
    reads = entry.get("reads", declared.reads if declared is not None else None)
    return {
        "needs_grad": bool(entry.get("needs_grad", False)),
        "needs_fit": bool(entry.get("needs_fit", False)),
        "description": str(entry.get("description", "")),
        "assumes_jem": bool(entry.get("assumes_jem", False)),
        "reads": None if reads is None or entry.get("needs_grad") else frozenset(reads),
        "across_ranks": declared.across_ranks if declared is not None else None,
    }


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
        if not isinstance(det, Detector):  # a plugin's object written without the base class
            raise InvalidInputError(
                f"OOD score {name!r} takes no memory_limit (its detector does not derive from jem.ood.Detector)"
            )
        det.set_memory_limit(memory_limit)
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
    det: Detector | None = None
    if isinstance(method, str):
        entry = lookup(_HOOK, method, "OOD score")
        if entry.get("needs_fit", False):
            if fit_data is None:
                raise NotFittedError(
                    f"OOD score {method!r} is fitted on in-distribution training data: pass "
                    f"fit_data=<train loader or tensor>, or a fitted jem.ood.detector({method!r}) as method"
                )
            det, kwargs = as_detector(detector(method, **kwargs)), {}
            if det is None:
                raise TypeError(f"OOD score {method!r} is registered with needs_fit=True but builds no detector")
        else:
            fn, needs_grad = entry["item"], bool(entry.get("needs_grad", False))
            _check_kwargs(method, fn, kwargs)
    elif (det := as_detector(method)) is not None:
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
        fn, needs_grad, method = det.score, det.needs_grad, det.name
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
    elif (det := as_detector(method)) is not None and (not isinstance(det, _Foreign) or det.has_outputs_form):
        if kwargs:
            raise TypeError(
                f"options {', '.join(sorted(kwargs))} were given with a detector object; build it with them"
            )
        s = det.score_outputs(jm, outputs)
        method = det.name
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
