"""Post-hoc OOD detection and calibration of a classifier trained elsewhere: no JEM training.

Give it your own trained model as ``--checkpoint`` (a state_dict of ``jem_plugin.app.nets.DigitsCNN``)
or let it train a plain cross-entropy classifier on the digits for a few epochs. Then: OOD scores
(log p(x), max softmax, gradient norm) against four OOD sets, AUROC/AUPR/FPR95, calibration
before and after temperature scaling, and plots (score histograms, ROC, reliability diagram).

    python examples/posthoc_ood.py --out runs/posthoc
    python examples/posthoc_ood.py --smoke
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import jem_plugin as jem
from jem_plugin import viz
from jem_plugin.app.data import digits_ood_sets, load_digits
from jem_plugin.app.nets import DigitsCNN


def train_plain_classifier(epochs: int) -> torch.nn.Module:
    """Stand-in for 'a classifier you already have': ordinary cross-entropy training."""
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(load_digits("train"), batch_size=64, shuffle=True)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="state_dict of a DigitsCNN you trained")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--out", default="runs/posthoc")
    p.add_argument("--smoke", action="store_true", help="tiny budget (seconds), for tests")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.checkpoint:
        model = DigitsCNN()
        model.load_state_dict(torch.load(args.checkpoint, weights_only=True))
    else:
        model = train_plain_classifier(1 if args.smoke else args.epochs)
    model.eval()

    # The three lines that matter: wrap, score, evaluate.
    jm = jem.wrap(model, data_range=(-1, 1))
    x_test, y_test = load_digits("test").tensors
    ood_sets = digits_ood_sets(x_test, y_test)

    results: dict = {"ood": {}}
    for method in ("logpx", "msp", "grad_norm"):
        s_in = jem.ood.score(jm, x_test, method=method, progress=False)
        outs = {name: jem.ood.score(jm, xo, method=method, progress=False) for name, xo in ood_sets.items()}
        results["ood"][method] = {name: jem.ood.evaluate(s_in, s) for name, s in outs.items()}
        viz.plot_histograms(s_in, outs, str(out_dir / f"hist_{method}.png"), title=f"score: {method}")
        viz.plot_roc(s_in, outs, str(out_dir / f"roc_{method}.png"), title=f"ROC: {method}")

    with torch.no_grad():
        logits = jm(x_test)
    results["calibration"] = jem.calibration.calibration_report(logits, y_test)
    viz.reliability_diagram(torch.softmax(logits, 1), y_test, str(out_dir / "reliability.png"))

    print(f"{'score':<10}" + "".join(f"{n:>12}" for n in ood_sets))
    for method, per_set in results["ood"].items():
        print(f"{method:<10}" + "".join(f"{per_set[n]['auroc']:>12.3f}" for n in ood_sets))
    cal = results["calibration"]
    print("calibration:", {k: round(v, 4) for k, v in cal.items() if isinstance(v, float)})
    print(f"plots: {out_dir}")
    return results


if __name__ == "__main__":
    main()
