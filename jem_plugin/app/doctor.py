"""``jem doctor``: checks of the user's own machine, and their report.

Three parts, one dict (:func:`run_doctor`; ``jem doctor --json PATH`` writes it):

- **install**: the versions of torch, torchvision, timm and pluggy, and whether torch and
  torchvision belong together. The known failure: a CPU-only torch beside a CUDA torchvision (or a
  torchvision built for another torch) fails inside torchvision at import with ``RuntimeError:
  operator torchvision::nms does not exist``. :func:`install_problem` is the cheap part (about
  10 ms, torchvision's compiled operators loaded without its 1.5 s of Python imports) that
  ``jem demo`` and ``jem train`` run before they train.
- **devices**: the CPU, each CUDA device, MPS.
- **self_test** on one device: the CUDA-graph sampler against the eager one, a bf16-autocast
  channels_last JEM step, a device generator driving ``SGLD.sample``, and the time of one JEM
  training iteration against its FLOP floor. Each check is a function of a device returning
  ``{"status": "ok" | "warning" | "failed" | "skipped", "detail": one line, ...}``; one that fails does not
  stop the others.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import SGLD, JEMLoss, ReplayBuffer, wrap

PACKAGES = ("torch", "torchvision", "timm", "pluggy")
PYTORCH_INDEX = "https://download.pytorch.org/whl"

Check = dict[str, Any]


# ----------------------------------------------------------------------------- install
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torchvision_dir() -> Path | None:
    spec = importlib.util.find_spec("torchvision")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def _torchvision_version() -> str | None:
    """torchvision's own ``__version__`` (with its ``+cu124``/``+cpu`` label), read without importing it."""
    if "torchvision" in sys.modules:
        return str(getattr(sys.modules["torchvision"], "__version__", None) or _version("torchvision"))
    where = _torchvision_dir()
    try:
        text = (where / "version.py").read_text() if where is not None else ""
    except OSError:
        text = ""
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.M)
    return found.group(1) if found else _version("torchvision")


