"""The detector contract: :class:`Detector`, the base class of every fitted OOD detector (the
built-in post-hoc ones and a plugin's or user's own), public as :class:`jem_plugin.ood.Detector`.

What a detector is, declared on its class, where :func:`jem_plugin.ood.score`,
:func:`jem_plugin.ood.evaluate_all` and the registry read it:

- **metadata**: ``name``, ``description``, ``paper``, ``needs_grad`` (its score takes an input
  gradient), ``needs_fit``, ``reads`` (the kinds of output it fits from and scores,
  :data:`jem_plugin.ood.KINDS`), ``across_ranks`` (``"reduce"`` or ``"gather"``: what
  :func:`jem_plugin.ood.score_info` says of a fit under ``torchrun``);
- **its memory**: :meth:`Detector.memory_estimate`, the peak of its fit at a :class:`FitShape`
  (an upper bound, in tensor bytes); a fit whose estimate is over the detector's memory limit is
  refused in one line before it allocates (:class:`~jem_plugin.errors.MemoryLimitError`);
- **how its state combines across ranks**: :attr:`Detector._rank_stats` (or
  :meth:`Detector._rank_statistics` where it depends on the pass), ``(attribute path, how)``
  pairs combined by :func:`jem_plugin.distributed._detectors.combine_ranks`.

What it does: :meth:`~Detector.fit` and :meth:`~Detector.score` on inputs, and the streaming
form they are built on, :meth:`~Detector.begin_fit`, :meth:`~Detector.add_outputs` per batch of
outputs and :meth:`~Detector.end_fit`, then :meth:`~Detector.score_outputs`. A subclass writes
the statistic: ``_begin(jm)`` (empty running sums), ``_add_outputs(outputs, labels)``,
``_finish(jm)`` (the fitted state) and ``_score_outputs(jm, outputs)``; the base does the rest
(the forward, the memory checks, the ranks, the fitted checks, pickling).
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Sized
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ._checks import unwrap_model
from ._outputs import Outputs, fit_inputs, forward_outputs
from .distributed._group import get_world_size
from .errors import InvalidInputError, MemoryLimitError, NotFittedError
from .model import as_jem

__all__ = ["Detector", "FitShape", "Estimate", "DEFAULT_LIMIT", "ENV", "RankStat", "human", "rows_of"]

#: The default memory limit of a fit, in bytes: 2 GiB, a fixed number, so that whether a fit is
#: refused does not depend on the machine it runs on, and the budget of issue 46 (every built-in
#: detector fits an ImageNet-size fit in it, or names the setting that does).
DEFAULT_LIMIT = 2 << 30

#: The environment variable that sets the limit for the process (bytes, e.g. ``8e9``; ``none``:
#: no limit), where the detector has no ``memory_limit`` of its own.
ENV = "JEM_OOD_MEMORY_LIMIT"

#: One statistic of a detector's fit and how it combines across ranks: its attribute path (two for
#: the paired kinds) and one of ``"sum"``, ``"min"``, ``"max"``, ``"moments"``, ``"sample"``,
#: ``"gather"``, ``"top"``, ``"low2"``, ``"high2"`` (:mod:`jem_plugin.distributed._detectors`).
RankStat = tuple[str | tuple[str, str], str]


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
    """A fit's peak in bytes (an upper bound), what holds most of it, and the setting that
    shrinks it (named by the refusal). ``extra={"grows": True}``: a bank of data of unknown
    length, checked as it grows (:meth:`Detector._check_growth`)."""

    bytes: float
    what: str
    fix: str
    extra: dict[str, Any] = field(default_factory=dict)


def human(n: float) -> str:
    """Bytes for a person in powers of 1024, named as such: ``2.0 GiB``, ``340.0 MiB``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


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


