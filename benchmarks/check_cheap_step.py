"""Do the cheaper iterations (issue 45, deliverable 3) lose anything on the tune set?

A small check on the generalisation matrix's tune data: digits32 at its ~150-per-class row (the
whole pool, 136 per class), resnet10t, 12 epochs (252 iterations), seeds 0-2, exactly the matrix's
cells (:func:`benchmarks.bench_generalisation.run_cell`: same data, splits, training, judge and
evaluation), with ``jem train``'s choice (``generative`` at p(x) weight 0.03) changed by each cut's
recipe settings (:data:`benchmarks.bench_train_step.CUTS`). The choice and the baseline are read
from the matrix's own cells (``results/generalisation/full/cells``); the choice's seed 0 is rerun
here to show those cells still reproduce with this code.

Per cut and seed: test accuracy against the baseline's, log p(x) AUROC on the four OOD sets against
the baseline's energy score (the matrix's target), the buffer's Fréchet distance over its init's,
the judge's accuracy on class-conditional samples (and on their init draws), training CPU seconds.

    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.check_cheap_step [--cuts steps5_shared chains16_shared]
    python -m benchmarks.check_cheap_step --summary-only

Writes ``results/generalisation/cheap_step/cells/*.json`` (one per cell; a rerun skips those
there) and ``results/cheap_step_digits.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_generalisation as GB
from benchmarks.bench_train_step import CHOICE, CUTS
from benchmarks.common import md_table, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "generalisation", "cheap_step")
MATRIX = os.path.join(HERE, "results", "generalisation", "full")
REPORT = os.path.join(HERE, "results", "cheap_step_digits")
DATASET, NET, EPOCHS, SEEDS = "digits32", "resnet10t", 12, (0, 1, 2)


def cell(seed: int, cut: str | None) -> dict[str, Any]:
    """The matrix's cell of ``jem train``'s choice (``cut=None``), the baseline (``"baseline"``), or
    the choice with a cut's settings."""
    c: dict[str, Any] = dict(
        dataset=DATASET, per_class=GB.per_class_for(DATASET, "150"), net=NET, run="baseline", seed=seed, epochs=EPOCHS
    )
    if cut != "baseline":
        c["run"] = "generative"
        c["set"] = {**CHOICE, **(CUTS[cut] if cut else {})}
    return c


def _read(c: dict[str, Any], *dirs: str) -> dict[str, Any] | None:
    for d in dirs:
        row = GB._read_json(os.path.join(d, "cells", GB.cell_name(c) + ".json"))
        if row is not None and "error" not in row:
            return row
    return None


def run(cuts: Sequence[str], seeds: Sequence[int] = SEEDS, rerun_choice: bool = True) -> None:
    todo = [cell(0, None)] if rerun_choice else []
    todo += [cell(s, k) for s in seeds for k in cuts]  # every cut's seed 0 first: partial results compare
    for c in todo:
        if _read(c, OUT) is None:
            GB._run_cell_job((c, OUT, False))


def _score(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    auroc = row["auroc"]["logpx"]
    base_energy = base["auroc"]["logpx"]  # the baseline's log p(x) is its energy score
    return {
        "acc_gap": row["accuracy"] - base["accuracy"],
        "auroc_min_gap": min(auroc[k] - base_energy[k] for k in auroc),
        "fd_ratio": row["buffer"]["fd"] / row["init_fd"],
        "judge_acc": row["cond"]["judge_acc"],
        "judge_acc_init": row["cond"]["judge_acc_init"],
        "train_cpu_s": row["train_cpu_s"],
        "iterations": row["iterations"],
    }


def summary(cuts: Sequence[str], seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    """Per run (the choice, each cut) and seed, the scores against that seed's baseline."""
    out: dict[str, Any] = {"seeds": list(seeds), "runs": {}, "reproduced": None}
    for name in ["choice", "choice (rerun here)", *cuts]:
        per_seed = {}
        for s in seeds:
            base = _read(cell(s, "baseline"), MATRIX)
            c = cell(s, None if name.startswith("choice") else name)
            row = _read(c, MATRIX if name == "choice" else OUT)
            if base is not None and row is not None:
                per_seed[s] = {**_score(row, base), "base_train_cpu_s": base["train_cpu_s"]}
        if per_seed:
            out["runs"][name] = {"settings": {**CHOICE, **CUTS.get(name, {})}, "seeds": per_seed}
    mine, theirs = _read(cell(0, None), OUT), _read(cell(0, None), MATRIX)
    if mine is not None and theirs is not None:
        out["reproduced"] = {
            k: (mine[k], theirs[k]) for k in ("accuracy", "init_fd") if isinstance(mine.get(k), (int, float))
        } | {"buffer_fd": (mine["buffer"]["fd"], theirs["buffer"]["fd"])}
    return out


def to_markdown(res: dict[str, Any]) -> str:
    rows = []
    for name, r in res["runs"].items():
        ss = r["seeds"]
        if not ss:
            continue

        def cells(key: str, fmt: str) -> str:
            vals = [ss[s][key] for s in sorted(ss)]
            each = " / ".join(f"s{s} " + fmt.format(ss[s][key]) for s in sorted(ss))
            return each + (f" (mean {fmt.format(statistics.mean(vals))})" if len(vals) > 1 else "")

        rows.append(
            [
                name,
                ", ".join(f"{k}={v}" for k, v in r["settings"].items()),
                cells("acc_gap", "{:+.3f}"),
                cells("auroc_min_gap", "{:+.4f}"),
                cells("fd_ratio", "{:.2f}"),
                cells("judge_acc", "{:.2f}") + " vs init " + cells("judge_acc_init", "{:.2f}"),
            ]
        )
    head = [
        "run",
        "settings",
        "test acc - baseline's (per seed)",
        "min over OOD sets of log p(x) AUROC - baseline energy's",
        "buffer FD / init FD",
        "judge acc on class samples",
    ]
    note = ""
    if res.get("reproduced"):
        note = "\n\nThe choice's seed 0 rerun with this code against the matrix's cell (mine, matrix's): " + ", ".join(
            f"{k} {a:.4f} / {b:.4f}" for k, (a, b) in res["reproduced"].items()
        )
    return (
        f"digits32, 136 per class, resnet10t, {EPOCHS} epochs (252 iterations), seeds {res['seeds']}; "
        "the baseline and the choice from the matrix's cells (older code: see the rerun below), the rest run here.\n\n"
        + md_table(head, rows)
        + note
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cuts", nargs="*", default=["steps5_shared", "chains16_shared", "steps5_shared_visits80"], choices=list(CUTS)
    )
    p.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    p.add_argument("--summary-only", action="store_true")
    p.add_argument("--no-rerun", action="store_true", help="skip rerunning the choice's seed 0")
    a = p.parse_args(argv)
    if not a.summary_only:
        run(a.cuts, a.seeds, not a.no_rerun)
    res = summary(a.cuts, a.seeds)
    write_json(REPORT + ".json", res)
    md = to_markdown(res)
    with open(REPORT + ".md", "w") as f:
        f.write("# Cheaper iterations on the tune set (check_cheap_step)\n\n" + md)
    print(md)


if __name__ == "__main__":
    main()
