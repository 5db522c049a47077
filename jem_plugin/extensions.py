"""What a run does beyond the loss, as explicit objects :func:`~jem_plugin.training.fit` runs.

An :class:`Extension` is called at named points of a run: once before the first step
(:meth:`~Extension.on_fit_start`), before every step with the batch (:meth:`~Extension.on_batch`),
around the optimiser step (:meth:`~Extension.run_step`, at most one extension per run takes it),
after every step (:meth:`~Extension.on_step_end`), after every epoch
(:meth:`~Extension.on_epoch_end`) and once after the last step (:meth:`~Extension.on_fit_end`).
Nothing here happens behind the loss's back: a loop of your own calls the same methods, or leaves
out what it does not want.

Extensions are training's one extension mechanism: a recipe's (SAM, the BatchNorm statistics
recomputed from the data) and yours (``fit(..., callbacks=[...])``, turned into extensions by
:func:`as_extension`) are called alike. Not pluggy hooks: what a run does belongs to that run (an
extension keeps state, like SAM's optimiser or the init fitted from the first batches), while a
pluggy hook is process-global and answers every run at once; pluggy stays what registers names
(adapters, scores, inits, loss terms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

from ._checks import model_device, unpack_batch, unwrap_parallel
from .buffer import ReplayBuffer
from .distributed import average_batchnorm_statistics, is_main_process
from .sam import SAM

if TYPE_CHECKING:  # only for annotations: training imports this module
    from ._train_state import TrainState

__all__ = ["Extension", "as_extension", "SharpnessAware", "RecomputeBatchNorm", "Decision", "FitInitFromBatches"]


class Extension:
    """Base class: every hook does nothing. Subclass and override the hooks you need."""

    #: Whether :meth:`run_step` replaces the plain ``backward(); optimizer.step()`` (SAM does).
    takes_step: ClassVar[bool] = False

    def on_fit_start(self, state: TrainState, loader: Iterable) -> None:
        """Before the first step of a run (also of a resumed one)."""

    def on_batch(self, state: TrainState, x: Tensor, y: Tensor) -> None:
        """Before the step on the batch ``(x, y)`` (on the model's device)."""

    def run_step(self, state: TrainState, closure: Callable[[], Any]) -> Any:
        """The optimiser step, for an extension with ``takes_step = True``: ``closure()`` computes
        the loss and its gradients and returns the loss output; return that output."""
        raise NotImplementedError(f"{type(self).__name__} does not take the optimiser step")

    def on_step_end(self, state: TrainState) -> None:
        """After every step (``state.metrics`` holds its metrics; ``state.stop = True`` stops the run)."""

    def on_epoch_end(self, state: TrainState) -> None:
        """After every epoch (``state.history`` holds its record; ``state.stop = True`` stops the run)."""

    def on_fit_end(self, state: TrainState, loader: Iterable) -> None:
        """After the last step of a complete run."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


#: The points of a run an :class:`Extension` is called at (``run_step`` aside: it replaces the step).
HOOKS = ("on_fit_start", "on_batch", "on_step_end", "on_epoch_end", "on_fit_end")


class _Methods(Extension):
    """An object that is not an :class:`Extension` but has some of its methods: those are called."""

    def __init__(self, obj: Any, methods: dict[str, Callable[..., Any]]) -> None:
        self.obj = obj
        for name, method in methods.items():
            setattr(self, name, method)  # shadows the no-op of the base class

    def __repr__(self) -> str:
        return repr(self.obj)


def as_extension(obj: Any) -> Extension:
    """``obj`` as an :class:`Extension`: itself if it is one; an object with some of the hook
    methods (``on_step_end(state)``, ``on_epoch_end(state)``, ... :data:`HOOKS`), called at those
    points; a plain callable ``fn(state)``, called at every epoch end. Anything else: ``TypeError``."""
    if isinstance(obj, Extension):
        return obj
    methods = {name: getattr(obj, name) for name in HOOKS if callable(getattr(obj, name, None))}
    if methods:
        return _Methods(obj, methods)
    if callable(obj):
        return _Methods(obj, {"on_epoch_end": obj})
    raise TypeError(
        f"a training callback is an Extension, an object with on_step_end(state) or on_epoch_end(state), "
        f"or a callable fn(state) run at each epoch end; got {type(obj).__name__}"
    )


class SharpnessAware(Extension):
    """Sharpness-aware minimisation (SADA-JEM: ``rho=2``, adaptive) around the run's optimiser.

    Each step runs the loss twice (:class:`~jem_plugin.sam.SAM`): the second pass, at the perturbed
    weights, reuses the first pass's SGLD samples and leaves BatchNorm running statistics alone.
    In your own loop: ``sam = SAM(optimizer, rho, adaptive)``; ``sam.step(closure, model=jm,
    loss_fn=loss_fn)``.
    """

    takes_step = True

    def __init__(self, rho: float = 2.0, adaptive: bool = True) -> None:
        self.rho, self.adaptive = float(rho), bool(adaptive)
        self._sam: SAM | None = None

    def run_step(self, state: TrainState, closure: Callable[[], Any]) -> Any:
        if self._sam is None or self._sam.base_optimizer is not state.optimizer:
            self._sam = SAM(state.optimizer, rho=self.rho, adaptive=self.adaptive)
        return self._sam.step(closure, model=state.jm, loss_fn=state.loss_fn)

    def __repr__(self) -> str:
        return f"SharpnessAware(rho={self.rho}, adaptive={self.adaptive})"


@dataclass(frozen=True)
class Decision:
    """One step that changes a trained model: whether it was kept, why, and the held-out numbers."""

    step: str
    kept: bool
    reason: str
    before: float | None = None
    after: float | None = None
    n_heldout: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def held_out_logits(jm: nn.Module, data: Any) -> tuple[Tensor, Tensor]:
    """Logits (float32, on the CPU) and labels of ``jm`` in eval mode on ``(x, y)`` tensors or a
    loader of labelled batches: what every keep-only-when-not-worse decision scores."""
    jm.eval()
    dev = model_device(jm) or torch.device("cpu")
    batches = (
        [(data[0][i : i + 256], data[1][i : i + 256]) for i in range(0, len(data[0]), 256)]
        if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor)
        else (unpack_batch(b, need_labels=True) for b in data)
    )
    with torch.no_grad():
        pairs = [(jm(x.to(dev)).float().cpu(), torch.as_tensor(y)) for x, y in batches]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def _agree(value: bool) -> bool:
    """Rank 0's decision on every rank (only rank 0 scores the held-out split)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


class RecomputeBatchNorm(Extension):
    """After training, recompute BatchNorm running statistics from the training data, and keep them
    only when held-out accuracy is not lower (ties broken by held-out NLL).

    JEM's joint pass mixes the samples into the running statistics that evaluation normalises data
    with. Without held-out data (``fit(val_data=)``) nothing shows the new statistics are not worse,
    so they are not kept. :attr:`decision` says what happened; ``fit`` also records it in
    ``history.events``. Under DDP each rank recomputes from its shard, the statistics are averaged,
    and rank 0's held-out verdict holds on every rank.
    """

    def __init__(self) -> None:
        self.decision: Decision | None = None

    def on_fit_end(self, state: TrainState, loader: Iterable) -> None:
        self.decision = recompute_batchnorm(unwrap_parallel(state.jm), loader, state.val_data)
        if self.decision is not None:
            state.history.events.append({"event": "post_training", **self.decision.as_dict()})


def recompute_batchnorm(jm: nn.Module, loader: Iterable, held_out: Any) -> Decision | None:
    """:class:`RecomputeBatchNorm`'s step on its own: ``None`` for a model without BatchNorm.
    ``held_out``: ``(x, y)`` tensors or a loader (rank 0's is used), or ``None``."""
    norms = [m for m in jm.modules() if isinstance(m, _BatchNorm)]
    if not norms:
        return None
    scored = held_out is not None and is_main_process()
    if held_out is None:
        return Decision(
            "bn_stats_from_data",
            False,
            "not recomputed: without a held-out split nothing shows the recomputed statistics are not worse",
        )
    was_training = jm.training
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in norms]
    before = _accuracy_nll(*held_out_logits(jm, held_out)) if scored else None
    update_bn(loader, jm, device=model_device(jm))
    average_batchnorm_statistics(jm)  # each rank saw its own shard
    n, after = 0, None
    if scored:
        logits, labels = held_out_logits(jm, held_out)
        n, after = len(labels), _accuracy_nll(logits, labels)
    keep = _agree(after is not None and before is not None and (after[0], -after[1]) >= (before[0], -before[1]))
    if not keep:
        for m, state in zip(norms, saved):
            m.load_state_dict(state)
    jm.train(was_training)
    if before is None or after is None:  # a rank other than 0: rank 0 reports
        return Decision("bn_stats_from_data", keep, "decided on rank 0")
    verdict = "kept: held-out accuracy is not lower" if keep else "discarded: held-out accuracy is lower with them"
    if before[0] == after[0]:
        verdict += f" (equal; held-out NLL {before[1]:.3f} -> {after[1]:.3f})"
    return Decision("bn_stats_from_data", keep, verdict, before[0], after[0], n)


