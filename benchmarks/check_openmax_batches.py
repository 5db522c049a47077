"""How much does pytorch-ood's OpenMax score depend on the batch an image is scored in?

pytorch-ood 0.4's ``OpenMax.predict`` computes an input's distance to a class's mean activation
only for the classes that some input *of the same batch* is predicted as, and uses 0 for the
others. Its score for one image therefore changes with the images beside it. ``bench_posthoc``
scores pytorch-ood's detectors in batches of one OOD set at a time, where this helps OpenMax on
some sets (lcnet_050, inverted digits: its best-per-set row there).

This script trains the benchmark's lcnet_050 (same data, seed, learning rate and epochs as
``bench_posthoc``), fits pytorch-ood's OpenMax and ours on the same training images, and
scores the in-distribution test digits and the five OOD sets four ways:

- ``batched``: 256 images of one set per batch (what ``bench_posthoc``'s table shows);
- ``per_input``: each image alone, a batch of one (its score depends on that image only; the
  distance is then measured to the predicted class alone);
- ``mixed_with_in``: 128 images of a set beside 128 in-distribution test digits per batch;
- ``every_class``: float64 logits with one row per class added to each batch
  (``bench_posthoc.EveryClassOpenMax``: every class's distance, the paper's OpenMax);

and ours (``jem.ood.evaluate_all(..., ["openmax"])``). AUROC, in-distribution positive.

    python benchmarks/check_openmax_batches.py   # ~3 CPU minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_posthoc as P
from benchmarks import common

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "openmax_batches.json")
NETWORK = "lcnet_050"


def measure(network: str = NETWORK, epochs: int | None = None) -> dict[str, dict[str, float]]:
    """AUROC per way of scoring (see the module docstring) and OOD set."""
    from pytorch_ood import detector as D

    import jem_plugin as jem
    from jem_plugin import ood

    d = P.load_data()
    _, spec, lr, default_epochs = P.NETWORKS[network]
    model, _ = P.train(spec, d["x"], d["y"], 10, epochs or default_epochs, lr=lr)
    fit = P._loader(d["x"], d["y"])
    theirs = D.OpenMax(model)
    theirs.fit(fit)
    every = P.EveryClassOpenMax(model).fit(fit)

    def aurocs(score: Callable[[Tensor], Tensor]) -> dict[str, float]:
        s_in = score(d["xt"])
        return {k: ood.evaluate(s_in, score(x))["auroc"] for k, x in d["sets"].items()}

    def in_batches(det, size: int) -> Callable[[Tensor], Tensor]:
        return lambda x: -torch.cat([det.predict(b) for b in x.split(size)]).float()

    def mixed(x: Tensor) -> Tensor:
        g = torch.Generator().manual_seed(0)
        out = []
        for b in x.split(128):
            beside = d["xt"][torch.randperm(len(d["xt"]), generator=g)[:128]]
            out.append(-theirs.predict(torch.cat([b, beside]))[: len(b)].float())
        return torch.cat(out)

    res: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        res["batched"] = aurocs(in_batches(theirs, P.BATCH))
        res["per_input"] = aurocs(in_batches(theirs, 1))
        res["mixed_with_in"] = aurocs(mixed)
        res["every_class"] = aurocs(in_batches(every, P.BATCH))
    jm = jem.wrap(model, **P._wrap_kw(10))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = ood.evaluate_all(jm, d["xt"], d["sets"], ["openmax"], fit_data=fit, progress=False)
    res["ours"] = {r["set"]: r["auroc"] for r in table.records}
    return res


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", default=NETWORK, choices=list(P.NETWORKS))
    p.add_argument("--epochs", type=int, default=None, help="default: bench_posthoc's for the network")
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(a.network, a.epochs)
    sets = list(next(iter(res.values())))
    print(f"{a.network}: AUROC of OpenMax, in-distribution positive")
    print(f"{'':14s}" + "".join(f"{s:>12s}" for s in sets))
    for way, row in res.items():
        print(f"{way:14s}" + "".join(f"{row[s]:12.3f}" for s in sets))
    common.write_json(a.out, {"network": a.network, "machine": common.machine_info(), "auroc": res})
    return res


if __name__ == "__main__":
    main()
