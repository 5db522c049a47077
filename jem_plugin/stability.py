"""Detect JEM training divergence and deal with it: raise with the remedies, or roll back.

Divergence is the top complaint against the reference JEM code: energies explode or turn NaN
after a few epochs and the script stops with ``1/0``. The authors' own advice
(wgrathwohl/JEM#4; paper appendix) is to restart from the last good checkpoint, lower the
learning rate, use more/smaller SGLD steps, or add a small L2 penalty on the energy.
:class:`DivergenceGuard` automates exactly that.

>>> guard = DivergenceGuard(jm, opt, loss_fn=loss_fn, policy="rollback")
>>> for x, y in loader:
...     with guard:                       # a DivergenceError inside is handled by the policy
...         out = loss_fn(jm, x, y)       # (the sampler raises one for non-finite chains)
...         guard.check(out)              # non-finite / exploding loss or energies -> DivergenceError
...         opt.zero_grad(); out.loss.backward(); opt.step()

Without the ``with`` block, ``if not guard.check(out): continue`` does the same for the checks on
``out`` (``check`` returns ``False`` when it rolled back: skip that batch); a ``DivergenceError``
raised by the sampler inside ``loss_fn`` then reaches the caller, so prefer the ``with`` block.

Policies
--------
``"raise"``: raise :class:`~jem_plugin.errors.DivergenceError` naming the iteration, the values
and the remedies. No snapshots are taken (no cost).

``"rollback"``: every ``snapshot_every`` healthy iterations, copy the state dicts of the model,
the optimizer, the loss (replay buffer, sampler, its generator) and the LR scheduler (one copy
of each, kept on ``snapshot_device``). On divergence, restore them bit for bit, apply safer
settings, warn, and go on; after ``max_rollbacks`` rollbacks raise. The safer settings
(``remedies``), applied cumulatively at each rollback:

* ``"l2"``: ``loss_fn.l2_weight`` becomes 0.1 if it was 0 (the strength the first author
  suggests), else doubles;
* ``"sgld_step"``: the sampler's step size (every step of its schedule) is halved;
* ``"lr"``: every optimizer param group's ``lr`` is halved, and the scheduler's ``base_lrs`` if
  a ``scheduler`` is given (schedulers that set the LR each step would undo it otherwise).

The global RNG is deliberately *not* rolled back, so the retried iterations see new noise (the
authors restarted "with a different random seed").

What counts as a divergence is one frozen :class:`GuardLimits` value:

>>> guard = DivergenceGuard(jm, opt, loss_fn=loss_fn, limits=GuardLimits(max_abs_energy=1e3, explode_factor=10))
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .errors import DivergenceError
from .losses import LossOutput
from .sampling import SGLD
from .schedules import Constant, Poly, as_schedule

__all__ = ["DivergenceGuard", "GuardLimits", "POLICIES", "REMEDIES", "DIVERGENCE_REMEDIES"]

POLICIES = ("raise", "rollback")
REMEDIES = ("l2", "sgld_step", "lr")
ENERGY_KEYS = ("energy_data", "energy_sample")

# What helps against a diverged training run: DivergenceError.remedies of the guard's errors.
DIVERGENCE_REMEDIES: tuple[str, ...] = (
    "add the energy L2 regulariser, JEMLoss(l2_weight=0.1) up to 1.0 (the authors' fix)",
    "use fewer or smaller SGLD steps, SGLD(step_size=..., steps=...), or proximal SGLD, SGLD(grad_clamp=...)",
    "lower the learning rate",
    "restart from the last good checkpoint (jem_plugin.checkpoint.Checkpointer(...).resume(...))",
    "let DivergenceGuard(..., policy='rollback') do (1)-(4) automatically",
)


def _copy_state(obj: Any, device: torch.device | None) -> Any:
    """Deep copy of a (nested) state dict; tensors are cloned (to ``device`` if given)."""
    if isinstance(obj, Tensor):
        t = obj.detach()
        return t.to(device, copy=True) if device is not None else t.clone()
    if isinstance(obj, Mapping):
        # Any: a dict subclass (a module state dict's OrderedDict) that may carry attributes
        out: Any = (
            type(obj)((k, _copy_state(v, device)) for k, v in obj.items())
            if isinstance(obj, dict)
            else {k: _copy_state(v, device) for k, v in obj.items()}
        )
        if hasattr(obj, "_metadata"):  # torch's module state dicts carry per-module versions
            out._metadata = obj._metadata
        return out
    if isinstance(obj, list):
        return [_copy_state(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy_state(v, device) for v in obj)
    return obj  # numbers, strings, None: immutable


def _fmt(v: float) -> str:
    return f"{v:.4g}"


@dataclass(frozen=True)
class GuardLimits:
    """What :class:`DivergenceGuard` calls a divergence (besides any non-finite value).

    max_abs_energy: ``|mean energy|`` of data or samples above this is a divergence (the reference
        script gave up at ``|loss| > 1e8``; healthy JEM energies are in the tens to hundreds).
    explode_factor: also a divergence when the ``|energy|`` exceeds ``explode_factor`` times the
        running median of the last ``window`` healthy iterations (and at least ``explode_factor``),
        once ``min_history`` iterations are recorded. ``None`` (default) turns it off.
    window, min_history: the running median's length, and the iterations it needs first.
    """

    max_abs_energy: float = 1e4
    explode_factor: float | None = None
    window: int = 200
    min_history: int = 20

    def __post_init__(self) -> None:
        if not (self.max_abs_energy > 0):
            raise ValueError(f"max_abs_energy must be > 0, got {self.max_abs_energy}")
        if self.explode_factor is not None and not self.explode_factor > 1:
            raise ValueError(f"explode_factor must be > 1 (or None), got {self.explode_factor}")
        if self.window < 1 or self.min_history < 0:
            raise ValueError(f"window must be >= 1 and min_history >= 0, got {self.window} and {self.min_history}")
        object.__setattr__(self, "max_abs_energy", float(self.max_abs_energy))


@runtime_checkable
class _Tunable(Protocol):
    """The knobs the ``"l2"`` and ``"sgld_step"`` remedies turn: :class:`~jem_plugin.losses.JEMLoss`'s,
    or those of a loss of the user's own that has the same two."""

    l2_weight: float
    sampler: Any


