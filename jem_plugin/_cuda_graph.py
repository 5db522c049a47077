"""CUDA-graph chains: one step of a :class:`~jem_plugin.chains.ChainSampler` (SGLD's Langevin step)
captured once as a CUDA graph, then replayed ``steps`` times.

On a GPU a small or medium network is launch-bound: one SGLD step is hundreds of small kernels
(forward, input-gradient backward, update, noise, clamp) and the host spends longer launching
them than the device running them. Captured once and replayed, the whole step is one launch.

What a graph bakes in, and how this module keeps it correct:

- Tensor addresses. The chain, the labels, the step size and the noise buffer are static tensors
  owned by the graph (a graph holds addresses, not tensors: each is kept alive with it): every
  run copies its start in and its result out. The model's parameters and buffers are read where
  they live, so an optimizer updating them in place (every torch optimizer does) is seen by the
  next run; if a parameter tensor is *replaced* (``model.half()``, a
  ``load_state_dict(assign=True)``), its address changes and the step is captured again.
- Everything host-side. Graphs are kept per model and per (shape, memory layout, dtype,
  conditioning, autocast state, TF32 flags, the sampler's class and its ``graph_key()`` (SGLD:
  noise, gradient clamp), BatchNorm mode, clamp bounds, generator);
  the step size may change from step to step (a 0-d device tensor refilled between replays).
- Random numbers. The user's CUDA generator is registered with the graph, so each replay draws
  the next Philox numbers of that generator exactly as the eager loop would: seeded runs
  repeat, and the warm-up before capture leaves the generator where it was.
- Memory. A replay allocates nothing: memory is flat in the number of steps. The graphs of a
  device share one memory pool, which holds one step's activations of the largest of them
  (every replay writes its intermediates before reading them, a run reads its graph's outputs
  right after its replays, and chains on a device replay one after another on the current
  stream, so sharing is safe); at most ``MAX_GRAPHS`` graphs per model are kept, and
  :func:`clear` hands the pool back to PyTorch's caching allocator.

Where capture is impossible (per-step Python hooks, trajectory or energy recording, a plain
callable model, a model that synchronises with the host or otherwise fails to capture) the
sampler runs eagerly and says why, once.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import hookspecs, plugins
from ._checks import autocast_cache_off, check_label_range, same_device, user_stacklevel
from .errors import CUDAGraphError
from .model import JEM, BatchNormMode, _CallableModule, sampling_mode

# Every CUDA call of this module goes through this name: the CPU tests replace it with a stand-in
# (fake graphs that record the captured step and replay it eagerly), so each line here runs in CI.
_cuda: Any = torch.cuda
_DEVICE_TYPE = "cuda"  # the device type whose chains are captured (the CPU tests set "cpu")

__all__ = ["MODES", "check_mode", "clear", "run"]

MODES = ("auto", "off", "require")
MAX_GRAPHS = 4  # per model; the least recently used graph is dropped
WARMUP_STEPS = 3  # eager steps on a side stream before capture (cuDNN/cuBLAS set-up, lazy init)

_graphs: weakref.WeakKeyDictionary[nn.Module, OrderedDict[tuple, _Graph | str]] = weakref.WeakKeyDictionary()
_warned: set[str] = set()
_pools: dict[torch.device, tuple[Any, Any]] = {}  # device -> (memory pool handle, capture stream)


class ChainSettings(Protocol):
    """What a chain run reads from its sampler (:class:`~jem_plugin.chains.ChainSampler` provides
    it; the protocol keeps this module below that one)."""

    cuda_graph: str
    clamp: bool
    batchnorm: BatchNormMode
    generator: torch.Generator | None

    def step_sizes(self, jm: Any = None) -> list[float]:
        """The step size of every step (the sampler's schedule, evaluated for its steps)."""
        ...

    def prepare(self, jm: Any, x: Tensor) -> Any:
        """Per-run state for :meth:`step` (kept alive with the graph)."""
        ...

    def step(self, x: Tensor, grad: Tensor, size: float | Tensor, state: Any) -> None:
        """One in-place update of the chain ``x`` (``size`` a 0-d tensor here)."""
        ...

    def wants_eager(self) -> str | None:
        """Why the sampler's step cannot be captured, or ``None``."""
        ...

    def graph_key(self) -> tuple:
        """The sampler's settings the captured step bakes in."""
        ...

    def draws_noise(self) -> bool:
        """Whether the step draws from the sampler's generator."""
        ...


def check_mode(mode: Any) -> str:
    """Validate ``SGLD(cuda_graph=...)``."""
    if mode not in MODES:
        raise ValueError(f"cuda_graph must be one of {MODES}, got {mode!r}")
    return mode


def clear() -> None:
    """Drop every captured graph (their memory pools return to PyTorch's caching allocator)."""
    _graphs.clear()
    _pools.clear()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    x: Tensor  # the chain (leaf that requires grad); updated in place by every replay
    a: Tensor  # step size, 0-d
    y: Tensor | None  # [B, 1] labels of class-conditional chains
    score: Tensor  # the last replay's log-density of each chain (before its update)
    # The sampler's per-run state (SGLD: the noise buffer each replay refills). A graph holds
    # addresses, not tensors: every tensor it uses that was allocated before capture must be kept
    # alive here, or its memory is reused.
    state: Any
    num_classes: int
    owners: tuple  # (generator, adapter), kept alive: their ids are in the key
    fingerprint: tuple


class _CaptureFailed(Exception):
    """The step cannot be captured: fall back to eager (and say why)."""


class _Eager(Exception):
    """The eager warm-up itself failed: the eager loop runs and raises its own clear error."""


def _fingerprint(model: nn.Module) -> tuple:
    """Addresses of everything the graph reads from the model: a replaced tensor means recapture."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in chain(model.parameters(), model.buffers()))


def _layout(x: Tensor) -> torch.memory_format:
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _blocker(sampler: ChainSettings, jm: JEM, x: Tensor, record: bool) -> str | None:
    """Why the chain cannot run as a graph, or ``None``."""
    if x.device.type != _DEVICE_TYPE or not _cuda.is_available():
        return f"the chain is on {x.device}, not on a CUDA device"
    if record:
        return "trajectory/energy recording reads the chain after every step"
    if plugins.has_implementations(hookspecs.STEP_HOOK):
        return f"a {hookspecs.STEP_HOOK} plugin hook runs Python after every step"
    reason = sampler.wants_eager()
    if reason is not None:
        return reason
    if isinstance(jm.model, _CallableModule):
        return "the model is a plain callable (its tensors cannot be tracked between runs)"
    if any(hasattr(p, "full_tensor") for p in jm.model.parameters()):  # FSDP2's shards are DTensors
        # a capture that fails on one rank after another rank's gather would hang the collective
        return "the model's parameters are sharded (FSDP): its forward gathers them with collectives"
    if _cuda.is_current_stream_capturing():
        return "a CUDA graph is already being captured on this stream"
    return None


def run(
    sampler: ChainSettings,
    jm: JEM,
    x: Tensor,
    y: Tensor | None,
    *,
    record: bool = False,
    progress: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """The chain run as a CUDA graph, ``(chain, log-density of each chain at its last step)``, or
    ``None`` when the eager loop must run it. ``y``, when given, is already checked (``[B]`` long
    labels on the chain's device). ``record``: the call records the trajectory or the energies
    (the eager loop must run it); ``progress``: a progress bar over the replays.

    ``"require"`` raises :class:`CUDAGraphError` instead of returning ``None``; ``"auto"`` warns
    once per reason, and only for chains on a CUDA device (on the CPU eager is the only path).
    """
    mode = sampler.cuda_graph
    if mode == "off" or not sampler.step_sizes(jm):
        return None
    reason = _blocker(sampler, jm, x, record)
    gen = sampler.generator
    if reason is None and gen is not None and not same_device(gen.device, x.device):
        return None  # the eager loop raises its clear device-mismatch error
    if reason is None:
        try:
            return _run(sampler, jm, x, y, progress)
        except _CaptureFailed as exc:
            reason = str(exc)
        except _Eager:
            return None
    if mode == "require":
        raise CUDAGraphError(
            f"{type(sampler).__name__}(cuda_graph='require') cannot run the chain as a CUDA graph: {reason}; use "
            "cuda_graph='auto' to fall back to the eager loop"
        )
    if x.device.type == _DEVICE_TYPE and reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"{type(sampler).__name__} runs eagerly, not as a CUDA graph: {reason}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),  # the user's line, however deep the driver called this
        )
    return None


def _key(sampler: ChainSettings, jm: JEM, x: Tensor, dtype: torch.dtype, cond: bool) -> tuple:
    domain = jm.domain
    autocast = torch.is_autocast_enabled(x.device.type)
    return (
        tuple(x.shape),
        _layout(x),
        dtype,
        x.device,
        cond,
        autocast,
        torch.get_autocast_dtype(x.device.type) if autocast else None,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        type(sampler),
        sampler.graph_key(),
        # batch or running BatchNorm statistics
        sampler.batchnorm,
        (tuple(domain.low), tuple(domain.high)) if sampler.clamp else None,
        id(sampler.generator),
        id(jm.adapter),
    )


def _run(sampler: ChainSettings, jm: JEM, x: Tensor, y: Tensor | None, progress: bool) -> tuple[Tensor, Tensor]:
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    sizes = sampler.step_sizes(jm)
    model = jm.model
    key = _key(sampler, jm, x, dtype, y is not None)
    per_model = _graphs.get(model)
    if per_model is None:
        per_model = _graphs[model] = OrderedDict()
    fingerprint = _fingerprint(model)
    entry = per_model.get(key)
    if isinstance(entry, str):  # this configuration failed to capture before: do not retry
        raise _CaptureFailed(entry)
    if entry is not None and (
        entry.fingerprint != fingerprint
        or entry.owners[0] is not sampler.generator
        or entry.owners[1] is not jm.adapter
    ):
        del per_model[key]
        entry = None
    if entry is None:
        try:
            entry = _capture(sampler, jm, x, y, dtype, sizes[0], fingerprint)
        except _CaptureFailed as exc:
            per_model[key] = str(exc)
            raise
        per_model[key] = entry
        while len(per_model) > MAX_GRAPHS:
            per_model.popitem(last=False)
    per_model.move_to_end(key)
    if y is not None and jm.num_classes is None:
        check_label_range(y, entry.num_classes, what="y (one class per chain)")

    steps = range(len(sizes))
    if progress:
        steps = tqdm(steps, desc=f"{type(sampler).__name__} (CUDA graph)", leave=False)
    with torch.inference_mode(False), torch.no_grad(), _cuda.device(x.device):
        entry.x.detach().copy_(x)
        if y is not None and entry.y is not None:  # both or neither: the key holds the conditioning
            entry.y.copy_(y.view(-1, 1))
        last = None
        for t in steps:
            if sizes[t] != last:  # a fill kernel, no host sync; once for a constant schedule
                entry.a.fill_(sizes[t])
                last = sizes[t]
            entry.graph.replay()
        out = entry.x.detach().clone()
        score = entry.score.clone()
    return out, score


def make_step(
    jm: JEM, xs: Tensor, a: Tensor, ys: Tensor | None, state: Any, sampler: ChainSettings
) -> Callable[[], tuple[Tensor, Tensor]]:
    """One step on the static chain ``xs`` (a leaf that requires grad), as the eager loop makes it
    but with the step size read from the 0-d tensor ``a``; returns ``(logits, score)``. ``state``
    is the sampler's :meth:`prepare` for ``xs``."""
    model, read_logits = jm.model, jm.adapter.logits
    xd = xs.detach()
    dtype, update = xs.dtype, sampler.step
    clamps = jm.domain.clamp_plan(xd) if sampler.clamp else ()
    # Unknown number of classes: the labels are checked at the first forward, as the eager loop
    # does, before a gather reads them (out of range on CUDA: a device-side assert, fatal to the
    # process). The first call is an eager warm-up step, never the captured one.
    check_k = ys is not None and jm.num_classes is None

    def step() -> tuple[Tensor, Tensor]:
        nonlocal check_k
        out = read_logits(model(xs))
        if ys is None:
            score = torch.logsumexp(out, 1)
        else:
            if check_k:
                check_label_range(ys.view(-1), out.shape[1], what="y (one class per chain)")
                check_k = False
            score = out.gather(1, ys)
        (g,) = torch.autograd.grad(score, xs, torch.ones_like(score))
        if g.dtype != dtype:
            g = g.to(dtype)
        update(xd, g, a, state)
        for view, lo, hi in clamps:
            view.clamp_(lo, hi)
        return out.detach(), score.detach()

    return step


def _capture(
    sampler: ChainSettings,
    jm: JEM,
    x: Tensor,
    y: Tensor | None,
    dtype: torch.dtype,
    first_size: float,
    fingerprint: tuple,
) -> _Graph:
    model = jm.model
    dev = x.device
    gen = sampler.generator
    with torch.inference_mode(False), _cuda.device(dev):
        rng = gen if gen is not None else _cuda.default_generators[dev.index]
        rng_state = rng.get_state()
        xs = torch.empty_like(x, dtype=dtype, memory_format=_layout(x))
        xs.copy_(x.detach())
        xs.requires_grad_(True)
        a = torch.full((), first_size, dtype=dtype, device=dev)
        ys = y.view(-1, 1).clone() if y is not None else None
        state = sampler.prepare(jm, xs.detach())
        step = make_step(jm, xs, a, ys, state, sampler)
        try:
            # Autocast's cast cache off: it would hand later steps (and the capture) stale casts.
            with (
                sampling_mode(model, sampler.batchnorm),
                torch.enable_grad(),
                autocast_cache_off(dev.type),
            ):
                if dev not in _pools:
                    _pools[dev] = (_cuda.graph_pool_handle(), _cuda.Stream(dev))
                pool, side = _pools[dev]
                side.wait_stream(_cuda.current_stream(dev))
                try:
                    with _cuda.stream(side):
                        for _ in range(WARMUP_STEPS):
                            step()
                except Exception as exc:  # the model's own error: the eager loop reports it
                    raise _Eager() from exc
                _cuda.current_stream(dev).wait_stream(side)
                graph = _cuda.CUDAGraph()
                if gen is not None and sampler.draws_noise():
                    if not hasattr(graph, "register_generator_state"):
                        raise _CaptureFailed(
                            f"torch {torch.__version__} cannot register a generator with a "
                            "CUDA graph (torch.cuda.CUDAGraph.register_generator_state)"
                        )
                    graph.register_generator_state(gen)  # replays draw from the user's generator
                try:
                    with _cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                        out, score = step()
                except Exception as exc:  # host syncs, data-dependent control flow, unsupported ops
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise _CaptureFailed(f"capture failed ({type(exc).__name__}: {first[:200]})") from exc
        finally:
            rng.set_state(rng_state)  # the warm-up's draws never happened, as far as the user can tell
    return _Graph(
        graph=graph,
        x=xs,
        a=a,
        y=ys,
        score=score.reshape(-1),
        state=state,
        num_classes=int(out.shape[1]),
        owners=(gen, jm.adapter),
        fingerprint=fingerprint,
    )
