"""``jem train``: train a classifier with (or without) the JEM loss, then report on the held-out split."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ... import distributed as jdist
from ... import training
from ..._checks import model_device
from ...builtins.init_distributions import COVARIANCES
from ...recipes import DEFAULT_RECIPE, RECIPES, get_recipe
from ...sampling import COLOURS
from .. import CLIError, post_training
from ..experiments import dataset_sample_quality
from ..model_files import (
    build_model,
    check_classes,
    check_inputs,
    check_resume,
    check_training_split,
    drop_buffer_from_checkpoints,
    load_data,
    model_spec,
    save_model_checkpoint,
    save_run_sampler,
    split_held_out,
    wrap_for_data,
)
from ..report import QUALITY_HOW_TO_READ
from ._common import _check_install, _device, _out_dir, _positive

RECIPE_FLAGS = (
    "sgld_steps",
    "step_size",
    "noise",
    "grad_clip",
    "buffer_size",
    "buffer_visits",
    "reinit_freq",
    "init",
    "init_covariance",
    "init_rank",
    "n_samples",
    "px_weight",
    "pxy_weight",
    "l2_weight",
    "data_noise",
    "lr",
    "warmup_iters",
    "batchnorm",
    "sgld_batchnorm",
    "sgld_colours",
    "bn_stats_from_data",
)


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "train",
        parents=[common],
        help="train a classifier with (or without) the JEM loss",
        description="Train a classifier with (or without) the JEM loss; resumes from --out/checkpoints. "
        "Recipe settings (--sgld-steps ... --warmup-iters) default to the --recipe's. "
        "Multi-process (DDP, one replay buffer per rank; --batch-size and --buffer-size are "
        "per rank): torchrun --nproc_per_node=2 -m jem_plugin.app.cli train --out runs/jem-ddp ... "
        "(resume with the same --nproc_per_node).",
    )
    p.add_argument(
        "--model",
        default="digits-cnn",
        help="digits-cnn, toy-mlp, a timm name, or module:factory (factory(num_classes=K) -> nn.Module)",
    )
    p.add_argument("--data", default="digits", help="digits, toy2d[:NAME], folder:PATH, cifar10:PATH")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="folder data: share of each class held out for evaluation (default 0.2; 0 keeps none)",
    )
    p.add_argument("--val-data", default=None, help="held-out data instead of a split, e.g. folder:data/val")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default=DEFAULT_RECIPE,
        help=f"JEM recipe (default: {DEFAULT_RECIPE}; fast keeps calibration, its samples barely move at 32x32)",
    )
    p.add_argument(
        "--epochs",
        type=_positive,
        default=None,
        help="default: 150 for digits and toy2d (about 2.5 min on 2 cores), 30 otherwise",
    )
    p.add_argument("--batch-size", type=_positive, default=64)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-iters", type=int, default=None, help="capped to a tenth of the run")
    p.add_argument("--baseline", action="store_true", help="plain cross-entropy, no generative loss")
    p.add_argument("--sgld-steps", type=_positive, default=None)
    p.add_argument("--n-samples", type=_positive, default=None, help="SGLD chains per iteration (default: recipe)")
    p.add_argument("--step-size", type=float, default=None)
    p.add_argument("--noise", type=float, default=None)
    p.add_argument("--grad-clip", type=float, default=None, help="proximal SGLD: clip each update (JEM++)")
    p.add_argument(
        "--buffer-size",
        type=_positive,
        default=None,
        help="replay-buffer slots (default: the recipe's; generative sizes it for the run)",
    )
    p.add_argument(
        "--buffer-visits",
        type=_positive,
        default=None,
        help="size the buffer so each slot is drawn about this many times in the run, at most "
        "--buffer-size (default: recipe; generative 40)",
    )
    p.add_argument("--reinit-freq", type=float, default=None)
    p.add_argument("--init", default=None, help="SGLD init distribution (uniform, gaussian, ...)")
    p.add_argument(
        "--init-covariance",
        choices=list(COVARIANCES),
        default=None,
        help="gaussian init: per-pixel variances, JEM++'s full covariance (up to about 3x58x58), "
        "--init-rank principal directions per class (any size), or each class's power "
        "spectrum (stationary: images, any size)",
    )
    p.add_argument(
        "--init-rank",
        type=_positive,
        default=None,
        help="principal directions per class of a lowrank init covariance (default: recipe, 32)",
    )
    p.add_argument(
        "--batchnorm",
        choices=["joint", "separate"],
        default=None,
        help="samples pass BatchNorm with the data (joint) or on their own (separate; fast's default)",
    )
    p.add_argument(
        "--bn-stats-from-data",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after training, recompute BatchNorm running statistics from the training data "
        "(the joint pass mixes the samples into them; generative's default)",
    )
    p.add_argument(
        "--sgld-batchnorm",
        choices=["eval", "batch"],
        default=None,
        help="chains normalised by running (eval) or their own batch (batch; fast's default) statistics",
    )
    p.add_argument(
        "--sgld-colours",
        choices=list(COLOURS),
        default=None,
        help="SGLD steps move every channel (all) or only the colour axes the data vary along "
        "(data: grey images stay grey in an RGB model; generative's default)",
    )
    p.add_argument("--ce-weight", type=float, default=1.0)
    p.add_argument("--px-weight", type=float, default=None)
    p.add_argument("--pxy-weight", type=float, default=None)
    p.add_argument("--l2-weight", type=float, default=None)
    p.add_argument("--data-noise", type=float, default=None)
    p.add_argument("--on-divergence", choices=["raise", "rollback"], default="raise")
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds checkpoints")
    p.add_argument(
        "--checkpoint-every",
        type=_positive,
        default=None,
        help="also checkpoint every N iterations (default: at epoch ends only)",
    )
    p.add_argument(
        "--checkpoint-buffer",
        choices=["full", "none"],
        default="full",
        help="none: checkpoints leave out the replay buffer (smaller); a resume restarts its chains",
    )
    p.add_argument("--amp", choices=["off", "bf16", "fp16"], default="off", help="mixed precision (fp16: CUDA)")
    p.add_argument("--channels-last", action="store_true", help="channels-last memory format (CNNs on GPU)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop (after checkpointing) after this long")
    p.set_defaults(func=run)


def run(args) -> int:
    _check_install()
    try:
        return _train(args, jdist.init_distributed(device=_device(args.device)))
    finally:
        jdist.cleanup()  # also on errors: leave the process group


def _train(args, info) -> int:
    dev, out = info.device, _out_dir(args.out or "runs/jem")
    recipe = get_recipe(args.recipe)
    recipe = dataclasses.replace(recipe, **{k: v for k, v in vars(args).items() if k in RECIPE_FLAGS and v is not None})
    if args.buffer_size is not None and args.buffer_visits is None:
        recipe = dataclasses.replace(recipe, buffer_visits=None)  # the size asked for, not one for the run
    if recipe.sam_rho:
        raise CLIError(f"recipe {recipe.name!r} uses sharpness-aware minimisation, which jem train does not run yet")
    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    ds, domain, k, shape = load_data(args.data, train=True, image_size=args.image_size, seed=args.seed)
    recipe, notes = recipe.for_inputs(shape)
    for note in notes if info.is_main and not args.baseline else ():
        print(f"jem train: {note}")
    data_classes = getattr(ds, "classes", None)
    held_out, val = None, None
    if args.val_data:
        val, *_ = load_data(args.val_data, train=False, image_size=args.image_size, seed=args.seed)
        check_classes(
            [str(c) for c in data_classes or range(k)],
            [str(c) for c in getattr(val, "classes", [])],
            f"--val-data {args.val_data}",
        )
        held_out = {"data": args.val_data}
    elif args.data.startswith("folder:") and args.val_fraction > 0:
        n_total = len(ds)
        ds, val = split_held_out(ds, args.val_fraction, args.seed)
        held_out = {"fraction": args.val_fraction, "seed": args.seed, "n_total": n_total}
    elif not args.data.startswith("folder:"):
        val, *_ = load_data(args.data, train=False, image_size=args.image_size, seed=args.seed)
    epochs = args.epochs or (150 if args.data.split(":")[0] in ("digits", "toy2d") else 30)
    options = {"width": 32, "act": "leaky_relu", "pool": "max"} if args.model == "digits-cnn" else None
    spec = model_spec(args.model, args.data, k, shape, domain, options, classes=data_classes, held_out=held_out)
    jm = wrap_for_data(build_model(args.model, k, shape[0], options), spec).to(dev)
    x0 = next(iter(DataLoader(ds, batch_size=2)))[0]
    check_inputs(jm, x0, spec, args.data)
    before = check_resume(out, spec, no_resume=args.no_resume)
    if before is not None and args.buffer_size is None:
        # A continued run keeps its chains: the slots it began with, whatever --epochs says now
        # (a run from before the buffer was sized for the run has the recipe's buffer_size).
        recipe = dataclasses.replace(
            recipe, buffer_size=before.get("replay_buffer_slots", recipe.buffer_size), buffer_visits=None
        )
    if info.distributed:
        # From here on each rank draws its own data noise and chains.
        torch.manual_seed(jdist.rank_seed(args.seed))
    g = torch.Generator().manual_seed(args.seed)
    if info.distributed:
        # Each rank its share of the data, reshuffled per epoch (fit calls set_epoch).
        shard: DistributedSampler[Any] = DistributedSampler(
            ds, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=args.seed, drop_last=True
        )
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=shard, drop_last=True, generator=g)
        model = jdist.wrap_ddp(jm)
    else:
        loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True, generator=g)
        model = jm
    if len(loader) == 0:
        raise CLIError(
            f"--data {args.data} has {len(ds)} training images, fewer than --batch-size "
            f"{args.batch_size}; lower --batch-size"
        )
    advice = check_training_split(
        ds,
        k,
        args.batch_size,
        data=args.data,
        fits_init=not args.baseline and recipe.init != "uniform",
        classes=data_classes,
    )
    if advice and info.is_main:
        print(f"jem train: {advice}")
    loss_fn = None
    if not args.baseline:
        xs, ys = (
            next(iter(DataLoader(ds, batch_size=min(len(ds), 5000), shuffle=False)))
            if recipe.init != "uniform"
            else (None, None)
        )
        loss_fn = recipe.build_loss(
            sample_shape=shape,
            num_classes=k,
            x_fit=xs,
            y_fit=ys,
            device=dev,
            generator=jdist.rank_generator(args.seed, dev),
            ce_weight=args.ce_weight,
            total_iters=epochs * len(loader),
            batch_size=args.batch_size,
        )
        spec["replay_buffer_slots"] = loss_fn.buffer.capacity  # per rank; what a resumed run keeps
        if args.checkpoint_buffer == "none":
            drop_buffer_from_checkpoints(loss_fn.buffer)
    warmup = recipe.warmup_for(epochs * len(loader))
    if info.is_main:
        print(
            f"jem train: {args.model} on {args.data}, {'baseline (cross-entropy only)' if args.baseline else 'recipe ' + recipe.name}, "
            f"{epochs} epochs of {len(loader)} iterations, warm-up {warmup}; output in {out}/"
        )
        if loss_fn is not None and loss_fn.buffer.capacity < recipe.buffer_size:
            print(
                f"jem train: replay buffer of {loss_fn.buffer.capacity} slots, not {recipe.buffer_size}: "
                f"recipe {recipe.name!r} draws each about {recipe.buffer_visits:g} times in the run's "
                f"{epochs * len(loader)} iterations (--buffer-size sets it)"
            )
        if not args.no_resume and list((out / "checkpoints").glob("*.pt")):
            print(
                f"jem train: {out}/checkpoints holds an earlier run of this model: continuing it "
                "(--no-resume starts over)"
            )
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps(spec, indent=2))
    val_loader = DataLoader(val, batch_size=256) if val is not None else None
    # training.fit read at call time: the CLI tests replace it to capture what `jem train` asks for
    history = training.fit(
        model,
        train_loader=loader,
        epochs=epochs,
        optimizer=recipe.build_optimizer(jm.parameters()),
        warmup_iters=warmup,
        loss_fn=loss_fn,
        val_data=val_loader,
        eval_every=max(1, epochs // 10),
        checkpoint_dir=out / "checkpoints",
        resume=not args.no_resume,
        checkpoint_every=args.checkpoint_every,
        guard_policy=args.on_divergence,
        progress=not args.quiet,
        max_seconds=args.max_seconds,
        amp=args.amp,
        channels_last=args.channels_last,
    )
    record = history.to_dict()
    # The final model's held-out logits, once: rank 0 reports accuracy and calibration from them.
    scored = info.is_main and val_loader is not None
    decisions: list[post_training.Decision] = []
    small = post_training.small_held_out_warning(len(val)) if scored and val is not None else None
    if small:
        print(f"jem train: warning: {small}")
    if loss_fn is not None and recipe.bn_stats_from_data:
        # The joint pass mixed the samples into the running statistics that evaluation normalises
        # data with. Recomputed before the samples and scores below, which use the result, and
        # kept only if the held-out split shows they are not worse.
        bn = post_training.recompute_batchnorm(
            jm, loader, (lambda: _held_out_logits(jm, val_loader)) if scored else None, dev
        )
        if bn is not None:
            decisions.append(bn)
    if loss_fn is not None and len(shape) == 3 and bool(loss_fn.buffer.initialized):  # each rank's own chains
        from ...viz import save_image_grid

        name = f"buffer_rank{info.rank}.png" if info.distributed else "buffer.png"
        save_image_grid(
            loss_fn.buffer.samples(64).cpu(),
            out / name,
            domain=domain,
            nrow=8,
            title=f"replay buffer after {len(history)} epochs\n(unconditional samples)",
        )
    if info.is_main and loss_fn is not None and len(shape) == 3 and bool(loss_fn.buffer.initialized):
        # Once, at the end (a judge costs seconds): rank 0's buffer against the held-out split (issue 16)
        q = record["sample_quality"] = dataset_sample_quality(
            jm,
            loss_fn.buffer,
            ds,
            val,
            sgld_steps=max(20, recipe.sgld_steps),
            step_size=recipe.step_size,
            noise=recipe.noise,
            grad_clip=recipe.grad_clip,
            seed=args.seed,
            batchnorm=recipe.sgld_batchnorm,
            colours=recipe.sgld_colours,
        )
        print(
            "sample quality: "
            + (
                q["skipped"]
                if "skipped" in q
                else f"buffer FD {q['fd_buffer']:.3g} (init {q['fd_init']:.3g}, held-out floor {q['fd_heldout_floor']:.3g}; "
                f"{int(q['fd_n_samples'])} images), judge accuracy on class samples {q['judge_acc_samples']:.2f} "
                f"(init {q['judge_acc_init']:.2f}, test images {q['judge_acc_heldout']:.2f}). " + QUALITY_HOW_TO_READ
            )
        )
    if scored:
        final_logits = _held_out_logits(jm, val_loader)
        temperature, c = post_training.choose_temperature(*final_logits)
        record["calibration"] = c
        print(
            f"held-out calibration ({int(c['n'])} images): ECE {c['ece_before']:.3f}, {c['ece_after']:.3f} "
            f"after a temperature of {c['temperature']:.2f} (each half of the held-out split scaled by one "
            "fitted on the other; fit yours with jem.calibration.TemperatureScaler)"
        )
        decisions.append(temperature)
        if temperature.kept:
            spec["temperature"] = c["temperature"]  # calibrated probabilities: softmax(logits / T)
        record["held_out"] = {"n": len(final_logits[1]), "accuracy": _accuracy(*final_logits)}
    if info.is_main:
        record["post_training"] = [d.as_dict() for d in decisions]
        for d in decisions:
            numbers = (
                f", held-out {d.before:.3f} -> {d.after:.3f}" if d.before is not None and d.after is not None else ""
            )
            print(f"jem train: {d.title}{numbers}: {d.reason}")
    if info.is_main:
        save_model_checkpoint(out / "model.pt", jm, spec)
        if loss_fn is not None and len(shape) == 3:
            save_run_sampler(out / "model.pt", loss_fn)  # jem sample draws as the run drew
        (out / "history.json").write_text(json.dumps(record, indent=2))
        metrics = {k: record[k] for k in ("held_out", "calibration", "post_training", "sample_quality") if k in record}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if "held_out" in record:
            print(f"held-out accuracy {record['held_out']['accuracy']:.3f} (the saved model, after the steps above)")
        print(f"model: {out / 'model.pt'}  (metrics.json and history.json beside it)")
    jdist.barrier()  # no rank exits (and tears down the group) before rank 0 has written
    return 0


def _held_out_logits(jm, loader) -> tuple[torch.Tensor, torch.Tensor]:
    jm.eval()
    dev = model_device(jm)
    with torch.no_grad():
        logits, labels = zip(*[(jm.logits(xb.to(dev)).float().cpu(), yb) for xb, yb in loader])
    return torch.cat(logits), torch.cat(labels)


def _accuracy(z: torch.Tensor, y: torch.Tensor) -> float:
    return float((z.argmax(1) == y).double().mean())
