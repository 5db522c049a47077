"""Whether the long row's buffer target and its AUROC target ever hold together (issue 45).

The issue asks the default to meet three targets at once on textures: accuracy within a point of
the baseline, log p(x) AUROC at least the baseline energy's on each of the four OOD sets, and a
buffer Fréchet distance at most half its init's. No textures cell has met all three. This reads
every committed long-row point (each recipe against its baseline at the same iteration, the mean
over the seeds that have both) and asks, per data set, how the AUROC gaps fall on the points whose
buffer moved (FD at most half the init's) and on the points whose buffer did not: how many meet
the AUROC target, which set falls below, and how each set's gap follows the FD ratio (Spearman's
rank correlation, scipy's). Beside it, the JEM paper's own AUROC table. It trains nothing::

    python -m benchmarks.check_fd_auroc

It writes ``OUT/fd_auroc.md`` and ``OUT/long-row-fd-auroc.png`` (default
``benchmarks/results/long_row``; the figure is copied to ``docs/img``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_generalisation as GB
from benchmarks.bench_long_row import (
    DATASETS,
    DOCS_IMG,
    GPU_NETWORKS,
    NET_COLOURS,
    NETWORKS,
    OOD_NAMES,
    RESULTS,
    TARGETS,
    curves,
    load_rows,
)

#: Grathwohl et al. 2019 ("Your classifier is secretly an energy based model"), the OOD table:
#: AUROC with CIFAR-10 as the data, after ~10^5 iterations (``../shared/paper-notes``)
PAPER_AUROC = {
    "JEM log p(x)": {"SVHN": 0.67, "CIFAR10 interp": 0.65, "CIFAR100": 0.67, "CelebA": 0.75},
    "Wide-ResNet baseline max p(y|x)": {"SVHN": 0.93, "CIFAR10 interp": 0.77, "CIFAR100": 0.85, "CelebA": 0.62},
}
#: how a gap or a correlation is written
GAP = "{:+.2f}"


def points_of(entries: Sequence[dict[str, Any]], dataset: str) -> list[dict[str, Any]]:
    """Every evaluated point of ``dataset`` whose buffer was measured, with its cell's network and role."""
    return [
        {"net": e["net"], "role": e["role"], "run": e["run"], **p}
        for e in entries
        if e["dataset"] == dataset
        for p in e["points"]
        if p.get("fd_ratio") is not None and all(p.get(f"auroc_gap_{s}") is not None for s in OOD_NAMES)
    ]


