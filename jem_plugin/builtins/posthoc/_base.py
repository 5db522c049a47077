"""The streaming base of the fitted detectors and the helpers every family shares: the fit data
read batch by batch, a bounded uniform sample, the classifier head, the input step of the
gradient detectors."""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..._checks import (
    INPUT_KEYS,
    DomainCheck,
    check_input,
    check_label_range,
    model_device,
    same_device,
    unpack_batch,
    unwrap_model,
)
from ...errors import InvalidInputError, InvalidLabelError, NoFeaturesError, NotFittedError
from ...model import as_jem, sampling_mode

F_ = TypeVar("F_", bound=Callable[..., Any])


def describe(*, name: str, description: str, paper: str, needs_grad: bool = False) -> Callable[[F_], F_]:
    """A function score's registry entry, kept on the function as a fitted detector keeps its on
    its class: ``name``, ``needs_grad``, ``needs_fit`` (False), ``description`` and ``paper``,
    which registration reads."""

    def mark(fn: F_) -> F_:
        for key, value in (
            ("name", name),
            ("needs_grad", needs_grad),
            ("needs_fit", False),
            ("description", description),
            ("paper", paper),
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
            self.gen = torch.Generator(device=rows.device).manual_seed(self.seed)
        self.keys.append(torch.rand(rows.shape[0], generator=self.gen, device=rows.device))
        if self.held > 2 * self.capacity:
            self._compact()

    def _compact(self) -> None:
        rows, keys = torch.cat(self.rows), torch.cat(self.keys)
        if self.capacity is not None and rows.shape[0] > self.capacity:
            idx = torch.topk(keys, self.capacity, largest=False, sorted=False).indices
            rows, keys = rows[idx], keys[idx]
        self.rows, self.keys, self.held = [rows], [keys], rows.shape[0]

    def values(self) -> Tensor:
        if self.capacity is not None and self.rows:
            self._compact()
        return torch.cat(self.rows) if self.rows else torch.empty(0)


def _labelled_batches(data: Any, batch_size: int, input_key: str | None) -> tuple[Iterator, int | None, bool]:
    """``(iterator of (x, y or None), number of batches or None, data was in memory)``."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(t, Tensor) for t in data)
        and data[1].dim() == 1
        and data[0].dim() >= 2
        and data[0].shape[0] == data[1].shape[0]
    ):
        x_all, y_all = data
        return zip(x_all.split(batch_size), y_all.split(batch_size)), -(-x_all.shape[0] // batch_size), True
    if isinstance(data, Tensor):
        if data.dim() < 2:
            raise InvalidInputError(f"expected a batch of inputs [N, ...], got a tensor of shape {tuple(data.shape)}")
        return ((x, None) for x in data.split(batch_size)), -(-data.shape[0] // batch_size), True
    if not hasattr(data, "__iter__"):
        raise InvalidInputError(
            "fit data must be a tensor, an (x, y) pair of tensors or an iterable of batches (e.g. a "
            f"DataLoader), got {type(data).__name__}"
        )
    try:
        n: int | None = len(data)
    except TypeError:
        n = None
    keys = INPUT_KEYS if input_key is None else input_key
    return (unpack_batch(item, input_key=keys) for item in data), n, False


def _features_of(
    jm: Any,
    data: Any,
    *,
    batch_size: int,
    progress: bool | None,
    input_key: str | None,
    desc: str,
    read: Callable[[Any, Tensor], tuple[Tensor, Tensor]],
) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
    """``(features fp32, logits fp32, labels or None)`` of every batch of ``data``, the first two
    from ``read(jm, x)`` (a detector's :meth:`_FittedDetector._read`): the model in
    :func:`~jem_plugin.model.sampling_mode` (eval, frozen), no autograd graph, batches moved to
    the model's device."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batches, n, in_memory = _labelled_batches(data, batch_size, input_key)
    if progress is None:
        progress = not in_memory and sys.stderr.isatty()
    device, dtype, domain_check = model_device(jm), jm.param_dtype(), DomainCheck(batches=1)
    seen = 0
    with (
        sampling_mode(jm),
        torch.no_grad(),
        tqdm(total=n, desc=desc, unit="batch", disable=not progress, leave=False) as bar,
    ):
        for x, y in batches:
            if device is not None and not same_device(x.device, device):
                x = x.to(device, non_blocking=True)
            x = check_input(x, dtype=dtype, domain=jm.domain)
            domain_check(x, jm.domain, desc, stacklevel=4)
            feats, logits = read(jm, x)
            seen += x.shape[0]
            yield feats.float(), logits.float(), None if y is None else y.to(feats.device)
            bar.update(1)
    if not seen:
        raise InvalidInputError(f"{desc}: no inputs to fit on, the data is empty")


def _features_and_logits(jm: Any, x: Tensor, features: bool) -> tuple[Tensor, Tensor]:
    """``jm.features(x)``, or ``(logits, logits)`` for a detector that reads the logits alone."""
    if features:
        return jm.features(x)
    logits = jm(x)
    return logits, logits


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
    """Base of the detectors fitted on in-distribution data: ``fit`` streams over the data
    (features of each batch handed to :meth:`_add`), :meth:`_finish` turns the running sums
    into the fitted state, ``score`` maps a batch to ``[B]`` scores, higher = in-distribution."""

    #: What the registry says of the detector (registration reads these, :mod:`.`): its score
    #: name, whether it takes input gradients or a fit, a one-line description and its paper.
    name = "detector"
    needs_grad = False
    needs_fit = True
    description = ""
    paper = ""
    #: False for a detector of the logits alone: it then never asks the adapter for features, so
    #: it works on models whose penultimate layer cannot be found (a convolutional head).
    uses_features = True

    def __init__(self) -> None:
        self.fitted = False

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self._options().items())
        return f"{type(self).__name__}({options}{', fitted' if self.fitted else ''})"

    def _options(self) -> dict[str, Any]:
        return {}

    def fit(
        self,
        jm: Any,
        data: Any,
        *,
        batch_size: int = 256,
        progress: bool | None = None,
        input_key: str | None = None,
    ) -> _FittedDetector:
        """Fit on in-distribution ``data`` (a DataLoader or iterable of batches, a tensor, or an
        ``(x, y)`` pair of tensors), streaming batch by batch; returns ``self``.

        The model runs in eval mode with frozen parameters (restored after), without autograd.
        ``progress``: a tqdm bar over batches (default: only for an iterable on a terminal).
        """
        core = as_jem(jm, f"{self.name}.fit")
        self._begin(core)
        self._stream(core, data, self._add, batch_size=batch_size, progress=progress, input_key=input_key)
        self._finish(core)
        self._fitted_now(core)
        return self

    def _stream(
        self,
        core: Any,
        data: Any,
        add: Callable[[Tensor, Tensor, Tensor | None], None],
        *,
        batch_size: int,
        progress: bool | None,
        input_key: str | None,
        desc: str | None = None,
    ) -> None:
        """One pass over ``data``: ``add(features, logits, labels or None)`` per batch."""
        for feats, logits, y in _features_of(
            core,
            data,
            batch_size=batch_size,
            progress=progress,
            input_key=input_key,
            desc=desc or f"fit {self.name}",
            read=self._read,
        ):
            add(feats, logits, y)

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
        """``[B]`` scores of the batch ``x``, higher = more in-distribution (no autograd graph).
        The model runs in the mode it is in; :func:`jem_plugin.ood.score` puts it in eval mode."""
        core = as_jem(jm, f"{self.name}.score")
        self._check_fitted(core)
        with torch.no_grad():
            feats, logits = self._read(core, x)
            return self._score(core, feats.float(), logits.float())

    def _read(self, jm: Any, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(features, logits)`` of a batch, what :meth:`_add` and :meth:`_score` get: the
        penultimate features, or the logits in both places for a detector of the logits alone
        (it then works on a model whose features cannot be read)."""
        return _features_and_logits(jm, x, self.uses_features)

    # subclasses
    def _begin(self, jm: Any) -> None: ...

    def _add(self, feats: Tensor, logits: Tensor, y: Tensor | None) -> None:
        raise NotImplementedError

    def _finish(self, jm: Any) -> None: ...

    def _score(self, jm: Any, feats: Tensor, logits: Tensor) -> Tensor:
        raise NotImplementedError


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
