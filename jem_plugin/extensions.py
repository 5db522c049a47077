"""What a recipe adds to training beyond the loss, as explicit objects :func:`~jem_plugin.training.fit` runs.

An :class:`Extension` is called at named points of a run: once before the first step
(:meth:`~Extension.on_fit_start`), before every step with the batch (:meth:`~Extension.on_batch`),
around the optimiser step (:meth:`~Extension.run_step`, at most one extension per run takes it) and
once after the last step (:meth:`~Extension.on_fit_end`). Nothing here happens behind the loss's
back: a loop of your own calls the same methods, or leaves out what it does not want.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

if TYPE_CHECKING:  # only for annotations: training imports this module
    from ._train_state import TrainState

__all__ = ["Extension"]


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
