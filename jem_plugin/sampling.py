"""Stochastic Gradient Langevin Dynamics on a classifier's energy (JEM, Grathwohl et al. 2019).

One step ascends the unnormalised log density and adds Gaussian noise::

    x <- x + a_t * d/dx logsumexp_y f(x)[y] + s * N(0, I)      # p(x)
    x <- x + a_t * d/dx f(x)[y]             + s * N(0, I)      # p(x|y), class-conditional

with the step size ``a_t`` and the noise ``s`` decoupled, as in JEM. Options: a decaying step size
(:mod:`jem_plugin.schedules`), proximal (gradient-clamped) updates from JEM++, clamping to the
model's input domain, a plugin hook after each step, and per call, trajectories and energies for
inspection.

The hot loop is written to cost no more than a hand-written loop (one forward, one input-gradient
backward, one in-place update per step): parameters are frozen for the chain (no parameter graph),
the chain is updated in place, the noise buffer is reused, and nothing syncs with the device per
step unless something is recorded.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import _cuda_graph, hookspecs, plugins
from ._checks import (
    DomainCheck,
    autocast_cache_off,
    check_input,
    check_label_range,
    check_labels,
    follow,
    model_device,
    restore_generator,
    same_device,
)
from ._colours import project_colours
from .errors import DivergenceError, InvalidInputError, JEMError
from .model import as_jem, input_grad_enabled, sampling_mode
from .schedules import Constant, Poly, Schedule, as_schedule, schedule_from_dict, schedule_to_dict

if TYPE_CHECKING:  # pragma: no cover
    from .buffer import ReplayBuffer
    from .model import JEM

__all__ = ["SGLD", "SGLDStepState", "SGLDDiagnostics", "Constant", "Poly"]

COLOURS = ("all", "data")  # SGLD(colours=...): steps move every channel, or the data's colour axes only
# SGLD(batchnorm=...): "joint": the samples share BatchNorm with the data in the loss (the chains
# normalised with the running statistics); "separate": the samples normalised by their own batch
# statistics, in the chains and in the loss's second pass.
BATCHNORM_MODES = ("joint", "separate")

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

    ``x`` is the chain (fp32, after the update, noise and clamp). Modify it in place, or assign a
    new tensor of the same shape to ``state.x``: the sampler continues from it.
    """

    step: int
    x: Tensor
    grad: Tensor
    step_size: float
    noise: float
    y: Tensor | None
    sampler: SGLD


