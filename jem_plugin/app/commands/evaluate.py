"""``jem eval``: accuracy and calibration of a trained model on held-out data."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from ... import calibration
from ..._checks import model_device
from ..model_files import check_inputs
from ._common import _beside_checkpoint, _checkpoint_args, _emit, _eval_tensors, _load_scored_model, _out_file


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "eval",
        parents=[common],
        help="accuracy and calibration of a trained model",
        description="Accuracy and calibration of a trained model (a jem train model file, or --model and "
        "--weights for one trained elsewhere): JSON on stdout (and in --out), and a reliability diagram "
        "next to --out (default: in eval's own folder beside the checkpoint, MODEL_eval/DATA_reliability.png; "
        "never over the training run's files).",
    )
    _checkpoint_args(p, own_weights=True)
    p.set_defaults(func=run)


def run(args) -> int:
    jm, spec, model_file = _load_scored_model(args, "eval")
    x, y, where = _eval_tensors(args, spec)
    check_inputs(jm, x, spec, args.data or spec["data"])
    with torch.no_grad():
        logits = torch.cat([jm.logits(xb.to(model_device(jm))).cpu() for xb in x.split(512)])
    result = {
        "data": where,
        "accuracy": float((logits.argmax(1) == y).float().mean()),
        **calibration.calibration_report(logits, y),
        "n": len(y),
    }
    _emit(result, args)
    from ...viz import reliability_diagram  # lazy: matplotlib

    png = _out_file(args.out).with_suffix(".png") if args.out else _figure_path(model_file, args.data)
    reliability_diagram(logits, y, str(png), title=f"{Path(model_file).name} on {where}: reliability", from_logits=True)
    print(f"figure: {png}", file=sys.stderr)  # stdout stays the JSON, for scripts
    return 0


def _figure_path(model_file: str, data: str | None) -> Path:
    """Where the reliability diagram goes without ``--out``: eval's own folder beside the model
    file (``runs/jem/model_eval/``), one figure per data set (``held-out``, ``folder_NAME``, ...),
    so that neither the training run's files nor another data set's figure are written over."""
    kind, _, rest = (data or "held-out").partition(":")
    name = kind + (f"_{Path(rest).name or rest}" if rest else "")
    folder = _beside_checkpoint(model_file, "_eval")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_')}_reliability.png"