def rows_of(data: Any) -> int | None:
    """How many fit rows ``data`` holds where that is known without reading it: a tensor, an
    ``(x, y)`` pair, a DataLoader over a sized dataset, :class:`~jem_plugin.ood.Outputs` or a list
    of them (or of ``(outputs, labels)``); ``None`` otherwise (a generator)."""
    if isinstance(data, Tensor):
        return int(data.shape[0]) if data.dim() else None
    if isinstance(data, Outputs):
        return len(data)
    if isinstance(data, tuple) and data and isinstance(data[0], (Tensor, Outputs)):
        return rows_of(data[0])
    if isinstance(data, list):
        counts = [rows_of(item) for item in data]
        return sum(c for c in counts if c is not None) if counts and None not in counts else None
    dataset = getattr(data, "dataset", None)  # a DataLoader's, where it has one
    if isinstance(dataset, Sized) and getattr(data, "batch_size", 1) is not None:
        return len(dataset)
    return None


def _held(outputs: Outputs, kind: str) -> Any:
    """The value of ``kind`` in ``outputs``, ``None`` where it was not computed or failed."""
    try:
        return getattr(outputs, kind)
    except Exception:  # a kind the network could not give: the detector reading it will say so
        return None


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


@dataclass
class _FitCheck:
    """What a fit in progress still has to check of its memory: the limit and the shape the first
    batch checks again, and for a bank of unknown length that it grows. Kept on the detector only
    while it fits (not pickled, not combined across ranks)."""

    limit: float | None
    shape: FitShape
    first_batch: bool = True
    grows: bool = False


