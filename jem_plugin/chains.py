"""The sampler contract: what the library asks of a sampler, and the one chain driver.

:class:`Sampler` is what :class:`~jem_plugin.losses.JEMLoss` (and ``jem sample``) call: a
``sample`` method. :class:`ChainSampler` is the base class of the library's samplers
(:class:`~jem_plugin.sampling.SGLD`, :class:`~jem_plugin.builtins.pgd_negatives.PGDNegatives`)
and of a third party's: a subclass writes one :meth:`~ChainSampler.step` (how the chain moves
given the input gradient of its log density) and gets the rest from here, once:

- the checks, at the public edge only (``sample``/``run``): each input is checked once; the
  loss, which checked its batch and labels, draws past them;
- the starts: a replay buffer (moved to the model's device, its finished chains written back),
  ``x_init``, or uniform draws over the model's domain at the size it trained on
  (:meth:`JEM.sample_shape <jem_plugin.model.JEM.sample_shape>`);
- the chain itself: the model in :func:`~jem_plugin.model.sampling_mode` with the sampler's
  BatchNorm mode, one forward and one input-gradient backward per step, the clamp to the input
  domain, the recording of trajectories and energies, the divergence check, and where the
  sampler allows it the CUDA-graph capture (:mod:`jem_plugin._cuda_graph`).

A sampler moves a chain that runs in the model's dtype (float64 for a float64 model, else fp32):
starts of any floating dtype are cast to it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, overload, runtime_checkable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import _cuda_graph
from ._checks import (
    DomainCheck,
    autocast_cache_off,
    check_count,
    check_input,
    check_label_range,
    check_labels,
    follow,
    model_device,
    restore_generator,
    same_device,
)
from .buffer import ReadOnlyBuffer, ReplayBuffer
from .errors import DivergenceError, InvalidInputError
from .model import BatchNormMode, as_jem, check_batchnorm, input_grad_enabled, sampling_mode

__all__ = ["Sampler", "ChainSampler", "SGLDDiagnostics", "chain_dtype", "label_bound", "sample_checked"]

_CHAIN_REMEDIES: tuple[str, ...] = (
    "a smaller step size or fewer steps",
    "the energy L2 regulariser, JEMLoss(l2_weight=...)",
    "restart training from the last good checkpoint",
)


@dataclass(frozen=True)
class SGLDDiagnostics:
    """What one chain run returns beside the samples (``run(..., return_diagnostics=True)``), for
    every :class:`ChainSampler`.

    A value, not state on the sampler: one sampler may be shared by several losses, scores and
    threads, and each call gets its own diagnostics.

    steps: steps run. final_step_size: the step size of the last step (``None`` for 0 steps).
    trajectory: the chain before the first and after every step (``steps + 1`` tensors) when the
    call asked for ``record_trajectory=True``, else ``None``. energies: ``E(x)`` (``E(x, y)`` for
    class-conditional chains) along the chain, ``[steps + 1, B]``, when the call asked for
    ``record_energies=True``, else ``None``.
    """

    steps: int
    final_step_size: float | None
    trajectory: list[Tensor] | None = None
    energies: Tensor | None = None


@runtime_checkable
class Sampler(Protocol):
    """What :class:`~jem_plugin.losses.JEMLoss` and ``jem sample`` call on a sampler.

    ``sample(jm, n, buffer=, y=)`` draws ``n`` samples (for the labels ``y`` when given), starting
    from the replay ``buffer`` and writing the finished chains back; ``sample(jm, x_init=, y=)``
    runs chains from ``x_init``. Both return a detached tensor ``[n, *input shape]``.

    Two attributes are read when present: ``batchnorm`` (one of
    :data:`~jem_plugin.model.BATCHNORM_MODES`; how the loss passes the samples through BatchNorm,
    ``"joint"`` when absent) and ``clamp`` (whether the chains stay inside the input domain, which
    keeps the loss's data noise inside it too; ``False`` when absent). :class:`ChainSampler` has
    both, and the loss, which checked the batch and its labels already, draws from one past its
    checks.
    """

    def sample(
        self,
        jm: Any,
        n: int | None = None,
        *,
        buffer: Any = None,
        y: Tensor | None = None,
        x_init: Tensor | None = None,
    ) -> Tensor: ...


def chain_dtype(jm: Any) -> torch.dtype:
    """The dtype chains run in for ``jm``: float64 for a float64 model, else fp32 (half-precision
    models run fp32 chains; their forward runs in the caller's autocast)."""
    return torch.float64 if jm.param_dtype() == torch.float64 else torch.float32


def label_bound(jm: Any, buffer: Any = None) -> int | None:
    """The number of classes labels for chains must lie below: the model's, and a class-conditional
    buffer's when there is one (a buffer indexes its class segments by the labels), the smaller if
    both are known; ``None`` when neither is."""
    known = [k for k in (jm.num_classes, getattr(buffer, "num_classes", None)) if k is not None]
    return min(known) if known else None


def check_recording(return_diagnostics: bool, record_trajectory: bool, record_energies: bool) -> None:
    """A recording asked for without ``return_diagnostics`` would be thrown away: say so."""
    for name, asked in (("record_trajectory", record_trajectory), ("record_energies", record_energies)):
        if asked and not return_diagnostics:
            raise ValueError(f"{name}=True records into the diagnostics: pass return_diagnostics=True too")


class ChainSampler(ABC):
    """Base class of samplers that move chains along the input gradient of the model's log density.

    A subclass writes :meth:`step` (abstract); the base class runs the chains (see the module docstring).
    The log density is ``logsumexp_y f(x)[y]``, or ``f(x)[y]`` for chains drawn for labels ``y``.

    Parameters
    ----------
    steps: steps per chain (``0`` returns the start unchanged).
    clamp: clamp the chain to the model's input domain after every step (per channel for
        normalised inputs). Also tells :class:`~jem_plugin.losses.JEMLoss` to keep its data noise
        inside the domain.
    batchnorm: how the samples meet BatchNorm layers (one of
        :data:`~jem_plugin.model.BATCHNORM_MODES`): ``"joint"``, the chains normalise with the
        running statistics and in the loss the samples share BatchNorm with the data;
        ``"separate"``, the chains and the loss's pass over the samples normalise with the
        statistics of the samples' own batch, the running statistics left to the data.
    generator: a ``torch.Generator`` for the starts, the buffer's draws and any noise a step
        draws: the same seed gives the same samples.

    Class attributes a subclass may set: :attr:`name` (in messages), :attr:`remedies` (in a
    :class:`~jem_plugin.errors.DivergenceError`), :attr:`step_size` (one step size for every step,
    unless :meth:`step_sizes` says otherwise), :attr:`max_energy`, and :attr:`cuda_graph`
    (``"off"``: eager chains; a sampler whose :meth:`step` is pure tensor work, with the step size
    read from the tensor it is given, may allow ``"auto"`` or ``"require"``, as SGLD does).
    """

    name: ClassVar[str] = "chain"
    remedies: ClassVar[tuple[str, ...]] = _CHAIN_REMEDIES
    step_size: Any = 1.0
    max_energy: float | None = None
    cuda_graph: str = "off"

    def __init__(
        self,
        steps: int = 20,
        *,
        clamp: bool = True,
        batchnorm: BatchNormMode = "joint",
        generator: torch.Generator | None = None,
    ) -> None:
        check_count("steps", steps, 0)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.steps = steps
        self.clamp = bool(clamp)
        self.batchnorm: BatchNormMode = check_batchnorm(batchnorm)
        self.generator = generator
        self._x_init_check = DomainCheck()  # out-of-domain starts warn once (first calls only)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, batchnorm={self.batchnorm!r}, clamp={self.clamp})"

    # ------------------------------------------------------------------ what a subclass writes
    @abstractmethod
    def step(self, x: Tensor, grad: Tensor, size: float | Tensor, state: Any) -> None:
        """Move the chains ``x`` (``[B, ...]``, updated in place) one step, given ``grad``, the
        input gradient of each chain's log density (the driver's to keep or overwrite).

        ``size`` is this step's entry of :meth:`step_sizes`: a float, or a 0-d tensor holding it
        when the step runs inside a CUDA graph. ``state`` is what :meth:`prepare` returned for
        this chain run. The clamp to the domain comes after, from the driver.
        """

    def prepare(self, jm: Any, x: Tensor) -> Any:
        """Per-run state handed to every :meth:`step` (noise buffers, the starts); ``None`` here.
        Called once per chain run, with the chain ``x`` before the first step."""
        return None

    def step_sizes(self, jm: Any = None) -> list[float]:
        """The step size of every step: :attr:`step_size`, ``steps`` times."""
        return [float(self.step_size)] * self.steps

    def after_step(self, t: int, x: Tensor, size: float, y: Tensor | None, state: Any) -> None:
        """Called after step ``t`` (and the clamp) of an eager chain; nothing here. SGLD runs the
        ``jem_sgld_step`` plugin hook from it."""
        return None  # optional: a sampler overrides it only if it needs it

    def wants_eager(self) -> str | None:
        """Why this chain cannot run as a CUDA graph (read before capture), or ``None``."""
        return None

    def graph_key(self) -> tuple:
        """The settings a captured step bakes in beyond the driver's (shape, dtype, BatchNorm
        mode, clamp, generator...): a changed value captures the step again."""
        return ()

    def draws_noise(self) -> bool:
        """Whether :meth:`step` draws random numbers from :attr:`generator` (a CUDA graph must then
        register the generator)."""
        return False

    def use_buffer(self, buffer: Any) -> None:
        """Called before each draw of starts from ``buffer``; nothing here (SGLD reads the colour
        axes of the buffer's data)."""
        return None  # optional: a sampler overrides it only if it needs it

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The generator's state (plain tensors: ``weights_only``-loadable), which
        :class:`~jem_plugin.losses.JEMLoss` saves with its own; a subclass adds its settings."""
        gen = self.generator
        return {
            "generator_state": gen.get_state() if gen is not None else None,
            "generator_device": str(gen.device) if gen is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the generator :meth:`state_dict` saved (into the current one where there is one)."""
        if state.get("generator_state") is not None:
            self.generator = restore_generator(
                self.generator, state["generator_state"], state.get("generator_device"), type(self).__name__
            )

    # ------------------------------------------------------------------ the public edge
    @overload
    def run(
        self,
        jm: Any,
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
        jm: Any,
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
        jm: Any,
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
        jm: Any,
        x: Tensor,
        y: Tensor | None = None,
        *,
        return_diagnostics: bool = False,
        record_trajectory: bool = False,
        record_energies: bool = False,
        progress: bool = False,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
        """Run the chains from ``x`` (for the labels ``y`` when given); returns a new detached
        tensor in the model's dtype (float64 for a float64 model, else fp32), or
        ``(x, SGLDDiagnostics)`` with ``return_diagnostics=True``.

        ``record_trajectory=True``: the chain after every step (``steps + 1`` tensors) in the
        diagnostics; ``record_energies=True``: ``E(x)`` (or ``E(x, y)``) along the chain,
        ``[steps + 1, B]`` (one extra forward for the final state); both need
        ``return_diagnostics=True`` and run the chain eagerly. ``progress=True``: a tqdm progress
        bar over the steps.

        ``x`` itself is not modified. Works inside ``torch.no_grad()``, ``torch.inference_mode()``
        and ``torch.autocast`` (the forward runs in the caller's autocast; the chain does not).
        Raises :class:`~jem_plugin.errors.DivergenceError` if the chain's energies are not finite.
        """
        check_recording(return_diagnostics, record_trajectory, record_energies)
        jm = as_jem(jm, f"{type(self).__name__}.run")
        x = check_input(x, dtype=chain_dtype(jm), domain=jm.domain, what="chain start")
        if y is not None:
            y = self._check_y(y, x.shape[0], label_bound(jm), x.device)
        return self._chain(jm, x, y, return_diagnostics, record_trajectory, record_energies, progress)

    @overload
    def sample(
        self,
        jm: Any,
        n: int | None = ...,
        *,
        buffer: Any = ...,
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
        jm: Any,
        n: int | None = ...,
        *,
        buffer: Any = ...,
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
        jm: Any,
        n: int | None = ...,
        *,
        buffer: Any = ...,
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
        jm: Any,
        n: int | None = None,
        *,
        buffer: Any = None,
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

        Chains start from ``buffer`` (a :class:`~jem_plugin.buffer.ReplayBuffer`, or any object
        with ``sample(n, domain=, y=, generator=) -> (x, idx)`` and ``update(idx, x)``; the
        finished chains are written back), or from ``x_init``, or else uniformly over
        ``jm.domain``; ``shape`` defaults to the size the model was trained on
        (:attr:`~jem_plugin.JEM.trained_input_size`), else the domain's ``input_size``
        (:meth:`~jem_plugin.JEM.sample_shape`).
        """
        # A contradiction fails before the buffer is drawn from.
        check_recording(return_diagnostics, record_trajectory, record_energies)
        jm = as_jem(jm, f"{type(self).__name__}.sample")
        n, y, x_init = self._check_sample(jm, n, buffer, y, x_init)
        if n is None:
            raise ValueError("say how many samples: sample(jm, n=64, ...) (or pass y= or x_init=)")
        if buffer is not None:
            follow(buffer, model_device(jm))  # the buffer lives where the chains run: no copy per iteration
        elif x_init is None and shape is None:
            shape = jm.sample_shape()  # here: a size conflict is warned at the caller's line
        return self._draw(
            jm, n, buffer, y, x_init, shape, return_diagnostics, record_trajectory, record_energies, progress
        )

    def _draw(
        self,
        jm: Any,
        n: int,
        buffer: Any = None,
        y: Tensor | None = None,
        x_init: Tensor | None = None,
        shape: Sequence[int] | None = None,
        return_diagnostics: bool = False,
        record_trajectory: bool = False,
        record_energies: bool = False,
        progress: bool = False,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
        """:meth:`sample` past its checks: for callers that checked every input and placed the
        buffer already (:class:`~jem_plugin.losses.JEMLoss`; ``y`` long labels on the chains'
        device, in range; ``n`` the number of chains)."""
        recording = (return_diagnostics, record_trajectory, record_energies, progress)
        if x_init is not None:
            return self._chain(jm, x_init, y, *recording)
        device = model_device(jm)
        if buffer is not None:
            self.use_buffer(buffer)
            if isinstance(buffer, (ReplayBuffer, ReadOnlyBuffer)):  # the labels were checked above
                x0, idx = buffer.sample(n, domain=jm.domain, y=y, generator=self.generator, validate=False)
            else:  # a user's buffer checks what it needs
                x0, idx = buffer.sample(n, domain=jm.domain, y=y, generator=self.generator)
            if device is not None and not same_device(x0.device, device):  # a buffer that is not an nn.Module
                x0 = x0.to(device)
            out = self._chain(jm, x0, y, *recording)
            buffer.update(idx, out[0] if isinstance(out, tuple) else out)
            return out
        size = tuple(shape) if shape is not None else jm.sample_shape()  # the trained size, else the domain's
        if size is None:
            raise ValueError(
                "the input shape is unknown: pass shape=(C, H, W), x_init=..., or a ReplayBuffer (or train first: "
                "the model records the size of its first training batch)"
            )
        x0 = jm.domain.uniform(n, size, generator=self.generator, device=device or torch.device("cpu"))
        return self._chain(jm, x0, y, *recording)

    # ------------------------------------------------------------------ checks
    def _check_sample(
        self, jm: Any, n: Any, buffer: Any, y: Any, x_init: Any
    ) -> tuple[int | None, Tensor | None, Tensor | None]:
        """``sample``'s arguments checked together, each once: ``(n, y, x_init)``."""
        if buffer is not None and x_init is not None:
            raise ValueError("pass either buffer= (persistent chains) or x_init= (chain starts), not both")
        if n is not None:
            check_count("n", n, 1)
        if y is not None:
            device = x_init.device if isinstance(x_init, Tensor) else model_device(jm, "cpu")
            y = self._check_y(y, None, label_bound(jm, buffer), device)
            if n is not None and n != y.shape[0]:
                raise ValueError(f"n={n} conflicts with y of {y.shape[0]} labels; pass one of them")
            n = y.shape[0]
        if x_init is not None:
            x_init = check_input(x_init, dtype=chain_dtype(jm), domain=jm.domain, what="x_init")
            self._x_init_check(x_init, jm.domain, f"{type(self).__name__}.sample(x_init=...)", stacklevel=3)
            if n is not None and n != x_init.shape[0]:
                raise ValueError(f"n={n} conflicts with x_init of batch size {x_init.shape[0]}")
            n = x_init.shape[0]
        return n, y, x_init

    @staticmethod
    def _check_y(y: Any, batch: int | None, num_classes: int | None, device: Any) -> Tensor:
        y = check_labels(y, batch, num_classes=num_classes, device=device, what="y (one class per chain)")
        if y.is_inference():  # labels made under inference_mode cannot be saved for backward
            with torch.inference_mode(False):
                y = y.clone()
        return y

    # ------------------------------------------------------------------ the driver
    def _chain(
        self,
        jm: Any,
        x: Tensor,
        y: Tensor | None,
        return_diagnostics: bool,
        record_trajectory: bool,
        record_energies: bool,
        progress: bool,
    ) -> Tensor | tuple[Tensor, SGLDDiagnostics]:
        """The chains from checked starts ``x`` and labels ``y``."""
        sizes = self.step_sizes(jm)
        dtype = chain_dtype(jm)
        if x.dtype != dtype:  # starts drawn from a buffer or the domain are fp32
            x = x.to(dtype)
        if self.cuda_graph != "off" and sizes:
            # None: this chain runs eagerly
            graphed = _cuda_graph.run(self, jm, x, y, record=record_trajectory or record_energies, progress=progress)
            if graphed is not None:
                out, last = graphed
                self._check_divergence(out, last, len(sizes))
                if not return_diagnostics:
                    return out
                return out, SGLDDiagnostics(steps=len(sizes), final_step_size=sizes[-1])
        y_index = y.view(-1, 1) if y is not None else None
        trajectory: list[Tensor] = []
        energies: list[Tensor] = []
        grad = torch.autograd.grad
        logsumexp = torch.logsumexp
        last_score = None
        # jm(x) is adapter.logits(model(x)): call the two directly (no wrapper-module dispatch per step).
        model, read_logits = jm.model, jm.adapter.logits

        with (
            sampling_mode(model, self.batchnorm),
            autocast_cache_off(x.device.type),
            input_grad_enabled(x.detach().to(dtype)) as xg,
        ):
            xd = xg.detach()  # alias of the leaf: in-place updates without autograd bookkeeping
            gen = self.generator
            if self.draws_noise() and gen is not None and not same_device(gen.device, xd.device):
                raise InvalidInputError(
                    f"the {self.name} generator is on {gen.device} but the chain is on {xd.device}; create it "
                    f"with torch.Generator(device={str(xd.device)!r})"
                )
            state = self.prepare(jm, xd)
            clamps = jm.domain.clamp_plan(xd) if self.clamp else ()  # applied after every update
            if record_trajectory:
                trajectory.append(xd.clone())
            steps_iter: Any = range(len(sizes))
            if progress:
                steps_iter = tqdm(steps_iter, desc=self.name, leave=False)
            check_k = y is not None and jm.num_classes is None  # labels checked at the first forward
            score = ones = None
            for t in steps_iter:
                out = read_logits(model(xg))
                if y_index is None:
                    score = logsumexp(out, 1)
                else:
                    if check_k:
                        check_label_range(y_index, out.shape[1], what="y (one class per chain)")
                        check_k = False
                    score = out.gather(1, y_index)
                if ones is None:  # d(sum)/d(score) = 1: pass it directly, no sum kernel per step
                    ones = torch.ones_like(score)
                (g,) = grad(score, xg, ones)  # frees the graph: nothing outlives the step
                if g.dtype != dtype:  # only under exotic autocast setups
                    g = g.to(dtype)
                self.step(xd, g, sizes[t], state)
                for view, lo, hi in clamps:
                    view.clamp_(lo, hi)
                if record_energies:
                    energies.append(-score.detach().reshape(-1).to(dtype))
                self.after_step(t, xd, sizes[t], y, state)
                if record_trajectory:
                    trajectory.append(xd.clone())
            if score is not None:
                last_score = score.detach()  # the last step's energies, for the divergence check
            if record_energies:
                with torch.no_grad():
                    out = read_logits(model(xd))
                    final = logsumexp(out, 1) if y_index is None else out.gather(1, y_index)
                last_score = final.reshape(-1)
                energies.append(-last_score.to(dtype))

        if last_score is not None:
            self._check_divergence(xd, last_score, len(sizes))
        if not return_diagnostics:
            return xd
        return xd, SGLDDiagnostics(
            steps=len(sizes),
            final_step_size=sizes[-1] if sizes else None,
            trajectory=trajectory if record_trajectory else None,
            energies=torch.stack(energies) if record_energies else None,
        )

    def _check_divergence(self, x: Tensor, score: Tensor, steps: int) -> None:
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
            f"{self.name} diverged: {what} after {steps} steps ({self!r})", remedies=self.remedies, energy=energy
        )


def sample_checked(
    sampler: Sampler, jm: Any, n: int, buffer: Any = None, y: Tensor | None = None, x_init: Tensor | None = None
) -> Tensor:
    """``sampler.sample(jm, n, buffer=, y=)`` (or ``x_init=``) for inputs the caller has checked:
    :class:`~jem_plugin.losses.JEMLoss` after its batch check. A :class:`ChainSampler` is entered
    past its own checks; a subclass that overrides ``sample``, and any other sampler, is called
    through ``sample``."""
    if isinstance(sampler, ChainSampler) and type(sampler).sample is ChainSampler.sample:
        out = sampler._draw(jm, n, buffer, y, x_init)
        assert isinstance(out, Tensor)  # no diagnostics asked for
        return out
    if x_init is not None:
        return sampler.sample(jm, x_init=x_init, y=y)
    return sampler.sample(jm, n, buffer=buffer, y=y)