class DivergenceGuard:
    """Watch a JEM training run for divergence; raise with the remedies or roll back.

    Parameters
    ----------
    model: the module being trained (a :class:`~jem_plugin.JEM` or the bare model).
    optimizer: its optimizer (restored on rollback; its ``lr`` is lowered by the ``"lr"`` remedy).
    loss_fn: the :class:`~jem_plugin.losses.JEMLoss` (its replay buffer and sampler are restored;
        its ``l2_weight`` and sampler step size are the ``"l2"``/``"sgld_step"`` remedies). Not
        needed separately when it is a submodule of ``model`` (``GenerativeLossMixin``).
    policy: ``"raise"`` or ``"rollback"`` (see the module docs).
    limits: what counts as a divergence, :class:`GuardLimits` (default: ``|energy| > 1e4``).
    snapshot_every: healthy iterations between snapshots (policy ``"rollback"``).
    max_rollbacks: rollbacks allowed before raising.
    remedies: which safer settings a rollback applies (subset of ``("l2", "sgld_step", "lr")``).
    scheduler: an LR scheduler to restore and (``"lr"`` remedy) scale with the optimizer.
    snapshot_device: keep snapshots there (e.g. ``"cpu"`` to save accelerator memory); default:
        where the tensors are (fastest).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        loss_fn: nn.Module | None = None,
        policy: str = "raise",
        limits: GuardLimits = GuardLimits(),
        snapshot_every: int = 50,
        max_rollbacks: int = 3,
        remedies: Iterable[str] = REMEDIES,
        scheduler: Any = None,
        snapshot_device: str | torch.device | None = None,
    ) -> None:
        if not isinstance(limits, GuardLimits):
            raise TypeError(f"DivergenceGuard: limits must be a GuardLimits, got {type(limits).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        remedies = tuple(remedies)
        unknown = [r for r in remedies if r not in REMEDIES]
        if unknown:
            raise ValueError(f"unknown remedies {unknown}; choose from {REMEDIES}")
        if snapshot_every < 1 or max_rollbacks < 0:
            raise ValueError("snapshot_every must be >= 1 and max_rollbacks >= 0")
        if policy == "rollback" and optimizer is None:
            raise ValueError("policy='rollback' needs the optimizer, to restore its state")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.policy = policy
        self.limits = limits
        self.snapshot_every = snapshot_every
        self.max_rollbacks = max_rollbacks
        self.remedies = remedies
        self.snapshot_device = torch.device(snapshot_device) if snapshot_device is not None else None
        self.iteration = 0  # check() calls so far
        self.rollbacks = 0
        self.snapshot_iteration: int | None = None  # iteration of the snapshot we would restore
        self.applied: list[str] = []  # human-readable log of the remedies applied
        self._history: deque[float] = deque(maxlen=limits.window)
        self._depth = 0  # nesting of `with guard:` blocks
        self.last_event: dict[str, Any] = {}  # what the last rollback did (for logs)
        self._snapshot: dict[str, Any] | None = None
        self._raised: DivergenceError | None = None  # the error this guard let through last
        # A loss owned by the model (GenerativeLossMixin) is saved and restored with it.
        self._loss_separate = loss_fn is not None and not any(m is loss_fn for m in model.modules())

    # ------------------------------------------------------------------ detection
    @staticmethod
    def _metrics(out: Any) -> dict[str, float]:
        if isinstance(out, LossOutput):
            return dict(out.metrics)
        if isinstance(out, Mapping):
            return {k: float(v) for k, v in out.items()}
        if isinstance(out, Tensor):
            return {"loss": float(out.detach())}
        return {"loss": float(out)}

    def _problem(self, metrics: dict[str, float]) -> str | None:
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            return f"non-finite {', '.join(bad)}"
        energies = {k: abs(metrics[k]) for k in ENERGY_KEYS if k in metrics}
        if not energies:
            return None
        name, worst = max(energies.items(), key=lambda kv: kv[1])
        limits = self.limits
        if worst > limits.max_abs_energy:
            return f"|{name}| = {_fmt(worst)} exceeds max_abs_energy={_fmt(limits.max_abs_energy)}"
        if limits.explode_factor is not None and len(self._history) >= limits.min_history:
            median = statistics.median(self._history)
            limit = limits.explode_factor * max(median, 1.0)
            if worst > limit:
                return (
                    f"|{name}| = {_fmt(worst)} jumped above {limits.explode_factor}x the running "
                    f"median {_fmt(median)} of the last {len(self._history)} iterations"
                )
        return None

    def before_step(self, iteration: int) -> None:
        """Align the guard's iteration counter with the training loop's (optional)."""
        self.iteration = int(iteration)

    def check(self, out: Any, metrics: Mapping[str, float] | None = None, *, iteration: int | None = None) -> bool:
        """Inspect one iteration, before its backward and optimizer step; ``True`` when healthy.

        ``out`` is the :class:`~jem_plugin.losses.LossOutput` (or a loss tensor/float, with the
        metrics dict as ``metrics``). Non-finite values or exploding energies are a divergence:

        * policy ``"raise"``: :class:`DivergenceError` naming the iteration, values and remedies;
        * policy ``"rollback"``: restore the last snapshot, apply the safer settings, warn and return
          ``False`` (skip this batch). Inside ``with guard:`` it raises instead, so the rest of the
          block (the backward and optimizer step on the diverged loss) is skipped, and the guard's
          exit does the rollback.

        On a healthy iteration a snapshot is taken when one is due (policy ``"rollback"``). Reads
        the metrics' python floats: no device sync beyond the one ``JEMLoss`` already did.
        """
        if iteration is not None:
            self.iteration = int(iteration)
        try:
            self._check(out, metrics)
        except DivergenceError as exc:
            if self._depth > 0:
                raise  # the with-block's __exit__ applies the policy
            self._handle(exc)
            return False
        return True

    def _check(self, out: Any, metrics: Mapping[str, float] | None) -> None:
        it = self.iteration
        self.iteration += 1
        metrics = dict(metrics) if metrics is not None else self._metrics(out)
        if "loss" not in metrics and (isinstance(out, (Tensor, float, int))):
            metrics["loss"] = float(out.detach()) if isinstance(out, Tensor) else float(out)
        problem = self._problem(metrics)
        if problem is not None:
            shown = {k: metrics[k] for k in ("loss", *ENERGY_KEYS) if k in metrics}
            energies = [abs(metrics[k]) for k in ENERGY_KEYS if k in metrics]
            energy = (max(energies) if all(map(math.isfinite, energies)) else math.nan) if energies else None
            raise DivergenceError(problem, remedies=DIVERGENCE_REMEDIES, iteration=it, energy=energy, metrics=shown)
        energies = [abs(metrics[k]) for k in ENERGY_KEYS if k in metrics]
        if energies:
            self._history.append(max(energies))
        if self.policy == "rollback" and (
            self.snapshot_iteration is None or it - self.snapshot_iteration >= self.snapshot_every
        ):
            self.snapshot(it)

    def step(self, out: Any, metrics: Mapping[str, float] | None = None) -> bool:
        """``check`` outside a ``with guard:`` block: ``True`` to go on with this batch, ``False``
        after a rollback (skip the batch's backward and optimizer step)."""
        depth, self._depth = self._depth, 0
        try:
            return self.check(out, metrics)
        finally:
            self._depth = depth

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> DivergenceGuard:
        self._depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._depth -= 1
        if exc is None or not isinstance(exc, DivergenceError):
            return False
        self._handle(exc)  # re-raises under policy "raise" or after max_rollbacks
        return True  # rolled back: swallow the error, skip the rest of the block

    def _final(self, exc: DivergenceError) -> DivergenceError:
        """Mark ``exc`` as this guard's last word: raised again as is if it comes back (``with``)."""
        self._raised = exc
        return exc

    def _handle(self, exc: DivergenceError) -> None:
        if exc is self._raised:
            raise exc
        if exc.iteration is None:
            # Raised before check() (the sampler's non-finite chains): count the iteration and
            # say where it happened and what helps, in the guard's terms.
            it = self.iteration
            self.iteration += 1
            wrapped = DivergenceError(
                exc.reason, remedies=DIVERGENCE_REMEDIES, iteration=it, energy=exc.energy, metrics=exc.metrics
            )
            wrapped.__cause__ = exc
            exc = wrapped
        if self.policy == "raise":
            raise self._final(exc)
        if self._snapshot is None:
            raise self._final(
                DivergenceError(
                    f"{exc.reason}; could not roll back: no healthy iteration was seen yet, so there is no snapshot",
                    remedies=exc.remedies,
                    iteration=exc.iteration,
                    energy=exc.energy,
                    metrics=exc.metrics,
                )
            ) from exc
        if self.rollbacks >= self.max_rollbacks:
            raise self._final(
                DivergenceError(
                    f"{exc.reason}; diverged again after {self.rollbacks} rollbacks to the snapshot of "
                    f"iteration {self.snapshot_iteration} (safer settings applied: "
                    f"{'; '.join(self.applied) or 'none'})",
                    remedies=exc.remedies,
                    iteration=exc.iteration,
                    energy=exc.energy,
                    metrics=exc.metrics,
                )
            ) from exc
        self.rollback()
        changes = self._apply_remedies()
        self.rollbacks += 1
        self.applied.extend(changes)
        where = f"JEM training diverged at iteration {exc.iteration}: " if exc.iteration is not None else ""
        self.last_event = {
            "problem": exc.reason,
            "diverged_at": exc.iteration,
            "restored_iteration": self.snapshot_iteration,
            "rollbacks": self.rollbacks,
            "changes": list(changes),
        }
        warnings.warn(
            f"jem-plugin: {where}{exc.reason}. Rolled back to the snapshot of "
            f"iteration {self.snapshot_iteration} (rollback {self.rollbacks}/{self.max_rollbacks}); "
            f"safer settings: {', '.join(changes) or 'none (remedies=())'}.",
            RuntimeWarning,
            stacklevel=3,
        )
        # The restored state plus the new settings is the new "last good" state: a later rollback
        # keeps the remedies (the sampler's step size and the lr live in the saved states).
        self.snapshot(self.snapshot_iteration)

    # ------------------------------------------------------------------ snapshots
    def _objects(self) -> dict[str, Any]:
        objs: dict[str, Any] = {"model": self.model}
        if self.optimizer is not None:
            objs["optimizer"] = self.optimizer
        if self._loss_separate:
            objs["loss_fn"] = self.loss_fn
        if self.scheduler is not None:
            objs["scheduler"] = self.scheduler
        return objs

    def snapshot(self, iteration: int | None = None) -> None:
        """Copy the current state of every watched object (done automatically by :meth:`check`)."""
        self._snapshot = {
            name: _copy_state(obj.state_dict(), self.snapshot_device) for name, obj in self._objects().items()
        }
        self.snapshot_iteration = self.iteration if iteration is None else iteration

    def rollback(self) -> None:
        """Restore the last snapshot bit for bit (model, optimizer, loss state, scheduler)."""
        if self._snapshot is None:
            raise DivergenceError("no snapshot to roll back to yet")
        for name, obj in self._objects().items():
            # Load copies: optimizers keep the tensors they are given, and must not alias the snapshot.
            obj.load_state_dict(_copy_state(self._snapshot[name], None))

    # ------------------------------------------------------------------ remedies
    def _loss(self) -> _Tunable | None:
        """The JEM loss whose settings the remedies change: ``loss_fn``, or the model's ``jem_loss``
        submodule (where :class:`~jem_plugin.integrations.mixin.GenerativeLossMixin` keeps it; read
        by name, so the core needs no integration)."""
        loss_fn = self.loss_fn
        if loss_fn is None:
            loss_fn = self.model._modules.get("jem_loss")
        return loss_fn if isinstance(loss_fn, _Tunable) else None

    def _apply_remedies(self) -> list[str]:
        changes: list[str] = []
        loss_fn = self._loss()
        if "l2" in self.remedies and loss_fn is not None:
            old = float(loss_fn.l2_weight)
            loss_fn.l2_weight = 0.1 if old == 0 else 2 * old
            changes.append(f"l2_weight {_fmt(old)} -> {_fmt(loss_fn.l2_weight)}")
        sampler = loss_fn.sampler if loss_fn is not None else None
        if "sgld_step" in self.remedies and isinstance(sampler, SGLD):
            old_step = sampler.step_size
            if isinstance(old_step, (Constant, Poly)):  # a schedule of jem_plugin.schedules: it stays one (and data)
                sampler.step_size = old_step.scaled(0.5)
                changes.append(f"SGLD step_size {old_step!r} -> {sampler.step_size!r}")
            elif callable(old_step):
                sampler.step_size = _Halved(old_step)
                changes.append("SGLD step size schedule x0.5")
            else:
                sampler.step_size = 0.5 * float(old_step)
                changes.append(f"SGLD step_size {_fmt(float(old_step))} -> {_fmt(sampler.step_size)}")
        if "lr" in self.remedies and self.optimizer is not None:
            olds = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = 0.5 * g["lr"]
                if "initial_lr" in g:
                    g["initial_lr"] = 0.5 * g["initial_lr"]
            # a user's scheduler: torch's LRScheduler has base_lrs, other schedulers may not
            if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                self.scheduler.base_lrs = [0.5 * b for b in self.scheduler.base_lrs]
            changes.append(
                f"lr {_fmt(float(olds[0]))} -> {_fmt(float(olds[0]) * 0.5)}"
                + (" (all groups x0.5)" if len(olds) > 1 else "")
            )
        return changes

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters and the remedies applied (not the snapshot: a resumed run takes a new one).

        The sampler's step size and the learning rate are already in the sampler's and the
        optimizer's own state; ``l2_weight`` is not in ``JEMLoss.state_dict()``, so it is kept here.
        """
        loss_fn = self._loss()
        return {
            "iteration": self.iteration,
            "rollbacks": self.rollbacks,
            "applied": list(self.applied),
            "history": list(self._history),
            "l2_weight": float(loss_fn.l2_weight) if self.rollbacks and loss_fn is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.iteration = int(state["iteration"])
        self.rollbacks = int(state["rollbacks"])
        self.applied = list(state.get("applied", []))
        self._history.clear()
        self._history.extend(state.get("history", []))
        self._snapshot, self.snapshot_iteration = None, None
        loss_fn = self._loss()
        if state.get("l2_weight") is not None and loss_fn is not None:
            loss_fn.l2_weight = float(state["l2_weight"])


class _Halved:
    """A step-size schedule scaled by 0.5 (picklable, unlike a lambda)."""

    def __init__(self, fn) -> None:
        self.fn = as_schedule(fn)  # a t -> a_t function or a (t, steps) -> a_t schedule

    def __call__(self, t: int, steps: int) -> float:
        return 0.5 * float(self.fn(t, steps))
