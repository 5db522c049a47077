"""Where a long-row model's log p(x) puts simple inputs (issue 45: the AUROC target on textures).

Likelihood models tend to rank simple inputs as likelier than their data (Nalisnick et al. 2019).
On the long row, where the buffer moves (p(x) weight 0.3 on textures), log p(x) ranks the digits
(``other``) above the textures. This check asks which simple inputs the energy rates like the data,
to say what negatives a remedy needs: the log p(x) AUROC (data likelier; 0.5: rated like the data)
of the textures test split against its four OOD sets and against:

- constant images, grey at five levels, and of random colours;
- the test images in grey (the mean of their channels), blurred (sigma 2 pixels), darkened.

Each with the BatchNorm statistics as the checkpoint holds them (training's, which the joint pass
mixed with the samples) and recomputed from the training data, since the evaluation keeps one or
the other by validation accuracy. The model comes from a long-row checkpoint (``OUT/checkpoints/
<cell>.pt``; a finished cell deletes its own, so probe a running or stopped one)::

    python -m benchmarks.check_simple_inputs benchmarks/results/long_row/checkpoints/<cell>.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_generalisation as GB
from benchmarks import bench_generative as G
from benchmarks.bench_long_row import SIZE
from jem_plugin.builtins.smoothed_negatives import smoothed_copy

GREYS = (0.0, 0.25, 0.5, 0.75, 1.0)


def simple_inputs(x: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Simple images as many as ``x`` (ImageNet-normalised, ``[N, 3, H, W]``), and simple copies of ``x``."""
    mean = torch.tensor(G.IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(G.IMAGENET_STD).view(1, 3, 1, 1)
    n, shape = len(x), x.shape[1:]
    g = torch.Generator().manual_seed(seed)
    out = {f"constant grey {v}": ((torch.full((n, *shape), v) - mean) / std) for v in GREYS}
    out["constant colours"] = (torch.rand(n, 3, 1, 1, generator=g).expand(-1, -1, *shape[1:]) - mean) / std
    unit = x * std + mean  # back to [0, 1]
    out["test in grey"] = (unit.mean(1, keepdim=True).expand(-1, 3, -1, -1) - mean) / std
    out["test blurred (sigma 2)"] = smoothed_copy(x, 2.0)
    out["test darkened (half)"] = (unit * 0.5 - mean) / std
    return out


def ranking(model: torch.nn.Module, S: dict[str, Any]) -> dict[str, float]:
    """log p(x) AUROC of ``S``'s test split against its OOD sets and :func:`simple_inputs`."""
    model.eval()
    sets = {**S["ood"], **simple_inputs(S["xt"])}
    ood = jem.ood.evaluate_all(jem.wrap(model, **S["wrap_kw"]), S["xt"], sets, methods=("logpx",), progress=False)
    return {k: round(v["auroc"], 3) for k, v in ood["logpx"].items()}


def check(
    checkpoint: str, dataset: str = "textures", net: str = "resnet10t", seed: int = 0, tiny: bool = False
) -> dict[str, Any]:
    """:func:`ranking` with the checkpoint's BatchNorm statistics and with statistics from the data."""
    ds = GB.dataset(dataset, tiny)
    S = GB.setting(ds, net, GB.per_class_for(dataset, SIZE, tiny), seed)
    model = G.make_model(GB.NETWORKS.get(net, net))
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["objects"]["model"])
    out = {"as_trained": ranking(model, S)}
    GB.recompute_bn_statistics(S, model)
    out["from_data"] = ranking(model, S)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--dataset", default="textures", choices=list(GB.DATASETS))
    p.add_argument("--net", default="resnet10t")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = check(a.checkpoint, a.dataset, a.net, a.seed)
    print("| inputs | log p(x) AUROC, BatchNorm as trained | from the data |\n|---|---|---|")
    for k in out["as_trained"]:
        print(f"| {k} | {out['as_trained'][k]:.3f} | {out['from_data'][k]:.3f} |")


if __name__ == "__main__":
    main()
