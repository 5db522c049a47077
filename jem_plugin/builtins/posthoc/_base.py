"""The streaming base of the fitted detectors and the helpers every family shares: the fit data
read batch by batch, a bounded uniform sample, the classifier head, the input step of the
gradient detectors."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ..._checks import (
    check_label_range,
    unwrap_model,
)
from ..._outputs import Outputs, fit_inputs, forward_outputs
from ...distributed import get_world_size, rank_seed
from ...errors import InvalidInputError, InvalidLabelError, NoFeaturesError, NotFittedError
from ...model import as_jem
from . import _memory

F_ = TypeVar("F_", bound=Callable[..., Any])


def describe(
    *,
    name: str,
    description: str,
    paper: str,
    needs_grad: bool = False,
    reads: Collection[str] = (),
    score_outputs: Callable[..., Tensor] | None = None,
) -> Callable[[F_], F_]:
    """A function score's registry entry, kept on the function as a fitted detector keeps its on
    its class: ``name``, ``needs_grad``, ``needs_fit`` (False), ``description`` and ``paper``,
    which registration reads; for a score of outputs already computed (no input gradient), the
    kinds it ``reads`` and ``score_outputs(jm, outputs, **options)``, the same score from them."""

    def mark(fn: F_) -> F_:
        for key, value in (
            ("name", name),
            ("needs_grad", needs_grad),
            ("needs_fit", False),
            ("description", description),
            ("paper", paper),
            ("reads", frozenset(reads)),
            ("score_outputs", score_outputs),
        ):
            setattr(fn, key, value)
        return fn

    return mark


def _head(jm: Any, what: str) -> nn.Module:
    head = as_jem(jm, what).head()
    if head is None:
        raise NoFeaturesError(
            f"{what} recomputes the logits from the features and needs the layer mapping them to the "
            "logits; this model's adapter knows none (features read by a callable). Wrap the model "
            "with wrap(model, features='name.of.classifier') instead"
        )
    return head


def _energy(head: nn.Module, h: Tensor) -> Tensor:
    """``logsumexp(head(h))`` in fp32, ``h`` cast to the head's dtype."""
    w = next(head.parameters(), None)
    logits = head(h if w is None or w.dtype == h.dtype else h.to(w.dtype))
    return torch.logsumexp(logits.float(), dim=1)


class _Sample:
    """A uniform sample without replacement of at most ``capacity`` rows of a stream (all rows
    when ``capacity`` is None): each row gets a random key, the ``capacity`` smallest keys are
    kept (bottom-k sampling). Compacted only when twice the capacity is held, so adding costs
    O(1) amortised per row; seeded, so a fit repeats."""

    def __init__(self, capacity: int | None, seed: int) -> None:
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"the sample size must be a positive integer or None, got {capacity!r}")
        self.capacity, self.seed = capacity, seed
        self.rows: list[Tensor] = []
        self.keys: list[Tensor] = []
        self.held = 0
        self.gen: torch.Generator | None = None

    def add(self, rows: Tensor) -> None:
        self.rows.append(rows)
        self.held += rows.shape[0]
        if self.capacity is None:
            return
        if self.gen is None:
            # each rank its own keys: a sample combined across ranks is then uniform over them all
            self.gen = torch.Generator(device=rows.device).manual_seed(rank_seed(self.seed))
        self.keys.append(torch.rand(rows.shape[0], generator=self.gen, device=rows.device))
        if self.held > 2 * self.capacity:
            self._compact()

    def _compact(self) -> None:
        keys = torch.cat(self.keys)
        if self.capacity is not None and keys.shape[0] > self.capacity:
            idx = torch.topk(keys, self.capacity, largest=False, sorted=False).indices
            rows, keys = self._gather(idx), keys[idx]
        else:
            rows = self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)
        self.rows, self.keys, self.held = [rows], [keys], rows.shape[0]

    def _gather(self, idx: Tensor) -> Tensor:
        """``torch.cat(self.rows)[idx]`` without concatenating the rows: the kept rows copied
        chunk by chunk, so compacting holds the rows and the sample, not the rows twice."""
        order = idx.argsort()
        ends = torch.tensor([r.shape[0] for r in self.rows], device=idx.device).cumsum(0)
        cuts = torch.searchsorted(idx[order], ends).tolist()  # the kept rows of each chunk, in order
        out = self.rows[0].new_empty((idx.shape[0], *self.rows[0].shape[1:]))
        lo, start = 0, 0
        for chunk, hi in zip(self.rows, cuts):
            where = order[lo:hi]
            out[where] = chunk[idx[where] - start]
            lo, start = hi, start + chunk.shape[0]
        return out

    def values(self) -> Tensor:
        if self.capacity is not None and self.rows:
            self._compact()
        if not self.rows:
            return torch.empty(0)
        return self.rows[0] if len(self.rows) == 1 else torch.cat(self.rows)


