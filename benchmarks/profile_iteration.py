"""Where the time of one training iteration goes: ``jem train``'s default recipe against a
cross-entropy iteration (issue 45, deliverable 3: profile first).

Both iterations are :func:`benchmarks.bench_generative.train_step` (what the generalisation matrix
and the long row train with: the same augmentation, optimiser and schedule), batch 64 of 32x32
textures at ~150 per class, one torch thread, on resnet10t (BatchNorm) and convnext_atto
(LayerNorm). The default is :func:`benchmarks.bench_long_row.jem_train_choice`'s recipe for that
row (``generative`` at p(x) weight 0.03). ``bench_train_step``'s JEM contenders are plain SGLD
from uniform noise, not this recipe, so its contenders are not reused here.

Each part is timed in CPU seconds by wrapping the library's functions from outside (no library
change): the chains' model forwards and their input gradients (``SGLD.run``), the rest of the chain
(gradient clamp, colour projection, domain clamps), the divergence check, the replay buffer's draw
and write-back, the rest of ``SGLD.sample``; the loss's one forward over data and samples; the
input checks; the parameters' backward; the optimiser step; the augmentation; the rest. The
wrappers cost a few microseconds per call; the shares are what to read (the machine is shared).

    python -m benchmarks.profile_iteration [--iters 8] [--networks resnet10t convnext_atto]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_generalisation as GB
from benchmarks import bench_generative as G
from benchmarks import bench_long_row as L
from jem_plugin import buffer as jb
from jem_plugin import losses as jl
from jem_plugin import sampling as js

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "profile_iteration.json")

#: the table's rows, in order
PARTS = (
    "augmentation",
    "input checks",
    "buffer draw + write-back",
    "chain forwards",
    "chain input gradients",
    "divergence check",
    "SGLD.run",
    "SGLD.sample",
    "model forward (data; JEM: data + samples in one pass)",
    "loss forward",
    "parameter backward",
    "optimiser step",
    "iteration",
)
FORWARD = PARTS[8]


class Clock:
    """CPU seconds per part, each part's own (less the parts that ran inside it); whether a model
    forward belongs to the chains is read from the parts open when it runs."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.open: list[str] = []

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        self.open.append(name)
        t = time.process_time()
        try:
            yield
        finally:
            spent = time.process_time() - t
            self.own[name] += spent
            self.calls[name] += 1
            self.open.pop()
            if self.open:
                self.own[self.open[-1]] -= spent

    def wrap(self, fn: Callable, name: str | Callable[[], str]) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name() if callable(name) else name):
                return fn(*args, **kwargs)

        return timed

    def inside(self, part: str) -> bool:
        return part in self.open


@contextmanager
def patched(clock: Clock, ctx: dict[str, Any]) -> Iterator[None]:
    """The library's functions and this run's model, optimiser and backward wrapped in ``clock``."""
    targets = [
        (jl, "check_input", "input checks"),
        (jl.JEMLoss, "_check_batch", "input checks"),
        (js.SGLD, "sample", "SGLD.sample"),
        (js.SGLD, "run", "SGLD.run"),
        (js.SGLD, "_check_divergence", "divergence check"),
        (jb.ReplayBuffer, "sample", "buffer draw + write-back"),
        (jb.ReplayBuffer, "update", "buffer draw + write-back"),
        (jl.JEMLoss, "forward", "loss forward"),
        (G, "shift_augment", "augmentation"),
        (torch.Tensor, "backward", "parameter backward"),
    ]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    if ctx["loss_fn"] is not None:  # an instance's callable: warns once when data leave the domain
        targets.append((ctx["loss_fn"], "_domain_check", "input checks"))
    grad = torch.autograd.grad
    model, opt = ctx["model"], ctx["opt"]
    try:
        for obj, attr, name in targets:
            setattr(obj, attr, clock.wrap(getattr(obj, attr), name))
        # the chains read torch.autograd.grad when SGLD.run starts: their input gradients
        torch.autograd.grad = clock.wrap(grad, "chain input gradients")
        model.forward = clock.wrap(model.forward, lambda: "chain forwards" if clock.inside("SGLD.run") else FORWARD)
        opt.step = clock.wrap(opt.step, "optimiser step")
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
        torch.autograd.grad = grad
        del model.forward, opt.step


def profile(net: str, role: str, iters: int = 8) -> dict[str, Any]:
    """``iters`` iterations of ``role`` (``baseline`` or ``default``) on ``net`` after two untimed."""
    torch.set_num_threads(1)
    c = L.cell("textures", net, role, 0, 1)
    S = GB.setting(GB.dataset("textures"), net, c["per_class"], 0)
    overrides = {**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})}
    ctx = G.start_run(S, c["run"], L.ITERATIONS, batch_size=L.BATCH, overrides=overrides or None, fit_init="train")
    batches = torch.randperm(len(S["x"]), generator=ctx["g"]).split(L.BATCH)
    for idx in batches[:2]:
        G.train_step(ctx, S["x"][idx], S["y"][idx])
    clock = Clock()
    with patched(clock, ctx):
        for idx in batches[2 : 2 + iters]:
            with clock.part("iteration"):
                G.train_step(ctx, S["x"][idx], S["y"][idx])
    return {
        "net": net,
        "role": role,
        "run": GB.run_label(c),
        "iterations": iters,
        "cpu_s_per_iteration": sum(clock.own.values()) / iters,
        "calls_per_iteration": {k: v / iters for k, v in clock.calls.items()},
        # own time as a share of the iteration; "iteration": train_step's own (loss terms, zero_grad, schedule)
        "share": {k: v / sum(clock.own.values()) for k, v in clock.own.items()},
    }


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    names = {
        "SGLD.run": "rest of SGLD.run (clamp, colours)",
        "SGLD.sample": "rest of SGLD.sample",
        "loss forward": "rest of the loss (terms)",
        "iteration": "rest of the iteration (CE, zero_grad, schedule)",
    }
    header = ["part (own time)"] + [f"{r['net']} {'CE' if r['role'] == 'baseline' else r['run']}" for r in rows]
    body = [
        [names.get(p, p)] + [f"{100 * r['share'][p]:.1f}%" if p in r["share"] else "-" for r in rows] for p in PARTS
    ]
    ce = {r["net"]: r["cpu_s_per_iteration"] for r in rows if r["role"] == "baseline"}
    body.append(
        ["iteration / CE iteration"]
        + [f"{r['cpu_s_per_iteration'] / ce.get(r['net'], float('nan')):.1f}x" for r in rows]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--networks", nargs="*", default=["resnet10t", "convnext_atto"])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    rows = [profile(n, r, a.iters) for n in a.networks for r in ("baseline", "default")]
    res = {"rows": rows, "load_average": os.getloadavg(), "threads": 1}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(to_markdown(rows))
    print(f"load average {res['load_average']}")


if __name__ == "__main__":
    main()
