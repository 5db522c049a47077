"""``jem doctor``: check this machine (versions, devices, a self-test and a timing)."""

from __future__ import annotations

import argparse
import json

from .. import CLIError, doctor
from ._common import _device, _out_file


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine: versions, devices, a GPU self-test and timing",
        description="Check this machine: torch/torchvision/timm/pluggy versions and whether torch and "
        "torchvision match, the devices, and a self-test on --device (the CUDA-graph sampler, bf16 "
        "autocast with channels_last, a device generator, one JEM iteration timed against its FLOP "
        "floor). Exit status 1 when something failed.",
    )
    p.add_argument("--device", default=None, help="device to self-test (default: the GPU when there is one, else cpu)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the timing (default 20; 0 leaves it out)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON (default: none)")
    p.set_defaults(func=run, config=None)


def run(args) -> int:
    dev = _device(args.device) if args.device else doctor.default_device()
    if args.seconds < 0:
        raise CLIError(f"--seconds {args.seconds:g} is negative; give the timing's length (0 leaves it out)")
    json_path = _out_file(args.json, "--json") if args.json else None
    report = doctor.run_doctor(dev, seconds=args.seconds, echo=lambda line: print(line, flush=True))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
        print(f"report: {json_path}")
    return 0 if report["ok"] else 1
