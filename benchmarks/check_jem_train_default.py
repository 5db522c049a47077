"""`jem train` as a user first types it: its own default model and data, against its baseline.

With no flags `jem train` trains `digits-cnn` (no normalisation layers) on scikit-learn's 8x8
digits (about 144 training images per class), so its rule picks `generative` with the p(x) weight
0.03 and no energy L2 (`jem_plugin.app.default_recipe.default_choice`). That network is not in the
generalisation matrix, so this script judges the rule on it: for each seed, `jem train` with no
recipe flag, `jem train --baseline` and `jem train --recipe generative` (the recipe as it is), each
at its default epochs, through the command line; held-out accuracy on scikit-learn's test digits
(`metrics.json`), which no step of the rule read. Also the buffer's Fréchet distance against its
init's where the run reports it.

    python -m benchmarks.check_jem_train_default            # 3 seeds: ~25 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "jem_train_default.json")
RUNS = {"default": [], "baseline": ["--baseline"], "generative": ["--recipe", "generative"]}


def train(flags: list[str], seed: int, out: str) -> dict[str, Any]:
    """One `jem train` run through the CLI; its metrics.json and its CPU time."""
    cmd = [sys.executable, "-m", "jem_plugin.app.cli", "train", "--quiet", "--seed", str(seed), "--out", out, *flags]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    first = next((line for line in done.stdout.splitlines() if line.startswith("jem train: digits")), "")
    return {"metrics": metrics, "wall_s": time.perf_counter() - t, "run_line": first}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--epochs", type=int, default=None, help="default: jem train's own")
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    more = ["--epochs", str(a.epochs)] if a.epochs else []
    res: dict[str, Any] = {"machine": common.machine_info(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            for name in a.runs:
                r = train(RUNS[name] + more, seed, os.path.join(tmp, f"{name}_s{seed}"))
                res["runs"].setdefault(name, {})[str(seed)] = r
                acc = r["metrics"]["held_out"]["accuracy"]
                q = r["metrics"].get("sample_quality") or {}
                fd = f", buffer FD {q['fd_buffer']:.3g} (init {q['fd_init']:.3g})" if "fd_buffer" in q else ""
                print(f"seed {seed} {name:10s} held-out accuracy {acc:.4f}{fd} ({r['wall_s']:.0f} s)", flush=True)
    base = res["runs"].get("baseline", {})
    for name, by_seed in res["runs"].items():
        if name == "baseline" or not base:
            continue
        diffs = [
            100 * (r["metrics"]["held_out"]["accuracy"] - base[s]["metrics"]["held_out"]["accuracy"])
            for s, r in by_seed.items()
        ]
        res.setdefault("points_vs_baseline", {})[name] = {"per_seed": diffs, "mean": statistics.fmean(diffs)}
        print(
            f"{name}: {' / '.join(f'{d:+.1f}' for d in diffs)} points against the baseline (mean {statistics.fmean(diffs):+.2f})"
        )
    common.write_json(a.out, res)
    return res


if __name__ == "__main__":
    main()