def _spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def summarise(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The points split by the FD target: per group how many, how many meet the AUROC target (and
    all three), and per set the share below the baseline and the median gap; then each set's
    rank correlation with the FD ratio over all points (negative: the gap falls as the buffer moves)."""

    def group(ps: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {
            "n": len(ps),
            "auroc_met": sum(TARGETS["auroc"](p) for p in ps),
            "all_met": sum(all(t(p) for t in TARGETS.values()) for p in ps),
            "below": {s: sum(p[f"auroc_gap_{s}"] < 0 for p in ps) for s in OOD_NAMES},
            "median_gap": {s: (statistics.median(p[f"auroc_gap_{s}"] for p in ps) if ps else None) for s in OOD_NAMES},
        }

    moved = [p for p in points if TARGETS["fd"](p)]
    still = [p for p in points if not TARGETS["fd"](p)]
    fd = [p["fd_ratio"] for p in points]
    return {
        "moved": group(moved),
        "not_moved": group(still),
        "spearman_fd": {s: _spearman(fd, [p[f"auroc_gap_{s}"] for p in points]) for s in OOD_NAMES},
        "cells_moved": sorted({f"{p['net']} {p['run']}" for p in moved}),
    }


def to_markdown(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Where the FD and AUROC targets meet on the long row (check_fd_auroc)",
        "",
        "Every committed long-row point, each recipe against its cross-entropy baseline at the same iteration "
        "(the mean over the seeds that have both), split by the FD target (buffer Fréchet distance at most half "
        "its init's). Per group: points meeting the AUROC target (log p(x) AUROC at least the baseline energy's "
        "on all four OOD sets) and all three targets; per OOD set, the points below the baseline and the median "
        "gap. Last row: Spearman's rank correlation of each set's gap with the FD ratio over all points "
        "(positive: the gap falls as the buffer moves towards the data). `python -m benchmarks.check_fd_auroc`.",
        "",
    ]
    for dataset, s in summaries.items():
        role = "judged on" if dataset == "textures" else "tuned on"
        lines += [
            f"## {dataset} ({role})",
            "",
            "| points | n | AUROC met | all three met | "
            + " | ".join(f"`{x}` below / median gap" for x in OOD_NAMES)
            + " |",
            "|---|---|---|---|" + "---|" * len(OOD_NAMES),
        ]
        for key, label in (("moved", "FD <= half the init's"), ("not_moved", "FD above half")):
            g = s[key]
            lines.append(
                f"| {label} | {g['n']} | {g['auroc_met']} | {g['all_met']} | "
                + " | ".join(f"{g['below'][x]} / {GB._f(g['median_gap'][x], GAP)}" for x in OOD_NAMES)
                + " |"
            )
        lines.append(
            "| Spearman (gap, FD ratio), all points | | | | "
            + " | ".join(GB._f(s["spearman_fd"][x], GAP) for x in OOD_NAMES)
            + " |"
        )
        lines += ["", f"Cells with a point whose buffer moved: {', '.join(s['cells_moved']) or 'none'}.", ""]
    sets = list(next(iter(PAPER_AUROC.values())))
    lines += [
        "## The JEM paper's own table",
        "",
        "Grathwohl et al. 2019, OOD detection with CIFAR-10 as the data (AUROC), after ~10^5 iterations; its "
        "samples are the paper's generative result. The baseline column is the Wide-ResNet's max p(y|x), not "
        "its energy.",
        "",
        "| score | " + " | ".join(sets) + " |",
        "|---|" + "---|" * len(sets),
    ]
    lines += [f"| {k} | " + " | ".join(f"{v[x]:.2f}" for x in sets) + " |" for k, v in PAPER_AUROC.items()]
    jem, base = PAPER_AUROC.values()
    below = [x for x in sets if jem[x] < base[x]]
    lines += [
        "",
        f"The paper's log p(x) is below its baseline's score on {len(below)} of {len(sets)} sets ({', '.join(below)}).",
        "",
    ]
    return "\n".join(lines)


def figure(points_by_set: dict[str, list[dict[str, Any]]], path: str) -> str:
    """A panel per data set: the worst-set AUROC gap against the FD ratio, a dot per point, a colour
    per network, filled where accuracy is within a point; the region where both targets hold shaded."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(11, 4.6))
    axes = fig.subplots(1, len(points_by_set), squeeze=False)[0]
    nets: list[str] = []
    for ax, (dataset, ps) in zip(axes, points_by_set.items()):
        for p in ps:
            c = NET_COLOURS.get(p["net"], "k")
            filled = TARGETS["accuracy"](p)
            ax.plot(p["fd_ratio"], p["auroc_gap"], "o", ms=4.5, color=c, mfc=c if filled else "none", alpha=0.8)
            if p["net"] not in nets:
                nets.append(p["net"])
        ax.axvline(0.5, color="0.3", ls=":", lw=1)
        ax.axhline(0.0, color="0.3", ls=":", lw=1)
        (x0, _), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        y0, y1 = min(y0, -0.05), max(y1, 0.05)
        ax.set_xlim(min(x0, 0.4), ax.get_xlim()[1])  # fixed before shading, so the shade meets the edges
        ax.set_ylim(y0, y1)
        ax.axvspan(ax.get_xlim()[0], 0.5, ymin=-y0 / (y1 - y0), color="tab:green", alpha=0.12, lw=0)
        moved = [p for p in ps if TARGETS["fd"](p)]
        met = sum(TARGETS["auroc"](p) for p in moved)
        ax.set_title(
            f"{dataset} ({'judged on' if dataset == 'textures' else 'tuned on'}): {len(moved)} points with FD <= half "
            f"the init's;\nof those, {met} with log p(x) AUROC >= the baseline energy's on all sets",
            fontsize=9,
        )
        ax.set_xlabel("buffer Fréchet distance / its init's (target: <= 0.5)", fontsize=9)
        ax.set_ylabel("log p(x) AUROC - baseline energy's, worst of 4 sets\n(target: >= 0)", fontsize=9)
        ax.grid(alpha=0.3)
    order = [n for n in NETWORKS + GPU_NETWORKS if n in nets] + [n for n in nets if n not in NETWORKS + GPU_NETWORKS]
    handles = [Line2D([], [], color=NET_COLOURS.get(n, "k"), marker="o", ls="", label=n) for n in order]
    handles.append(Line2D([], [], color="k", marker="o", mfc="none", ls="", label="accuracy > 1 pt below"))
    handles.append(Line2D([], [], color="tab:green", lw=6, alpha=0.25, label="both targets"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(
        "The long row: every recipe point against its baseline at the same iteration (all recipes and roles)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    return path


def check(out_dir: str = RESULTS, docs: str | None = DOCS_IMG) -> dict[str, dict[str, Any]]:
    """:func:`summarise` per data set of the cells in ``out_dir``; writes the table and the figure."""
    entries = curves(load_rows(out_dir))
    points = {d: points_of(entries, d) for d in DATASETS}
    summaries = {d: summarise(ps) for d, ps in points.items()}
    with open(os.path.join(out_dir, "fd_auroc.md"), "w") as f:
        f.write(to_markdown(summaries))
    png = figure(points, os.path.join(out_dir, "long-row-fd-auroc.png"))
    if docs:
        os.makedirs(docs, exist_ok=True)
        shutil.copy(png, os.path.join(docs, os.path.basename(png)))
    return summaries


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=RESULTS, help="the long row's results directory (its cells/ are read)")
    p.add_argument("--docs", default=DOCS_IMG, help="where the figure is copied ('' for nowhere)")
    a = p.parse_args(argv)
    print(to_markdown(check(a.out, a.docs or None)))


if __name__ == "__main__":
    main()
