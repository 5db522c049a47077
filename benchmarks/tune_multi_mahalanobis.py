"""Choose ``multi_mahalanobis``'s layer weights on a split the judge never sees, then judge once.

``MultiMahalanobis`` sums the Mahalanobis distances of several layers. How to weigh them has two
candidates fixed before any run: ``"uniform"`` (pytorch-ood's default, ``alpha = 1``: the raw
distances, so a wide layer counts more) and ``"dof"`` (each layer's distance divided by its
standard deviation at in-distribution inputs, ``sqrt(2 r)``). The choice is made here, on
:mod:`benchmarks.tune_jem_twin`'s tuning split: the digits' *training* split alone (80 / 20 per
class), two folds of held-out classes, the two tuning networks, six OOD sets built like
``bench_posthoc``'s from other images and seeds. ``bench_posthoc`` (the test split) then judges
the chosen default once, beside every other detector.

Selection rule: the higher mean AUROC over the four folds and six sets. The penultimate-layer
``mahalanobis`` is scored beside them for reference.

    python -m benchmarks.tune_multi_mahalanobis      # ~5 CPU minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_posthoc as P
from benchmarks import common
from benchmarks.tune_jem_twin import OUT_DIR, TUNE_NETWORKS, each_fold, fold_data
from jem_plugin import ood

CANDIDATES = {"uniform": {"weights": "uniform"}, "dof": {"weights": "dof"}}
OUT = os.path.join(OUT_DIR, "multi_mahalanobis_tune.json")


def score_fold(network: str, held_out: tuple[int, ...]) -> dict[str, Any]:
    """The fold's cross-entropy model, and the AUROC per set of each candidate and ``mahalanobis``."""
    _, spec, lr, epochs = P.NETWORKS[network]
    F = fold_data(held_out)
    model, cost = P.train(spec, F["x"], F["y"], 8, epochs, lr=lr)
    jm = jem.wrap(model, **P._wrap_kw(8))
    methods: list[Any] = ["mahalanobis"]
    for name, options in CANDIDATES.items():
        det = ood.detector("multi_mahalanobis", **options)
        det.name = f"multi_mahalanobis[{name}]"
        methods.append(det)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = ood.evaluate_all(jm, F["xv"], F["sets"], methods, fit_data=P._loader(F["x"], F["y"]), progress=False)
    auroc: dict[str, dict[str, float]] = {}
    for r in P._strip(table.rows()):
        if r["status"] == "ok":
            auroc.setdefault(r["score"], {})[r["set"]] = round(float(r["auroc"]), 4)
    return {
        "accuracy": round(P.accuracy(model, F["xv"], F["yv"]), 4),
        "auroc": auroc,
        "mean_auroc": {k: round(statistics.fmean(v.values()), 4) for k, v in auroc.items()},
        "cost": cost,
    }


def summary(folds: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """Markdown of the folds and the selected candidate."""
    names = ["mahalanobis"] + [f"multi_mahalanobis[{c}]" for c in CANDIDATES]
    lines = ["| score | " + " | ".join(folds) + " | mean |", "|---" * (len(folds) + 2) + "|"]
    means = {}
    for n in names:
        vals = [f["mean_auroc"][n] for f in folds.values()]
        means[n] = statistics.fmean(vals)
        lines.append(f"| {n} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {means[n]:.4f} |")
    chosen = max(CANDIDATES, key=lambda c: means[f"multi_mahalanobis[{c}]"])
    return "\n".join(lines), chosen


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--render", action="store_true", help="print the table from the saved run")
    a = p.parse_args(argv)
    if not a.render:
        torch.set_num_threads(1)
        folds = each_fold(list(TUNE_NETWORKS), score_fold, "mean_auroc")
        common.write_json(OUT, {"machine": common.machine_info(), "folds": folds})
        print(f"wrote {OUT}")
    if a.render:
        with open(OUT) as fh:
            folds = json.load(fh)["folds"]
    table, chosen = summary(folds)
    print(table)
    print(f"selected: weights={chosen!r}")
    return {"folds": folds, "chosen": chosen}


if __name__ == "__main__":
    main()