@dataclass(frozen=True)
class SGLDDiagnostics:
    """What one chain run returns beside the samples (``run(..., return_diagnostics=True)``).

    A value, not state on the sampler: one ``SGLD`` may be shared by several losses, scores and
    threads, and each call gets its own diagnostics.

    steps: Langevin steps run. final_step_size: the step size of the last step (``None`` for
    0 steps). trajectory: the chain before the first and after every step (``steps + 1``
    tensors) when the call asked for ``record_trajectory=True``, else ``None``.
    energies: ``E(x)`` (``E(x, y)`` for class-conditional chains) along the chain,
    ``[steps + 1, B]``, when the call asked for ``record_energies=True``, else ``None``.
    """

    steps: int
    final_step_size: float | None
    trajectory: list[Tensor] | None = None
    energies: Tensor | None = None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_float(name: str, v: Any, allow_zero: bool = False) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}") from None
    if not math.isfinite(f) or f < 0 or (f == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {v!r}")
    return f


def _step_size(step_size: Any) -> Any:
    """``step_size`` checked: a number becomes a float; a schedule or callable is kept; plain data
    as :meth:`SGLD.state_dict` stores a schedule becomes that schedule."""
    if isinstance(step_size, Mapping):
        return schedule_from_dict(step_size)
    if callable(step_size):
        return step_size
    return _positive_float("step_size", step_size)


def _spelled(step_size: Any) -> str:
    if callable(step_size) and not isinstance(step_size, (Constant, Poly)):
        return getattr(step_size, "__qualname__", "<callable>")
    return repr(step_size)


class SGLD:
    """SGLD sampler for a :class:`~jem_plugin.model.JEM` (paper defaults: 20 steps, step 1, noise 0.01).

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

    def __init__(
        self,
        steps: int = 20,
        step_size: float | Schedule | Callable[[int], float] = 1.0,
        noise: float = 0.01,
        *,
        clamp: bool = True,
        grad_clamp: float | None = None,
        batchnorm: Literal["joint", "separate"] = "joint",
        colours: Literal["all", "data"] = "all",
        max_energy: float | None = None,
        generator: torch.Generator | None = None,
        cuda_graph: str = "auto",
    ) -> None:
        self.cuda_graph = _cuda_graph.check_mode(cuda_graph)
        if batchnorm not in BATCHNORM_MODES:
            raise ValueError(f"batchnorm must be one of {BATCHNORM_MODES}, got {batchnorm!r}")
        self.batchnorm: str = batchnorm
        if colours not in COLOURS:
            raise ValueError(f"colours must be one of {COLOURS}, got {colours!r}")
        self.colours = colours
        self.colour_projection: Tensor | None = None
        self._colours_of: Tensor | None = None  # the buffer projection colour_projection was read from
        if not _is_int(steps) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.steps = steps
        self.step_size: float | Schedule | Callable[[int], float] = _step_size(step_size)
        self.noise = _positive_float("noise", noise, allow_zero=True)
        self.clamp = bool(clamp)
        self.grad_clamp = None if grad_clamp is None else _positive_float("grad_clamp", grad_clamp)
        self.max_energy = None if max_energy is None else _positive_float("max_energy", max_energy)
        self.generator = generator

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
    def step_sizes(self) -> list[float]:
        """The step size of every step, ``a_0 .. a_{steps-1}``."""
        step_size, t_max = self.step_size, self.steps
        schedule = as_schedule(step_size)
        sizes = [float(schedule(t, t_max)) for t in range(t_max)]
        if not isinstance(schedule, (Constant, Poly)):  # those are checked when made
            bad = [(t, a) for t, a in enumerate(sizes) if not (math.isfinite(a) and a > 0)]
            if bad:
                raise ValueError(f"the step_size callable must return finite values > 0; got {bad[:3]}")
        return sizes

    # ------------------------------------------------------------------ chains
    @staticmethod
    def _check_y(jm: JEM, y: Any, batch: int, device) -> Tensor:
        y = check_labels(y, batch, num_classes=jm.num_classes, device=device, what="y (one class per chain)")
        if y.is_inference():  # labels made under inference_mode cannot be saved for backward
            with torch.inference_mode(False):
                y = y.clone()
        return y

    @staticmethod
    def _check_recording(return_diagnostics: bool, record_trajectory: bool, record_energies: bool) -> None:
        """A recording asked for without ``return_diagnostics`` would be thrown away: say so."""
        for name, asked in (("record_trajectory", record_trajectory), ("record_energies", record_energies)):
            if asked and not return_diagnostics:
                raise ValueError(f"{name}=True records into the diagnostics: pass return_diagnostics=True too")

    @overload
    def run(
        self,
        jm: JEM,
        x: Tensor,
        y: Tensor | None = ...,
        *,
        return_diagnostics: Literal[False] = ...,
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> Tensor: ...

    @overload
    def run(
        self,
        jm: JEM,
        x: Tensor,
        y: Tensor | None = ...,
        *,
        return_diagnostics: Literal[True],
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> tuple[Tensor, SGLDDiagnostics]: ...

    @overload
    def run(
        self,
        jm: JEM,
        x: Tensor,
        y: Tensor | None = ...,
        *,
        return_diagnostics: bool,
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]: ...

    def run(
        self,
        jm: JEM,
        x: Tensor,
        y: Tensor | None = None,
        *,
        return_diagnostics: bool = False,
        record_trajectory: bool = False,
        record_energies: bool = False,
        progress: bool = False,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
        """Run ``steps`` Langevin updates from ``x``; returns a new detached fp32 tensor, or
        ``(x, SGLDDiagnostics)`` with ``return_diagnostics=True``.

        ``record_trajectory=True``: the chain after every step (``steps + 1`` tensors) in the
        diagnostics; ``record_energies=True``: ``E(x)`` (or ``E(x, y)``) along the chain,
        ``[steps + 1, B]`` (one extra forward for the final state); both need
        ``return_diagnostics=True`` and run the chain eagerly. ``progress=True``: a tqdm progress
        bar over the steps.

        ``x`` itself is not modified. Works inside ``torch.no_grad()``, ``torch.inference_mode()``
        and ``torch.autocast`` (the forward runs in the caller's autocast; the chain stays fp32).
        Raises :class:`~jem_plugin.errors.DivergenceError` if the chain's energies are not finite.
        """
        self._check_recording(return_diagnostics, record_trajectory, record_energies)
        jm = as_jem(jm, "SGLD.run")
        x = check_input(x, domain=jm.domain, what="chain start")
        if y is not None:
            y = self._check_y(jm, y, x.shape[0], x.device)
        sizes = self.step_sizes()
        if self.cuda_graph != "off" and self.steps:
            # None: this chain runs eagerly
            graphed = _cuda_graph.run(self, jm, x, y, record=record_trajectory or record_energies, progress=progress)
            if graphed is not None:
                out, last = graphed
                self._check_divergence(out, last)
                if not return_diagnostics:
                    return out
                return out, SGLDDiagnostics(steps=len(sizes), final_step_size=sizes[-1] if sizes else None)
        # fp32 chain whatever the caller's precision (float64 chains stay float64 for float64 models).
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if y is not None:
            y_index = y.view(-1, 1)
        noise, clip, gen = self.noise, self.grad_clamp, self.generator
        colour = self._colour_matrix(x, dtype)
        domain = jm.domain
        use_hook = bool(sizes) and plugins.has_implementations(STEP_HOOK)  # checked once per run
        hook = plugins.get_plugin_manager().hook.jem_sgld_step if use_hook else None
        trajectory: list[Tensor] = []
        energies: list[Tensor] = []
        grad = torch.autograd.grad
        logsumexp = torch.logsumexp
        last_score = None
        # jm(x) is adapter.logits(model(x)): call the two directly (no wrapper-module dispatch per step).
        model, read_logits = jm.model, jm.adapter.logits

        with (
            sampling_mode(model, _cuda_graph.model_batchnorm(self.batchnorm)),
            autocast_cache_off(x.device.type),
            input_grad_enabled(x.detach().to(dtype)) as xg,
        ):
            xd = xg.detach()  # alias of the leaf: in-place updates without autograd bookkeeping
            if gen is not None and not same_device(gen.device, xd.device):
                raise InvalidInputError(
                    f"the SGLD generator is on {gen.device} but the chain is on {xd.device}; create it "
                    f"with torch.Generator(device={str(xd.device)!r})"
                )
            noise_buf = torch.empty_like(xd) if noise > 0 else None
            clamps = domain.clamp_plan(xd) if self.clamp else ()  # applied after every update
            if record_trajectory:
                trajectory.append(xd.clone())
            steps_iter = range(len(sizes))
            if progress:
                steps_iter = tqdm(steps_iter, desc="SGLD", leave=False)
            check_k = y is not None and jm.num_classes is None  # labels checked at the first forward
            score = ones = None
            for t in steps_iter:
                out = read_logits(model(xg))
                if y is None:
                    score = logsumexp(out, 1)
                else:
                    if check_k:
                        check_label_range(y, out.shape[1], what="y (one class per chain)")
                        check_k = False
                    score = out.gather(1, y_index)
                if ones is None:  # d(sum)/d(score) = 1: pass it directly, no sum kernel per step
                    ones = torch.ones_like(score)
                (g,) = grad(score, xg, ones)  # frees the graph: nothing outlives the step
                if g.dtype != dtype:  # only under exotic autocast setups
                    g = g.to(dtype)
                if clip is not None:
                    g.clamp_(-clip, clip)
                if colour is not None:
                    g = project_colours(g, colour)
                xd.add_(g, alpha=sizes[t])
                if noise_buf is not None:
                    z = noise_buf.normal_(generator=gen)
                    xd.add_(z if colour is None else project_colours(z, colour), alpha=noise)
                for view, lo, hi in clamps:
                    view.clamp_(lo, hi)
                if record_energies:
                    energies.append(-score.detach().reshape(-1).to(dtype))
                if hook is not None:
                    state = SGLDStepState(t, xd, g, sizes[t], noise, y, self)
                    hook(state=state)
                    if state.x is not xd:
                        xd.copy_(state.x)
                if record_trajectory:
                    trajectory.append(xd.clone())
            if score is not None:
                last_score = score.detach()  # the last step's energies, for the divergence check
            if record_energies:
                with torch.no_grad():
                    out = read_logits(model(xd))
                    final = logsumexp(out, 1) if y is None else out.gather(1, y_index)
                last_score = final.reshape(-1)
                energies.append(-last_score.to(dtype))

        if last_score is not None:
            self._check_divergence(xd, last_score)
        if not return_diagnostics:
            return xd
        return xd, SGLDDiagnostics(
            steps=len(sizes),
            final_step_size=sizes[-1] if sizes else None,
            trajectory=trajectory if record_trajectory else None,
            energies=torch.stack(energies) if record_energies else None,
        )

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

    def _check_divergence(self, x: Tensor, score: Tensor) -> None:
        # One host sync per chain, never per step. A NaN/inf anywhere makes the sum non-finite
        # (cheaper than an elementwise isfinite); a finite-but-overflowing sum is re-checked exactly.
        ok = torch.isfinite(x.sum() + score.sum())
        if not bool(ok):
            ok = torch.isfinite(x).all() & torch.isfinite(score).all()
        if self.max_energy is not None:
            ok &= (score.abs() <= self.max_energy).all()
        if bool(ok):
            return
        finite = torch.isfinite(score)
        what = (
            f"{int((~finite).sum())} of {score.numel()} chains have non-finite energies"
            if not bool(finite.all())
            else f"|energy| reached {float(score.abs().max()):.3g} (max_energy={self.max_energy})"
            if bool(torch.isfinite(x).all())
            else "the chain holds NaN/inf values"
        )
        energy = float(score.abs().max()) if bool(finite.all()) else math.nan
        raise DivergenceError(
            f"SGLD diverged: {what} after {self.steps} steps (step_size={self.step_size}, noise={self.noise})",
            remedies=SGLD_REMEDIES,
            energy=energy,
        )

    @overload
    def sample(
        self,
        jm: JEM,
        n: int | None = ...,
        *,
        buffer: ReplayBuffer | None = ...,
        y: Tensor | None = ...,
        x_init: Tensor | None = ...,
        shape: Sequence[int] | None = ...,
        return_diagnostics: Literal[False] = ...,
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> Tensor: ...

    @overload
    def sample(
        self,
        jm: JEM,
        n: int | None = ...,
        *,
        buffer: ReplayBuffer | None = ...,
        y: Tensor | None = ...,
        x_init: Tensor | None = ...,
        shape: Sequence[int] | None = ...,
        return_diagnostics: Literal[True],
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> tuple[Tensor, SGLDDiagnostics]: ...

    @overload
    def sample(
        self,
        jm: JEM,
        n: int | None = ...,
        *,
        buffer: ReplayBuffer | None = ...,
        y: Tensor | None = ...,
        x_init: Tensor | None = ...,
        shape: Sequence[int] | None = ...,
        return_diagnostics: bool,
        record_trajectory: bool = ...,
        record_energies: bool = ...,
        progress: bool = ...,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]: ...

    def sample(
        self,
        jm: JEM,
        n: int | None = None,
        *,
        buffer: ReplayBuffer | None = None,
        y: Tensor | None = None,
        x_init: Tensor | None = None,
        shape: Sequence[int] | None = None,
        return_diagnostics: bool = False,
        record_trajectory: bool = False,
        record_energies: bool = False,
        progress: bool = False,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
        """Draw ``n`` samples (class-conditional when ``y`` is given); with
        ``return_diagnostics=True``, ``(samples, SGLDDiagnostics)``; ``record_trajectory``,
        ``record_energies`` and ``progress`` as in :meth:`run`.

        Chains start from ``buffer`` (and the finished chains are written back), or from
        ``x_init``, or else uniformly over ``jm.domain``; ``shape`` defaults to the size the model
        was trained on (:attr:`~jem_plugin.JEM.trained_input_size`), else the domain's
        ``input_size`` (:meth:`~jem_plugin.JEM.sample_shape`).
        """
        # A contradiction fails before the buffer is drawn from.
        self._check_recording(return_diagnostics, record_trajectory, record_energies)

        def chain(x0: Tensor, y: Tensor | None) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
            return self.run(
                jm,
                x0,
                y,
                return_diagnostics=return_diagnostics,
                record_trajectory=record_trajectory,
                record_energies=record_energies,
                progress=progress,
            )

        jm = as_jem(jm, "SGLD.sample")
        if buffer is not None and x_init is not None:
            raise ValueError("pass either buffer= (persistent chains) or x_init= (chain starts), not both")
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"n must be a positive int, got {n!r}")
        if y is not None:
            y = check_labels(y, what="y")
            if n is not None and n != y.shape[0]:
                raise ValueError(f"n={n} conflicts with y of {y.shape[0]} labels; pass one of them")
            n = y.shape[0]
        if x_init is not None:
            x_init = check_input(x_init, domain=jm.domain, what="x_init")
            # Out-of-domain starts warn once; only the first calls are checked (one sync each).
            self.__dict__.setdefault("_x_init_check", DomainCheck())(x_init, jm.domain, "SGLD.sample(x_init=...)")
            if n is not None and n != x_init.shape[0]:
                raise ValueError(f"n={n} conflicts with x_init of batch size {x_init.shape[0]}")
            return chain(x_init, y)
        if n is None:
            raise ValueError("say how many samples: sample(jm, n=64, ...) (or pass y= or x_init=)")
        device = model_device(jm)
        if buffer is not None:
            follow(buffer, device)  # the buffer lives where the chains run: no copy per iteration
            if self.colours == "data":
                self.use_colours_of(buffer)
            x0, idx = buffer.sample(n, domain=jm.domain, y=y, generator=self.generator)
            if device is not None and not same_device(x0.device, device):  # a buffer that is not an nn.Module
                x0 = x0.to(device)
            out = chain(x0, y)
            buffer.update(idx, out[0] if isinstance(out, tuple) else out)
            return out
        shape = tuple(shape) if shape is not None else jm.sample_shape()  # the trained size, else the domain's
        if shape is None:
            raise ValueError(
                "the input shape is unknown: pass shape=(C, H, W), x_init=..., or a ReplayBuffer (or train first: "
                "the model records the size of its first training batch)"
            )
        x0 = jm.domain.uniform(n, shape, generator=self.generator, device=device or torch.device("cpu"))
        return chain(x0, y)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
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
        gen = self.generator
        state["generator_state"] = gen.get_state() if gen is not None else None
        state["generator_device"] = str(gen.device) if gen is not None else None
        return state

    def load_state_dict(self, state: dict) -> None:
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
        if state.get("generator_state") is not None:
            self.generator = restore_generator(
                self.generator, state["generator_state"], state.get("generator_device"), "SGLD"
            )


# The settings a checkpoint carries: every constructor argument but the generator (whose state is
# saved instead), read from the signature so that a new argument cannot be left out.
_SETTINGS: tuple[str, ...] = tuple(
    name for name in inspect.signature(SGLD.__init__).parameters if name not in ("self", "generator")
)
