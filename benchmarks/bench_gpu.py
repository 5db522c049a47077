"""JEM on a GPU (issue 15): the paper's WRN-28-10 iteration, SGLD against the eager chain, memory.

    python -m benchmarks.bench_gpu --out benchmarks/results      # on a CUDA machine
    python -m benchmarks.bench_gpu --flops-only                  # FLOP count of the iteration (any machine)

Without a GPU it prints one line and exits 0: every figure here must come from a GPU run.

(a) One JEM iteration of WRN-28-10 (no normalisation, LeakyReLU 0.2): a batch of 64 plus 64
    chains x 20 SGLD steps from a 10,000-sample replay buffer (5 % restarts), Adam. A plain
    PyTorch Algorithm-1 loop in fp32 against jem-plugin in fp32, bf16 autocast, bf16 +
    channels_last, and bf16 + channels_last with the CUDA-graph sampler (and fp32 with it).
    Each variant: median ms of >= 10 timed iterations after warm-up (``torch.cuda.synchronize``
    around each), the ratio to the FLOP floor (the iteration's FLOPs counted with
    ``torch.utils.flop_counter`` on the meta device, over the assumed dense bf16 peak; both the
    datasheet peak and the issue's 790 TFLOP/s are reported) and the hours for 150 CIFAR-10
    epochs (117,300 iterations). Convolutions use TF32 in fp32 (PyTorch's cuDNN default).
(b) ``SGLD.sample`` (64 chains x 20 steps, CUDA graph "auto", and "off") against the eager
    reference chain (:func:`benchmarks.common.floor_chain`: forward, input gradient, update,
    noise) on resnet10t, test_resnet (timm), resnet18 (torchvision), WRN-28-10, 3x32x32.
(c) Peak memory (``torch.cuda.max_memory_allocated`` above the resident model) of each of them.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

NAME = "gpu"
NO_GPU_NOTE = "bench_gpu: no CUDA device on this machine; the GPU figures are not measured (run it on a GPU)"
ITERATIONS_150_EPOCHS = 117_300  # 150 epochs x ceil(50,000 / 64) CIFAR-10 batches
ISSUE_PEAK_TFLOPS = 790.0  # the figure issue 15 used
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, by device-name fragment.
DATASHEET_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}
BATCH, CHAINS, STEPS = 64, 64, 20
SHAPE = (3, 32, 32)


# ---------------------------------------------------------------------- FLOPs
def _wrn(depth: int = 28, width: int = 10) -> nn.Module:
    from jem_plugin.app.nets import WideResNet

    return WideResNet(depth, width, 10)


def iteration_flops(
    model_fn: Callable[[], nn.Module] = _wrn, batch: int = BATCH, chains: int = CHAINS, steps: int = STEPS, shape=SHAPE
) -> dict[str, float]:
    """FLOPs of one JEM iteration, counted as ``jem doctor`` counts them
    (:func:`jem_plugin.app.doctor.iteration_flops_parts`), in the units this benchmark reports."""
    from jem_plugin.app.doctor import iteration_flops_parts

    parts = iteration_flops_parts(model_fn, batch, chains, steps, tuple(shape))
    return {
        "forward_gflop_per_image": parts["forward_per_image"] / 1e9,
        "chain_step_tflop": parts["chain_step"] / 1e12,
        "train_step_tflop": parts["train_step"] / 1e12,
        "iteration_tflop": parts["iteration"] / 1e12,
    }


def datasheet_peak(name: str) -> float | None:
    for frag, peak in DATASHEET_PEAK_TFLOPS.items():
        if frag in name:
            return peak
    return None


# ---------------------------------------------------------------------- timing helpers
def _timed(fn: Callable[[], Any], iters: int, warmup: int) -> dict[str, float]:
    """Median of ``iters`` synchronised calls after ``warmup``; the peak memory above the start."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "n": iters,
        "peak_mb_above_start": (torch.cuda.max_memory_allocated() - base) / 2**20,
    }


def _fresh_wrn(channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = _wrn().cuda()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return model


def _data(channels_last: bool = False):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(BATCH, *SHAPE, device="cuda", generator=g) * 2 - 1
    y = torch.randint(0, 10, (BATCH,), device="cuda", generator=g)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), y


