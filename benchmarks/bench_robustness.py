"""Robust accuracy of the digits baseline and JEM (issue 4's table): PGD L-inf, with and without
the paper's SGLD defence.

Reads the two models a digits experiment saved (``model_baseline.pt``, ``model_JEM.pt`` in its
run directory, written by :func:`jem_plugin.app.experiments.run_digits`), so it costs no training:

    python -m jem_plugin.app.experiments runs/digits              # or any run_digits(...) output dir
    python benchmarks/bench_robustness.py runs/digits         # -> robustness.json/.md/.png there

Rows: each model attacked directly (white box), and each model behind ``SGLDDefense``
(10 SGLD steps, 10 chains averaged) under the per-example worst case of a transfer attack and
BPDA+EOT with the margin loss (the honest number; see ``jem_plugin.robustness``). Budgets are in
pixel levels out of 255 of the [0, 1] image (the digits live in [-1, 1]).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jem_plugin import robustness, viz
from jem_plugin.app.data import digits_tensors
from jem_plugin.app.model_files import load_model_checkpoint

EPS_255 = (0, 2, 4, 8, 16, 32)


def _load(run_dir: Path, tag: str):
    jm, _ = load_model_checkpoint(str(run_dir / f"model_{tag}.pt"))
    return jm.eval()


def run(
    run_dir: str | Path,
    n: int = 360,
    steps: int = 10,
    seed: int = 0,
    defense: bool = True,
    defense_step_sizes: tuple[float, ...] = (1.0,),
    progress: bool = False,
    defense_steps: int = 10,  # the defence's SGLD steps and chains averaged: the paper's 10 and 10
    defense_chains: int = 10,
) -> dict:
    run_dir = Path(run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    config = metrics.get("config", {})
    x, y = digits_tensors("test", test_fraction=config.get("test_fraction", 0.2), seed=config.get("seed", 0))
    x, y = x[:n], y[:n]
    eps = [e / 255 for e in EPS_255]
    results: dict[str, dict] = {}
    for tag in ("baseline", "JEM"):
        if not (run_dir / f"model_{tag}.pt").is_file():
            continue
        jm = _load(run_dir, tag)
        g = torch.Generator().manual_seed(seed)
        results[f"{tag}"] = robustness.robust_accuracy(
            jm, x, y, eps, robustness.PGD(norm="linf", steps=steps), generator=g, progress=progress
        )
        for step_size in defense_step_sizes if defense else ():
            d = robustness.SGLDDefense(
                jm,
                steps=defense_steps,
                n_chains=defense_chains,
                step_size=step_size,
                generator=torch.Generator().manual_seed(seed),
            )
            results[f"{tag} + SGLD defence (step {step_size:g}, worst case)"] = robustness.robust_accuracy(
                jm,
                x,
                y,
                eps,
                robustness.PGD(norm="linf", steps=steps, loss="margin"),
                defense=d,
                attack="worst",
                generator=torch.Generator().manual_seed(seed),
                progress=progress,
            )
    return {
        "eps_255": list(EPS_255),
        "n": int(len(y)),
        "pgd_steps": steps,
        "results": results,
        "defense_step_sizes": list(defense_step_sizes) if defense else [],
    }


def to_markdown(res: dict) -> str:
    head = "| model | " + " | ".join(f"eps {e}/255" for e in res["eps_255"]) + " |"
    sep = "|---|" + "---|" * len(res["eps_255"])
    rows = [f"| {name} | " + " | ".join(f"{a:.3f}" for a in r["accuracy"]) + " |" for name, r in res["results"].items()]
    return "\n".join([f"PGD L-inf, {res['pgd_steps']} steps, {res['n']} test digits; accuracy:", "", head, sep, *rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a run_digits output directory holding model_baseline.pt and model_JEM.pt")
    p.add_argument("--n", type=int, default=360)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-defense", action="store_true")
    p.add_argument(
        "--defense-step-sizes",
        type=float,
        nargs="+",
        default=[1.0],
        help="SGLD step sizes of the defence, one row each (the paper: 1.0)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    res = run(
        args.run_dir,
        n=args.n,
        steps=args.steps,
        defense=not args.no_defense,
        defense_step_sizes=tuple(args.defense_step_sizes),
        progress=True,
    )
    out = Path(args.run_dir)
    (out / "robustness.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (out / "robustness.md").write_text(md + "\n")
    viz.plot_robust_accuracy(
        res["results"],
        str(out / "robust_accuracy.png"),
        title="digits: robust accuracy (PGD L-inf)",
        eps_scale=255,
        eps_label="eps (pixel levels / 255)",
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