class Detector:
    """Base class of the OOD detectors fitted on in-distribution data (see the module's
    docstring for the contract). Fit with :meth:`fit` (or :meth:`begin_fit`,
    :meth:`add_outputs` per batch, :meth:`end_fit`), then pass it to
    :func:`jem_plugin.ood.score` as ``method`` or call :meth:`score` on batches.

    A subclass sets the class attributes below and writes ``_begin``, ``_add_outputs``,
    ``_finish`` and ``_score_outputs``; optionally :meth:`memory_estimate` (so that a fit too
    large for its limit is refused before it allocates) and ``_rank_stats`` (so that it fits
    under ``torchrun`` on every rank's shard).
    """

    #: The score's name (progress bars, tables, the registry), a one-line description, its paper.
    name = "detector"
    description = ""
    paper = ""
    #: Whether scoring takes an input gradient (then it scores inputs, not outputs).
    needs_grad = False
    #: Whether it is fitted on in-distribution data before it scores.
    needs_fit = True
    #: The kinds of output it fits from and scores (:data:`jem_plugin.ood.KINDS`): what
    #: :func:`jem_plugin.ood.outputs` computes for it. The logits alone work on any classifier.
    reads: frozenset[str] = frozenset({"logits"})
    #: What the fit keeps, for :func:`jem_plugin.ood.score_info`: ``"reduce"`` (statistics of a
    #: fixed size, reduced across ranks), ``"gather"`` (rows of the fit data, gathered onto every
    #: rank), ``None`` (not said).
    across_ranks: str | None = None
    #: What the fit accumulates and how each rank's combines with the others' under a process
    #: group of several ranks: ``(attribute path, how)`` pairs (:data:`RankStat`); ``None``: not
    #: said (such a fit runs with ``distributed=False``).
    _rank_stats: tuple[RankStat, ...] | None = None
    #: Whether it is fitted (set by :meth:`end_fit`).
    fitted = False

    def __init__(self) -> None:
        self.fitted = False

    # -- what it declares ----------------------------------------------------------------------
    def memory_estimate(self, shape: FitShape) -> Estimate | None:
        """The peak of this detector's fit at ``shape``, in bytes of tensors on the device the
        statistics live on (an upper bound: its running state, the copies its end of fit makes,
        one batch's scratch), or ``None`` where it has no estimate or a width it needs is not
        known yet. Checked against the limit when the fit starts and on its first batch."""
        return None

    def _rank_statistics(self) -> tuple[RankStat, ...] | None:
        """What this pass of the fit combines across ranks (:attr:`_rank_stats`; a detector whose
        statistics depend on the pass or its options says so here)."""
        return self._rank_stats

    @property
    def layers_read(self) -> list[str]:
        """The layers whose outputs it reads (``"layers"`` in :attr:`reads`), known once
        :meth:`begin_fit` has run; ``[]`` for the others."""
        return []

    @property
    def shares_forward(self) -> bool:
        """Whether it fits and scores from outputs alone (:meth:`add_outputs`,
        :meth:`score_outputs`), so that :func:`jem_plugin.ood.evaluate_all` hands it the outputs
        of a forward shared with other detectors; False where it needs the inputs themselves (an
        input gradient)."""
        return not self.needs_grad

    # -- the memory limit ----------------------------------------------------------------------
    def set_memory_limit(self, limit: Any) -> None:
        """The most memory this detector's fit may take, in bytes (``None``: no limit); checked
        now, applied when the fit starts. :func:`jem_plugin.ood.detector`'s ``memory_limit``
        calls it."""
        _checked_limit(limit, "memory_limit")
        self.memory_limit = limit

    def memory_limit_bytes(self) -> float | None:
        """The memory limit of this detector's fit in bytes, ``None`` for none: its own
        ``memory_limit``, else the ``JEM_OOD_MEMORY_LIMIT`` environment variable, else
        :data:`DEFAULT_LIMIT` (2 GiB)."""
        if "memory_limit" in self.__dict__:
            return _checked_limit(self.__dict__["memory_limit"], "memory_limit")
        env = os.environ.get(ENV)
        if env is not None:
            return _checked_limit(None if env.strip().lower() in ("", "none") else env, ENV)
        return DEFAULT_LIMIT

    def _refusal(self, est: Estimate, limit: float, shape: FitShape) -> MemoryLimitError:
        return MemoryLimitError(
            f"{self.name}: this fit would need about {human(est.bytes)} of {shape.on} for {est.what}, over its "
            f"memory_limit of {human(limit)}: {est.fix}, or raise the limit "
            f"(jem.ood.detector({self.name!r}, memory_limit=...) or {ENV}=bytes)"
        )

    def _check_memory(self, check: _FitCheck) -> None:
        est = self.memory_estimate(check.shape)
        if est is None:
            return
        if est.extra.get("grows"):
            check.grows = True
            return
        if check.limit is not None and est.bytes > check.limit:
            self.__dict__.pop("_fit_check", None)
            raise self._refusal(est, check.limit, check.shape)

    def _check_fit_memory(self, core: Any, rows: int | None) -> None:
        """At the start of a fit on ``core`` (``rows`` fit rows where known): refuse where the
        estimate is over the limit; where a width it needs is known only from the outputs, the
        first batch checks (:meth:`_check_batch_memory`)."""
        limit = self.memory_limit_bytes()
        d, k = _head_shape(core) if "features" in self.reads or "logits" in self.reads else (None, None)
        check = _FitCheck(limit, FitShape(rows=rows, dim=d, classes=k))
        self._fit_check = check
        self._check_memory(check)

    def _check_batch_memory(self, outputs: Outputs) -> None:
        """On a fit's first batch: the start's check again, with the widths and batch size of the
        outputs themselves, before the detector keeps anything of them."""
        check = self.__dict__.get("_fit_check")
        if check is None or not check.first_batch:
            return
        check.first_batch = False
        logits = outputs.logits
        feats = _held(outputs, "features")
        layers = _held(outputs, "layers") or {}
        names = list(self.layers_read) or list(layers)
        check.shape = replace(
            check.shape,
            classes=int(logits.shape[1]),
            dim=int(feats.shape[1]) if isinstance(feats, Tensor) and feats.dim() == 2 else check.shape.dim,
            layers=tuple((int(layers[n].shape[1]), int(math.prod(layers[n].shape[2:]))) for n in names if n in layers)
            or None,
            batch=int(logits.shape[0]),
            on="GPU memory" if logits.is_cuda else "memory",
        )
        self._check_memory(check)

    def _check_growth(self, held_rows: int) -> None:
        """For a bank of data of unknown length: refuse once holding ``held_rows`` rows (and
        concatenating them at the end) would exceed the limit, before the bank grows past it."""
        check = self.__dict__.get("_fit_check")
        if check is None or not check.grows or check.limit is None or check.first_batch:
            return
        shape = replace(check.shape, rows=held_rows)
        est = self.memory_estimate(shape)
        if est is not None and est.bytes > check.limit:
            raise self._refusal(est, check.limit, shape)

    # -- fitting -------------------------------------------------------------------------------
    def fit(
        self,
        jm: Any,
        data: Any,
        *,
        batch_size: int = 256,
        progress: bool | None = None,
        input_key: str | None = None,
        distributed: bool = True,
    ) -> Detector:
        """Fit on in-distribution ``data`` (a DataLoader or iterable of batches, a tensor, or an
        ``(x, y)`` pair of tensors), streaming batch by batch; returns ``self``.

        The model runs in eval mode with frozen parameters (restored after), without autograd.
        ``progress``: a tqdm bar over batches (default: only for an iterable on a terminal).
        ``distributed``: under ``torchrun`` (an initialised ``torch.distributed`` process group of
        several ranks), ``data`` is this rank's shard and the ranks' statistics are combined
        before the fit finishes, so that every rank holds the fit of the union (see
        :meth:`begin_fit`); ``False``: each rank fits its own data alone.
        """
        core = as_jem(jm, f"{self.name}.fit")
        self._check_reiterable(data)
        self.begin_fit(core, rows=rows_of(data), distributed=distributed)
        while True:
            for x, y in fit_inputs(
                core, data, batch_size=batch_size, progress=progress, input_key=input_key, desc=self._fit_desc()
            ):
                self._saw_inputs(x)
                self.add_outputs(forward_outputs(core, x, self.reads, self.layers_read), y)
            if self.end_fit(core):
                return self

    def fit_outputs(self, jm: Any, data: Any, *, distributed: bool = True) -> Detector:
        """Fit from outputs already computed (pytorch-ood's ``fit_features``): ``data`` is one
        ``(outputs, labels)`` pair for the whole set (:class:`~jem_plugin.ood.Outputs`, labels
        ``[N]`` or ``None``), a lone :class:`~jem_plugin.ood.Outputs`, or an iterable of such
        batches (iterable twice for a detector that streams twice, ``openmax``); returns
        ``self``. ``jm``: the network they came from (the head of ``react`` and ``vim``, the
        default layers of the multi-layer ones). The outputs hold what :attr:`reads` names
        (:func:`jem_plugin.ood.outputs` computes them). ``distributed``: as for :meth:`fit`
        (``data``: this rank's outputs)."""
        core = as_jem(jm, f"{self.name}.fit_outputs")
        if not self.shares_forward:
            raise ValueError(
                f"{self.name} fits from the inputs themselves (an input gradient), not from outputs: "
                "fit it with .fit(jm, data)"
            )
        if isinstance(data, Outputs) or (isinstance(data, tuple) and data and isinstance(data[0], Outputs)):
            data = [data]
        self._check_reiterable(data)
        self.begin_fit(core, rows=rows_of(data), distributed=distributed)
        while True:
            seen = 0
            for item in data:
                out, y = (item, None) if isinstance(item, Outputs) else item
                self.add_outputs(out, y)
                seen += 1
            if not seen:
                raise InvalidInputError(f"{self.name}.fit_outputs: no outputs to fit on, the data is empty")
            if self.end_fit(core):
                return self

    def begin_fit(self, jm: Any, *, rows: int | None = None, distributed: bool = True) -> None:
        """Start a streaming fit on the network ``jm`` (its running sums emptied).

        ``rows``: how many fit rows will come, where known (for the memory check: a fit whose
        :meth:`memory_estimate` is over the detector's memory limit is refused here or on the
        first batch, before it allocates). ``distributed`` (default): where a
        ``torch.distributed`` process group of several ranks is initialised (``torchrun``), each
        rank streams its own shard and :meth:`end_fit` combines the ranks' statistics before the
        fit finishes (sums and moments all-reduced, bounds min/max-reduced, banks and samples
        gathered): a collective, so every rank must fit the same detectors in the same order, and
        each must have data. ``False``: this rank's data alone."""
        core = as_jem(jm, f"{self.name}.fit")
        self._check_fit_memory(core, rows)
        self._fit_across_ranks = bool(distributed) and get_world_size() > 1
        self._begin(core)

    def add_outputs(self, outputs: Outputs, y: Tensor | None = None) -> None:
        """Add one batch of in-distribution outputs (and its labels, ``[B]`` or ``None``) to the fit."""
        self._check_batch_memory(outputs)
        with torch.no_grad():
            self._add_outputs(outputs, y)

    def end_fit(self, jm: Any) -> bool:
        """End a pass over the fit data: ``True`` once fitted, ``False`` where the detector needs
        the same data streamed again (``openmax``: class means, then the distances to them)."""
        core = as_jem(jm, f"{self.name}.fit")
        if self.__dict__.get("_fit_across_ranks"):
            from .distributed._detectors import combine_ranks  # only under a process group of several ranks

            combine_ranks(self)
        if self._another_pass(core):
            return False
        self.__dict__.pop("_fit_across_ranks", None)
        self.__dict__.pop("_fit_check", None)
        self._finish(core)
        self._fitted_now(core)
        return True

    # -- scoring -------------------------------------------------------------------------------
    def score(self, jm: Any, x: Tensor) -> Tensor:
        """``[B]`` scores of the batch ``x``, higher = more in-distribution (no autograd graph):
        one forward for the outputs it reads, then :meth:`score_outputs`. The model runs in the
        mode it is in; :func:`jem_plugin.ood.score` puts it in eval mode."""
        core = as_jem(jm, f"{self.name}.score")
        self._check_fitted(core)
        with torch.no_grad():
            return self._score_outputs(core, forward_outputs(core, x, self.reads, self.layers_read))

    def score_outputs(self, jm: Any, outputs: Outputs) -> Tensor:
        """``[B]`` scores of a batch's outputs already computed (pytorch-ood's
        ``predict_features``), higher = more in-distribution: what :meth:`score` gives for the
        inputs they came from. ``jm``: the network they came from."""
        core = as_jem(jm, f"{self.name}.score_outputs")
        self._check_fitted(core)
        with torch.no_grad():
            return self._score_outputs(core, outputs)

    # -- the fitted state ----------------------------------------------------------------------
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

    def _fitted_now(self, core: Any) -> None:
        """Mark the detector fitted on ``core``'s network (a weak reference: the detector does not
        keep the network alive)."""
        self.fitted, self._warned_other_model = True, False
        self._fitted_on = weakref.ref(unwrap_model(core.model))

    def __getstate__(self) -> dict[str, Any]:
        # pickle/torch.save keep the fitted statistics, not the link to the network (a weak
        # reference) nor a fit's pending memory check
        state = self.__dict__.copy()
        state.pop("_fitted_on", None)
        state.pop("_fit_check", None)
        return state

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options().items())
        return f"{type(self).__name__}({options}{', fitted' if self.fitted else ''})"

    def _options(self) -> dict[str, Any]:
        """The options it was built with, for its ``repr``."""
        return {}

    # -- what a subclass writes ----------------------------------------------------------------
    def _begin(self, jm: Any) -> None:
        """Empty the running statistics, at the start of a fit on the network ``jm``."""

    def _add_outputs(self, outputs: Outputs, y: Tensor | None) -> None:
        """Add a batch's outputs (and labels) to the running statistics (no autograd)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it fits (_add_outputs)")

    def _finish(self, jm: Any) -> None:
        """Turn the running statistics into the fitted state, at the end of the fit."""

    def _score_outputs(self, jm: Any, outputs: Outputs) -> Tensor:
        """``[B]`` scores of a batch's outputs, higher = more in-distribution (no autograd)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it scores (_score_outputs)")

    def _fit_desc(self) -> str:
        """The progress bar's text for the pass :meth:`fit` is about to stream."""
        return f"fit {self.name}"

    def _check_reiterable(self, data: Any) -> None:
        """Raise where the fit needs ``data`` more than once and it is a one-shot iterator."""

    def _saw_inputs(self, x: Tensor) -> None:
        """The inputs of a fit batch, before its outputs (for a fit that needs the images)."""

    def _another_pass(self, jm: Any) -> bool:
        """At the end of a pass over the fit data: prepare another and say so (``True``), or not."""
        return False


