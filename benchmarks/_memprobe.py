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

import torch


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
