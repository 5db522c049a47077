"""``jem train``: train a classifier with (or without) the JEM loss, then report on the held-out split."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, DistributedSampler

from ... import distributed as jdist
from ... import training
from ...extensions import Decision, Extension, RecomputeBatchNorm, SharpnessAware, held_out_logits
from ...inits import Uniform
from ...nets import build_model
from ...recipes import RECIPES, Recipe, flat_names, get_recipe
from .. import CLIError, post_training
from ..default_recipe import (
    BENCHMARKS_PAGE,
    DEFAULT_PX_WEIGHT,
    DEFAULT_RECIPE,
    NO_NORMALISATION_L2_WEIGHT,
    RAISED_LR_FACTOR,
    SMALL_DATA_PER_CLASS,
    SMALL_DATA_RECIPE,
    default_choice_for,
    generative_half,
    kind_name,
    lr_raised,
    network_kind,
)
from ..ledger_evidence import ledger_line
from ..model_files import (
    DEFAULT_IMAGE_MODEL,
    check_classes,
    check_inputs,
    check_resume,
    check_training_split,
    dataset_labels,
    default_model_for,
    drop_buffer_from_checkpoints,
    load_data,
    model_spec,
    save_model_checkpoint,
    save_run_sampler,
    split_held_out,
    wrap_for_data,
)
from ..report import sample_quality_line
from ..sample_checks import dataset_sample_quality
from ._common import SKIP_BAD_HELP, _check_install, _device, _out_dir, _positive, _use_threads


def _dashed(name: str) -> str:
    """A recipe setting's flat name as its flag spells it: ``px_weight`` -> ``px-weight``."""
    return name.replace("_", "-")


def _optional(kind: type):
    """An argparse type that also reads ``none`` (a setting the recipe may switch off)."""

    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """One flag per recipe setting, read from the recipe tree's fields (:func:`~jem_plugin.recipes.flat_names`)."""
    group = p.add_argument_group(
        "recipe settings (default: the --recipe's; `jem train --recipe NAME --show-recipe` prints them)"
    )
    for name, info in flat_names().items():
        flag = "--" + _dashed(name)
        text = f"{info['help']} (default: the recipe's)"
        if info["type"] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        choices = info["choices"]
        kind = _optional(info["type"]) if info["optional"] else info["type"]
        group.add_argument(
            flag,
            type=kind,
            choices=choices,
            default=None,
            help=text,
            metavar=None if choices else name.split("_")[-1].upper(),
        )


