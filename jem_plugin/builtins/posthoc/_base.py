"""The streaming base of the fitted detectors and the helpers every family shares: the fit data
read batch by batch, a bounded uniform sample, the classifier head, the input step of the
gradient detectors."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ..._checks import check_label_range
from ..._detector import Detector, Estimate, FitShape
from ..._outputs import Outputs, forward_outputs
from ...distributed import rank_seed
from ...errors import InvalidLabelError, NoFeaturesError
from ...model import as_jem

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


#: The most values a bounded sample's compaction copies at a time (:meth:`_Sample._gather`).
GATHER_VALUES = 1 << 20


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
        chunk by chunk, and at most :data:`GATHER_VALUES` values at a time (indexing a chunk
        copies what it selects: of the last compaction's sample, up to the whole sample), so
        compacting holds the rows and the sample, not the rows twice."""
        order = idx.argsort()
        ends = torch.tensor([r.shape[0] for r in self.rows], device=idx.device).cumsum(0)
        cuts = torch.searchsorted(idx[order], ends).tolist()  # the kept rows of each chunk, in order
        out = self.rows[0].new_empty((idx.shape[0], *self.rows[0].shape[1:]))
        step = max(1, GATHER_VALUES // max(1, out[0].numel())) if out.shape[0] else 1
        lo, start = 0, 0
        for chunk, hi in zip(self.rows, cuts):
            for a in range(lo, hi, step):
                where = order[a : min(a + step, hi)]
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


class _FittedDetector(Detector):
    """Base of the package's fitted detectors (:class:`jem_plugin.ood.Detector`, which streams
    the fit and checks its memory), fitted and scored from ``(features, logits)``: :meth:`_take`
    reads them from a batch's outputs (cast to float32), :meth:`_add` adds them to the running
    sums, ``_finish`` turns those into the fitted state and :meth:`_score` maps them to ``[B]``
    scores, higher = in-distribution."""

    #: The penultimate features and the logits; the logits alone for a detector of the logits (it
    #: then never asks the adapter for features, so it works on models whose penultimate layer
    #: cannot be found).
    reads: frozenset[str] = frozenset({"logits", "features"})
    #: Statistics of a fixed size unless a detector says it keeps rows (``"gather"``).
    across_ranks: str | None = "reduce"
    #: The formula of the fit's peak, ``(detector, shape) -> Estimate`` (:mod:`._memory`),
    #: declared by each detector class as ``staticmethod(_memory.<formula>)``.
    _memory_formula: Callable[[Any, FitShape], Estimate | None] | None = None

    def memory_estimate(self, shape: FitShape) -> Estimate | None:
        """The peak of this detector's fit at ``shape``: its class's formula (:mod:`._memory`)."""
        return None if self._memory_formula is None else self._memory_formula(self, shape)

    def _add_outputs(self, outputs: Outputs, y: Tensor | None) -> None:
        feats, logits = self._take(outputs)
        self._add(feats.float(), logits.float(), y)

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

    # subclasses
    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        raise NotImplementedError

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
            self._check_growth(self._sample.held + rows.shape[0])
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
