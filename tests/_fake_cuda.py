"""A stand-in for the ``torch.cuda`` calls of :mod:`jem_plugin._cuda_graph`, so that its Python runs
on CPU chains in CI (no GPU there).

Install it with :func:`install` (or by hand: ``_cuda_graph._cuda = FakeCuda()`` and
``_cuda_graph._DEVICE_TYPE = "cpu"``). What it keeps of a real CUDA graph:

- Capture records the step and replays it as it is, not as Python: every aten op run inside
  ``graph(...)`` (forward, input-gradient backward, update, noise, clamp) is recorded by a
  ``TorchDispatchMode`` with its arguments and outputs. ``replay()`` runs those ops again and
  copies each result into the output tensor recorded at capture, so every tensor keeps its
  address, as in a real graph. What happens in Python (module flags, hooks, ``sampling_mode``) is
  not replayed, and Python scalars (noise, clip, clamp bounds) are baked in; the tensors the
  ops read (the parameters, the static chain, the step size) are read where they live, when the
  graph replays.
- Memory: a graph keeps what it allocated during capture (its pool) and only the address of a
  tensor that existed before. A replay that reads or writes such a tensor once it is freed (a
  buffer nobody keeps, a parameter replaced with ``p.data = ...``) raises: a real replay would
  use memory that belongs to something else by then.
- Capture computes nothing that can be seen: a tensor that existed before capture and was
  written during it gets its contents back when capture ends, and a tensor made during capture
  holds NaN until the first replay (a real capture launches no kernel, and its outputs hold
  whatever the memory pool held).
- A host synchronisation during capture (``.item()``, ``nonzero``) raises the CUDA error,
  "operation not permitted when stream is capturing".
- Random numbers: an op drawing from a generator that is neither registered with the graph
  (``CUDAGraph.register_generator_state``) nor the default one fails to capture, as CUDA's
  Philox generators do; replays draw the next numbers of the generator, as a registered one does.

Knobs for the fallback tests: ``fail_capture`` (an exception the first op of a capture raises),
``register_generator_state = False`` (a torch without ``CUDAGraph.register_generator_state``),
``capturing = True`` (``is_current_stream_capturing()`` says so). ``graphs`` lists every graph
made, ``captures`` counts the captures that succeeded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from jem_plugin import _cuda_graph

NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"
NOT_REGISTERED = "Attempt to increase offset for a CUDA generator not in capture mode."
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_aten = torch.ops.aten
# Ops that read device memory on the host (what a real capture refuses).
_HOST_SYNCS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.equal.default}


def install(monkeypatch: pytest.MonkeyPatch, device_type: str = "cpu") -> FakeCuda:
    """Put a fresh :class:`FakeCuda` in ``_cuda_graph`` for one test, with no graph cached and no
    warning given yet; all undone when the test ends."""
    fake = FakeCuda(device_type)
    monkeypatch.setattr(_cuda_graph, "_cuda", fake)
    monkeypatch.setattr(_cuda_graph, "_DEVICE_TYPE", device_type)
    monkeypatch.setattr(_cuda_graph, "_warned", set())
    monkeypatch.setattr(_cuda_graph, "_graphs", type(_cuda_graph._graphs)())
    monkeypatch.setattr(_cuda_graph, "_pools", {})
    return fake


class FakeStream:
    """A stream: remembers which streams it was told to wait for."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.device, self.name = device, name
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        if not isinstance(other, FakeStream):
            raise TypeError(f"wait_stream takes a stream, got {type(other).__name__}")
        self.waited.append(other)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class _DefaultGenerators:
    """``torch.cuda.default_generators``: one per device; here every index is the CPU default."""

    def __getitem__(self, index: int | None) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


