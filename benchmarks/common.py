"""Shared machinery of the benchmarks: machine description, models, the floor, timing, memory.

Why each piece is the way it is:

- **Interleaving.** The machine is shared, so load drifts over minutes. Every contender runs once
  per round (A, B, C, D, then the next round, with the order rotated each round so that no
  contender always follows the same one) and we report medians. Ratios are the median over rounds
  of the *paired* ratio ``t_X[i] / t_floor[i]`` (robust to drift), next to the plain ratio of medians.
- **Threads.** ``torch.set_num_threads(1)`` by default (``--threads`` to change): on 2 shared cores
  more threads only add noise.
- **Memory.** ``tracemalloc`` does not see torch's allocations, so on CPU every memory figure is
  the ``ru_maxrss`` (peak resident set) growth of a *fresh subprocess* across the measured call; on
  CUDA it is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The three models of issue 6, with their input shapes. All are evaluated in [-1, 1] (the JEM
# convention, and what the reference code feeds its WideResNet), so every contender samples the
# same energy on the same domain.
MODELS = {
    "digits_cnn": (1, 8, 8),
    "test_resnet": (3, 32, 32),
    "resnet10t": (3, 32, 32),
}


# ---------------------------------------------------------------------- environment
def set_threads(n: int) -> None:
    torch.set_num_threads(int(n))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model, cores, torch version and threads, GPU."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "timm": _version("timm"),
        "torchebm": _version("torchebm"),
        "pytorch-ood": _version("pytorch-ood"),
        "jem-plugin": _version("jem-plugin"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    return info


def machine_markdown(info: dict[str, Any]) -> str:
    gpu = info.get("gpu") or "none"
    load = info.get("load_average")
    load_s = ", ".join(f"{v:.2f}" for v in load) if load else "n/a"
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores (shared), torch {info['torch']} "
        f"with {info['torch_threads']} thread(s), Python {info['python']}, GPU: {gpu}. "
        f"timm {info.get('timm')}, torchebm {info.get('torchebm')}, pytorch-ood "
        f"{info.get('pytorch-ood')}. Load average at start: {load_s}."
    )


# ---------------------------------------------------------------------- models
def make_model(name: str, num_classes: int = 10, seed: int = 0) -> tuple[nn.Module, Any, tuple[int, ...]]:
    """``(model, jm, input_shape)``: a randomly initialised classifier (``pretrained=False``) and its JEM.

    The model is returned in eval mode: sampling benchmarks compare contenders on the same
    deterministic energy (BatchNorm using running statistics, no Dropout), since the reference
    loop and torchebm do not manage modes the same way (documented in the README).
    """
    import jem_plugin as jem

    torch.manual_seed(seed)
    shape = MODELS[name]
    if name == "digits_cnn":
        from jem_plugin.app.nets import DigitsCNN

        model = DigitsCNN(num_classes=num_classes)
    else:
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    model.eval()
    jm = jem.wrap(model, data_range=(-1.0, 1.0), input_size=shape, num_classes=num_classes)
    return model, jm, shape


def uniform_batch(n: int, shape: Sequence[int], seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, *shape), generator=g) * 2 - 1


# ---------------------------------------------------------------------- the floor
class frozen:
    """Context manager: parameters ``requires_grad=False`` inside, the previous flags after."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)
        return self

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)
        return False


def floor_chain(
    model: nn.Module,
    x0: Tensor,
    steps: int,
    step_size: float = 1.0,
    noise: float = 0.01,
    generator: torch.Generator | None = None,
    y: Tensor | None = None,
) -> Tensor:
    """The FLOOR: ``steps`` x [forward, input gradient of logsumexp, in-place Langevin update].

    Nothing else: no buffer, no mode handling, no clamp, no checks. The caller freezes the
    parameters beforehand (outside the timed region) so that autograd records the input path
    only: the least work any sampler can do. The noise is drawn with ``Tensor.normal_`` from
    ``generator`` into one reused buffer, the way a careful hand-written loop would.
    """
    x = x0.detach().clone().requires_grad_(True)
    xd = x.detach()
    buf = torch.empty_like(xd)
    for _ in range(steps):
        out = model(x)
        score = torch.logsumexp(out, 1) if y is None else out.gather(1, y.view(-1, 1))
        (g,) = torch.autograd.grad(score.sum(), x)
        xd.add_(g, alpha=step_size)
        if noise > 0:
            xd.add_(buf.normal_(generator=generator), alpha=noise)
    return xd


# ---------------------------------------------------------------------- timing
class Contender:
    """One timed thing: ``fn()`` is timed; ``setup()``/``teardown()`` run around it, untimed;
    ``prepare()`` runs once before anything (one-time allocations such as filling a buffer)."""

    def __init__(
        self,
        fn: Callable[[], Any],
        setup: Callable[[], Any] | None = None,
        teardown: Callable[[], Any] | None = None,
        prepare: Callable[[], Any] | None = None,
    ) -> None:
        self.fn, self.setup, self.teardown, self.prepare = fn, setup, teardown, prepare