def _given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe settings the user gave, as flags or ``--config`` keys (their argparse defaults)."""
    return {name: getattr(args, name) for name in flat_names() if getattr(args, name, None) is not None}


def recipe_from_args(
    args: argparse.Namespace, name: str | None = None, defaults: dict[str, Any] | None = None
) -> Recipe:
    """The ``--recipe`` (or ``name``, the one chosen for the data) with ``defaults`` (the settings
    chosen for the data) and then the settings given as flags (or ``--config`` keys) applied."""
    changes = {**(defaults or {}), **_given_settings(args)}
    if "buffer_capacity" in changes and "buffer_visits" not in changes:
        changes["buffer_visits"] = None  # the size asked for, not one for the run
    return get_recipe(name or args.recipe or DEFAULT_RECIPE).replace(**changes)


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "train",
        parents=[common],
        help="train a classifier with (or without) the JEM loss",
        description="Train a classifier with (or without) the JEM loss; resumes from --out/checkpoints. "
        "Recipe settings (--sgld-steps ... --warmup-iters) default to the --recipe's. "
        "Multi-process (DDP, one replay buffer per rank; --batch-size and --buffer-capacity are "
        "per rank): torchrun --nproc_per_node=2 -m jem_plugin.app.cli train --out runs/jem-ddp ... "
        "(resume with the same --nproc_per_node).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="digits-cnn, toy-mlp, a timm name, or module:factory (factory(num_classes=K) -> nn.Module) "
        "(default: digits-cnn for --data digits, toy-mlp for toy2d, resnet10t for other images)",
    )
    p.add_argument(
        "--data",
        default="digits",
        help="digits, toy2d[:NAME], textures[:N], folder:PATH (one sub-folder per class), cifar10:PATH",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="folder data: share of each class held out for evaluation (0 keeps none)",
    )
    p.add_argument(
        "--val-data",
        default=None,
        help="held-out data instead of a split, e.g. folder:data/val (default: none; the split or the data's test set)",
    )
    p.add_argument("--image-size", type=int, default=32, help="folder and textures data: images resized to this")
    p.add_argument(
        "--skip-bad-images",
        action="store_true",
        help=SKIP_BAD_HELP,
    )
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        default=None,
        help=f"JEM recipe (default: {SMALL_DATA_RECIPE} for a BatchNorm network whose smallest class has at most "
        f"{SMALL_DATA_PER_CLASS} training images, at no more than {RAISED_LR_FACTOR:g}x the recipe's --lr; "
        f"{DEFAULT_RECIPE} with --px-weight {DEFAULT_PX_WEIGHT:g} otherwise, and --l2-weight "
        f"{NO_NORMALISATION_L2_WEIGHT:g} on a network without normalisation layers: what lost the least accuracy "
        f"in the generalisation matrix, {BENCHMARKS_PAGE})",
    )
    p.add_argument(
        "--epochs",
        type=_positive,
        default=None,
        help="default: 150 for digits and toy2d (about 2.5 min on 2 cores), 30 otherwise",
    )
    p.add_argument("--batch-size", type=_positive, default=64, help="images per training step")
    p.add_argument("--baseline", action="store_true", help="plain cross-entropy, no generative loss")
    p.add_argument("--show-recipe", action="store_true", help="print the recipe with the settings given here, and stop")
    p.add_argument(
        "--on-divergence",
        choices=["raise", "rollback"],
        default="raise",
        help="when training diverges: stop with the known remedies (raise), or roll back and go on",
    )
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
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop (after checkpointing) after this long; the same command continues (default: no limit)",
    )
    add_recipe_flags(p)
    p.set_defaults(func=run, interrupted=interrupted)


# What a cross-entropy baseline takes from the recipe (the rest shapes the generative loss, which it
# has none of): the optimiser, SAM and the steps after training, so that the two runs compare like for like.
BASELINE_SETTINGS = ("optim.", "sam.", "bn_stats_from_data")


def _generative_only(args) -> list[str]:
    """The flags (or ``--config`` keys) given that set the generative loss: refused with ``--baseline``."""
    names = flat_names()
    flags = [f"--{_dashed(n)}" for n in _given_settings(args) if not names[n]["path"].startswith(BASELINE_SETTINGS)]
    if args.checkpoint_buffer == "none":
        flags.append("--checkpoint-buffer none")
    return flags


def _refuse_for_baseline(args) -> None:
    """Every ``jem train`` flag applies to ``--baseline`` but those of the generative loss: one line."""
    flags = _generative_only(args)
    if flags:
        one = len(flags) == 1
        raise CLIError(
            f"--baseline trains with cross-entropy alone (the recipe's optimiser, SAM and post-training steps): "
            f"{', '.join(flags)} set{'s' * one} the generative loss or its replay buffer, which a baseline has "
            f"none of; leave {'it' if one else 'them'} out (flags or --config keys), or drop --baseline"
        )


def run(args) -> int:
    if args.baseline:
        _refuse_for_baseline(args)
    if args.show_recipe:
        print(recipe_from_args(args))
        if args.baseline:
            print(
                "(--baseline: only its optimiser settings, SAM and bn_stats_from_data apply; "
                "the baseline trains with cross-entropy alone)"
            )
        if args.recipe is None:  # the choice waits for the data and the network
            print(
                f"(no --recipe: jem train picks by the data and the network: {SMALL_DATA_RECIPE} for a BatchNorm "
                f"network whose smallest class has at most {SMALL_DATA_PER_CLASS} training images (at no more than "
                f"{RAISED_LR_FACTOR:g}x its --lr), else this one with px_weight {DEFAULT_PX_WEIGHT:g} (and "
                f"l2_weight {NO_NORMALISATION_L2_WEIGHT:g} on a network without normalisation layers); "
                f"--recipe {DEFAULT_RECIPE} shows and trains it as it is)"
            )
        return 0
    _check_install()
    try:
        return _train(args, jdist.init_distributed(device=_device(args.device)))
    finally:
        jdist.cleanup()  # also on errors: leave the process group


def _train(args, info) -> int:
    dev, out = info.device, _out_dir(args.out or "runs/jem")
    if args.model is None:  # the net made for the bundled data, else a small timm CNN: said, for images
        args.model = default_model_for(args.data)
        if args.model == DEFAULT_IMAGE_MODEL and info.is_main:
            print(f"jem train: --model {args.model}, the default for --data {args.data.partition(':')[0]}")
    # The same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(args.seed)
    ds, domain, k, shape = load_data(
        args.data, train=True, image_size=args.image_size, seed=args.seed, skip_bad=args.skip_bad_images
    )
    ds, val, held_out, data_classes = _held_out_split(args, ds, k)
    # Data that cannot train (one class, a class left without images) is refused before anything else
    # (both candidate defaults fit a per-class init: the check does not wait for the choice below).
    provisional = recipe_from_args(args, name=args.recipe or DEFAULT_RECIPE)
    informative = not isinstance(provisional.buffer.init, Uniform)
    advice = check_training_split(
        ds, k, args.batch_size, data=args.data, fits_init=not args.baseline and informative, classes=data_classes
    )
    epochs = args.epochs or (150 if args.data.split(":")[0] in ("digits", "toy2d") else 30)
    options = {"width": 32, "act": "leaky_relu", "pool": "max"} if args.model == "digits-cnn" else None
    spec = model_spec(args.model, args.data, k, shape, domain, options, classes=data_classes, held_out=held_out)
    if args.skip_bad_images:
        spec["skip_bad_images"] = True  # eval, ood and sample read the run's folder as it was read here
    jm = wrap_for_data(build_model(args.model, k, shape[0], options), spec).to(dev)
    x0, y0 = next(iter(DataLoader(ds, batch_size=2)))[:2]
    check_inputs(jm, x0, spec, args.data)
    _use_threads(args, jm.model, shape, speak=info.is_main)
    # the run's iterations as the loader will make them (drop_last, each rank its shard)
    iterations = epochs * (len(ds) // info.world_size // args.batch_size)
    recipe = _choose_recipe(args, info, ds, jm, iterations)
    recipe, notes = recipe.for_inputs(shape)
    # The baseline: the recipe's optimiser, SAM and post-training steps, without its generative loss
    baseline_steps = baseline_extensions(recipe) if args.baseline else []
    for note in notes if info.is_main and not args.baseline else ():
        print(f"jem train: {note}")
    before = check_resume(out, spec, no_resume=args.no_resume)
    done = _finished(out, epochs) if before is not None else None
    if done:
        if info.is_main:
            print(f"jem train: {done}")
        return 0
    if before is not None and args.buffer_capacity is None:
        # A continued run keeps its chains: the slots it began with, whatever --epochs says now.
        recipe = recipe.replace(
            buffer_capacity=before.get("replay_buffer_slots", recipe.buffer.capacity), buffer_visits=None
        )
    if info.distributed:
        # From here on each rank draws its own data noise and chains.
        torch.manual_seed(jdist.rank_seed(args.seed))
    loader, model = _loader(args, ds, jm, info)
    if advice and info.is_main:
        print(f"jem train: {advice}")
    total = epochs * len(loader)
    setup = None
    if not args.baseline:
        # An informative init is fitted here, once, on (up to 5000 of) the training images.
        setup = recipe.build(
            jm,
            ds if informative else (x0, y0),
            total_iters=total,
            batch_size=args.batch_size,
            generator=jdist.rank_generator(args.seed, dev),
        )
        spec["replay_buffer_slots"] = setup.buffer.capacity  # per rank; what a resumed run keeps
        spec["recipe"] = setup.recipe.to_dict()  # the configuration, said once; the tensors are in model.pt
        if args.checkpoint_buffer == "none":
            drop_buffer_from_checkpoints(setup.buffer)
    if info.is_main:
        _announce(args, recipe, setup, epochs, len(loader), out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps(spec, indent=2))
    val_loader = DataLoader(val, batch_size=256) if val is not None else None
    # training.fit read at call time: the CLI tests replace it to capture what `jem train` asks for
    history = training.fit(
        model,
        loader,
        setup,
        epochs=epochs,
        optimizer=None if setup is not None else recipe.optim,
        val_data=val_loader,
        callbacks=baseline_steps,
        options=training.FitOptions(
            eval_every=max(1, epochs // 10),
            checkpoint_dir=out / "checkpoints",
            resume=not args.no_resume,
            checkpoint_every=args.checkpoint_every,
            guard_policy=args.on_divergence,
            progress=not args.quiet,
            max_seconds=args.max_seconds,
            amp=args.amp,
            channels_last=args.channels_last,
        ),
    )
    extensions = setup.extensions if setup is not None else baseline_steps
    _report(args, info, jm, setup, extensions, history, ds, val, val_loader, spec, out, domain, len(shape) == 3)
    jdist.barrier()  # no rank exits (and tears down the group) before rank 0 has written
    return 0


def baseline_extensions(recipe: Recipe) -> list[Extension]:
    """What the cross-entropy baseline runs of ``recipe`` besides its optimiser: SAM and the BatchNorm
    statistics recomputed from the data after training (kept only on held-out evidence), as
    :meth:`~jem_plugin.recipes.Recipe.build` gives the JEM run."""
    steps: list[Extension] = []
    if recipe.sam.rho is not None:
        steps.append(SharpnessAware(rho=recipe.sam.rho, adaptive=recipe.sam.adaptive))
    if recipe.bn_stats_from_data:
        steps.append(RecomputeBatchNorm())
    return steps


def _finished(out, epochs: int) -> str | None:
    """The line saying that the run in ``out`` is complete for ``epochs`` (its model.pt written after
    its last epoch), or None: a run asked for more epochs, or cut short, continues."""
    try:
        history = json.loads((out / "history.json").read_text())
    except (OSError, ValueError):
        return None
    done = len(history.get("epochs", []))
    if not (out / "model.pt").is_file() or history.get("stopped") or done < epochs:
        return None
    return (
        f"this run is complete ({out / 'model.pt'}, {done} epochs; metrics.json beside it); nothing to do. "
        f"--no-resume starts over, a larger --epochs continues it"
    )


def interrupted(args) -> str:
    """What Ctrl-C leaves and how to go on: the same command continues from --out/checkpoints."""
    ckpts = Path(args.out or "runs/jem") / "checkpoints"
    if ckpts.is_dir() and list(ckpts.glob("*.pt")):
        return (
            f"the checkpoints in {ckpts} are kept: run the same command again (same --out) to continue "
            "from the newest, --no-resume to start over"
        )
    return "no checkpoint was written yet: run the same command again to start the run"


# A learning rate raised more than RAISED_LR_FACTOR-fold above the recipe's is warned about: the
# recipes were measured at their own rate, and at rates tuned for cross-entropy they lost far more.
RAISED_LR_EVIDENCE = (
    f"In the generalisation matrix ({BENCHMARKS_PAGE}), at 40 images per class and learning rates "
    "tuned for cross-entropy, generative and fast lost 3-67 points of accuracy against a baseline at the "
    "same rate (lcnet_050 at 1e-2, wrn10-1 at 3e-3)."
)


def _choose_recipe(args, info, ds, jm, iterations: int) -> Recipe:
    """The ``--recipe``, or the one that held accuracy for data of this size on this kind of network
    (and, for a run of ``iterations`` at least as long as the long row needed, the one that met every
    target there)."""
    smallest = min(Counter(dataset_labels(ds)).values(), default=0)
    choice = default_choice_for(jm, smallest, lr=args.lr)
    tell = args.recipe is None and info.is_main and not args.baseline
    half = None
    if args.recipe is None and not args.baseline:
        choice, half = generative_half(choice, iterations, *network_kind(jm))
    chosen = args.recipe or choice.recipe
    settings = {} if args.recipe else choice.settings
    if tell and chosen != DEFAULT_RECIPE:
        print(
            f"jem train: recipe {chosen}: on {choice.reason}, {DEFAULT_RECIPE} lost accuracy and "
            f"{chosen} held it ({BENCHMARKS_PAGE}); --recipe {DEFAULT_RECIPE} to choose it anyway"
        )
    given = _given_settings(args)
    told = {k: v for k, v in settings.items() if k not in given} if tell else {}
    if told:
        flags = " ".join(f"--{_dashed(k)} {v:g}" for k, v in told.items())
        l2 = f" and its energy L2 ({get_recipe(chosen).loss.l2_weight:g}) 2-22 more" if "l2_weight" in told else ""
        print(
            f"jem train: recipe {chosen} with {flags}: on {choice.reason}, {chosen}'s own p(x) weight "
            f"({get_recipe(chosen).loss.px_weight:g}) lost 0.6-43 points of accuracy against a cross-entropy "
            f"baseline{l2}, and these settings far less ({BENCHMARKS_PAGE}). Flags you give win; "
            f"--recipe {chosen} keeps the recipe's settings"
        )
    if tell:  # what the benefit ledger measured at its length, and when the long row's generative half pays:
        # two different facts, so a network kind both measured gets both lines
        measured = ledger_line(kind_name(*network_kind(jm)), chosen, settings, iterations)
        for line in (measured, half):
            if line:
                print(f"jem train: {line}")
    recipe = recipe_from_args(args, name=chosen, defaults=settings)
    if lr_raised(recipe.optim.lr, chosen) and info.is_main and not args.baseline and not told:
        preset_lr = get_recipe(chosen).optim.lr
        print(
            f"jem train: warning: --lr {recipe.optim.lr:g} is {recipe.optim.lr / preset_lr:.0f}x the {chosen} "
            f"recipe's {preset_lr:g}. {RAISED_LR_EVIDENCE} Compare with jem train --baseline --lr {recipe.optim.lr:g}."
        )
    return recipe


def _held_out_split(args, ds, k):
    """``(training set, held-out set or None, how it was held out, class names)``."""
    data_classes = getattr(ds, "classes", None)
    held_out, val = None, None
    if args.val_data:
        val, *_ = load_data(
            args.val_data, train=False, image_size=args.image_size, seed=args.seed, skip_bad=args.skip_bad_images
        )
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
    return ds, val, held_out, data_classes


def _loader(args, ds, jm, info):
    """The training loader (each rank its shard under DDP, reshuffled per epoch) and the model to fit."""
    g = torch.Generator().manual_seed(args.seed)
    if info.distributed:
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
    return loader, model


def _announce(args, recipe, setup, epochs: int, iters: int, out) -> None:
    warmup = setup.warmup_iters if setup is not None else recipe.optim.warmup_for(epochs * iters)
    what = "recipe " + recipe.name
    if setup is None:  # the recipe's optimiser, SAM and post-training steps (baseline_extensions)
        sam = f", SAM rho {recipe.sam.rho:g}" if recipe.sam.rho is not None else ""
        what = f"baseline (cross-entropy only, with recipe {recipe.name}'s optimiser{sam})"
    if setup is not None and recipe.name in RECIPES:  # the settings changed from the registered recipe's
        preset = RECIPES[recipe.name].flat()
        changed = [
            f"{_dashed(k)} {v:g}" if isinstance(v, float) else f"{_dashed(k)} {v}"
            for k, v in recipe.flat().items()
            if preset.get(k) != v
        ]
        what += f" ({', '.join(changed)})" if changed else ""
    print(
        f"jem train: {args.model} on {args.data}, {what}, {epochs} epoch{'s' * (epochs != 1)} of {iters} "
        f"iteration{'s' * (iters != 1)}, "
        f"warm-up {warmup}; output in {out}/"
    )
    if setup is not None and setup.buffer.capacity < recipe.buffer.capacity:
        print(
            f"jem train: replay buffer of {setup.buffer.capacity} slots, not {recipe.buffer.capacity}: "
            f"recipe {recipe.name!r} draws each about {recipe.buffer.visits:g} times in the run's "
            f"{epochs * iters} iterations (--buffer-capacity sets it)"
        )
    if not args.no_resume and list((out / "checkpoints").glob("*.pt")):
        print(
            f"jem train: {out}/checkpoints holds an earlier run of this model: continuing it (--no-resume starts over)"
        )


def _report(args, info, jm, setup, extensions, history, ds, val, val_loader, spec, out, domain, images: bool) -> None:
    """After training: the buffer's picture, the sample check, held-out calibration, the files.
    ``extensions``: the run's (the JEM recipe's, or the baseline's :func:`baseline_extensions`)."""
    record = history.to_dict()
    scored = info.is_main and val_loader is not None
    decisions: list[Decision] = [
        e.decision for e in extensions if isinstance(e, RecomputeBatchNorm) and e.decision is not None
    ]
    small = post_training.small_held_out_warning(len(val)) if scored and val is not None else None
    if small:
        print(f"jem train: warning: {small}")
    sampled = setup is not None and images and bool(setup.buffer.initialized)
    if sampled:  # each rank's own chains
        from ...viz import save_image_grid

        name = f"buffer_rank{info.rank}.png" if info.distributed else "buffer.png"
        save_image_grid(
            setup.buffer.samples(64).cpu(),
            out / name,
            domain=domain,
            nrow=8,
            title=f"replay buffer after {len(history)} epochs\n(unconditional samples)",
        )
    if info.is_main and sampled:
        # Once, at the end (a judge costs seconds): rank 0's buffer against the held-out split
        q = record["sample_quality"] = dataset_sample_quality(
            jm, setup.buffer, ds, val, sampler=setup.recipe.sampler, seed=args.seed
        )
        print(sample_quality_line(q))
    if scored:
        final_logits = held_out_logits(jm, val_loader)
        temperature, c = post_training.choose_temperature(*final_logits)
        record["calibration"] = c
        decisions.append(temperature)
        if temperature.kept:
            spec["temperature"] = c["temperature"]  # calibrated probabilities: softmax(logits / T)
        record["held_out"] = {"n": len(final_logits[1]), "accuracy": _accuracy(*final_logits)}
    if not info.is_main:
        return
    record["post_training"] = [d.as_dict() for d in decisions]
    for d in decisions:  # the steps, then what they leave: the saved model's calibration and accuracy
        what = "ECE" if d.step == "temperature" else "accuracy"
        numbers = (
            f", held-out {what} {d.before:.3f} -> {d.after:.3f}" if d.before is not None and d.after is not None else ""
        )
        print(f"jem train: {post_training.title(d)}{numbers}: {d.reason}")
    if "calibration" in record:
        print(_calibration_line(record["calibration"]))
    save_model_checkpoint(out / "model.pt", jm, spec)
    if setup is not None and images:
        save_run_sampler(out / "model.pt", setup.loss)  # jem sample draws as the run drew
    (out / "history.json").write_text(json.dumps(record, indent=2))
    metrics = {k: record[k] for k in ("held_out", "calibration", "post_training", "sample_quality") if k in record}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if "held_out" in record:
        print(f"held-out accuracy {record['held_out']['accuracy']:.3f} (the saved model, after the steps above)")
        chance = post_training.near_chance_warning(
            record["held_out"]["accuracy"],
            record["epochs"][-1].get("acc") if record.get("epochs") else None,
            final_logits[1],
            batchnorm=any(isinstance(m, _BatchNorm) for m in jm.modules()),
            recomputed=next((d for d in decisions if d.step == "bn_stats_from_data"), None),
            iterations=sum(int(e.get("iterations", 0)) for e in record.get("epochs", [])),
        )
        if chance:
            print(f"jem train: warning: {chance}")
    print(f"model: {out / 'model.pt'}  (metrics.json and history.json beside it)")


def _calibration_line(c: dict[str, Any]) -> str:
    """The saved model's held-out calibration: its ECE, and after the temperature it keeps (if any)."""
    head = f"held-out calibration ({int(c['n'])} images, the saved model): ECE {c['ece_before']:.3f}"
    if not c["temperature_kept"]:
        tried = (
            f"the candidate {c['temperature_candidate']:.2f} was not kept, see above"
            if c["temperature_fitted"]
            else "none fits"
        )
        return f"{head}; no temperature kept ({tried}): model.pt holds none, jem.load's jm.temperature is None"
    return (
        f"{head}, {c['ece_after']:.3f} after a temperature of {c['temperature']:.2f} (each half of the held-out split "
        f"scaled by one fitted on the other; {c['ece_saved']:.3f} with {c['temperature']:.2f} on the whole split, as "
        "jem eval reports it; kept in model.pt: jem.load gives jm.temperature, probabilities are softmax(logits / T))"
        + ("; below 1: the model was under-confident, its logits are sharpened" if c["temperature"] < 1 else "")
    )


def _accuracy(z: torch.Tensor, y: torch.Tensor) -> float:
    return float((z.argmax(1) == y).double().mean())
