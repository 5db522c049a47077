"""How many CPU threads the ``jem`` commands give torch: :func:`use_threads`, called by every
command before its work, and :func:`choose_threads`, the rule it applies.

Torch starts one thread per core. Its threads meet at the end of every operation, so when another
process keeps one of the cores busy (a browser, a second training run, a shared workstation), every
operation waits for the thread that lost its core: on 2 cores beside one busy process, ``jem demo``
took 5 min 30 s with torch's 2 threads and 29 s with one (issue 59); here a README-style loop took
51 s an iteration against 3.8 s (benchmarks/results/threads.md). A small model has too little work
per operation to share out either.

The rule: a thread per core that other processes leave free (their load on the cores this process
may use, measured over a moment less this process's own; not the 1-minute load average, which lags
a process that started or stopped seconds ago, and is the fallback off Linux), at most
torch's own default, and one thread for a model whose forward pass is below
:data:`SMALL_FORWARD_FLOPS` per input. A user's own choice always wins: ``OMP_NUM_THREADS`` in the
environment, or a ``torch.set_num_threads`` call before the command's work.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: Torch's thread count when this module was imported: its default, unless the user set it first.
_AT_IMPORT = torch.get_num_threads()
#: The count :func:`use_threads` last set (a count that differs from it was set by someone else).
_SET_HERE: int | None = None

#: A forward pass of fewer FLOPs than this per input is too small to share between threads: the
#: toy 2-D MLP (0.07 MFLOP) took 15-18 ms an iteration on one thread and 133-353 ms on two (load 5,
#: benchmarks/results/threads_small_model.txt); the digits CNN (3 MFLOP) ran the demo faster on two
#: than on one on an idle machine (20.6 s against 28.5 s, issue 59).
SMALL_FORWARD_FLOPS = 0.5e6
#: How long the other processes' load is measured (``/proc/stat``), in seconds.
LOAD_WINDOW_S = 0.2


@dataclass(frozen=True)
class ThreadChoice:
    """``threads`` torch uses, ``source`` (``"OMP_NUM_THREADS"``, ``"torch.set_num_threads"`` or
    ``"chosen"``) and ``reason``: the cores, the others' load and the model size it read."""

    threads: int
    source: str
    reason: str

    def line(self) -> str:
        """The one line a command says: what torch uses and why, and how to choose otherwise."""
        plural = "s" if self.threads != 1 else ""
        if self.source != "chosen":
            return f"jem: {self.threads} CPU thread{plural} ({self.source}, your setting)"
        return f"jem: {self.threads} CPU thread{plural} ({self.reason}; set OMP_NUM_THREADS=N to choose)"


def user_threads(environ: Any = None) -> str | None:
    """The user's own thread setting, or None: ``OMP_NUM_THREADS`` in ``environ`` (default: the
    process's), or a ``torch.set_num_threads`` call (torch's count differs from its default at this
    module's import, and from the last count :func:`use_threads` set)."""
    env = os.environ if environ is None else environ
    value = str(env.get("OMP_NUM_THREADS", "")).strip()
    if value:
        return f"OMP_NUM_THREADS={value}"
    now = torch.get_num_threads()
    if now != (_SET_HERE if _SET_HERE is not None else _AT_IMPORT):
        return f"torch.set_num_threads({now})"
    return None


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask where the OS has one, else all."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: no affinity mask
        return max(1, os.cpu_count() or 1)


def _allowed_cores() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity mask: every core
        return None