def _accuracy_nll(logits: Tensor, labels: Tensor) -> tuple[float, float]:
    return float((logits.argmax(1) == labels).float().mean()), float(F.cross_entropy(logits, labels))


@runtime_checkable
class _HasBuffer(Protocol):
    """A loss with a replay buffer (``JEMLoss``)."""

    buffer: Any


class FitInitFromBatches(Extension):
    """Fit the replay buffer's init distribution from the first training batches.

    For an informative init (``Gaussian``) that nobody fitted: on the first batch it fits the
    init from that batch and redraws the chains; it then keeps each batch and refits (redrawing
    the chains) each time the examples it holds double, until it holds ``examples`` (``0``: one
    fit, from the first batch). Classes missing from the examples get the distribution of all of
    them. One batch of 64 gives about six examples per class, too few for the chains of a
    per-class Gaussian to move, hence the doublings. It leaves alone an init that is fitted or a
    buffer whose chains were drawn before its first batch, and stops when someone else fits the
    init (``buffer.fit``, a restored checkpoint: a checkpoint taken while it collects resumes
    with the fit so far). The examples stay on their device until then (1024 images of
    3x224x224: 0.6 GB). Fitting on the training set with ``buffer.fit(x, y)`` before training
    is still better.

    ``fit(..., callbacks=[FitInitFromBatches()])`` fits ``loss_fn.buffer``. In a loop of your
    own: ``fit_init = FitInitFromBatches(buffer)``, then ``fit_init.on_batch(None, x, y)`` before
    each step (or ``fit_init.observe(buffer, x, y)``).
    """

    def __init__(self, buffer: ReplayBuffer | None = None, *, examples: int = 1024) -> None:
        if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
            raise ValueError(f"FitInitFromBatches examples must be an int >= 0, got {examples!r}")
        self.buffer, self.examples = buffer, examples
        self._target: int | None = None  # id() of the buffer the held examples are for
        self._held: list[tuple[Tensor, Tensor]] | None = None  # None: not collecting
        self._next = 0  # refit when this many examples are held
        self._fits = 0  # the buffer's fit_count after this extension's last fit

    def on_batch(self, state: TrainState | None, x: Tensor, y: Tensor) -> None:
        """Observe the batch for the buffer given to the constructor, else ``state.loss_fn``'s."""
        buffer: Any = self.buffer
        if buffer is None and state is not None and isinstance(state.loss_fn, _HasBuffer):
            buffer = state.loss_fn.buffer
        elif buffer is None and state is None:
            raise TypeError("FitInitFromBatches.on_batch(None, x, y) needs the buffer: FitInitFromBatches(buffer)")
        if isinstance(buffer, ReplayBuffer):
            self.observe(buffer, x, y)

    def observe(self, buffer: ReplayBuffer, x: Tensor, y: Tensor | None) -> bool:
        """Take the training batch ``(x, y)`` into account for ``buffer``'s init; returns whether
        it fitted the init (and redrew the chains) now."""
        if y is None:
            return False
        if self._target != id(buffer):
            self._target, self._held = id(buffer), None
        if self._held is None:
            if buffer.has_samples or not buffer.needs_fit:
                return False
            self._held, self._next = [], 0
        elif buffer.fit_count != self._fits:  # fitted by someone else: theirs stands
            self._held = None
            return False
        # Copies: a loop may reuse its batch tensors.
        self._held.append((x.detach().clone(), y.detach().reshape(-1).long().clone()))
        held = sum(int(b.shape[0]) for b, _ in self._held)
        if held < self._next:
            return False
        x_all = torch.cat([b for b, _ in self._held])
        y_all = torch.cat([c for _, c in self._held])
        buffer.fit(x_all, y_all, missing_classes="pool")
        buffer.reset()  # the chains have barely moved yet: restart them from the better fit
        self._fits = buffer.fit_count
        if held >= self.examples:
            self._held = None  # done: the init now counts as fitted
        else:
            self._next = 2 * held
        return True

    def __repr__(self) -> str:
        return f"FitInitFromBatches(examples={self.examples})"
