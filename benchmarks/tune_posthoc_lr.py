"""Choose a ``bench_posthoc`` network's learning rate on the training split alone.

``bench_posthoc`` trains each network twice by cross-entropy: on digits 0-9, and on 0-7 for the
held-out-classes set. A learning rate that trains one of them and not the other leaves a column
of the benchmark measured on a classifier that does not classify (lcnet_050 at 5e-3: 0.953 test
accuracy on 0-9, 0.457 on 0-7). This script picks the rate by validation *accuracy* only, never
an OOD metric, on :mod:`benchmarks.tune_jem_twin`'s tuning split (the digits' training split,
80 / 20 per class, eight classes kept per fold as the 0-7 model keeps eight), over two folds and
two seeds: the rate with the highest worst-case validation accuracy. ``--clips`` makes it a
choice of (rate, gradient-norm clipping) pairs the same way (``none``: no clipping).

    python -m benchmarks.tune_posthoc_lr --network lcnet_050 --lrs 0.005 0.01 0.02   # ~6 CPU min
    python -m benchmarks.tune_posthoc_lr --network lcnet_050 --lrs 0.01 --clips none 1   # ~4 CPU min
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_posthoc as P
from benchmarks import common
from benchmarks.tune_jem_twin import FOLDS, OUT_DIR, fold_data

SEEDS = (0, 1)


def run(
    network: str, lrs: list[float], epochs: int | None = None, clips: list[float | None] | None = None
) -> dict[str, Any]:
    """Validation accuracy per learning rate (and clipping), fold and seed; and the chosen one."""
    torch.set_num_threads(1)
    _, spec, _, default_epochs = P.NETWORKS[network]
    epochs = epochs or default_epochs
    grid = [(lr, clip) for lr in lrs for clip in (clips or [None])]

    def label(lr: float, clip: float | None) -> str:
        return str(lr) if clips is None else f"lr {lr} clip {clip}"

    acc: dict[str, dict[str, float]] = {}
    for lr, clip in grid:
        for held_out in FOLDS:
            F = fold_data(held_out)
            for seed in SEEDS:
                model, _ = P.train(spec, F["x"], F["y"], 8, epochs, lr=lr, seed=seed, clip=clip)
                key = f"fold {''.join(map(str, held_out))} seed {seed}"
                acc.setdefault(label(lr, clip), {})[key] = round(P.accuracy(model, F["xv"], F["yv"]), 4)
        P._log(f"{network} {label(lr, clip)}: {acc[label(lr, clip)]}")
    lr, clip = max(grid, key=lambda c: min(acc[label(*c)].values()))
    out: dict[str, Any] = {"network": network, "epochs": epochs, "validation_accuracy": acc, "chosen_lr": lr}
    if clips is not None:
        out["chosen_clip"] = clip
    return out


def _clip(text: str) -> float | None:
    return None if text == "none" else float(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", choices=list(P.NETWORKS), required=True)
    p.add_argument("--lrs", type=float, nargs="+", required=True)
    p.add_argument(
        "--clips",
        type=_clip,
        nargs="+",
        default=None,
        help="gradient-norm clippings to try, 'none' for none (default: none tried)",
    )
    p.add_argument("--epochs", type=int, default=None, help="default: the network's in bench_posthoc")
    p.add_argument("--out", default=OUT_DIR, help="directory of the JSON (default: benchmarks/results)")
    a = p.parse_args(argv)
    res = run(a.network, a.lrs, a.epochs, a.clips)
    path = os.path.join(a.out, f"posthoc_{'clip' if a.clips else 'lr'}_{a.network}.json")
    common.write_json(path, {"machine": common.machine_info(), "tune": res})
    for lr, v in res["validation_accuracy"].items():
        print(
            f"{lr if a.clips else 'lr ' + lr}: worst {min(v.values()):.3f}, "
            + ", ".join(f"{k} {x:.3f}" for k, x in v.items())
        )
    print(f"chosen: {res['chosen_lr']}" + (f", clip {res['chosen_clip']}" if a.clips else "") + f"  ({path})")
    return res


if __name__ == "__main__":
    main()
