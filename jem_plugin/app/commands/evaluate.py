"""``jem eval``: accuracy and calibration of a trained model on held-out data."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

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
        "--weights for one trained elsewhere): JSON on stdout (and in --out): the temperature the model file "
        "keeps (jem.load applies it) and the ECE, MCE, NLL and Brier with it; under 'refit', a temperature "
        "fitted on the evaluated data itself (not saved). A reliability diagram of the model as saved goes "
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
    kept = spec.get("temperature")  # what jem train kept in model.pt, and jem.load applies
    temperature = float(kept) if kept is not None else None
    as_saved = logits / temperature if temperature is not None else logits
    result = {
        "data": where,
        "accuracy": float((logits.argmax(1) == y).double().mean()),  # as jem train computes it
        "n": len(y),
        **model_calibration(as_saved, y, temperature),
        "refit": calibration.calibration_report(logits, y),
    }
    _emit(result, args)
    print(f"jem eval: {calibration_line(result)}", file=sys.stderr)  # stdout stays the JSON, for scripts
    from ...viz import reliability_diagram  # lazy: matplotlib

    png = _out_file(args.out).with_suffix(".png") if args.out else _figure_path(model_file, args.data)
    at = f" at its temperature {temperature:.2f}" if temperature is not None else ""
    reliability_diagram(
        as_saved, y, str(png), title=f"{Path(model_file).name}{at} on {where}: reliability", from_logits=True
    )
    print(f"figure: {png}", file=sys.stderr)
    return 0


def model_calibration(scaled: torch.Tensor, labels: torch.Tensor, temperature: float | None) -> dict[str, Any]:
    """The calibration of the model as saved: ``temperature`` (the model file's, or ``None`` where
    ``jem train`` kept none), ``temperature_kept`` (as ``metrics.json``'s ``calibration`` says it),
    and ECE, MCE, NLL and Brier of ``scaled``, its logits divided by that temperature."""
    return {
        "temperature": temperature,
        "temperature_kept": temperature is not None,
        "ece": calibration.ece(scaled, labels, from_logits=True),
        "mce": calibration.mce(scaled, labels, from_logits=True),
        "nll": calibration.nll(scaled, labels, from_logits=True),
        "brier": calibration.brier(scaled, labels, from_logits=True),
    }


def calibration_line(result: dict[str, Any]) -> str:
    """One line: the model's own temperature and ECE, then the temperature refitted on this data."""
    refit = result["refit"]
    if result["temperature_kept"]:
        head = (
            f"ECE {result['ece']:.3f} at the model's temperature {result['temperature']:.2f} (kept in the model file)"
        )
    else:
        head = f"ECE {result['ece']:.3f} of its own logits (the model keeps no temperature)"
    if refit["temperature_fitted"]:
        tail = (
            f"a temperature refitted on this data itself, {refit['temperature']:.2f}, gives ECE "
            f"{refit['ece_after']:.3f} (fitted to its NLL, an optimistic reference; not saved)"
        )
    else:
        tail = "no temperature fits this data (it has no misclassified image)"
    return f"{head}; {tail}"


def _figure_path(model_file: str, data: str | None) -> Path:
    """Where the reliability diagram goes without ``--out``: eval's own folder beside the model
    file (``runs/jem/model_eval/``), one figure per data set (``held-out``, ``folder_NAME``, ...),
    so that neither the training run's files nor another data set's figure are written over."""
    kind, _, rest = (data or "held-out").partition(":")
    name = kind + (f"_{Path(rest).name or rest}" if rest else "")
    folder = _beside_checkpoint(model_file, "_eval")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_')}_reliability.png"
