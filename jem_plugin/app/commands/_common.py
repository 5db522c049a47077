"""What several ``jem`` commands share: the device, output paths, a positive count, the install check,
the JSON result, and a trained model's evaluation images."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .. import CLIError, doctor
from ..model_files import held_out_data
from ..threads import ThreadChoice, use_threads

SKIP_BAD_HELP = (
    "leave out a folder's unreadable images (not images, truncated), saying how many, instead of stopping at the first"
)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _floats(text: str) -> list[float]:
    """A comma-separated list of numbers: ``0.485,0.456,0.406``."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas or spaces, e.g. 0.5,0.5,0.5; got {text!r}"
        ) from None


class _PerChannel(argparse.Action):
    """``--mean 0.485,0.456,0.406`` and ``--mean 0.485 0.456 0.406`` alike: one flat list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for part in values for v in part])


class DefaultDevice(str):
    """``--device`` as nobody gave it: the CPU. A GPU on the machine is then named in one line,
    since training there on the CPU is rarely what was meant."""


DEFAULT_DEVICE = DefaultDevice("cpu")


def _device(name: str):
    if isinstance(name, DefaultDevice) and torch.cuda.is_available():
        print(
            f"jem: running on the CPU (the default); this machine has a GPU ({torch.cuda.get_device_name(0)}): "
            "add --device cuda",
            file=sys.stderr,
        )
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise CLIError(f"unknown device {name!r} (use cpu, cuda, cuda:1, mps)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        build = "" if torch.version.cuda else f" (torch {torch.__version__} is a CPU-only build)"
        raise CLIError(f"--device {name} asked for CUDA but no GPU is available{build}; use --device cpu")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise CLIError(f"--device {name}: this machine has no Apple-silicon GPU (MPS); use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, AssertionError) as exc:
            raise CLIError(f"--device {name} is not available on this machine; use --device cpu") from exc
    return dev


def _use_threads(args, model=None, sample_shape=None, speak: bool = True) -> ThreadChoice:
    """The command's CPU threads, chosen before its work (:func:`..threads.use_threads`: one helper
    for every command) and said in one line unless ``--quiet`` (or ``speak`` is off: a DDP rank
    other than the first)."""
    quiet = getattr(args, "quiet", False) or not speak
    return use_threads(model, sample_shape, say=(lambda line: None) if quiet else None)


def _out_dir(path: str) -> Path:
    """A run directory for --out: never an existing file."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {path} is an existing file; give a directory (it is created if missing)")
    return out


