"""Peak-memory probe, run in a fresh interpreter by :func:`benchmarks.common.probe_memory`.

``python -m benchmarks._memprobe '{"kind": "sampler", "impl": "jem_plugin", "model": "test_resnet",
"batch": 64, "steps": 20, "buffer_size": 10000}'`` builds the contender, allocates everything that
is allocated once (model, replay buffer), resets the kernel's peak-RSS mark (``VmHWM``), runs the
call once and prints ``delta_mb``: peak RSS during the call minus RSS before it, i.e. the call's
peak working memory (falls back to the ``ru_maxrss`` delta where the mark cannot be reset).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class TensorPeak:
    """The peak of the bytes torch holds in CPU tensors, as the post-hoc detectors' memory
    estimates count them (``torch.cuda.max_memory_allocated`` on a GPU), read from the profiler's
    events: every allocation and free of torch's CPU allocator, in order. Exact, and independent
    of the C allocator's reuse of freed pages, as a resident-memory peak is not.

    Inside :func:`tensor_peak`, each call measured runs in ``with probe.call(caller_bytes):``;
    :attr:`bytes` is then the largest, over those calls, of the tensor bytes held during the call
    above the start, less ``caller_bytes`` (what the caller itself holds during it: the batch it
    passes). Bytes allocated between the calls (the caller drawing its next batch) count only
    where they are still held during a call."""

    def __init__(self) -> None:
        self.bytes = 0
        self._callers: list[int] = []

    @contextmanager
    def call(self, caller_bytes: int = 0) -> Iterator[None]:
        """Measure the block: a call of the code whose peak is wanted."""
        from torch.profiler import record_function

        self._callers.append(int(caller_bytes))
        with record_function(f"tensor_peak:{len(self._callers) - 1}"):
            yield

    def _read(self, events: list) -> None:
        windows, memory = [], []
        for e in events:
            name = e.name()
            if name == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
                memory.append((e.start_ns(), e.nbytes()))
            elif name.startswith("tensor_peak:"):
                windows.append((e.start_ns(), e.end_ns(), self._callers[int(name.split(":")[1])]))
        memory.sort()
        times = [t for t, _ in memory]
        held, running = [], 0
        for _, n in memory:
            running += n
            held.append(running)
        import bisect

        peak = 0
        for start, end, caller in windows:
            lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
            inside = [held[lo - 1] if lo else 0, *held[lo:hi]]
            peak = max(peak, max(inside) - caller)
        self.bytes = peak


@contextmanager
def tensor_peak() -> Iterator[TensorPeak]:
    """``with tensor_peak() as probe:`` around calls each wrapped in ``probe.call(...)``, then
    ``probe.bytes`` (see :class:`TensorPeak`)."""
    from torch.profiler import ProfilerActivity, profile

    probe = TensorPeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield probe
    probe._read(list(prof.profiler.kineto_results.events()))  # type: ignore[union-attr]


def tensors_bytes(*items: object) -> int:
    """The bytes of the tensors in ``items`` (tensors, dicts and sequences of them, objects whose
    attributes hold them, e.g. :class:`jem_plugin.ood.Outputs`), each storage counted once."""
    seen: dict[int, int] = {}

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "__dict__"):
            for x in vars(v).values():
                walk(x)

    for item in items:
        walk(item)
    return sum(seen.values())


def main(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    torch.set_num_threads(int(cfg.get("threads", 1)))
    from benchmarks import common

    if cfg["kind"] == "sampler":
        from benchmarks.bench_sampler import build_contenders

        contenders = build_contenders(
            cfg["model"], cfg["batch"], cfg["steps"], cfg["buffer_size"], include=(cfg["impl"],)
        )
        c = contenders[cfg["impl"]]
    else:
        raise SystemExit(f"unknown kind {cfg['kind']!r}")
    if c.prepare is not None:  # one-time allocations (filling a replay buffer) are not the call's
        c.prepare()
    if c.setup is not None:
        c.setup()
    import gc

    # One-time import, not working memory: autograd.grad with grad_outputs (jem-plugin, torchebm)
    # imports torch.fx.experimental.symbolic_shapes (sympy, mpmath: ~60 MB RSS) on its first call.
    # Import it up front for every contender so that the figure is the call's own memory.
    import importlib

    importlib.import_module("torch.fx.experimental.symbolic_shapes")

    gc.collect()
    before = common.maxrss_kb()
    hwm_reset = common.reset_peak_rss()  # also resets ru_maxrss on Linux
    rss_before = common.rss_kb()
    c.fn()
    out = {"rss_before_mb": (rss_before or 0) / 1024}
    if hwm_reset and rss_before is not None:
        # Peak RSS during the call above the RSS just before it: the call's working memory.
        out["delta_mb"] = (common.peak_rss_kb() - rss_before) / 1024
        out["method"] = "VmHWM reset"
    else:
        out["delta_mb"] = (common.maxrss_kb() - before) / 1024
        out["method"] = "ru_maxrss delta"
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
