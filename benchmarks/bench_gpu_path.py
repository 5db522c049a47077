"""The GPU path: autocast (bf16/fp16), channels_last and a compiled forward, with SGLD.

On every machine (CPU included) each variant is *exercised for correctness* against the eager fp32
chain from the same start and the same generator: the samples are finite, the chain stays fp32,
and the final chain is close to the eager one (the max |difference| is reported; exact equality
is not expected under reduced precision or a different kernel order). CPU timings of the variants
are recorded for information. On a CUDA machine the same variants are timed on the GPU against the
floor (the bare loop under the same variant), with ``torch.cuda.synchronize()`` around each call
and ``torch.cuda.max_memory_allocated`` as the memory figure; without CUDA the GPU figures are
skipped with a note.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, floor_chain, frozen, make_model, uniform_batch

NAME = "gpu_path"


def _variants(device: str, compile: bool = True) -> dict[str, dict[str, Any]]:
    v = {"eager_fp32": {}, "autocast_bf16": {"autocast": torch.bfloat16}, "channels_last": {"channels_last": True}}
    if compile:
        v["compiled"] = {"compile": True}
    if device == "cuda":
        v["autocast_fp16"] = {"autocast": torch.float16}
        v["autocast_bf16_channels_last"] = {"autocast": torch.bfloat16, "channels_last": True}
    return v


def _prepare(model_name: str, device: str, opts: dict[str, Any]):
    """``(model_for_floor, jm, shape, ctx)`` for one variant."""
    import jem_plugin as jem

    model, _, shape = make_model(model_name)
    model.to(device)
    if opts.get("channels_last"):
        model.to(memory_format=torch.channels_last)
    run_model = model
    if opts.get("compile"):
        # Compile the forward only; sampling takes input gradients through it (AOTAutograd).
        run_model = torch.compile(model)
    jm = jem.wrap(run_model, data_range=(-1.0, 1.0), input_size=shape, num_classes=10, adapter="generic")
    dt = opts.get("autocast")
    ctx: Callable[[], Any] = (lambda: torch.autocast(device_type=device, dtype=dt)) if dt else contextlib.nullcontext
    return model, run_model, jm, shape, ctx


def _start(batch, shape, device, channels_last):
    x0 = uniform_batch(batch, shape, seed=3).to(device)
    return x0.contiguous(memory_format=torch.channels_last) if channels_last and x0.dim() == 4 else x0


def correctness(model_name: str, batch: int, steps: int, device: str = "cpu", compile: bool = True) -> dict[str, Any]:
    """Per variant: the noisy chain (finite? fp32?) and the drift-only chain (``noise=0``) against eager.

    The drift-only chain is the precision check: with noise on, a channels_last start also gets its
    noise drawn in memory order (a different noise tensor for the same seed), which would hide the
    numerical difference behind a different random walk.
    """
    from jem_plugin.sampling import SGLD

    out: dict[str, Any] = {}
    eager = eager_drift = None
    for name, opts in _variants(device, compile).items():
        try:
            model, run_model, jm, shape, ctx = _prepare(model_name, device, opts)
            x0 = _start(batch, shape, device, opts.get("channels_last"))
            t0 = time.perf_counter()
            with ctx():
                x = SGLD(
                    steps=steps, step_size=1.0, noise=0.01, generator=torch.Generator(device=device).manual_seed(11)
                ).sample(jm, x_init=x0)
            first_call_s = time.perf_counter() - t0
            with ctx():
                xd = SGLD(steps=steps, step_size=1.0, noise=0.0).sample(jm, x_init=x0)
            r = {
                "finite": bool(torch.isfinite(x).all() and torch.isfinite(xd).all()),
                "dtype": str(x.dtype),
                "chain_fp32": x.dtype == torch.float32 and xd.dtype == torch.float32,
                "first_call_s": first_call_s,
            }
            if eager is None:
                eager, eager_drift = x.float().cpu(), xd.float().cpu()
                # Scale for the differences below: how far the eager drift-only chain moved.
                out["eager_max_abs_move"] = float((eager_drift - x0.float().cpu()).abs().max())
            r["max_abs_diff_vs_eager"] = float((xd.float().cpu() - eager_drift).abs().max())
            r["noisy_max_abs_diff_vs_eager"] = float((x.float().cpu() - eager).abs().max())
            r["ok"] = r["finite"] and r["chain_fp32"]
        except Exception as exc:  # a variant that cannot run here is reported, not fatal
            r = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        out[name] = r
    return out


def timings(model_name: str, batch: int, steps: int, repeats: int, device: str) -> dict[str, Any]:
    """Per variant: jem-plugin vs the floor under the same variant, interleaved."""
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.sampling import SGLD

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res: dict[str, Any] = {}
    for name, opts in _variants(device).items():
        try:
            model, run_model, jm, shape, ctx = _prepare(model_name, device, opts)
            x0 = _start(batch, shape, device, opts.get("channels_last"))
            gen = torch.Generator(device=device).manual_seed(0)
            sampler = SGLD(steps=steps, step_size=1.0, noise=0.01, generator=gen)
            buffer = ReplayBuffer(10000, shape, reinit_freq=0.05, device=device)
            freezer = frozen(model)

            def floor():
                with ctx():
                    floor_chain(run_model, x0, steps, generator=gen)
                sync()

            def ours():
                with ctx():
                    sampler.sample(jm, n=batch, buffer=buffer)
                sync()

            contenders = {
                "floor": Contender(floor, setup=freezer.__enter__, teardown=lambda: freezer.__exit__()),
                "jem_plugin": Contender(ours, prepare=lambda: buffer.initialize(jm.domain)),
            }
            times = common.interleaved(contenders, repeats=repeats, warmup=2)
            st = common.ratios(times, "floor")
            r = {
                "floor_ms": st["floor"]["median_s"] * 1e3,
                "jem_ms": st["jem_plugin"]["median_s"] * 1e3,
                "ratio": st["jem_plugin"]["ratio"],
            }
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ours()
                r["jem_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            res[name] = r
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    return res


def run(
    quick: bool = False,
    repeats: int | None = None,
    model: str | None = None,
    compile: bool = True,
    gpu_only: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """The variants on the CPU (correctness; timings unless ``quick``) and on the GPU where there
    is one. ``gpu_only``: the GPU's figures alone, for a GPU machine whose time is short."""
    if quick:
        model, batch, steps, repeats = model or "digits_cnn", 8, 3, repeats or 2
    else:
        model, batch, steps, repeats = model or "test_resnet", 64, 20, repeats or 5
    res: dict[str, Any] = {
        "model": model,
        "batch": batch,
        "steps": steps,
        "repeats": repeats,
    }
    if not gpu_only:
        res["cpu_correctness"] = correctness(model, batch, steps, "cpu", compile)
    if not (quick or gpu_only):
        res["cpu_timings"] = timings(model, batch, steps, repeats, "cpu")
    if torch.cuda.is_available():
        res["gpu_correctness"] = correctness(model, batch, steps, "cuda")
        res["gpu_timings"] = timings(model, batch, steps, max(repeats, 10), "cuda")
        res["gpu"] = torch.cuda.get_device_name(0)
    else:
        res["gpu_note"] = (
            "no CUDA device on this machine: GPU figures skipped (run this benchmark on a GPU to fill them)"
        )
    return res


