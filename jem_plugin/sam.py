"""Sharpness-aware minimisation for JEM training, as SADA-JEM uses it (rho 2, adaptive).

SAM (Foret et al. 2021; adaptive: ASAM, Kwon et al. 2021) takes two forward/backward passes per
iteration: the first finds the gradient ``g`` at ``w``, the weights move to the locally worst point
``w + e(w)`` (``e = rho * T^2 g / ||T g||``, ``T = |w|`` when adaptive, else 1), the second pass
takes the gradient there, and the base optimiser steps from the *restored* ``w`` with it.

Two JEM-specific rules (SADA-JEM):

- **sample once per iteration**: the second pass reuses the first pass's SGLD samples (no second
  chain, no second replay-buffer write); :meth:`SAM.step` does this when given ``loss_fn=``
  (through :meth:`JEMLoss.reusing_samples <jem_plugin.losses.JEMLoss.reusing_samples>`), or use
  that context manager yourself;
- **BatchNorm statistics frozen on the second pass**: the perturbed weights' batch must not move
  the running statistics (:func:`frozen_bn_stats`).

>>> sam = SAM(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rho=2.0, adaptive=True)
>>> def closure():
...     out = loss_fn(jm, x, y)
...     out.loss.backward()
...     return out
>>> out = sam.step(closure, model=model, loss_fn=loss_fn)   # two passes, one sampling
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from .model import frozen_bn_stats

__all__ = ["SAM", "ReusesSamples", "frozen_bn_stats", "reuse_samples"]


@runtime_checkable
class ReusesSamples(Protocol):
    """A loss that can draw once for several passes: in a ``reusing_samples()`` block, the first
    forward records its samples and later ones reuse them (:class:`~jem_plugin.losses.JEMLoss`)."""

    def reusing_samples(self) -> AbstractContextManager[Any]: ...


def _reusing(loss_fn: Any) -> AbstractContextManager[Any]:
    if not isinstance(loss_fn, ReusesSamples):
        raise TypeError(
            f"reusing the first pass's samples needs a loss with reusing_samples() (a JEMLoss); got "
            f"{type(loss_fn).__name__}: leave loss_fn out, and the second pass draws its own"
        )
    return loss_fn.reusing_samples()


def reuse_samples(loss_fn: Any) -> AbstractContextManager[Any]:
    """``loss_fn.reusing_samples()``: in the block the first forward records its samples and the
    later ones reuse them (the handle's ``replaying`` also switches by hand between the passes).
    Kept for loops written against it; new code calls the loss's method."""
    return _reusing(loss_fn)


class SAM:
    """Sharpness-aware minimisation around any ``torch.optim`` optimiser.

    Parameters
    ----------
    base_optimizer: the optimiser that makes the actual step (its ``param_groups`` are SAM's).
    rho: neighbourhood radius (SADA-JEM: 2.0 with ``adaptive=True``; plain SAM uses ~0.05).
    adaptive: ASAM's scale-invariant neighbourhood (``T = |w|``).

    Use :meth:`step` with a closure, or :meth:`first_step` / :meth:`second_step` in your own loop.
    Learning-rate schedulers attach to ``base_optimizer``.
    """

    def __init__(self, base_optimizer: torch.optim.Optimizer, rho: float = 2.0, adaptive: bool = True) -> None:
        if not isinstance(base_optimizer, torch.optim.Optimizer):
            raise TypeError(f"SAM wraps a torch.optim.Optimizer, got {type(base_optimizer).__name__}")
        if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
            raise ValueError(f"rho must be a finite number > 0, got {rho!r}")
        self.base_optimizer = base_optimizer
        self.rho, self.adaptive = float(rho), bool(adaptive)
        self._saved: dict[Tensor, Tensor] = {}

    def __repr__(self) -> str:
        return f"SAM(rho={self.rho}, adaptive={self.adaptive}, base={type(self.base_optimizer).__name__})"

    @property
    def param_groups(self) -> list[dict]:
        return self.base_optimizer.param_groups

    def _params_with_grads(self) -> list[tuple[Tensor, Tensor]]:
        """``(param, param.grad)`` for every parameter that has a gradient."""
        return [(p, p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def first_step(self, zero_grad: bool = True) -> None:
        """Move the weights to ``w + e(w)`` using the gradients now in ``.grad`` (the first pass's)."""
        params = self._params_with_grads()
        if not params:
            raise RuntimeError("SAM.first_step found no gradients: call loss.backward() first")
        scaled = [(p.abs() * grad if self.adaptive else grad) for p, grad in params]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in scaled]))
        scale = self.rho / (norm + 1e-12)
        self._saved = {}
        for p, grad in params:
            e = (p.square() if self.adaptive else torch.ones_like(p)) * grad * scale
            self._saved[p] = p.detach().clone()
            p.add_(e)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = True) -> None:
        """Restore ``w`` and let the base optimiser step with the gradients taken at ``w + e(w)``."""
        if not self._saved:
            raise RuntimeError("SAM.second_step without first_step: call first_step() after the first backward")
        for p, w in self._saved.items():
            p.copy_(w)
        self._saved = {}
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Callable[[], Any], *, model: nn.Module | None = None, loss_fn: Any = None) -> Any:
        """One SAM iteration: ``closure()`` (forward + backward) twice around the perturbation.

        ``model``: its BatchNorm running statistics are frozen on the second pass. ``loss_fn``: a
        :class:`~jem_plugin.JEMLoss` (any :class:`ReusesSamples` loss) whose second pass reuses the
        first pass's samples (:meth:`~jem_plugin.losses.JEMLoss.reusing_samples`). Returns the
        first pass's closure result.
        """
        if closure is None:
            raise TypeError("SAM.step needs a closure that computes the loss and calls backward()")
        ctx = _reusing(loss_fn) if loss_fn is not None else contextlib.nullcontext()
        with ctx:
            self.zero_grad()
            with torch.enable_grad():
                first = closure()
            self.first_step(zero_grad=True)
            with torch.enable_grad(), frozen_bn_stats(model):
                closure()
            self.second_step(zero_grad=True)
        return first

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"base": self.base_optimizer.state_dict(), "rho": self.rho, "adaptive": self.adaptive}

    def load_state_dict(self, state: dict) -> None:
        self.base_optimizer.load_state_dict(state["base"])
        self.rho, self.adaptive = float(state["rho"]), bool(state["adaptive"])
