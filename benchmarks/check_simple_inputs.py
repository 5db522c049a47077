"""Where a long-row model's log p(x) puts simple inputs (issue 45: the AUROC target on textures).

Likelihood models tend to rank simple inputs as likelier than their data (Nalisnick et al. 2019).
On the long row, where the buffer moves (p(x) weight 0.3 on textures), log p(x) ranks the digits
(``other``) above the textures. This check asks which simple inputs the energy rates like the data,
to say what negatives a remedy needs: the log p(x) AUROC (data likelier; 0.5: rated like the data)
of the textures test split against its four OOD sets and against:

- constant images, grey at five levels, and of random colours;
- the test images in grey (the mean of their channels), blurred (sigma 2 pixels), darkened.

``--complexity`` adds the scoring-side remedy of Serrà et al. 2020 ("Input complexity and
out-of-distribution detection with likelihood-based generative models"): log p(x) in bits plus
the input's compressed length L(x) in bits (PNG, Pillow's encoder, on the 8-bit image), which
is parameter-free for a normalised likelihood. Beside it, L(x) alone and the spread of each.

Each with the BatchNorm statistics as the checkpoint holds them (training's, which the joint pass
mixed with the samples) and recomputed from the training data, since the evaluation keeps one or
the other by validation accuracy. The model comes from a long-row checkpoint (``OUT/checkpoints/
<cell>.pt``; a finished cell deletes its own, so probe a running or stopped one)::

    python -m benchmarks.check_simple_inputs benchmarks/results/long_row/checkpoints/<cell>.pt [--complexity]
"""

from __future__ import annotations