def check_torchvision_import() -> int | None:
    """Do what ``import torchvision`` does to its compiled operators; return their CUDA version.

    The version is in ``torchvision.version.cuda``'s form (``12040`` for 12.4), ``None`` for a
    CPU build. Raises the error ``import torchvision`` would raise on this install. The cheap path
    (milliseconds) loads torchvision's ``_C`` library as torchvision does; only when that fails
    (or the library is not where it usually is) is torchvision imported for real, so that what is
    reported is what a user would meet.
    """
    where = _torchvision_dir()
    if where is None:
        raise ModuleNotFoundError("No module named 'torchvision'")
    if "torchvision" not in sys.modules:
        finder = importlib.machinery.FileFinder(
            str(where), (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
        )
        spec = finder.find_spec("_C_stable") or finder.find_spec("_C")
        if spec is not None and spec.origin:
            try:
                torch.ops.load_library(spec.origin)
                if hasattr(torch.ops.torchvision, "nms"):
                    version = int(torch.ops.torchvision._cuda_version())
                    return version if version > 0 else None
            except (OSError, RuntimeError, AttributeError):
                pass  # the real import below says what a user would see
    import torchvision  # the slow path: 1.5 s, only where the cheap one could not tell

    built_for = getattr(torchvision.version, "cuda", None)
    return int(built_for) if built_for else None


def _cuda_text(version: int | None) -> str:
    """torchvision's ``12040`` as ``12.4``."""
    return "none" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _fix(torch_version: str, installed: bool = True) -> str:
    """The commands that install the torchvision made for this torch, from the index this torch came from.

    An ``installed`` torchvision is uninstalled first. pip ignores a local label that the requirement
    does not name, so the wrong build (``0.28.0+cu130`` beside a CPU-only torch) already satisfies
    ``torchvision==0.28.*``, and ``pip install`` alone changes nothing. With it gone, pip keeps the
    installed torch (``2.13.0+cpu`` satisfies ``torch==2.13.0``) and picks the index's torchvision
    that requires exactly that torch. ``--force-reinstall`` would also download torch again and
    replace every dependency with the index's version.
    """
    base, _, label = torch_version.partition("+")
    major, minor = (base.split(".") + ["0", "0"])[:2]
    tv = f'"torchvision==0.{int(minor) + 15}.*"' if major == "2" and minor.isdigit() else "torchvision"
    index = f" --index-url {PYTORCH_INDEX}/{label}" if re.fullmatch(r"cpu|cu\d+|rocm[\d.]+|xpu", label) else ""
    uninstall = "pip uninstall -y torchvision && " if installed else ""
    return f"{uninstall}pip install torch=={base} {tv}{index}"


def _requirement_problems(versions: dict[str, str | None]) -> list[str]:
    """torchvision's own pin on torch, and jem-plugin's requirements on the four packages."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with matplotlib; without it these checks are left out
        return []
    pins: list[tuple[str, str]] = []
    for owner in ("torchvision", "jem-plugin"):
        try:
            pins += [(owner, r) for r in importlib.metadata.requires(owner) or ()]
        except importlib.metadata.PackageNotFoundError:
            continue
    problems = []
    for owner, text in pins:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        have = versions.get(req.name)
        if req.name not in PACKAGES or req.marker is not None:
            continue
        if have is None:
            if owner == "jem-plugin" and req.name != "torchvision":  # a missing torchvision is reported above
                problems.append(f'{req.name} is not installed; pip install "{text}"')
            continue
        if not req.specifier:
            continue
        try:
            ok = req.specifier.contains(Version(have.partition("+")[0]), prereleases=True)
        except InvalidVersion:
            continue
        if ok:
            continue
        if owner == "torchvision":
            problems.append(
                f"torchvision {versions['torchvision']} was built for torch{req.specifier}, not torch "
                f"{have}; install the pair built together from one index: {_fix(have)}"
            )
        else:
            problems.append(f'{req.name} {have} does not satisfy jem-plugin\'s "{text}"; pip install "{text}"')
    return problems


def install_report(full: bool = True) -> dict[str, Any]:
    """Versions of torch, torchvision, timm and pluggy, their CUDA builds, and what does not match.

    ``problems`` holds one line per mismatch, each naming what is installed and the fix; empty when
    all is well. ``full=False`` is the cheap check (milliseconds); ``full=True`` also imports
    torchvision for real (about 1.5 s) and reads ``torchvision.version.cuda`` from it.
    """
    versions = {name: _version(name) for name in PACKAGES}
    versions["torch"] = torch.__version__
    versions["torchvision"] = _torchvision_version()
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "jem_plugin": _version("jem-plugin"),
        "versions": versions,
        "torch_cuda": torch.version.cuda,
        "torchvision_cuda": None,
        "problems": [],
    }
    problems: list[str] = report["problems"]
    t, tv = str(torch.__version__), versions["torchvision"]
    if tv is None:
        problems.append(f"torchvision is not installed; install the one made for torch {t}: {_fix(t, installed=False)}")
    else:
        try:
            tv_cuda = check_torchvision_import()
            if full:
                import torchvision

                tv_cuda = int(getattr(torchvision.version, "cuda", None) or 0) or None
            report["torchvision_cuda"] = _cuda_text(tv_cuda) if tv_cuda else None
        except Exception as exc:  # any import failure is the finding, reported in one line
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            problems.append(
                f"torchvision {tv} does not work with torch {t}: importing it fails ({reason}); "
                f"install the pair built together from one index: {_fix(t)}"
            )
        else:
            t_major = (torch.version.cuda or "").split(".")[0]
            if tv_cuda and not torch.version.cuda:
                problems.append(
                    f"torchvision {tv} is built for CUDA {_cuda_text(tv_cuda)} but torch {t} is CPU-only; "
                    f"install the pair built together from one index: {_fix(t)}"
                )
            elif tv_cuda and t_major and str(tv_cuda // 1000) != t_major:
                problems.append(
                    f"torchvision {tv} is built for CUDA {_cuda_text(tv_cuda)}, torch {t} for CUDA "
                    f"{torch.version.cuda}; install the pair built together from one index: {_fix(t)}"
                )
    problems += _requirement_problems(versions)
    return report


def install_problem() -> str | None:
    """The first install problem in one line (the fix included), or ``None``: the cheap check
    ``jem demo`` and ``jem train`` run before they train (milliseconds on a healthy install)."""
    problems = install_report(full=False)["problems"]
    return problems[0] if problems else None


# ----------------------------------------------------------------------------- devices
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def devices() -> dict[str, Any]:
    """The CPU (cores, torch's threads), each CUDA device (name, capability, memory), MPS."""
    cuda = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cuda.append(
                {
                    "device": f"cuda:{i}",
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
    return {
        "cpu": {"name": _cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "cuda": cuda,
        "mps": _mps_available(),
    }


def default_device() -> torch.device:
    """The device ``jem doctor`` tests when none is named: the GPU where there is one."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if _mps_available() else "cpu")


# ----------------------------------------------------------------------------- self-test
class _SmallCNN(nn.Module):
    """Two convolutions and a linear head (no BatchNorm): the checks' model, as in tests/test_cuda.py."""

    def __init__(self, k: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


_SHAPE = (3, 16, 16)


def _small(device: torch.device, channels_last: bool = False) -> tuple[nn.Module, Any]:
    with torch.random.fork_rng(devices=[]):  # the same weights every run; the caller's random state is kept
        torch.manual_seed(0)
        model = _SmallCNN().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, wrap(model, data_range=(-1.0, 1.0), input_size=_SHAPE, num_classes=10)


def _inputs(n: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.rand(n, *shape, generator=g) * 2 - 1).to(device)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _ok(detail: str, **values: Any) -> Check:
    return {"status": "ok", "detail": detail, **values}


def _failed(detail: str, **values: Any) -> Check:
    return {"status": "failed", "detail": detail, **values}


def check_cuda_graph(device: torch.device) -> Check:
    """SGLD captured as a CUDA graph (``cuda_graph="require"``) against the eager chain, same seed."""
    if device.type != "cuda":
        return {"status": "skipped", "detail": "needs a CUDA device"}
    _, jm = _small(device)
    x = _inputs(8, _SHAPE, device)
    eager = SGLD(steps=5, generator=_generator(device, 0), cuda_graph="off").run(jm, x)
    graph = SGLD(steps=5, generator=_generator(device, 0), cuda_graph="require").run(jm, x)
    diff = float((graph - eager).abs().max())
    if torch.equal(graph, x):
        return _failed("the CUDA-graph chains did not move in 5 SGLD steps", max_abs_diff=diff)
    if not torch.allclose(graph, eager, rtol=1e-4, atol=1e-4):
        return _failed(
            f"the CUDA-graph chains differ from the eager ones by up to {diff:.2g} (tolerance 1e-4); "
            'train with SGLD(cuda_graph="off") on this machine',
            max_abs_diff=diff,
        )
    return _ok(f"5 SGLD steps as a CUDA graph match the eager chain (max |difference| {diff:.1e})", max_abs_diff=diff)


def check_autocast_channels_last(device: torch.device) -> Check:
    """One JEM loss step under bf16 autocast with a channels_last model: a finite loss and gradients."""
    model, jm = _small(device, channels_last=True)
    x = _inputs(8, _SHAPE, device).contiguous(memory_format=torch.channels_last)
    y = torch.arange(8, device=device) % 10
    loss_fn = JEMLoss(
        sampler=SGLD(steps=3, generator=_generator(device, 0)),
        buffer=ReplayBuffer(64, _SHAPE),
        generator=_generator(device, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = loss_fn(jm, x, y)
    loss = float(out.loss.detach())
    if not torch.isfinite(out.loss.detach()):
        return _failed(f"the JEM loss under bf16 autocast is {loss}; train without --amp bf16 on this machine")
    opt.zero_grad()
    out.loss.backward()
    if not all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
        return _failed("non-finite gradients from the bf16-autocast JEM loss; train without --amp bf16 here")
    opt.step()
    return _ok(f"one JEM step under bf16 autocast, channels_last model: loss {loss:.3f}, finite gradients", loss=loss)


def check_generator(device: torch.device) -> Check:
    """``SGLD.sample`` driven by a ``torch.Generator`` on the device: samples there, finite, reproducible."""
    _, jm = _small(device)
    a = SGLD(steps=3, generator=_generator(device, 0)).sample(jm, 8)
    b = SGLD(steps=3, generator=_generator(device, 0)).sample(jm, 8)
    if a.device.type != device.type:
        return _failed(f"samples came back on {a.device}, not {device}")
    if not torch.isfinite(a).all():
        return _failed("SGLD.sample returned non-finite samples")
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        return _failed("the same generator seed gave different samples (beyond 1e-4)")
    return _ok(
        f"torch.Generator(device={device.type!r}) drives SGLD.sample: finite samples on {a.device}, reproducible"
    )


def iteration_flops_parts(
    model_fn: Callable[[], nn.Module], batch: int, chains: int, steps: int, shape: tuple[int, ...] = (3, 32, 32)
) -> dict[str, int]:
    """FLOPs of one JEM iteration and its parts, counted by ``torch.utils.flop_counter`` on the meta
    device: ``forward_per_image``, ``chain_step`` (a forward of the chains plus their input
    gradient, parameters frozen), ``train_step`` (forward and full backward of batch and chains
    together) and ``iteration`` (``steps`` chain steps and one training step)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model_fn().to("meta")

    def count(fn: Callable[[], Any]) -> int:
        with FlopCounterMode(display=False) as fc:
            fn()
        return int(fc.get_total_flops())

    def chain_step() -> None:
        for p in model.parameters():
            p.requires_grad_(False)
        x = torch.empty(chains, *shape, device="meta", requires_grad=True)
        model(x).logsumexp(1).sum().backward()  # the input gradient (FlopCounterMode rejects autograd.grad)
        for p in model.parameters():
            p.requires_grad_(True)

    def train_step() -> None:
        model(torch.empty(batch + chains, *shape, device="meta")).logsumexp(1).sum().backward()

    step, train = count(chain_step), count(train_step)
    return {
        "forward_per_image": count(lambda: model(torch.empty(1, *shape, device="meta"))),
        "chain_step": step,
        "train_step": train,
        "iteration": steps * step + train,
    }


def iteration_flops(
    model_fn: Callable[[], nn.Module], batch: int, chains: int, steps: int, shape: tuple[int, ...] = (3, 32, 32)
) -> int:
    """FLOPs of one JEM iteration (see :func:`iteration_flops_parts`)."""
    return iteration_flops_parts(model_fn, batch, chains, steps, shape)["iteration"]


def matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """The throughput a large square matmul achieves on the device (TFLOP/s), timed for about ``seconds``."""
    n = 8192 if device.type == "cuda" else 2048 if device.type == "mps" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b  # warm-up
    _synchronize(device)
    reps, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10 if device.type != "cpu" else 1):
            a @ b
            reps += 1
        _synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and reps >= 2:
            return 2 * n**3 * reps / elapsed / 1e12


#: An iteration this many times its FLOP floor (or more) is called slow: ``jem doctor`` then does not
#: say "all good" (on 2 cores beside one busy process torch's 2 threads took 10.1x, issue 59).
SLOW_X_FLOOR = 10.0
#: One thread must be this much faster than torch's count before the doctor recommends it.
THREADS_MARGIN = 1.1


def _time_iterations(
    iteration: Callable[[], None], device: torch.device, seconds: float, warmup: int
) -> tuple[float, int]:
    """``(ms per iteration, iterations timed)``: ``warmup`` untimed, then for about ``seconds``."""
    for _ in range(warmup):  # kernels chosen, graph captured, buffer on the device
        iteration()
    _synchronize(device)
    n, t0 = 0, time.perf_counter()
    while True:
        iteration()
        n += 1
        _synchronize(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e3, n


def thread_advice(ms_by_threads: dict[int, float], current: int) -> tuple[int, str | None]:
    """``(the faster thread count, one line or None)`` from the iteration's milliseconds at each
    count timed (torch's ``current`` count and one thread): the line says which is faster here and
    how to set it, None where ``current`` is as fast (within :data:`THREADS_MARGIN`).

    >>> thread_advice({2: 17300.0, 1: 970.0}, 2)[0]
    1
    """
    best = min(ms_by_threads, key=lambda t: ms_by_threads[t])
    if best == current or ms_by_threads[current] <= THREADS_MARGIN * ms_by_threads[best]:
        return current, None
    ratio = ms_by_threads[current] / ms_by_threads[best]
    plural = "s" if best != 1 else ""
    return best, (
        f"{best} thread{plural} ran it {ratio:.1f}x faster than torch's {current} here (another process busy on a "
        f"core, or a small model): set OMP_NUM_THREADS={best} or call torch.set_num_threads({best}) in your own "
        "loops; the jem commands choose their threads themselves"
    )


def timing_status(x_floor: float, advice: str | None) -> tuple[str, str | None]:
    """``("ok" | "warning", what is wrong or None)`` for an iteration at ``x_floor`` times its FLOP
    floor, with the thread ``advice`` of :func:`thread_advice`: slow at :data:`SLOW_X_FLOOR` or
    more, or where another thread count was faster.

    >>> timing_status(10.1, None)[0]
    'warning'
    """
    if x_floor >= SLOW_X_FLOOR:
        why = f"the iteration takes {x_floor:.1f}x its FLOP floor (slow from {SLOW_X_FLOOR:g}x)"
        return "warning", f"{why}; {advice}" if advice else f"{why}: is another process busy on this machine?"
    if advice:
        return "warning", advice
    return "ok", None


def check_timing(device: torch.device, seconds: float = 20.0, *, batch: int = 64, sgld_steps: int = 20) -> Check:
    """One JEM training iteration (forward, SGLD, backward, step) timed for about ``seconds``.

    WRN-10-1 (the paper's network, narrow) at ``batch`` 32x32 images and as many chains. On CUDA in
    the recommended set-up (bf16 autocast, channels_last, the CUDA-graph sampler), elsewhere fp32.
    On the CPU it is timed twice, half the time each: at torch's thread count and at one thread
    (on a busy machine one thread can be many times faster); the faster is the result, and the
    detail says which it was and how to set it (:func:`thread_advice`). Its FLOPs divided by a
    matmul's throughput measured in the same run (at the faster count) give the floor; an iteration
    at :data:`SLOW_X_FLOOR` times the floor or more is a ``"warning"``, not ``"ok"``.
    """
    from .nets import WideResNet

    shape = (3, 32, 32)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def build() -> nn.Module:
        return WideResNet(10, 1, num_classes=10)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build().to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    jm = wrap(model, data_range=(-1.0, 1.0), input_size=shape, num_classes=10)
    loss_fn = JEMLoss(
        sampler=SGLD(steps=sgld_steps, generator=_generator(device, 0), cuda_graph="auto" if cuda else "off"),
        buffer=ReplayBuffer(1000, shape),
        n_samples=batch,
        generator=_generator(device, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = _inputs(batch, shape, device)
    if cuda:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.arange(batch, device=device) % 10

    def iteration() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = loss_fn(jm, x, y)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    current = torch.get_num_threads()
    counts = [current, 1] if device.type == "cpu" and current > 1 else [current]
    ms_by_threads: dict[int, float] = {}
    timed: dict[int, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for count in counts:
                torch.set_num_threads(count)
                ms_by_threads[count], timed[count] = _time_iterations(
                    iteration, device, seconds / len(counts), 2 if cuda else 1
                )
            best, advice = thread_advice(ms_by_threads, current)
            torch.set_num_threads(best)  # the floor at the count the iteration ran best at
            flops = iteration_flops(build, batch, batch, sgld_steps, shape)
            tflops = matmul_tflops(device, dtype, min(1.0, max(seconds, 0.05)))
        finally:
            torch.set_num_threads(current)
    ms, n = ms_by_threads[best], timed[best]
    floor_ms = flops / (tflops * 1e12) * 1e3
    status, problem = timing_status(ms / floor_ms, advice)
    dtype_name = str(dtype).removeprefix("torch.")
    setup = "bf16 autocast, channels_last, CUDA-graph sampler" if cuda else "fp32"
    threads = (
        ", ".join(f"{_duration(v)} at {t} thread{'s' if t != 1 else ''}" for t, v in ms_by_threads.items())
        if len(ms_by_threads) > 1
        else None
    )
    fallback = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    detail = (
        f"{1e3 / ms:.3g} iterations/s ({_duration(ms)} each, {n} timed"
        + (f"; {threads}" if threads else "")
        + f") of WRN-10-1, batch {batch} + {batch} chains x {sgld_steps} SGLD steps, {setup}; {flops / 1e9:.3g} "
        f"GFLOP each, which a {dtype_name} matmul at the {tflops:.3g} TFLOP/s measured here does in "
        f"{_duration(floor_ms)}: this iteration takes {ms / floor_ms:.1f}x its FLOP floor"
        + (f" ({fallback[0]})" if fallback else "")
        + (f"; {problem}" if problem else "")
    )
    return {
        "status": status,
        "detail": detail,
        "iterations_per_s": 1e3 / ms,
        "ms_per_iteration": ms,
        "iterations_timed": n,
        "ms_per_iteration_by_threads": {str(t): v for t, v in ms_by_threads.items()},
        "threads": best,
        "model": "WRN-10-1",
        "batch": batch,
        "chains": batch,
        "sgld_steps": sgld_steps,
        "dtype": dtype_name,
        "iteration_gflop": flops / 1e9,
        "matmul_tflops": tflops,
        "floor_ms": floor_ms,
        "x_floor": ms / floor_ms,
    }


def _duration(ms: float) -> str:
    return f"{ms / 1e3:.3g} s" if ms >= 999.5 else f"{ms:.3g} ms"


def _run_check(fn: Callable[..., Check], device: torch.device, **kwargs: Any) -> Check:
    t0 = time.perf_counter()
    try:
        result = fn(device, **kwargs)
    except Exception as exc:  # a failing check is reported in one line; the others still run
        text = str(exc).strip()
        result = _failed(f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else 'no message'}")
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


CHECKS: dict[str, Callable[..., Check]] = {
    "cuda_graph": check_cuda_graph,
    "autocast_channels_last": check_autocast_channels_last,
    "generator": check_generator,
    "timing": check_timing,
}


def self_test(
    device: torch.device | str, seconds: float = 20.0, on_check: Callable[[str, Check], Any] | None = None
) -> dict[str, Check]:
    """Every check on ``device`` (``seconds=0`` leaves the timing out); ``on_check(name, result)`` after each."""
    device = torch.device(device)
    checks: dict[str, Check] = {}
    for name, fn in CHECKS.items():
        if name != "timing":
            checks[name] = _run_check(fn, device)
        elif seconds > 0:
            checks[name] = _run_check(fn, device, seconds=seconds)
        else:
            checks[name] = {"status": "skipped", "detail": "--seconds 0", "seconds": 0.0}
        if on_check is not None:
            on_check(name, checks[name])
    return checks


# ----------------------------------------------------------------------------- report
def install_lines(install: dict[str, Any]) -> list[str]:
    """The install part of the printed report."""
    v = install["versions"]
    cuda = f"CUDA {install['torch_cuda']}" if install["torch_cuda"] else "CPU-only"
    tv_cuda = f"CUDA {install['torchvision_cuda']}" if install["torchvision_cuda"] else "no CUDA ops"
    lines = [
        f"python {install['python']}, jem-plugin {install['jem_plugin']}",
        f"torch {v['torch']} ({cuda}), torchvision {v['torchvision']} ({tv_cuda}), timm {v['timm']}, "
        f"pluggy {v['pluggy']}: " + ("they match" if not install["problems"] else "MISMATCH"),
    ]
    return lines + [f"PROBLEM: {p}" for p in install["problems"]]


def device_lines(devs: dict[str, Any]) -> list[str]:
    """The devices part of the printed report."""
    c = devs["cpu"]
    lines = [f"cpu: {c['name']}, {c['cores']} cores, torch uses {c['torch_threads']} threads"]
    lines += [f"{d['device']}: {d['name']}, capability {d['capability']}, {d['memory_gib']} GiB" for d in devs["cuda"]]
    if not devs["cuda"]:
        lines.append(
            "cuda: none"
            + (f" (torch is built for CUDA {torch.version.cuda}; no device is visible)" if torch.version.cuda else "")
        )
    lines.append(f"mps: {'present' if devs['mps'] else 'none'}")
    return lines


def check_line(name: str, check: Check) -> str:
    """One self-test check as a line: status, name, reason."""
    return f"{check['status']:<7}  {name}: {check['detail']}"


def run_doctor(
    device: torch.device | str = "cpu", seconds: float = 20.0, echo: Callable[[str], Any] | None = None
) -> dict[str, Any]:
    """Check this machine: the install, the devices, and the self-test on ``device``.

    Returns the report ``jem doctor --json`` writes: ``install`` (``versions``, ``problems``, ...),
    ``devices``, ``device`` and ``self_test`` (one entry per check, each with ``status``
    ``ok``/``failed``/``skipped`` and a one-line ``detail``), and ``ok``: no install problem and
    no failed check. ``echo`` receives each line of the printed report as it is ready.
    """
    say = echo or (lambda line: None)
    device = torch.device(device)
    report: dict[str, Any] = {"install": install_report(full=True)}
    say("install")
    for line in install_lines(report["install"]):
        say(f"  {line}")
    report["devices"] = devices()
    say("devices")
    for line in device_lines(report["devices"]):
        say(f"  {line}")
    report["device"] = str(device)
    say(f"self-test on {device}" + (f" (timing for about {seconds:g} s)" if seconds > 0 else ""))
    checks = report["self_test"] = self_test(device, seconds, lambda name, c: say(f"  {check_line(name, c)}"))
    failed = [name for name, c in checks.items() if c["status"] == "failed"]
    report["ok"] = not report["install"]["problems"] and not failed
    say(summary_line(report))
    return report


def summary_line(report: dict[str, Any]) -> str:
    """The report's last line: "all good" only when nothing failed and no check warned (a training
    iteration at :data:`SLOW_X_FLOOR` times its floor, or a faster thread count); else what to read."""
    checks = report["self_test"]
    failed = [name for name, c in checks.items() if c["status"] == "failed"]
    warned = [name for name, c in checks.items() if c["status"] == "warning"]
    if not report["ok"]:
        return f"{len(report['install']['problems'])} install problem(s), {len(failed)} failed check(s)" + (
            f": {', '.join(failed)}" if failed else ""
        )
    if warned:
        return f"works, with {len(warned)} warning(s): {', '.join(warned)} (see above)"
    return "all good"
