"""``jem ood``: OOD detection scores and metrics of a trained model, as JSON, a table and a heat map."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ... import ood
from .. import CLIError
from ..model_files import check_inputs, load_data, ood_sets, training_data
from ._common import (
    _beside_checkpoint,
    _checkpoint_args,
    _emit,
    _eval_tensors,
    _load_scored_model,
    _out_file,
    _positive,
)


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ood", parents=[common], help="OOD detection scores and metrics of a trained model")
    _checkpoint_args(p, own_weights=True)
    p.add_argument(
        "--scores",
        default="logpx,msp,grad_norm",
        help="comma-separated score names, or all (every registered score; see jem plugins); the "
        "scores without an input gradient share one forward per batch. Prints the JSON result on stdout and a table marking the best score per set on "
        "stderr, and writes it as CSV and a PNG heat map next to --out (default: next to the "
        "checkpoint)",
    )
    p.add_argument(
        "--score-option",
        action="append",
        default=[],
        type=_score_option,
        metavar="SCORE.KEY=VALUE",
        help="an option of one score, repeatable: multi_mahalanobis.weights=adversarial, knn.k=10, "
        '\'multi_mahalanobis.layers=["blocks.1", "blocks.3"]\' (VALUE read as JSON where it '
        "parses, else as text; default: none, each score's own defaults)",
    )
    p.add_argument(
        "--fit-data",
        default=None,
        metavar="SPEC",
        help="training data for the detectors that need fitting (Mahalanobis, KNN, ...), as "
        "--data specs are written (default: the model's training data)",
    )
    p.add_argument(
        "--openood",
        default=None,
        metavar="ROOT",
        help="an OpenOOD v1.5 data directory (benchmark_imglist/, images_classic/): its ID test "
        "list, near- and far-OOD lists, and its training list for fitting (default: none; --data and --ood)",
    )
    p.add_argument(
        "--benchmark",
        default="cifar10",
        choices=["cifar10", "cifar100", "imagenet200", "imagenet"],
        help="the OpenOOD benchmark under --openood (default cifar10)",
    )
    p.add_argument("--batch-size", type=_positive, default=256, help="images scored at once")
    p.add_argument(
        "--ood",
        action="append",
        default=None,
        metavar="SET",
        help="noise or folder:PATH, repeatable (named by the folder); default: noise "
        "(digits: noise, patches, blends, transposed)",
    )
    p.set_defaults(func=run)


def _score_option(text: str) -> tuple[str, str, Any]:
    """``SCORE.KEY=VALUE`` as ``(score, key, value)``, the value read as JSON where it parses."""
    name, eq, raw = text.partition("=")
    score, dot, key = name.partition(".")
    if not (eq and dot and score and key):
        raise argparse.ArgumentTypeError(f"expected SCORE.KEY=VALUE, e.g. knn.k=10; got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return score, key, value


def _method_options(options: list[tuple[str, str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    """``--score-option`` as ``evaluate_all``'s ``method_kwargs``, each checked against what its
    score accepts (one line, before anything is loaded)."""
    from ...plugins import collect

    out: dict[str, dict[str, Any]] = {}
    for score, key, value in options:
        if score not in methods:
            raise CLIError(
                f"--score-option {score}.{key}: {score!r} is not among the --scores run ({', '.join(methods)})"
            )
        out.setdefault(score, {})[key] = value
    try:
        ood._check_method_kwargs(out, collect(ood._HOOK))
    except TypeError as exc:
        raise CLIError(f"--score-option: {exc}") from None
    return out


def run(args) -> int:
    from ...plugins import collect
    from ...viz import plot_ood_table  # lazy: matplotlib
    from ..model_files import check_shape

    methods = ood._method_names(args.scores)  # unknown names: one line, before anything is loaded
    method_kwargs = _method_options(args.score_option, methods)
    if args.openood and (args.data or args.ood):
        raise CLIError("--openood gives both the test images and the OOD sets; drop --data and --ood")
    jm, spec, model_file = _load_scored_model(args, "ood", args.benchmark if args.openood else None)
    own = args.checkpoint is None
    size = args.image_size or int(spec["sample_shape"][-1])
    progress = False if args.quiet else None
    fit_needed = any(collect(ood._HOOK)[m].get("needs_fit", False) for m in methods)
    data_in: Any
    sets: dict[str, Any]
    fit_data: Any = None
    if args.openood:
        from ..openood import load_openood

        train, test, groups = load_openood(
            args.openood, args.benchmark, image_size=size, mean=spec.get("mean"), std=spec.get("std")
        )
        data_in = DataLoader(test, batch_size=args.batch_size)
        sets = {name: DataLoader(ds, batch_size=args.batch_size) for g in groups.values() for name, ds in g.items()}
        check_inputs(jm, next(iter(data_in))[0], spec, f"--openood {args.openood}")
        if fit_needed and not args.fit_data:
            fit_data = DataLoader(train, batch_size=args.batch_size)
    else:
        x, y, _ = _eval_tensors(args, spec)
        check_inputs(jm, x, spec, args.data or spec["data"])
        data_in, sets = x, ood_sets(args.ood, spec, jm, x, y, seed=args.seed, skip_bad=args.skip_bad_images)
    if fit_needed and fit_data is None and own and not args.fit_data:
        print(
            "jem ood: the detectors fitted on training data (mahalanobis, knn, ...) are skipped: "
            "give --fit-data folder:PATH (the classifier's training images) to score them",
            file=sys.stderr,
        )
    elif fit_needed and fit_data is None:
        # The model's own training data (its spec names it; the held-out split left out), or --fit-data.
        source = args.fit_data or spec["data"]
        if args.fit_data:
            ds, *_ = load_data(
                source,
                train=True,
                image_size=size,
                seed=args.seed,
                skip_bad=args.skip_bad_images,
                mean=spec.get("mean"),
                std=spec.get("std"),
            )
        else:
            ds = training_data(spec, args.seed, skip_bad=args.skip_bad_images)
        if len(ds):
            check_shape(spec, ds[0][0].shape, source)
        fit_data = DataLoader(ds, batch_size=args.batch_size)
    table = ood.evaluate_all(
        jm,
        data_in,
        sets,
        methods,
        fit_data=fit_data,
        method_kwargs=method_kwargs,
        batch_size=args.batch_size,
        progress=progress,
    )
    result: dict[str, Any] = {}
    for r in table.rows():
        key = f"{r['score']}/{r['set']}"
        if r["status"] == "ok":
            result[key] = {**table[r["score"]][r["set"]], "seconds_per_1000": r["seconds_per_1000"]}
        else:
            result[key] = {"status": r["status"], "reason": r["reason"]}
    _emit(result, args)
    base = _out_file(args.out).with_suffix("") if args.out else _beside_checkpoint(model_file, "_ood")
    csv_path, png_path = table.to_csv(base.with_suffix(".csv")), str(base.with_suffix(".png"))
    plot_ood_table(table, png_path, title=f"{Path(model_file).name}: AUROC per score and OOD set")
    # The JSON above is the result for scripts; the table is for the reader (stderr keeps stdout JSON).
    print(f"\n{table.to_text()}\ntable: {csv_path}\nfigure: {png_path}", file=sys.stderr)
    return 0
