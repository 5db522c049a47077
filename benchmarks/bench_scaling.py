"""Scaling of SGLD sampling: time against batch size and number of steps; peak memory against steps.

jem-plugin (``SGLD.sample`` with a replay buffer, defaults) against the floor (the bare loop), on
``test_resnet`` at 32x32 by default, interleaved per configuration. Memory: peak RSS growth of one
call in a fresh process per configuration (see ``benchmarks/_memprobe.py``).
"""

from __future__ import annotations

from typing import Any

import torch

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.bench_sampler import build_contenders

NAME = "scaling"


def run(
    quick: bool = False, repeats: int | None = None, model: str | None = None, memory: bool = True, **_: Any
) -> dict[str, Any]:
    if quick:
        model = model or "digits_cnn"
        repeats = repeats or 2
        batches, steps_list, base_batch, base_steps, buffer_size = (4, 8), (2, 4), 8, 2, 256
    else:
        model = model or "test_resnet"
        repeats = repeats or 5
        batches, steps_list, base_batch, base_steps, buffer_size = (
            (16, 32, 64, 128, 256),
            (5, 10, 20, 40, 80),
            64,
            20,
            10000,
        )
    include = ("floor", "jem_plugin")
    res: dict[str, Any] = {
        "model": model,
        "repeats": repeats,
        "base_batch": base_batch,
        "base_steps": base_steps,
        "vs_batch": {},
        "vs_steps": {},
        "memory_vs_steps": {},
    }

    def measure(batch: int, steps: int) -> dict[str, float]:
        times = common.interleaved(build_contenders(model, batch, steps, buffer_size, include), repeats, warmup=1)
        st = common.ratios(times, "floor")
        return {
            "floor_ms": st["floor"]["median_s"] * 1e3,
            "jem_ms": st["jem_plugin"]["median_s"] * 1e3,
            "ratio": st["jem_plugin"]["ratio"],
        }

    for b in batches:
        r = measure(b, base_steps)
        res["vs_batch"][str(b)] = {**r, "jem_ms_per_sample": r["jem_ms"] / b}
    for s in steps_list:
        r = measure(base_batch, s)
        res["vs_steps"][str(s)] = {**r, "jem_ms_per_step": r["jem_ms"] / s}
        if memory and not quick:
            res["memory_vs_steps"][str(s)] = {
                impl: common.probe_memory(
                    {
                        "kind": "sampler",
                        "impl": impl,
                        "model": model,
                        "batch": base_batch,
                        "steps": s,
                        "buffer_size": buffer_size,
                        "threads": torch.get_num_threads(),
                    }
                ).get("delta_mb")
                for impl in include
            }
    return res


def to_markdown(res: dict) -> str:
    lines = [
        f"Model {res['model']}, {res['repeats']} interleaved rounds per configuration, medians.",
        "",
        f"Time against batch size ({res['base_steps']} steps):",
        "",
    ]
    rows = [
        [b, f"{v['floor_ms']:.1f}", f"{v['jem_ms']:.1f}", common.fmt_ratio(v["ratio"]), f"{v['jem_ms_per_sample']:.2f}"]
        for b, v in res["vs_batch"].items()
    ]
    lines.append(common.md_table(["batch", "floor ms", "jem-plugin ms", "ratio", "jem ms / sample"], rows))
    lines += ["", f"Time and peak memory against steps (batch {res['base_batch']}):", ""]
    rows = []
    for s, v in res["vs_steps"].items():
        m = res["memory_vs_steps"].get(s, {})
        fm = lambda x: "n/a" if x is None else f"{x:.1f}"
        rows.append(
            [
                s,
                f"{v['floor_ms']:.1f}",
                f"{v['jem_ms']:.1f}",
                common.fmt_ratio(v["ratio"]),
                f"{v['jem_ms_per_step']:.2f}",
                fm(m.get("floor")),
                fm(m.get("jem_plugin")),
            ]
        )
    lines.append(
        common.md_table(
            ["steps", "floor ms", "jem-plugin ms", "ratio", "jem ms / step", "floor peak MB", "jem-plugin peak MB"],
            rows,
        )
    )
    return "\n".join(lines)


if __name__ == "__main__":

    def _extra(p):
        p.add_argument("--model", default=None, choices=list(common.MODELS))
        p.add_argument("--no-memory", dest="memory", action="store_false")

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
