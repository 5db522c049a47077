"""``jem demo``: a classifier and a JEM on the bundled digits, side by side, with a report."""

from __future__ import annotations

import argparse
from typing import Any

from .. import CLIError
from ..experiments import DigitsConfig, run_digits_demo
from ..nets import DigitsCNN
from ..report import headline, metric_label, write_report
from ._common import _check_install, _device, _out_dir, _use_threads

# `jem demo --smoke`: the whole pipeline in seconds (tests, a first look); not a meaningful result.
SMOKE_DEMO = {"epochs": 1, "sgld_steps": 2, "buffer_capacity": 500, "class_sample_steps": 2, "judge_epochs": 5}


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="baseline vs JEM on the bundled digits, with a report")
    p.add_argument(
        "--budget-seconds",
        type=float,
        default=240.0,
        help="time for both runs (default 240); a run it cuts short is reported as such",
    )
    p.add_argument("--smoke", action="store_true", help="run the pipeline in seconds (not a meaningful result)")
    p.add_argument("--force", action="store_true", help="write over a report already in --out")
    p.set_defaults(func=run)


def run(args) -> int:
    _check_install()
    out = _out_dir(args.out or "jem-report")
    if (out / "report.html").exists() and not args.force:
        raise CLIError(
            f"--out {out} already holds a report (report.html); use --out elsewhere, or --force to replace it"
        )
    _device(args.device)
    _use_threads(args, DigitsCNN(10, width=DigitsConfig.width), (1, 8, 8))  # the demo's network, sized
    overrides = SMOKE_DEMO if args.smoke else {}
    result = run_digits_demo(
        out,
        seed=args.seed,
        device=args.device,
        progress=not args.quiet,
        budget_seconds=args.budget_seconds,
        **overrides,
    )
    report = write_report(out, result, title="jem demo: a classifier and a JEM on the digits")
    runs = result.get("runs", {})
    first: dict[str, Any] = next(iter(runs.values()), {})
    keys = [k for k in first.get("summary", {}) if k.startswith(("acc", "ece", "auroc_logpx"))]
    lead = headline(result)
    if lead:  # a cut-short comparison leads with what it is, not with its numbers
        print(f"\n{lead}")
    elif args.smoke:
        print("\n--smoke: a check that the pipeline runs in seconds, not a comparison of the two models.")
    print(f"\n{'':<34}" + "".join(f"{n:>12}" for n in runs))
    for k in keys:
        vals = [runs[n]["summary"].get(k) for n in runs]
        print(
            f"{metric_label(k)[0]:<34}" + "".join(f"{v:>12.3f}" if isinstance(v, float) else f"{'':>12}" for v in vals)
        )
    if result.get("warning") and not lead:
        print(f"\nWARNING: {result['warning']}")
    print(f"\nreport: {report}  (metrics.json, model_baseline.pt and model_JEM.pt are next to it)")
    return 0
