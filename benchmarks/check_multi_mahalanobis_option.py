"""``multi_mahalanobis``'s ``weights="adversarial"`` option on ``bench_posthoc``'s test split, once.

The default (``dof``) was decided before this run (``benchmarks/check_multi_mahalanobis_combine.py``
and the README): this script only reports how the option does where the benchmark judges, beside
the default and pytorch-ood's best per set from ``results/posthoc.json`` (the same models: the
four networks and their 0-7 twins are retrained here exactly as ``bench_posthoc`` trains them,
same seeds). Nothing is chosen from it.

    python -m benchmarks.check_multi_mahalanobis_option      # ~8 CPU minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_posthoc as P
from benchmarks import common
from jem_plugin import ood

OUT = os.path.join(P.OUT, "multi_mahalanobis_option.json")


def score(network: str, D: dict[str, Any]) -> dict[str, dict[str, float]]:
    """AUROC per set of the default and the option, on the benchmark's two models of ``network``."""
    model, _, model8, _ = P.train_network(network, D)
    jm, jm8 = jem.wrap(model, **P._wrap_kw(10)), jem.wrap(model8, **P._wrap_kw(8))
    out: dict[str, dict[str, float]] = {}
    for core, x_in, sets, x_fit, y_fit in (
        (jm, D["xt"], D["sets"], D["x"], D["y"]),
        (jm8, D["xt07"], {"held_out": D["xt89"]}, D["x07"], D["y07"]),
    ):
        option = ood.detector("multi_mahalanobis", weights="adversarial")  # a new one per model
        option.name = "multi_mahalanobis[adversarial]"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = ood.evaluate_all(
                core, x_in, sets, ["multi_mahalanobis", option], fit_data=P._loader(x_fit, y_fit), progress=False
            )
        for r in table.rows():
            out.setdefault(r["score"], {})[r["set"]] = round(float(r["auroc"]), 4)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", nargs="+", default=list(P.NETWORKS), choices=list(P.NETWORKS))
    p.add_argument("--out", default=OUT)
    p.add_argument("--posthoc", default=os.path.join(P.OUT, "posthoc.json"), help="the benchmark's results")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    D = P.load_data()
    with open(a.posthoc) as fh:
        judged = json.load(fh)["posthoc"]["networks"]
    res: dict[str, Any] = {}
    for network in a.networks:
        res[network] = score(network, D)
        best = judged.get(network, {}).get("targets", {}).get("best_per_set", {})
        res[network]["pytorch-ood best"] = {s: round(v["pytorch_ood"][0], 4) for s, v in best.items()}
        P._log(f"{network}: {res[network]}")
    common.write_json(a.out, {"machine": common.machine_info(), "networks": res})
    for network, rows in res.items():
        print(f"\n{network}")
        print(
            common.md_table(
                ["score", *P.SETS], [[k, *(f"{v.get(s, float('nan')):.3f}" for s in P.SETS)] for k, v in rows.items()]
            )
        )
    return res


if __name__ == "__main__":
    main()
