"""The ``jem`` command: demo, train, eval, ood, sample, plugins.

Every subcommand takes ``--device``, ``--seed``, ``--out`` and ``--config FILE`` (JSON or TOML
whose keys are option names, e.g. ``{"epochs": 5, "sgld_steps": 10}``; flags on the command line
win). User errors (bad flags, missing paths, incompatible checkpoints) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from ..errors import JEMError
from . import CLIError
from .model_files import (build_model, load_data, load_model_checkpoint, wrap_for_data,
                          model_spec, save_model_checkpoint)

# `jem demo --smoke`: the whole pipeline in seconds (tests, a first look); not a meaningful result.
SMOKE_DEMO = {"epochs": 1, "sgld_steps": 2, "buffer_size": 500, "class_sample_steps": 2}


# ----------------------------------------------------------------------------- helpers
def _load_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise CLIError(f"config file {path!r} does not exist")
    text = p.read_text()
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError as exc:  # Python 3.10
            raise CLIError("TOML configs need Python >= 3.11; use a JSON config") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CLIError(f"config file {path!r} is not valid TOML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CLIError(f"config file {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CLIError(f"config file {path!r} must hold a table/object of option names")
    return {k.replace("-", "_"): v for k, v in data.items()}


def _device(name: str):
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise CLIError(f"unknown device {name!r} (use cpu, cuda, cuda:1, mps)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name} asked for CUDA but no GPU is available; use --device cpu")
    return dev


# ----------------------------------------------------------------------------- commands
def cmd_plugins(args) -> int:
    from ..plugins import list_plugins

    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        origin = "built-in" if r["builtin"] else f"external {r['version'] or ''}".strip()
        print(f"{r['name']:<{width}}  {origin:<10}  {', '.join(r['hooks'])}")
    return 0


def cmd_demo(args) -> int:
    from .experiments import run_digits_demo
    from .report import write_report

    out = Path(args.out or "jem-report")
    _device(args.device)
    overrides = SMOKE_DEMO if args.smoke else {}
    result = run_digits_demo(out, seed=args.seed, device=args.device, progress=not args.quiet,
                             budget_seconds=args.budget_seconds, **overrides)
    report = write_report(out, result)
    _print_summary(result)
    print(f"\nreport: {report}")
    return 0


def _print_summary(result: dict[str, Any]) -> None:
    runs = result.get("runs", {})
    names = list(runs)
    if not names:
        return
    keys = [k for k in runs[names[0]].get("summary", {})]
    print(f"{'metric':<28}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        vals = [runs[n]["summary"].get(k) for n in names]
        print(f"{k:<28}" + "".join(f"{v:>14.4f}" if isinstance(v, (int, float)) else f"{str(v):>14}" for v in vals))


def cmd_train(args) -> int:
    from .. import distributed as jdist

    try:
        return _train(args, jdist.init_distributed(device=_device(args.device)))
    finally:
        jdist.cleanup()  # also on errors: leave the process group


def _train(args, info) -> int:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from .. import distributed as jdist
    from ..buffer import ReplayBuffer
    from ..losses import JEMLoss
    from ..sampling import SGLD
    from ..training import fit

    dev = info.device
    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    ds, domain, k, shape = load_data(args.data, train=True, image_size=args.image_size, seed=args.seed)
    spec = model_spec(args.model, args.data, k, shape, domain)
    jm = wrap_for_data(build_model(args.model, k, shape[0]), spec).to(dev)
    if info.distributed:
        # From here on each rank draws its own data noise and chains.
        torch.manual_seed(jdist.rank_seed(args.seed))
    loss_fn = None
    if not args.baseline:
        sampler = SGLD(steps=args.sgld_steps, step_size=args.step_size, noise=args.noise,
                       grad_clip=args.grad_clip, generator=jdist.rank_generator(args.seed, dev))
        buffer = ReplayBuffer(args.buffer_size, shape, reinit_freq=args.reinit_freq, init=args.init,
                              num_classes=k, device=dev)
        if args.init == "gaussian":
            xs, ys = next(iter(DataLoader(ds, batch_size=min(len(ds), 5000), shuffle=False)))
            buffer.fit(xs, ys)
        loss_fn = JEMLoss(sampler, buffer, ce_weight=args.ce_weight, px_weight=args.px_weight,
                          pxy_weight=args.pxy_weight, l2_weight=args.l2_weight,
                          data_noise=args.data_noise).to(dev)
    g = torch.Generator().manual_seed(args.seed)
    if info.distributed:
        # Each rank its share of the data, reshuffled per epoch (fit calls set_epoch).
        shard = DistributedSampler(ds, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                   seed=args.seed, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=shard, drop_last=True, generator=g)
        model = jdist.wrap_ddp(jm)
    else:
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=g)
        model = jm
    out = Path(args.out or "runs/jem")
    out.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        (out / "spec.json").write_text(json.dumps(spec, indent=2))
    history = fit(model, loader, epochs=args.epochs, lr=args.lr, warmup_iters=args.warmup_iters,
                  loss_fn=loss_fn, checkpoint_dir=out / "checkpoints", resume=not args.no_resume,
                  guard_policy=args.on_divergence, progress=not args.quiet,
                  max_seconds=args.max_seconds)
    if loss_fn is not None and len(shape) == 3:  # each rank's own chains
        name = f"buffer_rank{info.rank}.png" if info.distributed else "buffer.png"
        loss_fn.buffer.save_grid(out / name, domain=domain)
    if info.is_main:
        save_model_checkpoint(out / "model.pt", jm, spec)
        (out / "history.json").write_text(json.dumps(history.to_dict(), indent=2))
        print(f"model: {out / 'model.pt'}")
    jdist.barrier()  # no rank exits (and tears down the group) before rank 0 has written
    return 0


def _eval_data(args, spec):
    import torch

    ds, _, _, _ = load_data(args.data or spec["data"], train=False, image_size=args.image_size, seed=args.seed)
    xs, ys = zip(*[ds[i] for i in range(len(ds))]) if not hasattr(ds, "tensors") else ds.tensors
    x = torch.stack(list(xs)) if isinstance(xs, tuple) else xs
    y = torch.as_tensor(ys) if isinstance(ys, tuple) else ys
    return x, y


def cmd_eval(args) -> int:
    import torch

    from .. import calibration

    jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device))
    x, y = _eval_data(args, spec)
    with torch.no_grad():
        logits = torch.cat([jm.logits(xb.to(next(jm.parameters()).device)).cpu() for xb in x.split(512)])
    result = {"accuracy": float((logits.argmax(1) == y).float().mean()),
              **calibration.calibration_report(logits, y)}
    _emit(result, args)
    return 0


def cmd_ood(args) -> int:
    import torch

    from . import data

    from .. import ood

    jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device))
    x, y = _eval_data(args, spec)
    if spec["data"].startswith("digits"):
        ood_sets = data.digits_ood_sets(x, y, seed=args.seed)
    else:
        ood_sets = {"noise": jm.domain.uniform(len(x), x.shape[1:], generator=torch.Generator().manual_seed(args.seed))}
    result: dict[str, Any] = {}
    for method in args.scores.split(","):
        s_in = ood.score(jm, x, method=method, progress=False if args.quiet else None)
        for name, xo in ood_sets.items():
            s_out = ood.score(jm, xo, method=method, progress=False)
            result[f"{method}/{name}"] = ood.evaluate(s_in, s_out)
    _emit(result, args)
    return 0


def cmd_sample(args) -> int:
    import torch

    from ..viz import save_image_grid
    from ..sampling import SGLD

    jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device))
    g = torch.Generator().manual_seed(args.seed)
    sampler = SGLD(steps=args.sgld_steps, step_size=args.step_size, noise=args.noise, generator=g)
    out = Path(args.out or "samples.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    y = None
    if args.per_class:
        k = spec["num_classes"]
        y = torch.arange(k).repeat_interleave(max(1, args.n // k))
    n = args.n if y is None else len(y)
    x0 = jm.domain.uniform(n, spec["sample_shape"], generator=g)
    x = sampler.sample(jm, x_init=x0, y=y)
    save_image_grid(x, out, domain=jm.domain, nrow=(max(1, args.n // spec["num_classes"]) if y is not None else 8))
    print(f"samples: {out}")
    return 0


def _emit(result: dict[str, Any], args) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


# ----------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    common.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    common.add_argument("--out", default=None, help="output path (directory or file, per command)")
    common.add_argument("--config", default=None, help="JSON or TOML file of option defaults")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    parser = argparse.ArgumentParser(prog="jem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", parents=[common], help="baseline vs JEM on the bundled digits, with a report")
    p.add_argument("--budget-seconds", type=float, default=240.0, help="training budget for both runs (default 240)")
    p.add_argument("--smoke", action="store_true", help="run the pipeline in seconds (not a meaningful result)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "train", parents=[common], help="train a classifier with (or without) the JEM loss",
        description="Train a classifier with (or without) the JEM loss; resumes from --out/checkpoints. "
                    "Multi-process (DDP, one replay buffer per rank; --batch-size and --buffer-size are "
                    "per rank): torchrun --nproc_per_node=2 -m jem_plugin.app.cli train --out runs/jem-ddp ... "
                    "(resume with the same --nproc_per_node).")
    p.add_argument("--model", default="digits-cnn", help="digits-cnn, toy-mlp, a timm name, or module:factory")
    p.add_argument("--data", default="digits", help="digits, toy2d[:NAME], folder:PATH, cifar10:PATH")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=1000)
    p.add_argument("--baseline", action="store_true", help="plain cross-entropy, no generative loss")
    p.add_argument("--sgld-steps", type=int, default=20)
    p.add_argument("--step-size", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=None, help="proximal SGLD: clip each update (JEM++)")
    p.add_argument("--buffer-size", type=int, default=10000)
    p.add_argument("--reinit-freq", type=float, default=0.05)
    p.add_argument("--init", default="uniform", help="SGLD init distribution (uniform, gaussian, ...)")
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--px-weight", type=float, default=1.0)
    p.add_argument("--pxy-weight", type=float, default=0.0)
    p.add_argument("--l2-weight", type=float, default=0.0)
    p.add_argument("--data-noise", type=float, default=0.03)
    p.add_argument("--on-divergence", choices=["raise", "rollback"], default="raise")
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds checkpoints")
    p.add_argument("--max-seconds", type=float, default=None, help="stop (after checkpointing) after this long")
    p.set_defaults(func=cmd_train)

    for name, func, helptext in (("eval", cmd_eval, "accuracy and calibration of a trained model"),
                                 ("ood", cmd_ood, "OOD detection scores and metrics of a trained model")):
        p = sub.add_parser(name, parents=[common], help=helptext)
        p.add_argument("checkpoint", help="model.pt written by `jem train`")
        p.add_argument("--data", default=None, help="evaluation data (default: the training data's test split)")
        p.add_argument("--image-size", type=int, default=32)
        if name == "ood":
            p.add_argument("--scores", default="logpx,msp,grad_norm", help="comma-separated score names")
        p.set_defaults(func=func)

    p = sub.add_parser("sample", parents=[common], help="draw SGLD samples from a trained model")
    p.add_argument("checkpoint", help="model.pt written by `jem train`")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--per-class", action="store_true", help="class-conditional: one row per class")
    p.add_argument("--sgld-steps", type=int, default=100)
    p.add_argument("--step-size", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.01)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("plugins", help="list loaded plugins and the hooks they implement")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins, config=None)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # Config values become defaults; flags given on the command line still win.
        config = _load_config(args.config)
        subparser = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001
        known = {a.dest for a in subparser._actions}  # noqa: SLF001
        unknown = sorted(set(config) - known)
        if unknown:
            raise CLIError(f"config file {args.config!r} has unknown options for `jem {args.command}`: {', '.join(unknown)}")
        subparser.set_defaults(**config)
        args = parser.parse_args(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return args.func(args)
    except (JEMError, FileNotFoundError, ValueError) as exc:
        print(f"jem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jem: interrupted (checkpoints written so far are kept)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `jem eval ... | head`: the reader left; stop quietly, and keep Python's exit-time flush of
        # stdout from raising the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