class _RunningMean:
    """The mean of the rows streamed through :meth:`add`, summed in float64 (fdbd, nci and dice
    read the mean training features)."""

    def __init__(self) -> None:
        self._sum: Tensor | None = None
        self._n = 0

    def add(self, rows: Tensor) -> None:
        s = rows.double().sum(dim=0)
        self._sum = s if self._sum is None else self._sum + s
        self._n += rows.shape[0]

    def mean(self) -> Tensor:
        assert self._sum is not None
        return (self._sum / self._n).float()


def _input_step(core: Any, x: Tensor, g: Tensor, eps: float) -> Tensor:
    """``x - eps * sign(g) * (high - low)``: ODIN's input step against the gradient ``g`` of a loss,
    ``eps`` in units of the ``[0, 1]`` pixel range (``eps / std`` for normalised images, as the
    ODIN and Mahalanobis code divide the gradient sign by the normalisation's std)."""
    xd = x.detach()
    lo, hi = core.domain.bounds(xd) if xd.dim() >= 2 else (0.0, 1.0)
    return xd - float(eps) * g.sign().to(xd.dtype) * (hi - lo)


def _checked_layers(layers: Sequence[str] | None) -> list[str] | None:
    """A multi-layer detector's ``layers=`` option as a list (``None``: the adapter's default)."""
    if layers is not None and (isinstance(layers, str) or not layers or not all(isinstance(n, str) for n in layers)):
        raise ValueError(f"layers must be a non-empty list of dotted submodule names, got {layers!r}")
    return None if layers is None else list(layers)