def _out_file(path: str, flag: str = "--out") -> Path:
    out = Path(path)
    if out.is_dir():
        raise CLIError(f"{flag} {path} is a directory; give a file name, e.g. {out / 'result.json'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _beside_checkpoint(checkpoint: str, suffix: str) -> Path:
    """A command's default output file, beside the checkpoint it read: ``model.pt`` with
    ``"_ood"`` gives ``model_ood`` (used when no ``--out`` is given)."""
    path = Path(checkpoint)
    return path.with_name(path.stem + suffix)


def _check_install() -> None:
    """The cheap part of `jem doctor` (milliseconds): a torch/torchvision mismatch ends the command
    before any training, not inside torchvision minutes later."""
    problem = doctor.install_problem()
    if problem:
        raise CLIError(problem)


def _emit(result: dict[str, Any], args) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        _out_file(args.out).write_text(text)


def _eval_tensors(args, spec):
    ds, where = held_out_data(spec, args.data, args.image_size, args.seed, skip_bad=args.skip_bad_images)
    if hasattr(ds, "tensors"):
        x, y = ds.tensors
    else:
        xs, ys = zip(*[ds[i] for i in range(len(ds))])
        x, y = torch.stack(list(xs)), torch.as_tensor(ys)
    return x, y, where


def _checkpoint_args(p: argparse.ArgumentParser, own_weights: bool = False) -> None:
    """The arguments of the commands that score a trained model (eval, ood). ``own_weights``: the
    model file may be left out for ``--model``/``--weights`` (a classifier trained elsewhere)."""
    if own_weights:
        p.add_argument(
            "checkpoint", nargs="?", default=None, help="model.pt written by `jem train` (or --model and --weights)"
        )
        _own_weights_args(p)
    else:
        p.add_argument("checkpoint", help="model.pt written by `jem train`")
    _trust_factory_arg(p)
    p.add_argument("--data", default=None, help="evaluation data (default: what training held out)")
    p.add_argument("--image-size", type=int, default=None, help="folder data resized to this (default: the model's)")
    p.add_argument("--skip-bad-images", action="store_true", help=SKIP_BAD_HELP)


def _trust_factory_arg(p: argparse.ArgumentParser) -> None:
    """``--trust-factory``, for the commands that read a model file (``jem.load``'s ``trust_factory``)."""
    p.add_argument(
        "--trust-factory",
        action="store_true",
        help="rebuild a model file trained with --model module:factory by importing that module and calling "
        "its factory (code the file names; without this flag such a file is refused: only built-in nets "
        "and timm names are built from a file)",
    )


def _own_weights_args(p: argparse.ArgumentParser) -> None:
    """``--model``/``--weights`` and what they need: a classifier trained elsewhere."""
    own = p.add_argument_group("a classifier trained elsewhere (instead of a jem train model file)")
    own.add_argument(
        "--model",
        default=None,
        metavar="SPEC",
        help="its network, as jem train's --model: a timm name, module:factory (e.g. "
        "torchvision.models:resnet18, called with num_classes=K) or a built-in net (default: none; "
        "the model file's)",
    )
    own.add_argument(
        "--weights",
        default=None,
        metavar="FILE",
        help="its weights: a file of torch.save(model.state_dict()) (or a training checkpoint holding "
        "one) (default: none; the model file's)",
    )
    own.add_argument(
        "--num-classes", type=_positive, default=None, help="its class count (default: the folders of --data)"
    )
    own.add_argument(
        "--mean",
        type=_floats,
        nargs="+",
        action=_PerChannel,
        default=None,
        help="the normalisation its training applied, per channel: 0.485,0.456,0.406 (default: its "
        "adapter's: timm's pretrained mean/std, ImageNet's for torchvision, else [-1, 1] pixels)",
    )
    own.add_argument(
        "--std",
        type=_floats,
        nargs="+",
        action=_PerChannel,
        default=None,
        help="with --mean: 0.229,0.224,0.225 (default: its adapter's)",
    )


def _load_scored_model(args, command: str, openood_benchmark: str | None = None) -> tuple[Any, dict[str, Any], str]:
    """``(jm, spec, model file)`` for a command that scores a trained model: a ``jem train`` model
    file, or ``--model``/``--weights`` (``user_weights.load_user_model``); the file names the
    default outputs."""
    from ..model_files import load_model_checkpoint
    from ..user_weights import load_user_model

    own = args.model is not None or args.weights is not None
    if own and args.checkpoint:
        raise CLIError(
            "give a jem train model file, or --model and --weights for a classifier trained elsewhere, not both"
        )
    if not own and not args.checkpoint:
        raise CLIError(f"give a jem train model file (jem {command} runs/jem/model.pt), or --model SPEC --weights FILE")
    if not own:
        if args.mean or args.std or args.num_classes:
            raise CLIError("--mean, --std and --num-classes describe --model/--weights; a model file carries them")
        jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device), args.trust_factory)
        _use_threads(args, jm.model, spec["sample_shape"])
        return jm, spec, args.checkpoint
    if not (args.model and args.weights):
        raise CLIError("a classifier trained elsewhere needs both --model SPEC and --weights FILE")
    jm, spec = load_user_model(
        args.model,
        args.weights,
        args.data,
        openood_benchmark=openood_benchmark,
        num_classes=args.num_classes,
        mean=args.mean,
        std=args.std,
        image_size=args.image_size,
        device=_device(args.device),
    )
    print(spec["assumed"], file=sys.stderr)  # what was assumed of weights trained elsewhere, never silently
    _use_threads(args, jm.model, spec["sample_shape"])
    return jm, spec, args.weights
