"""Whether coarse chain starts let the energy run away without the energy L2 (issue 45).

The long row's ``coarse`` role (jem train's choice at p(x) weight 0.3, a quarter of the chains
started from coarse images) diverged on wrn10-1, a network without normalisation whose choice
drops the energy L2: energies of 1e10 and chance accuracy by 288 iterations. This trains the same
cell's recipe (textures, ~150 per class, seed 0, the long row's run length for the buffer's size)
with the L2 at each of ``--l2-weights`` and prints the training energies every ``--every``
iterations, so that the two can be read side by side::

    OMP_NUM_THREADS=1 python -m benchmarks.check_coarse_energy --l2-weights 0 0.1 --iterations 300

It writes ``OUT/coarse_energy.md`` (default ``benchmarks/results/long_row``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_generalisation as GB
from benchmarks import bench_generative as G
from benchmarks.bench_long_row import COARSE_ROLE, ITERATIONS, RESULTS, cell, epochs_for

KEYS = ("acc", "energy_data", "energy_sample", "energy_gap")


def energies(
    l2_weight: float,
    iterations: int,
    every: int,
    net: str = "wrn10-1",
    dataset: str = "textures",
    tiny: bool = False,
) -> list[dict[str, float]]:
    """The training metrics every ``every`` iterations of the coarse cell's recipe with the L2 at
    ``l2_weight``, for ``iterations`` iterations of a run sized for the long row's length."""
    c = cell(dataset, net, COARSE_ROLE, 0, epochs_for(dataset, ITERATIONS, tiny), tiny, px_weight=0.3)
    S = GB.setting(GB.dataset(dataset, tiny), net, c["per_class"], 0)
    overrides = {**({"lr": c["lr"]} if "lr" in c else {}), **c["set"], "l2_weight": float(l2_weight)}
    total = c["epochs"] * math.ceil(len(S["x"]) / GB.BATCH)  # as the long row's cell: its buffer's size
    ctx = G.start_run(S, c["run"], total, batch_size=GB.BATCH, overrides=overrides, fit_init="train")
    rows: list[dict[str, float]] = []
    it = 0
    while it < iterations:  # the batches in the cell's order (the run's own generator shuffles)
        for b in torch.randperm(len(S["x"]), generator=ctx["g"]).split(GB.BATCH):
            m = G.train_step(ctx, S["x"][b], S["y"][b])
            it += 1
            if it % every == 0 or it == iterations:
                rows.append({"iteration": it, **{k: float(m[k]) for k in KEYS}})
            if it >= iterations:
                break
    return rows


def table(runs: dict[float, list[dict[str, float]]]) -> str:
    """One row per iteration, the metrics of each L2 weight side by side."""
    weights = sorted(runs)
    head = "| iteration | " + " | ".join(f"{k} (L2 {w:g})" for w in weights for k in KEYS) + " |"
    lines = [head, "|" + "---|" * (1 + len(KEYS) * len(weights))]
    for i, row in enumerate(runs[weights[0]]):
        cells = [f"{runs[w][i][k]:.3g}" for w in weights for k in KEYS]
        lines.append(f"| {row['iteration']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--l2-weights", nargs="+", type=float, default=[0.0, 0.1])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--network", default="wrn10-1")
    p.add_argument("--tiny", action="store_true", help="the tiny data set (a smoke test of the plumbing)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    runs = {w: energies(w, a.iterations, a.every, a.network, tiny=a.tiny) for w in a.l2_weights}
    text = (
        f"Coarse chain starts (the long row's `coarse` role) on textures/{a.network}, seed 0: the training "
        f"metrics of one batch every {a.every} iterations, with the energy L2 at each weight "
        f"(`python -m benchmarks.check_coarse_energy --l2-weights {' '.join(f'{w:g}' for w in a.l2_weights)} "
        f"--iterations {a.iterations}`).\n\n" + table(runs) + "\n"
    )
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "coarse_energy.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