def _ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _same_memory(a: Tensor, b: Tensor) -> bool:
    return (
        _ptr(a) == _ptr(b)
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeCUDAGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.graph._before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.graph._after(func, args, kwargs, out)
        return out


class FakeCUDAGraph:
    """``torch.cuda.CUDAGraph`` of a torch without ``register_generator_state``: captured by
    :meth:`FakeCuda.graph`, then :meth:`replay` runs the recorded ops again."""

    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda
        self._generators: list[torch.Generator] = []
        self._ops: list[tuple[Any, tuple, dict, list[Any]]] = []
        self._captured = False
        self._capture_started = False
        self.replays = 0
        self._made: set[int] = set()  # storages allocated during capture
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    # ---------------------------------------------------------------- capture
    @contextmanager
    def _capture(self) -> Iterator[None]:
        if self._capture_started:
            raise RuntimeError("this CUDAGraph has already been captured")
        self._capture_started = True
        try:
            with _Recorder(self):
                yield
        except BaseException:
            self._ops = []
            raise
        else:
            self._captured = True
            self._cuda.captures += 1
            with torch.no_grad():  # what a capture leaves in its outputs: nothing computed
                for _, _, _, outs in self._ops:
                    for t in outs:
                        if isinstance(t, Tensor) and _ptr(t) in self._made and t.is_floating_point():
                            t.detach().fill_(float("nan"))
        finally:
            for storage, saved in self._saved.values():  # and in the tensors it wrote to: their old values
                storage.copy_(saved)
            self._saved.clear()

    def _registered(self) -> set[int]:
        return {g._cdata for g in (torch.default_generator, *self._generators)}

    def _before(self, func, args: tuple, kwargs: dict) -> None:
        fail = self._cuda.fail_capture
        if fail is not None:
            raise fail
        if func in _HOST_SYNCS:
            raise RuntimeError(NOT_PERMITTED)
        for value in (*args, *kwargs.values()):
            # (the dispatcher hands over a new Python object for the same generator: compare _cdata)
            if isinstance(value, torch.Generator) and value._cdata not in self._registered():
                raise RuntimeError(NOT_REGISTERED)
        for i, arg in enumerate(func._schema.arguments):  # tensors the op writes to
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in _tensors(value):
                ptr = _ptr(t)
                if ptr and ptr not in self._made and ptr not in self._saved:
                    storage = t.untyped_storage()
                    self._saved[ptr] = (storage, storage.clone())

    def _after(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = {_ptr(t) for t in _tensors((args, kwargs))}
        outs = tree_flatten(out)[0]
        for t in outs:
            if isinstance(t, Tensor) and _ptr(t) and _ptr(t) not in inputs:
                self._made.add(_ptr(t))
        self._ops.append(
            (func, tree_map(self._hold, args), tree_map(self._hold, kwargs), [self._hold(t) for t in outs])
        )

    def _hold(self, value: Any) -> Any:
        """What the graph keeps of a tensor: the memory it allocated during capture (its pool), and
        only the address of a tensor that existed before (that tensor may be freed, as in CUDA)."""
        if isinstance(value, Tensor) and _ptr(value) and _ptr(value) not in self._made:
            return _Address(value)
        return value

    # ---------------------------------------------------------------- replay
    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("replay() of a CUDAGraph that was not captured")
        self.replays += 1
        with torch.no_grad():
            for func, args, kwargs, outs in self._ops:
                new = tree_flatten(func(*tree_map(_at, args), **tree_map(_at, kwargs)))[0]
                for r, o in zip(new, outs):
                    o = _at(o)
                    if isinstance(o, Tensor) and r is not o and not _same_memory(r, o):
                        o.detach().copy_(r)


class _Address:
    """A tensor a graph reads or writes that it does not own: its address, not a reference. Once
    the tensor is freed (or its storage replaced, ``p.data = ...``), a replay reads freed memory;
    here it raises."""

    def __init__(self, t: Tensor) -> None:
        self.ref = StorageWeakRef(t.untyped_storage())
        self.meta = (t.dtype, t.device, t.storage_offset(), tuple(t.shape), t.stride())

    def tensor(self) -> Tensor:
        if self.ref.expired():
            raise RuntimeError(
                "a CUDA graph replay reads or writes a tensor freed since capture (a real graph would use "
                "memory that now belongs to something else): keep the tensors the graph uses alive"
            )
        storage = torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)
        dtype, device, offset, shape, stride = self.meta
        return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)


def _at(value: Any) -> Any:
    return value.tensor() if isinstance(value, _Address) else value


class FakeCUDAGraphWithGenerators(FakeCUDAGraph):
    """``torch.cuda.CUDAGraph`` of a torch that registers generators with graphs."""

    def register_generator_state(self, generator: torch.Generator) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"register_generator_state takes a torch.Generator, got {type(generator).__name__}")
        if self._capture_started:
            raise RuntimeError("register_generator_state must come before capture")
        self._generators.append(generator)


class FakeCuda:
    """The ``torch.cuda`` names :mod:`jem_plugin._cuda_graph` calls; chains on ``device_type``."""

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self.default_generators = _DefaultGenerators()
        # knobs
        self.fail_capture: BaseException | None = None
        self.register_generator_state = True
        self.capturing = False
        # what happened
        self.graphs: list[FakeCUDAGraph] = []
        self.captures = 0
        self.pools: list[object] = []
        self.streams: list[FakeStream] = []
        self._default = FakeStream(torch.device(device_type), "default")
        self._current: FakeStream | None = None
        self._in_capture = 0

    def _check(self, dev: Any) -> torch.device:
        dev = torch.device(dev)
        if dev.type != self.device_type:
            raise ValueError(f"Expected a {self.device_type} device, but got: {dev}")
        return dev

    def is_available(self) -> bool:
        return True

    def is_current_stream_capturing(self) -> bool:
        return self.capturing or self._in_capture > 0

    @contextmanager
    def device(self, dev: Any) -> Iterator[None]:
        self._check(dev)
        yield

    def graph_pool_handle(self) -> object:
        pool = object()
        self.pools.append(pool)
        return pool

    def Stream(self, dev: Any = None) -> FakeStream:
        s = FakeStream(self._check(dev if dev is not None else self.device_type), f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self, dev: Any = None) -> FakeStream:
        if dev is not None:
            self._check(dev)
        return self._current or self._default

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        prev, self._current = self._current, s
        try:
            yield
        finally:
            self._current = prev

    def CUDAGraph(self) -> FakeCUDAGraph:
        g = (FakeCUDAGraphWithGenerators if self.register_generator_state else FakeCUDAGraph)(self)
        self.graphs.append(g)
        return g

    @contextmanager
    def graph(
        self,
        cuda_graph: FakeCUDAGraph,
        pool: object | None = None,
        stream: FakeStream | None = None,
        capture_error_mode: str = "global",
    ) -> Iterator[None]:
        if not isinstance(cuda_graph, FakeCUDAGraph):
            raise TypeError(f"graph() takes a CUDAGraph, got {type(cuda_graph).__name__}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise RuntimeError(f"Unknown capture error mode. Expected one of {CAPTURE_ERROR_MODES}")
        if pool is not None and not any(pool is p for p in self.pools):
            raise RuntimeError("pool must come from graph_pool_handle()")
        prev, self._current = self._current, stream if stream is not None else self.Stream()
        self._in_capture += 1
        try:
            with cuda_graph._capture():
                yield
        finally:
            self._in_capture -= 1
            self._current = prev
