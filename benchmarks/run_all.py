"""Run every benchmark and write ``results.json`` and ``results.md`` (a Markdown report with the machine).

    python -m benchmarks.run_all --out benchmarks/results            # everything (quality: ~1 h on 2 cores)
    python -m benchmarks.run_all --quick                              # smoke run of seconds
    python -m benchmarks.run_all --skip quality                       # speed only
    python benchmarks/run_all.py --only sampler scoring

A benchmark that is skipped but has a result file from an earlier run in ``--out`` (``<name>.json``,
written by every benchmark) is carried over into the report and marked as such, so the slow
quality benchmark can run on its own (in the background) and still land in the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import (
    bench_gpu_path,
    bench_quality,
    bench_sampler,
    bench_scaling,
    bench_scoring,
    bench_train_step,
    common,
)

BENCHMARKS = {
    "sampler": bench_sampler,
    "train_step": bench_train_step,
    "scoring": bench_scoring,
    "scaling": bench_scaling,
    "gpu_path": bench_gpu_path,
    "quality": bench_quality,
}


def run_benchmarks(
    names: Sequence[str],
    quick: bool = False,
    repeats: int | None = None,
    out_dir: str | None = None,
    epochs: int | None = None,
    workers: int = 2,
    log=print,
) -> dict[str, Any]:
    """Run the named benchmarks; ``{name: result}`` plus ``{name}_seconds`` timings."""
    results: dict[str, Any] = {}
    for name in names:
        mod = BENCHMARKS[name]
        t0 = time.perf_counter()
        log(f"[run_all] {name} ...")
        kw: dict[str, Any] = {"quick": quick, "repeats": repeats, "out_dir": out_dir}
        if name == "quality":
            kw.update(epochs=epochs, workers=workers)
        results[name] = mod.run(**kw)
        results[name]["benchmark_seconds"] = time.perf_counter() - t0
        log(f"[run_all] {name} done in {results[name]['benchmark_seconds']:.0f} s")
    return results


def targets_table(results: dict[str, Any]) -> list[list[str]]:
    """One row per target of issue 6: what was measured and whether it is met."""
    rows: list[list[str]] = []
    mark = common.target_mark
    s = results.get("sampler")
    if s:
        for m, r in s["targets"].items():
            rows.append([f"sampler <= 1.02x floor ({m})", common.fmt_ratio(r["ratio"]), mark(r["le_1.02x_floor"])])
            t = s["models"][m]["time"]
            for o in ("reference", "torchebm"):
                if f"not_slower_than_{o}" in r:
                    rows.append(
                        [
                            f"sampler not slower than {o} ({m})",
                            f"{common.fmt_ratio(r.get(f'vs_{o}'))} of its time (paired; medians "
                            f"{t['jem_plugin']['median_s'] * 1e3:.1f} vs {t[o]['median_s'] * 1e3:.1f} ms)",
                            mark(r[f"not_slower_than_{o}"]),
                        ]
                    )
            if r.get("memory_growth_mb") is not None:
                fl = r.get("floor_memory_growth_mb")
                rows.append(
                    [
                        f"sampler memory flat in steps ({m})",
                        f"{r['memory_growth_mb']:+.1f} MB from fewest to most steps (floor: "
                        f"{'n/a' if fl is None else format(fl, '+.1f')} MB)",
                        mark(r.get("memory_flat")),
                    ]
                )
        a = s.get("agreement", {})
        rows.append(
            [
                "sampler computes the floor's chain (same generator)",
                f"bit-identical: {a.get('ours_equal_floor')}",
                mark(a.get("ours_equal_floor")),
            ]
        )
    sc = results.get("scoring")
    if sc:
        for m, e in sc["models"].items():
            thr = e.get("throughput_vs_pytorch_ood")
            ident = e["check"].get("identical")
            rows.append(
                [
                    f"logpx == pytorch-ood EnergyBased, >= 0.95x throughput ({m})",
                    f"identical: {ident}, max diff {e['check'].get('max_abs_diff', float('nan')):.1e}, "
                    f"{'n/a' if thr is None else f'{thr:.2f}x'}",
                    mark(None if thr is None else bool(ident) and e.get("throughput_ok")),
                ]
            )
    ts = results.get("train_step")
    if ts:
        for m, e in ts["models"].items():
            if "jem_vs_sum_of_parts" in e:
                rows.append(
                    [
                        f"JEM step <= 1.05x sum of parts ({m})",
                        f"{e['jem_vs_sum_of_parts']:.3f}x",
                        mark(e["jem_vs_sum_of_parts_le_1.05"]),
                    ]
                )
    q = results.get("quality")
    if q:
        c = q["comparisons"]
        for k, v in c.items():
            if isinstance(v, dict) and "matches_20step" in v:
                measured = (
                    f"diverged ({v['diverged']})"
                    if "diverged" in v
                    else f"acc {-v['acc_below_20step'] * 100:+.1f} pt, "
                    f"AUROC {-v['worst_logpx_auroc_below_20step']:+.3f}"
                )
                rows.append([f"{k} within 1 pt / 0.02 AUROC of 20 steps", measured, mark(v["matches_20step"])])
        if "fast_recipe_cost_vs_baseline" in c:
            rows.append(
                [
                    "whole recipe (fast) <= 4x baseline time",
                    f"{c['fast_recipe_cost_vs_baseline']:.2f}x",
                    mark(c["fast_recipe_cost_ok"]),
                ]
            )
        fs = c.get("fast_recipe_seeds")
        if fs:
            rows.append(
                [
                    "fast recipe meets issue 3's targets on every seed",
                    f"{fs['all_targets_met']} of {fs['n']} seeds; accuracy vs baseline mean "
                    f"{fs['mean_acc_vs_baseline'] * 100:+.2f} pt, worst {fs['worst_acc_vs_baseline'] * 100:+.2f} pt",
                    mark(fs["all_targets_met"] == fs["n"]),
                ]
            )
    return rows


def write_report(results: dict[str, Any], out: str, command: str, carried: Sequence[str] = ()) -> str:
    machine = results["machine"]
    parts = [
        "# jem-plugin benchmark results",
        "",
        common.machine_markdown(machine),
        "",
        f"Command: `{command}`" + (f" (carried over from earlier runs: {', '.join(carried)})" if carried else ""),
        "",
        "## Targets",
        "",
        common.md_table(["target", "measured", "status"], targets_table(results)),
    ]
    for name, mod in BENCHMARKS.items():
        if name in results:
            parts += ["", f"## {name}", "", mod.to_markdown(results[name])]
    md = "\n".join(parts) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md)
    common.write_json(os.path.join(out, "results.json"), results)
    return md


START, END = "<!-- results:start -->", "<!-- results:end -->"


def update_readme(md: str, path: str = os.path.join(common.REPO_ROOT, "benchmarks", "README.md")) -> None:
    """Replace the text between the results markers of the README with the report (headings demoted)."""
    with open(path) as f:
        text = f.read()
    if START not in text or END not in text:
        raise SystemExit(f"{path} has no {START} ... {END} markers")
    body = "\n".join(("#" + line) if line.startswith("#") else line for line in md.splitlines()[1:])
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{body.strip()}\n{END}{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(common.REPO_ROOT, "benchmarks", "results"))
    p.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of seconds")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machine)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 15; quick 3)")
    p.add_argument("--only", nargs="*", choices=list(BENCHMARKS), default=None)
    p.add_argument("--skip", nargs="*", choices=list(BENCHMARKS), default=[])
    p.add_argument("--epochs", type=int, default=None, help="quality: epochs per run (default 150)")
    p.add_argument("--workers", type=int, default=2, help="quality: parallel training processes")
    p.add_argument(
        "--readme",
        action="store_true",
        help="also paste the report between the results markers of benchmarks/README.md",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild results.json/results.md from the <name>.json files in --out",
    )
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    names = [] if args.report_only else [n for n in (args.only or list(BENCHMARKS)) if n not in args.skip]
    machine = common.machine_info()
    if args.report_only:  # describe the machine the numbers came from, not the one rebuilding the report
        for name in BENCHMARKS:
            path = os.path.join(args.out, f"{name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    machine = json.load(f).get("machine", machine)
                break
    results: dict[str, Any] = {"machine": machine}
    fresh = run_benchmarks(
        names, quick=args.quick, repeats=args.repeats, out_dir=args.out, epochs=args.epochs, workers=args.workers
    )
    for name, res in fresh.items():  # per-benchmark files too, so later partial runs can reuse them
        common.write_json(os.path.join(args.out, f"{name}.json"), {"machine": machine, name: res})
    carried = []
    for name in BENCHMARKS:
        if name in fresh:
            results[name] = fresh[name]
            continue
        path = os.path.join(args.out, f"{name}.json")
        if os.path.exists(path) and not args.quick:
            with open(path) as f:
                old = json.load(f)
            if name in old:
                results[name] = old[name]
                results[name]["carried_over_from"] = path
                carried.append(name)
    command = "python -m benchmarks.run_all " + " ".join(argv if argv is not None else sys.argv[1:])
    md = write_report(results, args.out, command.strip(), carried)
    if args.readme:
        update_readme(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
