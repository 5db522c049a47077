"""What a recipe adds to training beyond the loss, as explicit objects :func:`~jem_plugin.training.fit` runs.

An :class:`Extension` is called at named points of a run: once before the first step
(:meth:`~Extension.on_fit_start`), before every step with the batch (:meth:`~Extension.on_batch`),
around the optimiser step (:meth:`~Extension.run_step`, at most one extension per run takes it) and
once after the last step (:meth:`~Extension.on_fit_end`). Nothing here happens behind the loss's
back: a loop of your own calls the same methods, or leaves out what it does not want.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

from ._checks import model_device, unpack_batch, unwrap_parallel
from .distributed import average_batchnorm_statistics, is_main_process
from .sam import SAM

if TYPE_CHECKING:  # only for annotations: training imports this module
    from ._train_state import TrainState

__all__ = ["Extension", "SharpnessAware", "RecomputeBatchNorm", "Decision"]


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

    def on_fit_end(self, state: TrainState, loader: Iterable) -> None:
        """After the last step of a complete run."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


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


def _held_out(jm: nn.Module, data: Any) -> tuple[Tensor, Tensor]:
    """Logits and labels of ``jm`` (eval mode) on ``(x, y)`` tensors or a loader of batches."""
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
    before = _accuracy_nll(*_held_out(jm, held_out)) if scored else None
    update_bn(loader, jm, device=model_device(jm))
    average_batchnorm_statistics(jm)  # each rank saw its own shard
    n, after = 0, None
    if scored:
        logits, labels = _held_out(jm, held_out)
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