def _cpu_times(cores: set[int] | None) -> tuple[float, float] | None:
    """``(busy, total)`` jiffies from ``/proc/stat``, summed over ``cores`` (None: all); None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [ln.split() for ln in f if ln.startswith("cpu")]
    except OSError:
        return None
    if cores is None:
        rows = [lines[0][1:]]  # the first line sums every core
    else:
        rows = [ln[1:] for ln in lines[1:] if ln[0][3:].isdigit() and int(ln[0][3:]) in cores]
    busy = total = 0.0
    try:
        for row in rows:
            fields = [float(v) for v in row]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
            busy, total = busy + sum(fields) - idle, total + sum(fields)
    except (ValueError, IndexError):
        return None
    return (busy, total) if rows else None


def others_load(window: float = LOAD_WINDOW_S) -> tuple[float, str]:
    """``(cores' worth of load other processes put on the cores this process may use, how it was
    read)``: their busy time over ``window`` seconds while this process sleeps (Linux), else the
    1-minute load average."""
    cores = _allowed_cores()
    count = len(cores) if cores else (os.cpu_count() or 1)
    before, own, t0 = _cpu_times(cores), time.process_time(), time.perf_counter()
    if before is not None:
        time.sleep(window)
        after = _cpu_times(cores)
        if after is not None and after[1] > before[1]:
            # less this process's own (torch's threads may still spin after its last operation)
            mine = (time.process_time() - own) / max(time.perf_counter() - t0, 1e-6)
            return max(0.0, count * (after[0] - before[0]) / (after[1] - before[1]) - mine), "now"
    try:
        return min(float(count), os.getloadavg()[0]), "1-minute load average"
    except (AttributeError, OSError):  # Windows
        return 0.0, "unknown"


def forward_flops(model: nn.Module, sample_shape: Sequence[int]) -> float | None:
    """FLOPs of ``model``'s forward pass on one input of ``sample_shape``, counted on a copy on the
    meta device (no memory, no compute); None where the model cannot be counted so."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        meta = copy.deepcopy(model).to("meta").eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            meta(torch.empty(1, *sample_shape, device="meta"))
        return float(counter.get_total_flops())
    except Exception:  # any model the meta device cannot run: the rule then leaves size out
        return None


def choose_threads(cpus: int, busy: float, default: int, flops: float | None = None, how: str = "now") -> ThreadChoice:
    """The rule, on what was read: ``cpus`` usable cores, ``busy`` cores' worth of other
    processes' load (``how`` it was read), torch's ``default`` count, and the model's forward
    ``flops`` per input (None: unknown). One thread per core the others leave free, at most
    ``default``; one for a model below :data:`SMALL_FORWARD_FLOPS`.

    >>> choose_threads(2, 1.0, 2).threads
    1
    >>> choose_threads(2, 0.1, 2).threads
    2
    """
    taken = min(cpus, int(busy + 0.5))  # a core counts as taken when another process holds half of it
    free = max(1, cpus - taken)
    used = f"{busy:.1f} in use by other processes" + (f" ({how})" if how != "now" else "")
    parts = [f"{cpus} core{'s' if cpus != 1 else ''}", used]
    threads = max(1, min(default, free))
    if flops is not None:
        parts.append(f"a {flops / 1e6:.2g}-MFLOP forward pass")
        if flops < SMALL_FORWARD_FLOPS:
            threads = 1
            parts[-1] += " (small)"
    return ThreadChoice(threads, "chosen", ", ".join(parts))


def use_threads(
    model: nn.Module | None = None,
    sample_shape: Sequence[int] | None = None,
    *,
    say: Callable[[str], Any] | None = None,
) -> ThreadChoice:
    """Choose torch's CPU threads for a command's work (:func:`choose_threads` on this machine
    now), set them, and ``say`` the one line (default: stderr). A user's ``OMP_NUM_THREADS`` or
    ``torch.set_num_threads`` is kept, and then nothing is said."""
    global _SET_HERE
    own = user_threads()
    if own is not None:
        return ThreadChoice(torch.get_num_threads(), own.split("=")[0].split("(")[0], own)
    busy, how = others_load()
    flops = forward_flops(model, sample_shape) if model is not None and sample_shape is not None else None
    choice = choose_threads(usable_cpus(), busy, _AT_IMPORT, flops, how)
    torch.set_num_threads(choice.threads)
    _SET_HERE = choice.threads
    (say or (lambda line: print(line, file=sys.stderr, flush=True)))(choice.line())
    return choice


def slow_cause(threads: int, cpus: int, busy: float) -> str | None:
    """What a run that was too slow can see of why, in words: torch's ``threads`` against the
    ``cpus`` cores other processes left free (``busy``: cores' worth of their load), or the load
    alone; None where neither shows.

    >>> slow_cause(2, 2, 1.0).startswith("torch ran 2 threads")
    True
    """
    free = max(1, cpus - min(cpus, int(busy + 0.5)))
    load = f"other processes kept {busy:.1f} of the {cpus} cores busy"
    if threads > free:
        return (
            f"torch ran {threads} threads while {load}, so its threads waited for each other: rerun with "
            f"OMP_NUM_THREADS={free}"
        )
    if busy >= 0.5:
        return f"{load}: rerun when they are done"
    return None
