"""``jem sample``: SGLD samples from a trained model, and an independent judge's check of them."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..._checks import generator_on, model_device
from ...sampling import SGLD
from .. import CLIError
from ..model_files import held_out_data, load_model_checkpoint, load_run_sampler, sampler_file, training_data
from ..sample_checks import samples_against_data
from ._common import (
    SKIP_BAD_HELP,
    _beside_checkpoint,
    _device,
    _out_file,
    _positive,
    _trust_factory_arg,
    _use_threads,
)


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("sample", parents=[common], help="draw SGLD samples from a trained model")
    p.add_argument("checkpoint", help="model.pt written by `jem train`")
    _trust_factory_arg(p)
    p.add_argument("--n", type=_positive, default=64, help="how many samples (--per-class: split among the classes)")
    p.add_argument("--per-class", action="store_true", help="class-conditional: one row per class")
    p.add_argument(
        "--sgld-steps", type=_positive, default=None, help="SGLD steps (default: the run's; 100 without its sampler.pt)"
    )
    p.add_argument("--step-size", type=float, default=None, help="SGLD step size (default: the run's)")
    p.add_argument("--noise", type=float, default=None, help="SGLD noise (default: the run's)")
    p.add_argument(
        "--from-buffer",
        action="store_true",
        help="continue the run's replay-buffer chains (default: fresh chains from the run's init distribution)",
    )
    p.add_argument(
        "--no-check", action="store_true", help="skip the check by an independent judge (trained in seconds)"
    )
    p.add_argument("--skip-bad-images", action="store_true", help=SKIP_BAD_HELP + " (the check's data)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...viz import save_image_grid  # lazy: matplotlib

    dev = _device(args.device)
    jm, spec = load_model_checkpoint(args.checkpoint, dev, args.trust_factory)
    if len(spec["sample_shape"]) != 3:
        raise CLIError(f"jem sample draws images; this model's inputs have shape {tuple(spec['sample_shape'])}")
    _use_threads(args, jm.model, spec["sample_shape"])
    out = _image_file(args.out) if args.out else _beside_checkpoint(args.checkpoint, "_samples.png")
    g = torch.Generator().manual_seed(args.seed)
    k, classes = spec["num_classes"], spec.get("classes") or [str(i) for i in range(spec["num_classes"])]
    per = max(1, args.n // k) if args.per_class else args.n
    y = torch.arange(k).repeat_interleave(per) if args.per_class else None
    n, shape, device = len(y) if y is not None else args.n, tuple(spec["sample_shape"]), model_device(jm)
    run = load_run_sampler(args.checkpoint, device)
    asked = {"steps": args.sgld_steps, "step_size": args.step_size, "noise": args.noise}
    if run is None:
        if args.from_buffer:
            raise CLIError(f"--from-buffer needs {sampler_file(args.checkpoint)}, written by `jem train`")
        print(
            f"jem sample: no {sampler_file(args.checkpoint).name} beside the model (a baseline, or a model from an "
            "older jem train): chains start from uniform noise with default settings"
        )
        settings: dict[str, Any] = {"steps": 100}
        buffer = None
    else:
        settings, buffer = run
    settings.update({key: v for key, v in asked.items() if v is not None})
    sampler = SGLD(**settings, generator=generator_on(device, g, args.seed))
    if buffer is not None and sampler.colours == "data":
        sampler.use_colours_of(buffer)
    yd = None if y is None else y.to(device)
    if buffer is not None and args.from_buffer:
        if y is not None and buffer.num_classes is None:
            raise CLIError("this run's replay buffer is unconditional; drop --per-class to continue its chains")
        x0, _ = buffer.sample(n, domain=jm.domain, y=yd, generator=g)  # the file keeps its chains
        starts = short = "the run's replay buffer"
    elif buffer is not None:
        x0 = buffer.init_dist.sample(n, shape, jm.domain, g, device, y=yd)
        starts, short = f"the run's init distribution ({buffer.init_name})", f"{buffer.init_name} init"
    else:
        x0 = jm.domain.uniform(n, shape, generator=g)
        starts = short = "uniform noise"
    x = sampler.sample(jm, x_init=x0.to(device), y=yd).cpu()
    what = "class-conditional" if y is not None else "unconditional"
    save_image_grid(
        x,
        out,
        domain=jm.domain,
        nrow=per if y is not None else min(8, args.n),
        title=f"{what}\n{sampler.steps} SGLD steps from\n{short}",  # short lines: a grid may be 4 images wide
        row_labels=[f"class {c}" for c in classes] if y is not None else None,
    )
    print(f"samples: {out} ({sampler.steps} SGLD steps from {starts})")
    if not args.no_check:
        _print_sample_check(x, x0.cpu(), y, spec, args.seed, args.skip_bad_images)
    return 0


def _image_file(path: str):
    """``--out``: a picture's file name, checked before any sampling (``samples.json`` ended the
    command after the chains, in matplotlib's words)."""
    from matplotlib.figure import Figure  # lazy: matplotlib

    out = _out_file(path)
    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        raise CLIError(
            f"--out {path}: jem sample writes a picture; give a name ending .png (or {', '.join(sorted(formats))})"
        )
    return out


def _print_sample_check(
    x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor | None, spec, seed: int, skip_bad: bool = False
) -> None:
    """The samples as an independent judge sees them, against where their chains started."""
    train_ds = training_data(spec, seed, skip_bad=skip_bad)
    heldout_ds, _ = held_out_data(spec, None, None, seed, skip_bad=skip_bad)
    q = samples_against_data(x, x0, train_ds, heldout_ds, y=y, num_classes=spec["num_classes"], seed=seed)
    if "skipped" in q:
        print(f"check skipped: {q['skipped']}")
        return
    print(sample_check_line(q))


def sample_check_line(q: dict) -> str:
    """The check's one line: the judge's figures and what they say, read from the figures (the
    samples are closer to the data than their starts, or they are not)."""
    line = (
        f"check (a judge trained on the training data, {q['judge_acc_heldout']:.2f} on held-out images): "
        f"Fréchet distance to {q['n']} held-out images {q['fd_samples']:.3g} for the samples, "
        f"{q['fd_starts']:.3g} for their starting points"
    )
    if "judge_acc_samples" in q:
        line += (
            f"; it puts {q['judge_acc_samples']:.0%} of the samples in the class they were drawn for "
            f"({q['judge_acc_starts']:.0%} of the starting points)"
        )
    if q["fd_samples"] < q["fd_starts"]:
        verdict = "the samples are closer to the data than their starts: the chains moved towards it"
    else:
        verdict = (
            "the samples are NOT closer to the data than their starts: the chains did not move towards it "
            "(more --sgld-steps, or a longer training run)"
        )
    if "judge_acc_samples" in q and q["judge_acc_samples"] <= q["judge_acc_starts"]:
        verdict += "; the judge places no more samples than starts in their class"
    return f"{line}. {verdict[0].upper()}{verdict[1:]}."
