"""Post-hoc OOD scoring: ``jem_plugin.ood.score(..., "logpx")`` against pytorch-ood's ``EnergyBased``.

Both score the same ``N`` inputs in batches of 256 with the model in eval mode; pytorch-ood's
``predict`` is called under ``torch.no_grad()`` (as its examples do; it does not switch modes
or disable gradients itself). pytorch-ood returns outlier scores (the energy, higher = OOD); ours
are in-distribution scores, so the comparison is ``ours == -theirs``.

Also: the cost of the gradient-norm score (``grad_norm``: one forward and one input-gradient
backward per batch) relative to ``logpx`` (one forward), and against its own floor (the bare
forward, ``autograd.grad`` and per-example norm).
"""

from __future__ import annotations

from typing import Any

import torch

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, frozen, make_model, uniform_batch

NAME = "scoring"
TARGET_THROUGHPUT = 0.95


def _grad_norm_floor(model, X, batch_size):
    out = []
    for xb in X.split(batch_size):
        x = xb.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(torch.logsumexp(model(x), 1).sum(), x)
        out.append(-g.flatten(1).norm(dim=1))
    return torch.cat(out)


def build_contenders(model_name: str, n: int, batch_size: int) -> tuple[dict[str, Contender], dict]:
    from jem_plugin import ood

    model, jm, shape = make_model(model_name)
    model.eval()
    X = uniform_batch(n, shape, seed=7)
    contenders: dict[str, Contender] = {}
    contenders["jem_logpx"] = Contender(lambda: ood.score(jm, X, "logpx", batch_size=batch_size, progress=False))
    try:
        from pytorch_ood.detector import EnergyBased

        det = EnergyBased(model)

        def theirs():
            with torch.no_grad():
                return torch.cat([det.predict(xb) for xb in X.split(batch_size)])

        contenders["pytorch_ood_energy"] = Contender(theirs)
    except ImportError:
        theirs = None
    contenders["jem_grad_norm"] = Contender(
        lambda: ood.score(jm, X, "grad_norm", batch_size=batch_size, progress=False)
    )
    freezer = frozen(model)
    contenders["grad_norm_floor"] = Contender(
        lambda: _grad_norm_floor(model, X, batch_size), setup=freezer.__enter__, teardown=lambda: freezer.__exit__()
    )
    check = {}
    ours = ood.score(jm, X, "logpx", batch_size=batch_size, progress=False)
    if theirs is not None:
        t = theirs()
        check["max_abs_diff"] = float((ours + t).abs().max())
        check["identical"] = bool(torch.equal(ours, -t))
    gn = ood.score(jm, X, "grad_norm", batch_size=batch_size, progress=False)
    with frozen(model):
        gf = _grad_norm_floor(model, X, batch_size)
    check["grad_norm_max_abs_diff_vs_floor"] = float((gn - gf).abs().max())
    return contenders, check


def run(
    quick: bool = False,
    repeats: int | None = None,
    models: list[str] | None = None,
    n: int | None = None,
    batch_size: int = 256,
    **_: Any,
) -> dict[str, Any]:
    if quick:
        models = models or ["digits_cnn"]
        repeats = repeats or 3
        n = n or 128
        batch_size = 64
    else:
        models = models or ["digits_cnn", "test_resnet"]
        repeats = repeats or 15
        n = n or 2048
    res: dict[str, Any] = {"n": n, "batch_size": batch_size, "repeats": repeats, "models": {}}
    for name in models:
        contenders, check = build_contenders(name, n, batch_size)
        times = common.interleaved(contenders, repeats=repeats, warmup=1)
        stats = common.ratios(times, "jem_logpx")
        entry: dict[str, Any] = {"time": stats, "check": check}
        for s in stats.values():
            s["throughput_per_s"] = n / s["median_s"]
        if "pytorch_ood_energy" in times:
            # Our throughput relative to theirs = t_theirs / t_ours (paired per round).
            entry["throughput_vs_pytorch_ood"] = common.paired_ratio(times["pytorch_ood_energy"], times["jem_logpx"])
            entry["throughput_ok"] = entry["throughput_vs_pytorch_ood"] >= TARGET_THROUGHPUT
        entry["grad_norm_vs_forward"] = stats["jem_grad_norm"]["ratio"]
        entry["grad_norm_vs_its_floor"] = common.paired_ratio(times["jem_grad_norm"], times["grad_norm_floor"])
        res["models"][name] = entry
    return res


def to_markdown(res: dict) -> str:
    lines = [
        f"OOD scoring of {res['n']} inputs in batches of {res['batch_size']}, {res['repeats']} interleaved "
        "rounds, medians; ratio = paired median of t / t(jem logpx).",
        "",
    ]
    rows = []
    for name, entry in res["models"].items():
        for impl, s in entry["time"].items():
            rows.append(
                [
                    name,
                    impl,
                    common.fmt_ms(s["median_s"]),
                    f"{s['throughput_per_s']:.0f}",
                    f"{s['spread']:.1%}",
                    common.fmt_ratio(s["ratio"]),
                ]
            )
    lines.append(common.md_table(["model", "scorer", "median ms", "inputs/s", "spread", "time x jem logpx"], rows))
    lines.append("")
    for name, entry in res["models"].items():
        c = entry["check"]
        thr = entry.get("throughput_vs_pytorch_ood")
        lines.append(
            f"- {name}: throughput vs pytorch-ood EnergyBased **{'n/a' if thr is None else f'{thr:.3f}x'}** "
            f"(target >= {TARGET_THROUGHPUT}x: {common.target_mark(entry.get('throughput_ok'))}); scores "
            f"identical (ours == -energy): {c.get('identical')}, max |diff| {c.get('max_abs_diff', float('nan')):.2e}; "
            f"grad_norm costs {entry['grad_norm_vs_forward']:.2f}x a logpx forward pass and "
            f"{entry['grad_norm_vs_its_floor']:.3f}x its bare floor (max |diff| vs floor "
            f"{c['grad_norm_max_abs_diff_vs_floor']:.2e})"
        )
    return "\n".join(lines)


if __name__ == "__main__":

    def _extra(p):
        p.add_argument("--models", nargs="*", default=None, choices=list(common.MODELS))
        p.add_argument("--n", type=int, default=None, help="number of inputs scored")

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