def plain_algorithm1(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """JEM's Algorithm 1 written directly in PyTorch (the reference code's structure, fp32)."""
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    buffer = torch.rand(10000, *SHAPE, device="cuda") * 2 - 1
    params = list(model.parameters())

    def iteration():
        idx = torch.randint(0, buffer.shape[0], (CHAINS,), device="cuda")
        x0 = buffer[idx]
        fresh = torch.rand(CHAINS, *SHAPE, device="cuda") * 2 - 1
        x0 = torch.where((torch.rand(CHAINS, device="cuda") < 0.05).view(-1, 1, 1, 1), fresh, x0)
        for p in params:
            p.requires_grad_(False)
        xk = x0.clone().requires_grad_(True)
        for _ in range(STEPS):
            (g,) = torch.autograd.grad(model(xk).logsumexp(1).sum(), xk)
            xk.data.add_(g).add_(torch.randn_like(xk), alpha=0.01).clamp_(-1, 1)
        for p in params:
            p.requires_grad_(True)
        xs = xk.detach()
        buffer[idx] = xs
        xd = x + 0.03 * torch.randn_like(x)
        logits = model(torch.cat([xd, xs]))
        ld, ls = logits[:BATCH], logits[BATCH:]
        loss = F.cross_entropy(ld, y) - ld.logsumexp(1).mean() + ls.logsumexp(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return iteration


def jem_iteration(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None, cuda_graph: str
) -> Callable[[], None]:
    import jem_plugin as jem

    jm = jem.wrap(model, data_range=(-1.0, 1.0), input_size=SHAPE, num_classes=10)
    sampler = jem.SGLD(steps=STEPS, generator=torch.Generator(device="cuda").manual_seed(2), cuda_graph=cuda_graph)
    loss_fn = jem.JEMLoss(sampler=sampler, buffer=jem.ReplayBuffer(10000, SHAPE, device="cuda"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ctx = (lambda: torch.autocast("cuda", dtype=amp)) if amp is not None else contextlib.nullcontext

    def iteration():
        with ctx():
            out = loss_fn(jm, x, y)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    return iteration


VARIANTS = {  # name: (implementation, autocast dtype, channels_last, cuda_graph)
    "plain_fp32": ("plain", None, False, "off"),
    "jem_fp32": ("jem", None, False, "off"),
    "jem_fp32_graph": ("jem", None, False, "require"),
    "jem_bf16": ("jem", torch.bfloat16, False, "off"),
    "jem_bf16_channels_last": ("jem", torch.bfloat16, True, "off"),
    "jem_bf16_channels_last_graph": ("jem", torch.bfloat16, True, "require"),
}


def wrn_iteration(iters: int, warmup: int, flops: dict[str, float], peak: float | None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (impl, amp, cl, graph) in VARIANTS.items():
        try:
            model = _fresh_wrn(cl)
            x, y = _data(cl)
            fn = plain_algorithm1(model, x, y) if impl == "plain" else jem_iteration(model, x, y, amp, graph)
            r = _timed(fn, iters, warmup)
            s = r["median_ms"] / 1e3
            for label, p in (("datasheet", peak), ("issue_790", ISSUE_PEAK_TFLOPS)):
                if p:
                    r[f"x_flop_floor_{label}"] = s / (flops["iteration_tflop"] / p)
            r["hours_150_epochs"] = s * ITERATIONS_150_EPOCHS / 3600
            res[name] = r
        except Exception as exc:  # a variant that fails is reported, not fatal
            res[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        finally:
            model = fn = None
            gc.collect()
            torch.cuda.empty_cache()
    if "jem_fp32" in res and "plain_fp32" in res and "median_ms" in res["jem_fp32"]:
        res["jem_fp32_vs_plain"] = res["jem_fp32"]["median_ms"] / res["plain_fp32"]["median_ms"]
    return res


def _sampler_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(weights=None, num_classes=10)
    if name == "wrn28_10":
        return _wrn()
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10)


def sampler_vs_eager(names, iters: int, warmup: int) -> dict[str, Any]:
    import jem_plugin as jem

    res: dict[str, Any] = {}
    for name in names:
        try:
            model = _sampler_model(name).cuda().eval()
            jm = jem.wrap(model, data_range=(-1.0, 1.0), input_size=SHAPE, num_classes=10)
            x0 = torch.rand(CHAINS, *SHAPE, device="cuda") * 2 - 1
            gen = torch.Generator(device="cuda").manual_seed(0)
            r: dict[str, Any] = {}
            with common.frozen(model):
                r["eager_reference"] = _timed(
                    lambda m=model, x=x0, g=gen: common.floor_chain(m, x, STEPS, generator=g), iters, warmup
                )
            for mode in ("auto", "off"):
                s = jem.SGLD(steps=STEPS, clamp=False, generator=gen, cuda_graph=mode)
                r[f"sgld_{mode}"] = _timed(lambda s=s, j=jm, x=x0: s.sample(j, x_init=x), iters, warmup)
                r[f"speedup_{mode}"] = r["eager_reference"]["median_ms"] / r[f"sgld_{mode}"]["median_ms"]
            res[name] = r
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        finally:
            model = jm = None
            gc.collect()
            torch.cuda.empty_cache()
    return res


def run(quick: bool = False, repeats: int | None = None, **_: Any) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"note": NO_GPU_NOTE}
    iters = max(repeats or 10, 10)
    warmup = 3
    name = torch.cuda.get_device_name(0)
    peak = datasheet_peak(name)
    flops = iteration_flops()
    res: dict[str, Any] = {
        "gpu": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "peak_tflops_datasheet": peak,
        "peak_tflops_issue": ISSUE_PEAK_TFLOPS,
        "flops": flops,
        "iters": iters,
        "warmup": warmup,
    }
    res["wrn_iteration"] = wrn_iteration(iters, warmup, flops, peak)
    models = ["test_resnet"] if quick else ["resnet10t", "test_resnet", "resnet18", "wrn28_10"]
    res["sampler"] = sampler_vs_eager(models, iters, warmup)
    return res


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "n/a"


def to_markdown(res: dict) -> str:
    if "note" in res:
        return res["note"]
    fl = res["flops"]
    lines = [
        (
            f"GPU: {res['gpu']} (torch {res['torch']}, CUDA {res['cuda']}). Medians of {res['iters']} "
            f"synchronised iterations after {res['warmup']} warm-up ones."
        ),
        "",
        (
            f"WRN-28-10: {fl['forward_gflop_per_image']:.2f} GFLOP per image forward; one iteration "
            f"({BATCH} + {CHAINS} chains x {STEPS} steps) is {fl['iteration_tflop']:.1f} TFLOP "
            "(torch.utils.flop_counter). FLOP floor at the assumed dense bf16 peak: datasheet "
            f"{_f(res['peak_tflops_datasheet'], '{:.0f}')} TFLOP/s, and the issue's {res['peak_tflops_issue']:.0f}."
        ),
        "",
    ]
    rows = []
    for name, r in res["wrn_iteration"].items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            rows.append([name, "ERROR: " + r["error"], "", "", "", ""])
            continue
        rows.append(
            [
                name,
                _f(r["median_ms"]),
                _f(r.get("x_flop_floor_datasheet"), "{:.2f}x"),
                _f(r.get("x_flop_floor_issue_790"), "{:.2f}x"),
                _f(r["hours_150_epochs"], "{:.2f}"),
                _f(r["peak_mb_above_start"], "{:.0f}"),
            ]
        )
    lines.append(
        common.md_table(
            ["variant", "ms / iteration", "x floor (datasheet)", "x floor (790)", "h for 150 epochs", "peak MB"], rows
        )
    )
    if "jem_fp32_vs_plain" in res["wrn_iteration"]:
        lines.append(f"\njem-plugin fp32 eager / plain fp32 loop: {res['wrn_iteration']['jem_fp32_vs_plain']:.3f}x")
    rows = []
    for name, r in res["sampler"].items():
        if "error" in r:
            rows.append([name, "ERROR: " + r["error"], "", "", "", "", ""])
            continue
        rows.append(
            [
                name,
                _f(r["eager_reference"]["median_ms"]),
                _f(r["sgld_auto"]["median_ms"]),
                _f(r["speedup_auto"], "{:.2f}x"),
                _f(r["sgld_off"]["median_ms"]),
                _f(r["speedup_off"], "{:.2f}x"),
                f"{r['eager_reference']['peak_mb_above_start']:.0f} / {r['sgld_auto']['peak_mb_above_start']:.0f}",
            ]
        )
    lines += [
        "",
        f"SGLD.sample, {CHAINS} chains x {STEPS} steps, {SHAPE}:",
        "",
        common.md_table(
            [
                "model",
                "eager reference ms",
                "SGLD graph ms",
                "speed-up",
                "SGLD eager ms",
                "speed-up",
                "peak MB ref / graph",
            ],
            rows,
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--flops-only" in args:
        print(iteration_flops())
        return 0
    if not torch.cuda.is_available():
        print(NO_GPU_NOTE)
        return 0
    common.standalone_main(NAME, run, to_markdown, argv=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