def _as_contender(c: Any) -> Contender:
    return c if isinstance(c, Contender) else Contender(c)


def interleaved(
    contenders: dict[str, Any],
    repeats: int = 15,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time every contender once per round for ``repeats`` rounds (order rotated per round).

    Returns ``{name: [seconds per round]}``. ``warmup`` untimed rounds first (oneDNN primitive
    caches, allocator growth, lazy imports). ``clock``: wall time by default; ``time.process_time``
    (CPU seconds) on a machine others load, where wall time counts their work too.
    """
    items = [(k, _as_contender(v)) for k, v in contenders.items()]
    times: dict[str, list[float]] = {k: [] for k, _ in items}
    n = len(items)
    log = os.environ.get("JEM_BENCH_LOG")  # progress on stderr for long runs
    for _, c in items:
        if c.prepare is not None:
            c.prepare()
    # Collections happen between timed calls, never inside one. freeze(): everything alive now
    # (torch, timm, the models) is never scanned again, so each collect costs microseconds.
    gc.collect()
    gc.freeze()
    try:
        for r in range(warmup + repeats):
            rot = r % n
            order = items[rot:] + items[:rot]
            for name, c in order:
                if c.setup is not None:
                    c.setup()
                gc.collect()
                gc.disable()
                t0 = clock()
                try:
                    c.fn()
                finally:
                    dt = clock() - t0
                    gc.enable()
                if c.teardown is not None:
                    c.teardown()
                if r >= warmup:
                    times[name].append(dt)
            if log:
                print(
                    f"[interleaved] round {r + 1}/{warmup + repeats}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items() if v),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        gc.unfreeze()
    return times


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and relative spread (IQR / median, our noise figure)."""
    s = sorted(samples)
    med = statistics.median(s)
    if len(s) >= 4:
        q = statistics.quantiles(s, n=4)
        q1, q3 = q[0], q[2]
    else:
        q1, q3 = s[0], s[-1]
    return {
        "median_s": med,
        "q1_s": q1,
        "q3_s": q3,
        "min_s": s[0],
        "spread": (q3 - q1) / med if med > 0 else float("nan"),
        "n": len(s),
    }


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over rounds of ``a[i] / b[i]``: the ratio of two interleaved contenders."""
    return statistics.median([x / y for x, y in zip(a, b)])


def ratios(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Per contender: timing summary, paired median ratio and ratio of medians against ``base``."""
    out = {}
    med_base = statistics.median(times[base])
    for name, t in times.items():
        s = summarize(t)
        s["ratio"] = paired_ratio(t, times[base])
        s["ratio_of_medians"] = s["median_s"] / med_base
        out[name] = s
    return out


# ---------------------------------------------------------------------- memory
def maxrss_kb() -> int:
    """Peak resident set size of this process so far, in KiB (Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (``VmHWM``) to the current RSS (Linux >= 4.0).

    Without it the peak of a call hides under the peak of ``import torch`` or model building
    (freed large tensors go back to the OS, so the current RSS can sit far below the old peak).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_kb() -> int | None:
    return _status_kb("VmRSS")


def peak_rss_kb() -> int | None:
    return _status_kb("VmHWM")


def probe_memory(config: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """Run ``benchmarks._memprobe`` with ``config`` in a fresh interpreter; returns its JSON answer.

    A fresh process per configuration: ``ru_maxrss`` is a high-water mark, so the only way to see
    the peak of one call is a process that has done nothing bigger before it.
    """
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(config.get("threads", 1)))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks._memprobe", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- output
def fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None or r != r else f"{r:.3f}x"


def fmt_ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.1f}"


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=_json_default)
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, (torch.dtype, torch.device)):
        return str(o)
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return str(o)


def write_markdown(out_dir: str, name: str, machine: dict[str, Any], md: str) -> None:
    """``OUT/<name>.md``: a benchmark's Markdown under its title and the machine it ran on."""
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(f"# {name}\n\n{machine_markdown(machine)}\n\n{md}\n")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def target_mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def standalone_main(
    name: str,
    run: Callable[..., dict],
    to_markdown: Callable[[dict], str],
    argv: Sequence[str] | None = None,
    extra_args: Callable | None = None,
) -> dict:
    """The ``__main__`` of every ``bench_*.py``: parse common flags, run, write JSON and Markdown."""
    import argparse

    p = argparse.ArgumentParser(description=f"jem-plugin benchmark: {name}")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of seconds")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machine)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 15, quick 3)")
    if extra_args is not None:
        extra_args(p)
    args = p.parse_args(argv)
    set_threads(args.threads)
    kwargs = {k: v for k, v in vars(args).items() if k not in ("out", "threads")}
    kwargs["out_dir"] = args.out
    res = run(**kwargs)
    res = {"machine": machine_info(), name: res}
    write_json(os.path.join(args.out, f"{name}.json"), res)
    md = f"# {name}\n\n{machine_markdown(res['machine'])}\n\n{to_markdown(res[name])}\n"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)
    return res


def ensure_repo_on_path() -> None:
    """Let ``python benchmarks/bench_x.py`` import ``benchmarks.*`` like ``python -m`` does."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