class _Foreign(Detector):
    """A detector object that does not derive from :class:`Detector` (any object with
    ``.score(jm, x)``, the contract before the base class), seen through the contract: its
    optional members (``name``, ``needs_grad``, ``fit``, ``fitted``, ``reads``, ``layers_read``,
    ``shares_forward``, ``score_outputs``, ``begin_fit``/``add_outputs``/``end_fit``) are read
    here, once, so that the scoring and comparing code talks to one interface."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.name = str(getattr(obj, "name", type(obj).__name__))
        self.needs_grad = bool(getattr(obj, "needs_grad", False))
        self.needs_fit = callable(getattr(obj, "fit", None))
        # fitted unless it says it is not: an object without the flag is never fitted twice
        self.fitted = getattr(obj, "fitted", True) is not False
        reads = getattr(obj, "reads", None)
        self.reads = frozenset(reads) if reads is not None else frozenset()
        self._has_reads = reads is not None
        self.across_ranks = getattr(obj, "across_ranks", None)

    @property
    def layers_read(self) -> list[str]:
        return list(getattr(self.obj, "layers_read", None) or [])

    @property
    def has_outputs_form(self) -> bool:
        """Whether it scores outputs already computed (``score_outputs``)."""
        return callable(getattr(self.obj, "score_outputs", None))

    @property
    def shares_forward(self) -> bool:
        streams = all(callable(getattr(self.obj, a, None)) for a in ("begin_fit", "add_outputs", "end_fit"))
        return (
            not self.needs_grad
            and bool(getattr(self.obj, "shares_forward", False))
            and self.has_outputs_form
            and self._has_reads
            and (self.fitted or not self.needs_fit or streams)
        )

    def fit(self, jm: Any, data: Any, **options: Any) -> Detector:
        self.obj.fit(jm, data, **options)
        self.fitted = True
        return self

    def begin_fit(self, jm: Any, *, rows: int | None = None, distributed: bool = True) -> None:
        self.obj.begin_fit(jm)

    def add_outputs(self, outputs: Outputs, y: Tensor | None = None) -> None:
        self.obj.add_outputs(outputs, y)

    def end_fit(self, jm: Any) -> bool:
        done = self.obj.end_fit(jm)
        self.fitted = self.fitted or done is not False
        return done

    def score(self, jm: Any, x: Tensor) -> Tensor:
        return self.obj.score(jm, x)

    def score_outputs(self, jm: Any, outputs: Outputs) -> Tensor:
        return self.obj.score_outputs(jm, outputs)


def as_detector(obj: Any) -> Detector | None:
    """``obj`` through the detector contract: itself where it is a :class:`Detector`, a view of
    it where it is another object with ``.score(jm, x)``, ``None`` where it is neither."""
    if isinstance(obj, Detector):
        return obj
    if callable(getattr(obj, "score", None)):
        return _Foreign(obj)
    return None
