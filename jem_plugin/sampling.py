"""Stochastic Gradient Langevin Dynamics on a classifier's energy (JEM, Grathwohl et al. 2019).

One step ascends the unnormalised log density and adds Gaussian noise::

    x <- x + a_t * d/dx logsumexp_y f(x)[y] + s * N(0, I)      # p(x)
    x <- x + a_t * d/dx f(x)[y]             + s * N(0, I)      # p(x|y), class-conditional

with the step size ``a_t`` and the noise ``s`` decoupled, as in JEM. Options: a decaying step size
(:mod:`jem_plugin.schedules`), proximal (gradient-clamped) updates from JEM++, clamping to the
model's input domain, a plugin hook after each step, and per call, trajectories and energies for
inspection.

SGLD writes only the step; the chain loop is :class:`~jem_plugin.chains.ChainSampler`'s, shared
with every sampler, and written to cost no more than a hand-written loop (one forward, one
input-gradient backward, one in-place update per step): parameters are frozen for the chain (no
parameter graph), the chain is updated in place, the noise buffer is reused, and nothing syncs with
the device per step unless something is recorded.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from . import _cuda_graph, hookspecs, plugins
from ._checks import check_positive
from ._colours import project_colours
from .chains import ChainSampler, SGLDDiagnostics
from .errors import InvalidInputError, JEMError
from .model import BATCHNORM_MODES, BatchNormMode
from .schedules import Constant, Poly, Schedule, as_schedule, schedule_from_dict, schedule_to_dict

if TYPE_CHECKING:  # pragma: no cover
    from .buffer import ReplayBuffer
    from .model import JEM

__all__ = ["SGLD", "SGLDStepState", "SGLDDiagnostics", "Constant", "Poly", "BATCHNORM_MODES"]

COLOURS = ("all", "data")  # SGLD(colours=...): steps move every channel, or the data's colour axes only

STEP_HOOK = hookspecs.STEP_HOOK
SGLD_REMEDIES: tuple[str, ...] = (
    "a smaller step size or fewer steps, SGLD(step_size=..., steps=...)",
    "proximal SGLD, SGLD(grad_clamp=...)",
    "the energy L2 regulariser, JEMLoss(l2_weight=...)",
    "restart training from the last good checkpoint",
)


@dataclass
class SGLDStepState:
    """What the ``jem_sgld_step`` hook sees after each update.

    ``x`` is the chain (in the model's dtype: fp32, or float64 for a float64 model; after the
    update, noise and clamp). Modify it in place, or assign a
    new tensor of the same shape to ``state.x``: the sampler continues from it.
    """

    step: int
    x: Tensor
    grad: Tensor
    step_size: float
    noise: float
    y: Tensor | None
    sampler: SGLD


@dataclass
class _SGLDRun:
    """One chain run's scratch: the noise buffer, the colour projection, the plugin hook, and the
    last gradient as applied (what the hook sees)."""

    noise: Tensor | None
    colour: Tensor | None
    hook: Any
    grad: Tensor | None = None


def _step_size(step_size: Any) -> Any:
    """``step_size`` checked: a number becomes a float; a schedule or callable is kept; plain data
    as :meth:`SGLD.state_dict` stores a schedule becomes that schedule."""
    if isinstance(step_size, Mapping):
        return schedule_from_dict(step_size)
    if callable(step_size):
        return step_size
    return check_positive("step_size", step_size)


def _spelled(step_size: Any) -> str:
    if callable(step_size) and not isinstance(step_size, (Constant, Poly)):
        return getattr(step_size, "__qualname__", "<callable>")
    return repr(step_size)


class SGLD(ChainSampler):
    """SGLD sampler for a :class:`~jem_plugin.model.JEM` (paper defaults: 20 steps, step 1, noise 0.01).

    A :class:`~jem_plugin.chains.ChainSampler`: :meth:`step` is the Langevin update above; ``run``
    and ``sample`` (checks, starts, recording, divergence, CUDA graphs) are the base class's.

    Parameters
    ----------
    steps: Langevin steps per chain (``0`` returns the start unchanged).
    step_size: ``a`` in the update, constant; or a schedule: :class:`~jem_plugin.schedules.Poly`
        (the polynomial decay of Welling & Teh, 2011, e.g. ``Poly(1.0, power=0.55, end=0.01)``),
        :class:`~jem_plugin.schedules.Constant`, or any callable ``(t, steps) -> a_t`` or
        ``t -> a_t`` for ``t = 0 .. steps-1``.
    noise: standard deviation ``s`` of the Gaussian noise added each step.
    clamp: clamp the chain to the model's input domain (per channel for normalised inputs) after
        every step.
    grad_clamp: proximal SGLD (JEM++): clamp the gradient elementwise to ``[-c, c]`` before the
        step, ``x <- x + a_t * clamp(grad, -c, c) + noise``, as JEM++'s code does
        (``t.clamp(eta, -eps, eps) * sgld_lr``; with its default ``sgld_lr = 1`` this is also a
        bound on the update). Not the gradient-norm clip of the optimiser (``OptimConfig(max_grad_norm=...)``).
    batchnorm: how the samples meet BatchNorm layers that are in train mode (one of
        :data:`BATCHNORM_MODES`). ``"joint"``: the samples share BatchNorm with the data in the
        loss's pass, and the chains normalise with the running statistics (each chain independent
        of the others). ``"separate"``: the samples are normalised by their own batch statistics,
        in the chains (running statistics untouched) and in the loss's second pass; this is how
        JEM++ samples.
    colours: ``"all"``: steps move every channel freely. ``"data"``: each step (gradient and
        noise) is projected, pixel by pixel, onto the colour axes the data vary along, read from
        the buffer at each ``sample(..., buffer=)`` (:attr:`ReplayBuffer.colour_projection
        <jem_plugin.buffer.ReplayBuffer.colour_projection>`, set when its init is fitted) and kept
        in :attr:`colour_projection` for chains run without one. Grey data in an RGB model then
        give grey chains: per-channel steps add colour speckle the energy learns to spot, and the
        chains can stall on it. Colour data use all axes: no change.
    max_energy: also raise :class:`DivergenceError` when ``|E|`` of the final chain exceeds this
        (exploding but still finite energies); ``None`` checks finiteness only.
    generator: ``torch.Generator`` for the noise, the start and the buffer draws: the same seed
        gives bitwise identical samples.
    cuda_graph: ``"auto"`` (default) runs chains on a CUDA device as one captured CUDA graph per
        step, replayed ``steps`` times (eager where capture is impossible, with a one-time warning
        saying why), and chains on any other device eagerly, without a word. ``"off"`` always runs
        eagerly; ``"require"`` raises :class:`~jem_plugin.errors.CUDAGraphError` with the reason
        instead of falling back. ``jem doctor --device cuda`` checks the graph against the eager
        chain on your GPU.

    Recording the trajectory or the energies and a progress bar are chosen per call:
    ``run``/``sample(..., record_trajectory=, record_energies=, progress=)``.

    Attributes
    ----------
    colour_projection: ``[C, C]`` matrix applied to every step over the channel dimension, or
        ``None`` (no projection); ``colours="data"`` sets it from the buffer (:meth:`use_colours_of`;
        ``None`` for data that use every colour axis, so colour images keep CUDA graphs). Set it
        yourself to confine chains run from ``x_init``.
    """

    name = "SGLD"
    remedies = SGLD_REMEDIES

    def __init__(
        self,
        steps: int = 20,
        step_size: float | Schedule | Callable[[int], float] = 1.0,
        noise: float = 0.01,
        *,
        clamp: bool = True,
        grad_clamp: float | None = None,
        batchnorm: BatchNormMode = "joint",
        colours: Literal["all", "data"] = "all",
        max_energy: float | None = None,
        generator: torch.Generator | None = None,
        cuda_graph: str = "auto",
    ) -> None:
        self.cuda_graph = _cuda_graph.check_mode(cuda_graph)
        super().__init__(steps, clamp=clamp, batchnorm=batchnorm, generator=generator)
        if colours not in COLOURS:
            raise ValueError(f"colours must be one of {COLOURS}, got {colours!r}")
        self.colours = colours
        self.colour_projection: Tensor | None = None
        self._colours_of: Tensor | None = None  # the buffer projection colour_projection was read from
        self.step_size: float | Schedule | Callable[[int], float] = _step_size(step_size)
        self.noise = check_positive("noise", noise, allow_zero=True)
        self.grad_clamp = None if grad_clamp is None else check_positive("grad_clamp", grad_clamp)
        self.max_energy = None if max_energy is None else check_positive("max_energy", max_energy)

    def __repr__(self) -> str:
        extra = f", grad_clamp={self.grad_clamp}" if self.grad_clamp is not None else ""
        if self.batchnorm != "joint":
            extra += f", batchnorm={self.batchnorm!r}"
        if self.colours != "all":
            extra += f", colours={self.colours!r}"
        return (
            f"SGLD(steps={self.steps}, step_size={_spelled(self.step_size)}, noise={self.noise}{extra}, "
            f"clamp={self.clamp})"
        )

    # ------------------------------------------------------------------ schedule
    def step_sizes(self, jm: Any = None) -> list[float]:
        """The step size of every step, ``a_0 .. a_{steps-1}`` (the same for every model)."""
        step_size, t_max = self.step_size, self.steps
        schedule = as_schedule(step_size)
        sizes = [float(schedule(t, t_max)) for t in range(t_max)]
        if not isinstance(schedule, (Constant, Poly)):  # those are checked when made
            bad = [(t, a) for t, a in enumerate(sizes) if not (math.isfinite(a) and a > 0)]
            if bad:
                raise ValueError(f"the step_size callable must return finite values > 0; got {bad[:3]}")
        return sizes

    # ------------------------------------------------------------------ the step
    def prepare(self, jm: JEM, x: Tensor) -> _SGLDRun:
        """The noise buffer (reused every step), the colour projection on the chain's device, and
        whether a ``jem_sgld_step`` plugin hook runs (checked once per run)."""
        hook = plugins.get_plugin_manager().hook.jem_sgld_step if plugins.has_implementations(STEP_HOOK) else None
        noise = torch.empty_like(x) if self.noise > 0 else None
        return _SGLDRun(noise=noise, colour=self._colour_matrix(x, x.dtype), hook=hook)

    def step(self, x: Tensor, grad: Tensor, size: float | Tensor, state: _SGLDRun) -> None:
        """``x <- x + size * grad (clamped to grad_clamp, projected on the colour axes) + noise * N(0, I)``."""
        if self.grad_clamp is not None:
            grad.clamp_(-self.grad_clamp, self.grad_clamp)
        colour = state.colour
        if colour is not None:
            grad = project_colours(grad, colour)
        if isinstance(size, Tensor):  # inside a CUDA graph: the step size is a device scalar
            x.addcmul_(grad, size)
        else:
            x.add_(grad, alpha=size)
        if state.noise is not None:
            z = state.noise.normal_(generator=self.generator)
            x.add_(z if colour is None else project_colours(z, colour), alpha=self.noise)
        state.grad = grad

    def after_step(self, t: int, x: Tensor, size: float, y: Tensor | None, state: _SGLDRun) -> None:
        """The ``jem_sgld_step`` plugin hook, when a plugin implements it."""
        if state.hook is None:
            return
        assert state.grad is not None  # set by step, which ran before
        step_state = SGLDStepState(t, x, state.grad, size, self.noise, y, self)
        state.hook(state=step_state)
        if step_state.x is not x:
            x.copy_(step_state.x)

    def wants_eager(self) -> str | None:
        if self.colour_projection is not None:
            return (
                "the colour projection of SGLD(colours='data') on data with fewer colour axes than channels is "
                "not part of the captured step yet"
            )
        return None

    def graph_key(self) -> tuple:
        return (self.noise, self.grad_clamp)

    def draws_noise(self) -> bool:
        return self.noise > 0

    def use_buffer(self, buffer: Any) -> None:
        """With ``colours="data"``, read the colour axes of the buffer's data (:meth:`use_colours_of`)."""
        if self.colours == "data":
            self.use_colours_of(buffer)

    def use_colours_of(self, buffer: ReplayBuffer) -> None:
        """Confine steps to the colour axes of the data ``buffer`` was fitted on (what
        ``colours="data"`` does at each ``sample(..., buffer=)``); no projection when they are all."""
        p = getattr(buffer, "colour_projection", None)
        if p is None:
            raise JEMError(
                "SGLD(colours='data') confines steps to the colour axes of the buffer's data, and this "
                "buffer has none: fit its init (buffer.fit(x, y), or FitInitFromBatches) on image data "
                "[N, C, ...], or use colours='all'"
            )
        if p is not self._colours_of:  # a new fit or device: one check, not one per iteration
            self._colours_of = p
            self.colour_projection = None if torch.equal(p, torch.eye(p.shape[0], device=p.device)) else p

    def _colour_matrix(self, x: Tensor, dtype: torch.dtype) -> Tensor | None:
        """The colour projection for this chain, on its device, or ``None``."""
        p = self.colour_projection
        if p is None:
            if self.colours == "data" and self._colours_of is None:
                raise JEMError(
                    "SGLD(colours='data') has no colour axes yet: they come from the buffer at "
                    "sample(..., buffer=); set sampler.colour_projection to run chains from x_init first"
                )
            return None
        if x.dim() < 2 or tuple(p.shape) != (x.shape[1], x.shape[1]):
            raise InvalidInputError(
                f"SGLD colour_projection of shape {tuple(p.shape)} does not fit chains of shape "
                f"{tuple(x.shape)}: it needs [C, C] with C = {x.shape[1] if x.dim() > 1 else '?'} channels (dim 1)"
            )
        return p.to(device=x.device, dtype=dtype)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every constructor setting and the generator's state (plain tensors and Python values:
        ``weights_only``-loadable). A :class:`~jem_plugin.schedules.Poly` or ``Constant`` step
        size is saved as plain data (``{"kind": "poly", "start": ..., ...}``); any other callable
        step size as ``None``: it is not data."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _SETTINGS}
        step_size = self.step_size
        if isinstance(step_size, (Constant, Poly)):
            state["step_size"] = schedule_to_dict(step_size)
        elif callable(step_size):
            state["step_size"] = None
        state.update(super().state_dict())  # the generator's state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; settings it lacks (older checkpoints) keep their
        current values, and a callable step size is kept. The settings are validated together,
        as the constructor does."""
        settings = {name: getattr(self, name) for name in _SETTINGS}
        settings.update((k, state[k]) for k in _SETTINGS if k in state and k != "step_size")
        if state.get("step_size") is not None:
            stored = state["step_size"]
            settings["step_size"] = schedule_from_dict(stored) if isinstance(stored, Mapping) else float(stored)
        checked = SGLD(**settings)
        for name in _SETTINGS:
            setattr(self, name, getattr(checked, name))
        super().load_state_dict(state)  # the generator


# The settings a checkpoint carries: every constructor argument but the generator (whose state is
# saved instead), read from the signature so that a new argument cannot be left out.
_SETTINGS: tuple[str, ...] = tuple(
    name for name in inspect.signature(SGLD.__init__).parameters if name not in ("self", "generator")
)
