"""Does a longer-trained `generative` twin close the JEM target of issue 29?

``bench_posthoc`` trains resnet10t's JEM-trained twins from scratch, ``fast`` for as long as its
cross-entropy twin (12 epochs) and ``generative`` for half as long (6, the CPU budget). The
target (the twin's log p(x) above every post-hoc detector on the cross-entropy twin, mean AUROC
over the six OOD sets) was missed by both. This script trains one twin (``--recipe``,
``--epochs``) exactly as the benchmark does (same data, seed, learning rate, batch) and writes
its scores; compare with ``results/posthoc.md``.

    python -m benchmarks.check_jem_twin_epochs --recipe generative --epochs 12   # ~8 CPU minutes

``--default-choice`` trains the twin with what ``jem train`` chooses for these data and this
network (:func:`jem_plugin.app.default_recipe.default_choice_for`) instead of ``--recipe``; ``--candidate
NAME`` with one of :mod:`benchmarks.tune_jem_twin`'s candidates (the one its tuning selected is
judged here, once).
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
from benchmarks import tune_jem_twin as T
from jem_plugin.recipes import Recipe, get_recipe, list_recipes

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "jem_twin_epochs.json")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--recipe", default="generative", choices=[r for r in list_recipes() if get_recipe(r).sam.rho is None]
    )
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--network", default=P.JEM_TWIN, choices=list(P.NETWORKS))
    p.add_argument("--default-choice", action="store_true", help="the recipe and settings jem train chooses")
    p.add_argument("--candidate", choices=list(T.CANDIDATES), help="a candidate of benchmarks.tune_jem_twin")
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    D = P.load_data()
    recipe: str | Recipe = a.recipe
    if a.default_choice or a.candidate:  # jem train's choice is the tuning's candidate "choice"
        recipe = T.candidate_recipe(a.candidate or "choice", a.network, int(torch.bincount(D["y"]).min()))
        print(f"{a.candidate or 'jem train choice'} for {a.network}: {recipe.name}, loss {recipe.to_dict()['loss']}")
    twin = P._strip(P.score_jem_twin(D, a.network, recipe, a.epochs))
    logpx = {r["set"]: r["auroc"] for r in twin["scores"] if r["score"] == "logpx"}
    print(f"{a.network} `{twin['recipe']}` twin, {a.epochs} epochs: accuracy {twin['accuracy']:.3f}; logpx AUROC")
    print(" ".join(f"{k} {v:.3f}" for k, v in logpx.items()) + f"; mean {twin['mean_auroc']['logpx']:.3f}")
    common.write_json(a.out, {"machine": common.machine_info(), "twin": twin})
    return twin


if __name__ == "__main__":
    main()