def to_markdown(res: dict) -> str:
    lines = [
        f"Model {res['model']}, batch {res['batch']}, {res['steps']} SGLD steps. Correctness: each variant's "
        "drift-only chain (noise 0) against the eager fp32 one from the same start (max |diff|), and "
        "the noisy chain with the same generator (noisy |diff|: channels_last draws its noise in memory "
        "order, so it walks differently for the same seed).",
        "",
    ]
    for dev in ("cpu", "gpu"):
        corr = res.get(f"{dev}_correctness")
        if corr is None:
            continue
        tim = res.get(f"{dev}_timings", {})
        rows = []
        for name, r in corr.items():
            if not isinstance(r, dict):
                continue
            t = tim.get(name, {})
            if "error" in r:
                rows.append([dev.upper(), name, "ERROR", r["error"], "", "", "", "", "", ""])
                continue
            rows.append(
                [
                    dev.upper(),
                    name,
                    r["finite"],
                    r["dtype"],
                    f"{r['max_abs_diff_vs_eager']:.2e}",
                    f"{r['noisy_max_abs_diff_vs_eager']:.2e}",
                    f"{r['first_call_s']:.2f}",
                    f"{t['floor_ms']:.1f}" if "floor_ms" in t else "n/a",
                    f"{t['jem_ms']:.1f}" if "jem_ms" in t else "n/a",
                    common.fmt_ratio(t.get("ratio")),
                ]
            )
        lines.append(
            common.md_table(
                [
                    "device",
                    "variant",
                    "finite",
                    "chain dtype",
                    "max |diff| vs eager",
                    "noisy |diff|",
                    "first call s",
                    "floor ms",
                    "jem-plugin ms",
                    "ratio",
                ],
                rows,
            )
        )
        lines.append("")
    for dev in ("cpu", "gpu"):
        c = res.get(f"{dev}_correctness", {})
        if "eager_max_abs_move" in c:
            lines.append(
                f"{dev.upper()}: the eager drift-only chain moved up to {c['eager_max_abs_move']:.2e} from its start "
                "(scale for the differences above)."
            )
    if "gpu_note" in res:
        lines.append(f"GPU: {res['gpu_note']}.")
    return "\n".join(lines)


if __name__ == "__main__":

    def _extra(p):
        p.add_argument("--model", default=None, choices=list(common.MODELS))
        p.add_argument(
            "--gpu-only", action="store_true", help="the GPU's figures alone (no CPU correctness or timings)"
        )

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