import argparse
import math
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
#: the data's normalisation, to go back to [0, 1] pixels
MEAN = torch.tensor(G.IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(G.IMAGENET_STD).view(1, 3, 1, 1)


def simple_inputs(x: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Simple images as many as ``x`` (ImageNet-normalised, ``[N, 3, H, W]``), and simple copies of ``x``."""
    n, shape = len(x), x.shape[1:]
    g = torch.Generator().manual_seed(seed)
    out = {f"constant grey {v}": ((torch.full((n, *shape), v) - MEAN) / STD) for v in GREYS}
    out["constant colours"] = (torch.rand(n, 3, 1, 1, generator=g).expand(-1, -1, *shape[1:]) - MEAN) / STD
    unit = x * STD + MEAN  # back to [0, 1]
    out["test in grey"] = (unit.mean(1, keepdim=True).expand(-1, 3, -1, -1) - MEAN) / STD
    out["test blurred (sigma 2)"] = smoothed_copy(x, 2.0)
    out["test darkened (half)"] = (unit * 0.5 - MEAN) / STD
    return out


def ranking(model: torch.nn.Module, S: dict[str, Any]) -> dict[str, float]:
    """log p(x) AUROC of ``S``'s test split against its OOD sets and :func:`simple_inputs`."""
    model.eval()
    sets = {**S["ood"], **simple_inputs(S["xt"])}
    ood = jem.ood.evaluate_all(jem.wrap(model, **S["wrap_kw"]), S["xt"], sets, methods=("logpx",), progress=False)
    return {k: round(v["auroc"], 3) for k, v in ood["logpx"].items()}


def png_bits(x: torch.Tensor) -> torch.Tensor:
    """The PNG length in bits of each ImageNet-normalised image of ``x``, as 8-bit RGB (Pillow's
    encoder at its default level; torchvision's own is deprecated)."""
    import io

    from PIL import Image

    u8 = ((x * STD + MEAN).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()

    def length(img) -> float:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        return 8.0 * buf.tell()

    return torch.tensor([length(img) for img in u8])


def set_bits(S: dict[str, Any]) -> dict[str, torch.Tensor]:
    """:func:`png_bits` of ``S``'s test split (``"test"``) and of each OOD set: the model does not
    enter, so one call serves both BatchNorm passes of :func:`complexity`."""
    return {k: png_bits(v) for k, v in {"test": S["xt"], **S["ood"]}.items()}


@torch.no_grad()
def complexity(
    model: torch.nn.Module, S: dict[str, Any], bits: dict[str, torch.Tensor] | None = None
) -> dict[str, dict[str, float]]:
    """Per OOD set of ``S``: the AUROC (test split in) of log p(x), of the PNG length L(x) alone and
    of Serrà et al.'s ``log p(x) / ln 2 + L(x)`` (bits; higher: more in-distribution), with the
    means of log p(x) and L(x). ``"test"``: the test split's means and standard deviations.
    ``bits``: :func:`set_bits` of ``S``, if already computed."""
    model.eval()
    jm = jem.wrap(model, **S["wrap_kw"])
    sets = {"test": S["xt"], **S["ood"]}
    logpx = {k: torch.cat([jm.log_px(b) for b in v.split(256)]) for k, v in sets.items()}
    bits = set_bits(S) if bits is None else bits
    lt, bt = logpx["test"], bits["test"]
    out = {"test": {"logpx_mean": lt.mean().item(), "logpx_sd": lt.std().item(), "bits_mean": bt.mean().item(),
                    "bits_sd": bt.std().item()}}  # fmt: skip
    for k in S["ood"]:
        lo, bo = logpx[k], bits[k]
        out[k] = {
            "logpx_mean": lo.mean().item(),
            "bits_mean": bo.mean().item(),
            "auroc_logpx": jem.ood.evaluate(lt, lo)["auroc"],
            "auroc_bits": jem.ood.evaluate(bt, bo)["auroc"],
            "auroc_serra": jem.ood.evaluate(lt / math.log(2) + bt, lo / math.log(2) + bo)["auroc"],
        }
    return out


def check(
    checkpoint: str,
    dataset: str = "textures",
    net: str = "resnet10t",
    seed: int = 0,
    tiny: bool = False,
    with_complexity: bool = False,
) -> dict[str, Any]:
    """:func:`ranking` with the checkpoint's BatchNorm statistics and with statistics from the data
    (and :func:`complexity` with each, under ``"complexity_<which>"``, where ``with_complexity``)."""
    ds = GB.dataset(dataset, tiny)
    S = GB.setting(ds, net, GB.per_class_for(dataset, SIZE, tiny), seed)
    model = G.make_model(GB.NETWORKS.get(net, net))
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=False)["objects"]["model"])
    bits = set_bits(S) if with_complexity else None
    out: dict[str, Any] = {"as_trained": ranking(model, S)}
    if bits is not None:
        out["complexity_as_trained"] = complexity(model, S, bits)
    GB.recompute_bn_statistics(S, model)
    out["from_data"] = ranking(model, S)
    if bits is not None:
        out["complexity_from_data"] = complexity(model, S, bits)
    return out


def complexity_markdown(out: dict[str, Any]) -> str:
    """:func:`complexity`'s two passes as a table."""
    lines = [
        "| OOD set | log p(x) mean (test) | PNG bits mean (test) | AUROC log p(x) | AUROC L(x) alone | AUROC Serrà "
        "log2 p(x) + L(x) |",
        "|---|---|---|---|---|---|",
    ]
    for which in ("as_trained", "from_data"):
        c = out[f"complexity_{which}"]
        t = c["test"]
        lines.append(
            f"| test split ({which.replace('_', ' ')}) | {t['logpx_mean']:.2f} (sd {t['logpx_sd']:.2f}) | "
            f"{t['bits_mean']:.0f} (sd {t['bits_sd']:.0f}) | | | |"
        )
        lines += [
            f"| {k} | {v['logpx_mean']:.2f} | {v['bits_mean']:.0f} | {v['auroc_logpx']:.3f} | {v['auroc_bits']:.3f} | "
            f"{v['auroc_serra']:.3f} |"
            for k, v in c.items()
            if k != "test"
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--dataset", default="textures", choices=list(GB.DATASETS))
    p.add_argument("--net", default="resnet10t")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--complexity", action="store_true", help="also Serrà et al.'s complexity-corrected log p(x)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = check(a.checkpoint, a.dataset, a.net, a.seed, with_complexity=a.complexity)
    print("| inputs | log p(x) AUROC, BatchNorm as trained | from the data |\n|---|---|---|")
    for k in out["as_trained"]:
        print(f"| {k} | {out['as_trained'][k]:.3f} | {out['from_data'][k]:.3f} |")
    if a.complexity:
        print("\n" + complexity_markdown(out))


if __name__ == "__main__":
    main()