class _FittedDetector:
    """Base of the detectors fitted on in-distribution data. The fit streams: :meth:`begin_fit`,
    then :meth:`add_outputs` with each batch's outputs (:class:`jem_plugin.ood.Outputs`: what
    :meth:`_take` reads of them handed to :meth:`_add`), then :meth:`end_fit`, where
    :meth:`_finish` turns the running sums into the fitted state; :meth:`score_outputs` maps a
    batch's outputs to ``[B]`` scores, higher = in-distribution. :meth:`fit` and :meth:`score`
    compute the outputs of inputs (one forward per batch) and do the same."""

    #: What the registry says of the detector (registration reads these, :mod:`.`): its score
    #: name, whether it takes input gradients or a fit, a one-line description and its paper.
    name = "detector"
    needs_grad = False
    needs_fit = True
    description = ""
    paper = ""
    #: The kinds of output it reads (:data:`jem_plugin.ood.KINDS`): what :func:`jem_plugin.ood.outputs`
    #: computes for it. The logits alone for a detector of the logits: it then never asks the
    #: adapter for features, so it works on models whose penultimate layer cannot be found.
    reads: frozenset[str] = frozenset({"logits", "features"})
    #: What the fit accumulates and how each rank's combines with the others' when it runs in a
    #: process group of several ranks (:mod:`._distributed`): ``(attribute path, how)`` pairs,
    #: ``how`` one of ``"sum"``, ``"min"``, ``"max"``, ``"moments"``, ``"sample"``, ``"gather"``,
    #: ``"top"``, ``"low2"``, ``"high2"``; ``None``: not said (such a fit runs with ``distributed=False``).
    _rank_stats: tuple[tuple[str | tuple[str, str], str], ...] | None = None
    #: What :func:`jem_plugin.ood.score_info` says of a fit across ranks: ``"reduce"`` where the
    #: fit keeps statistics of a fixed size (sums, moments, bounds, the largest distances),
    #: reduced across the ranks; ``"gather"`` where it keeps rows of the fit data (a bank, or a
    #: sample bounded by a cap where it has one), gathered from every rank onto every rank.
    across_ranks = "reduce"

    def __init__(self) -> None:
        self.fitted = False

    def set_memory_limit(self, limit: Any) -> None:
        """The most memory this detector's fit may take, in bytes (``None``: no limit); checked
        now, applied when the fit starts (:mod:`._memory`). :func:`jem_plugin.ood.detector`'s
        ``memory_limit`` calls it."""
        _memory.set_limit(self, limit)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options().items())
        return f"{type(self).__name__}({options}{', fitted' if self.fitted else ''})"

    def _options(self) -> dict[str, Any]:
        return {}

    @property
    def layers_read(self) -> list[str]:
        """The layers whose outputs it reads (``"layers"`` in :attr:`reads`), known once
        :meth:`begin_fit` has run; ``[]`` for the others."""
        return []

    @property
    def shares_forward(self) -> bool:
        """Whether it fits and scores from outputs alone (:meth:`add_outputs`,
        :meth:`score_outputs`), so that :func:`jem_plugin.ood.evaluate_all` hands it the
        outputs of a forward shared with other detectors; False where it needs the inputs
        themselves (an input gradient)."""
        return not self.needs_grad

    def fit(
        self,
        jm: Any,
        data: Any,
        *,
        batch_size: int = 256,
        progress: bool | None = None,
        input_key: str | None = None,
        distributed: bool = True,
    ) -> _FittedDetector:
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
        self.begin_fit(core, rows=_memory.rows_of(data), distributed=distributed)
        while True:
            for x, y in fit_inputs(
                core, data, batch_size=batch_size, progress=progress, input_key=input_key, desc=self._fit_desc()
            ):
                self._saw_inputs(x)
                self.add_outputs(forward_outputs(core, x, self.reads, self.layers_read), y)
            if self.end_fit(core):
                return self

    def fit_outputs(self, jm: Any, data: Any, *, distributed: bool = True) -> _FittedDetector:
        """Fit from outputs already computed (pytorch-ood's ``fit_features``): ``data`` is one
        ``(outputs, labels)`` pair for the whole set (:class:`~jem_plugin.ood.Outputs`, labels
        ``[N]`` or ``None``), a lone :class:`~jem_plugin.ood.Outputs`, or an iterable of such
        batches (iterable twice for ``openmax``); returns ``self``. ``jm``: the network they came
        from (the head of ``react`` and ``vim``, the default layers of the multi-layer ones).
        The outputs hold what :attr:`reads` names (:func:`jem_plugin.ood.outputs` computes them).
        ``distributed``: as for :meth:`fit` (``data``: this rank's outputs)."""
        core = as_jem(jm, f"{self.name}.fit_outputs")
        if not self.shares_forward:
            raise ValueError(
                f"{self.name} fits from the inputs themselves (an input gradient), not from outputs: "
                "fit it with .fit(jm, data)"
            )
        if isinstance(data, Outputs) or (isinstance(data, tuple) and data and isinstance(data[0], Outputs)):
            data = [data]
        self._check_reiterable(data)
        self.begin_fit(core, rows=_memory.rows_of(data), distributed=distributed)
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

        ``rows``: how many fit rows will come, where known (for the memory check of a detector
        whose statistics grow with the data: :mod:`._memory`, which refuses a fit over the
        detector's ``memory_limit`` here or on the first batch, before it allocates).
        ``distributed`` (default): where a ``torch.distributed`` process group of several ranks
        is initialised (``torchrun``), each rank streams its own shard and :meth:`end_fit`
        combines the ranks' statistics before the fit finishes (sums and moments all-reduced,
        bounds min/max-reduced, banks and samples gathered): a collective, so every rank must
        fit the same detectors in the same order, and each must have data. ``False``: this
        rank's data alone."""
        core = as_jem(jm, f"{self.name}.fit")
        _memory.check_fit(self, core, rows)
        self._fit_across_ranks = bool(distributed) and get_world_size() > 1
        self._begin(core)

    def add_outputs(self, outputs: Outputs, y: Tensor | None = None) -> None:
        """Add one batch of in-distribution outputs (and its labels, ``[B]`` or ``None``) to the fit."""
        _memory.check_batch(self, outputs)
        with torch.no_grad():
            feats, logits = self._take(outputs)
            self._add(feats.float(), logits.float(), y)

    def end_fit(self, jm: Any) -> bool:
        """End a pass over the fit data: ``True`` once fitted, ``False`` where the detector needs
        the same data streamed again (``openmax``: class means, then the distances to them)."""
        core = as_jem(jm, f"{self.name}.fit")
        if self.__dict__.get("_fit_across_ranks"):
            from ._distributed import combine_ranks  # only under a process group of several ranks

            combine_ranks(self)
        if self._another_pass(core):
            return False
        self.__dict__.pop("_fit_across_ranks", None)
        self._finish(core)
        self._fitted_now(core)
        return True

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

    def __getstate__(self) -> dict[str, Any]:
        # pickle/torch.save keep the fitted statistics, not the link to the network (a weak reference)
        state = self.__dict__.copy()
        state.pop("_fitted_on", None)
        return state

    def _fitted_now(self, core: Any) -> None:
        """Mark the detector fitted on ``core``'s network (a weak reference: the detector does not
        keep the network alive)."""
        self.fitted, self._warned_other_model = True, False
        self._fitted_on = weakref.ref(unwrap_model(core.model))

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

    def _score_outputs(self, core: Any, out: Outputs) -> Tensor:
        feats, logits = self._take(out)
        return self._score(core, feats.float(), logits.float())

    def _read(self, jm: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`_take` of the outputs of the batch ``x`` (one forward)."""
        return self._take(forward_outputs(jm, x, self.reads, self.layers_read))

    def _take(self, out: Outputs) -> tuple[Tensor, Tensor]:
        """``(features, logits)`` of a batch's outputs, what :meth:`_add` and :meth:`_score` get:
        the penultimate features, or the logits in both places for a detector of the logits alone."""
        if "features" in self.reads:
            return out.need("features", self.name), out.logits
        return out.logits, out.logits

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

    def _rank_statistics(self) -> tuple[tuple[str | tuple[str, str], str], ...] | None:
        """What this pass of the fit combines across ranks (:attr:`_rank_stats`; a detector whose
        statistics depend on the pass or its options says so here)."""
        return self._rank_stats

    # subclasses
    def _begin(self, jm: Any) -> None: ...

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        raise NotImplementedError

    def _finish(self, jm: Any) -> None: ...

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        raise NotImplementedError


class _FeatureMean(_FittedDetector):
    """Base of the detectors whose fit is the mean training feature vector, streamed in float64
    (fDBD, NCI, DICE): a subclass's ``_begin`` calls this one's, its ``_finish`` takes
    :meth:`_take_mean`."""

    _rank_stats = (("_running._sum", "sum"), ("_running._n", "sum"))

    def _begin(self, jm: Any) -> None:
        self._running = _RunningMean()

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        self._running.add(feats)

    def _take_mean(self) -> Tensor:
        """The mean of the fit data's features, once it is read."""
        mean = self._running.mean()
        del self._running
        return mean


class _RowBank(_FittedDetector):
    """Base of the detectors whose fit keeps rows of the fit data, a bank (KNN, NNGuide): the rows
    of every batch, or a uniform subsample of ``max_fit`` of them (``self.max_fit``, ``self.seed``,
    ``self.k`` set by the subclass). A bank of unknown length is refused before it outgrows the
    memory limit (:mod:`._memory`)."""

    _rank_stats = (("_sample", "sample"),)  # across ranks: the bank gathered, every rank holds it all
    across_ranks = "gather"
    max_fit: int | None
    seed: int
    k: int

    @staticmethod
    def _checked_k(k: Any) -> int:
        """``k`` if it is a positive integer (``True`` is not one), else one line saying so."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        return k

    def _options(self) -> dict[str, Any]:
        return {"k": self.k, "max_fit": self.max_fit}

    def _begin(self, jm: Any) -> None:
        self._sample = _Sample(self.max_fit, self.seed)

    def _bank_add(self, rows: Tensor) -> None:
        if self.max_fit is None:  # a bank of data of unknown length: refused before it outgrows the limit
            _memory.check_growth(self, self._sample.held + rows.shape[0])
        self._sample.add(rows)

    def _take_bank(self) -> Tensor:
        """The bank, once the fit data is read; at least ``k`` rows."""
        bank = self._sample.values()
        if bank.shape[0] < self.k:
            raise ValueError(f"{self.name} needs at least k={self.k} training inputs, the fit data has {bank.shape[0]}")
        del self._sample
        return bank


class _ClassConditional(_FittedDetector):
    """A detector fitted per class: labels from the data (``labels="true"``, ``(x, y)`` batches)
    or the model's predictions (``labels="predicted"``, for unlabelled data)."""

    labels: str

    def _set_labels(self, labels: str) -> None:
        if labels not in ("true", "predicted"):
            raise ValueError(f"labels must be 'true' (from the data) or 'predicted', got {labels!r}")
        self.labels = labels

    def _options(self) -> dict[str, Any]:
        return {"labels": self.labels}

    def _labels(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> Tensor:
        """The batch's class labels, ``long`` on the features' device, checked against the logits."""
        k = logits.shape[1]
        if self.labels == "predicted":
            y = logits.argmax(dim=1)
        elif y is None:
            raise InvalidLabelError(
                f"{self.name} is class-conditional and the fit data holds no labels: yield (x, y) "
                f"batches, or pass labels='predicted' to use the model's predictions"
            )
        y = y.to(device=feats.device, dtype=torch.long).reshape(-1)
        check_label_range(y, k, what=f"{self.name} fit labels")
        return y
