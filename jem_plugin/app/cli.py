"""The ``jem`` command: demo, train, eval, ood, sample, plugins, doctor.

Every subcommand takes ``--device``, ``--seed``, ``--out`` and ``--config FILE`` (JSON or TOML
whose keys are option names, e.g. ``{"epochs": 5, "sgld_steps": 10}``; flags on the command line
win). User errors (bad flags, missing paths, incompatible checkpoints) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch.utils.data import DataLoader, DistributedSampler

from .. import calibration, ood, training
from .. import distributed as jdist
from .._checks import model_device
from ..builtins.init_distributions import COVARIANCES
from ..errors import JEMError
from ..plugins import list_plugins
from ..recipes import DEFAULT_RECIPE, RECIPES, get_recipe
from ..sampling import COLOURS, SGLD
from . import CLIError, doctor, post_training
from .experiments import dataset_sample_quality, run_digits_demo, samples_against_data
from .model_files import (
    build_model,
    check_classes,
    check_inputs,
    check_resume,
    check_training_split,
    drop_buffer_from_checkpoints,
    held_out_data,
    load_data,
    load_model_checkpoint,
    load_run_sampler,
    model_spec,
    ood_sets,
    sampler_file,
    save_model_checkpoint,
    save_run_sampler,
    split_held_out,
    training_data,
    wrap_for_data,
)
from .report import QUALITY_HOW_TO_READ, metric_label, write_report

# `jem demo --smoke`: the whole pipeline in seconds (tests, a first look); not a meaningful result.
SMOKE_DEMO = {"epochs": 1, "sgld_steps": 2, "buffer_size": 500, "class_sample_steps": 2, "judge_epochs": 5}


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


def _check_config_types(config: dict[str, Any], actions: dict[str, argparse.Action], path: str) -> None:
    """A config value of the wrong type names the file and the key, not just argparse's complaint."""
    for key, value in config.items():
        a = actions[key]
        want: Any = bool if a.nargs == 0 else (int if a.type is _positive else a.type) or str
        ok = (
            isinstance(value, bool)
            if want is bool
            else (
                value is None
                or (
                    not isinstance(value, bool)
                    and (
                        isinstance(value, int)
                        if want is int
                        else isinstance(value, (int, float))
                        if want is float
                        else isinstance(value, str)
                    )
                )
            )
        )
        if not ok:
            name = getattr(want, "__name__", "text")
            raise CLIError(f"config file {path!r}: {key} = {value!r} is not {name}; write it as a JSON/TOML {name}")
        if a.choices is not None and value not in a.choices:
            raise CLIError(f"config file {path!r}: {key} = {value!r}; choose one of {', '.join(map(str, a.choices))}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one-line ``jem: error: ...`` of every other user error."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see `{self.prog} --help`)")


def _device(name: str):
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


def _check_install() -> None:
    """The cheap part of `jem doctor` (milliseconds): a torch/torchvision mismatch ends the command
    before any training, not inside torchvision minutes later."""
    problem = doctor.install_problem()
    if problem:
        raise CLIError(problem)


# ----------------------------------------------------------------------------- commands
def cmd_plugins(args) -> int:
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
    _check_install()
    out = _out_dir(args.out or "jem-report")
    _device(args.device)
    overrides = SMOKE_DEMO if args.smoke else {}
    result = run_digits_demo(
        out,
        seed=args.seed,
        device=args.device,
        progress=not args.quiet,
        budget_seconds=args.budget_seconds,
        **overrides,
    )
    report = write_report(out, result, title="jem demo: a classifier and a JEM on the digits")
    runs = result.get("runs", {})
    first: dict[str, Any] = next(iter(runs.values()), {})
    keys = [k for k in first.get("summary", {}) if k.startswith(("acc", "ece", "auroc_logpx"))]
    print(f"\n{'':<34}" + "".join(f"{n:>12}" for n in runs))
    for k in keys:
        vals = [runs[n]["summary"].get(k) for n in runs]
        print(
            f"{metric_label(k)[0]:<34}" + "".join(f"{v:>12.3f}" if isinstance(v, float) else f"{'':>12}" for v in vals)
        )
    if result.get("warning"):
        print(f"\nWARNING: {result['warning']}")
    print(f"\nreport: {report}  (metrics.json, model_baseline.pt and model_JEM.pt are next to it)")
    return 0


def cmd_train(args) -> int:
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
        from ..viz import save_image_grid

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


def _eval_tensors(args, spec):
    ds, where = held_out_data(spec, args.data, args.image_size, args.seed)
    if hasattr(ds, "tensors"):
        x, y = ds.tensors
    else:
        xs, ys = zip(*[ds[i] for i in range(len(ds))])
        x, y = torch.stack(list(xs)), torch.as_tensor(ys)
    return x, y, where


def cmd_eval(args) -> int:
    jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device))
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
    return 0


def cmd_ood(args) -> int:
    from ..plugins import collect
    from ..viz import plot_ood_table  # lazy: matplotlib
    from .model_files import check_shape

    methods = ood._method_names(args.scores)  # unknown names: one line, before anything is loaded
    if args.openood and (args.data or args.ood):
        raise CLIError("--openood gives both the test images and the OOD sets; drop --data and --ood")
    jm, spec = load_model_checkpoint(args.checkpoint, _device(args.device))
    size = args.image_size or int(spec["sample_shape"][-1])
    progress = False if args.quiet else None
    fit_needed = any(collect(ood._HOOK)[m].get("needs_fit", False) for m in methods)
    data_in: Any
    sets: dict[str, Any]
    fit_data: Any = None
    if args.openood:
        from .openood import load_openood

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
        data_in, sets = x, ood_sets(args.ood, spec, jm, x, y, seed=args.seed)
    if fit_needed and fit_data is None:
        # The model's own training data (its spec names it; the held-out split left out), or --fit-data.
        source = args.fit_data or spec["data"]
        if args.fit_data:
            ds, *_ = load_data(source, train=True, image_size=size, seed=args.seed)
        else:
            ds = training_data(spec, args.seed)
        if len(ds):
            check_shape(spec, ds[0][0].shape, source)
        fit_data = DataLoader(ds, batch_size=args.batch_size)
    table = ood.evaluate_all(
        jm, data_in, sets, methods, fit_data=fit_data, batch_size=args.batch_size, progress=progress
    )
    result: dict[str, Any] = {}
    for r in table.rows():
        key = f"{r['score']}/{r['set']}"
        if r["status"] == "ok":
            result[key] = {**table[r["score"]][r["set"]], "seconds_per_1000": r["seconds_per_1000"]}
        else:
            result[key] = {"status": r["status"], "reason": r["reason"]}
    _emit(result, args)
    base = (
        _out_file(args.out).with_suffix("")
        if args.out
        else Path(args.checkpoint).with_name(Path(args.checkpoint).stem + "_ood")
    )
    csv_path, png_path = table.to_csv(base.with_suffix(".csv")), str(base.with_suffix(".png"))
    plot_ood_table(table, png_path, title=f"{Path(args.checkpoint).name}: AUROC per score and OOD set")
    # The JSON above is the result for scripts; the table is for the reader (stderr keeps stdout JSON).
    print(f"\n{table.to_text()}\ntable: {csv_path}\nfigure: {png_path}", file=sys.stderr)
    return 0


def cmd_sample(args) -> int:
    from ..viz import save_image_grid  # lazy: matplotlib

    dev = _device(args.device)
    jm, spec = load_model_checkpoint(args.checkpoint, dev)
    if len(spec["sample_shape"]) != 3:
        raise CLIError(f"jem sample draws images; this model's inputs have shape {tuple(spec['sample_shape'])}")
    out = (
        _out_file(args.out)
        if args.out
        else Path(args.checkpoint).with_name(Path(args.checkpoint).stem + "_samples.png")
    )
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
    sampler = SGLD(**settings, generator=g)
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
        _print_sample_check(x, x0.cpu(), y, spec, args.seed)
    return 0


def _print_sample_check(x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor | None, spec, seed: int) -> None:
    """The samples as an independent judge sees them, against where their chains started."""
    train_ds = training_data(spec, seed)
    heldout_ds, _ = held_out_data(spec, None, None, seed)
    q = samples_against_data(x, x0, train_ds, heldout_ds, y=y, num_classes=spec["num_classes"], seed=seed)
    if "skipped" in q:
        print(f"check skipped: {q['skipped']}")
        return
    line = (
        f"check (a judge trained on the training data, {q['judge_acc_heldout']:.2f} on held-out images): "
        f"Fréchet distance to {q['n']} held-out images {q['fd_samples']:.3g} for the samples, "
        f"{q['fd_starts']:.3g} for their starting points"
    )
    if y is not None:
        line += (
            f"; it puts {q['judge_acc_samples']:.0%} of the samples in the class they were drawn for "
            f"({q['judge_acc_starts']:.0%} of the starting points)"
        )
    print(line + ". Lower distance than the starts: the chains moved towards the data.")


def cmd_doctor(args) -> int:
    dev = _device(args.device) if args.device else doctor.default_device()
    if args.seconds < 0:
        raise CLIError(f"--seconds {args.seconds:g} is negative; give the timing's length (0 leaves it out)")
    json_path = _out_file(args.json, "--json") if args.json else None
    report = doctor.run_doctor(dev, seconds=args.seconds, echo=lambda line: print(line, flush=True))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
        print(f"report: {json_path}")
    return 0 if report["ok"] else 1


def _emit(result: dict[str, Any], args) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        _out_file(args.out).write_text(text)


# ----------------------------------------------------------------------------- parser
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


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    common.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    common.add_argument("--out", default=None, help="output path (directory or file, per command)")
    common.add_argument("--config", default=None, help="JSON or TOML file of option defaults")
    common.add_argument("--quiet", action="store_true", help="no progress bars")

    parser = _Parser(prog="jem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("demo", parents=[common], help="baseline vs JEM on the bundled digits, with a report")
    p.add_argument(
        "--budget-seconds",
        type=float,
        default=240.0,
        help="time for both runs (default 240); a run it cuts short is reported as such",
    )
    p.add_argument("--smoke", action="store_true", help="run the pipeline in seconds (not a meaningful result)")
    p.set_defaults(func=cmd_demo)

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
    p.set_defaults(func=cmd_train)

    for name, func, helptext in (
        ("eval", cmd_eval, "accuracy and calibration of a trained model"),
        ("ood", cmd_ood, "OOD detection scores and metrics of a trained model"),
    ):
        p = sub.add_parser(name, parents=[common], help=helptext)
        p.add_argument("checkpoint", help="model.pt written by `jem train`")
        p.add_argument("--data", default=None, help="evaluation data (default: what training held out)")
        p.add_argument("--image-size", type=int, default=None, help="default: the model's")
        if name == "ood":
            p.add_argument(
                "--scores",
                default="logpx,msp,grad_norm",
                help="comma-separated score names, or all (every registered score; see jem plugins). "
                "Prints the JSON result on stdout and a table marking the best score per set on "
                "stderr, and writes it as CSV and a PNG heat map next to --out (default: next to the "
                "checkpoint)",
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
                "list, near- and far-OOD lists, and its training list for fitting",
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
        p.set_defaults(func=func)

    p = sub.add_parser("sample", parents=[common], help="draw SGLD samples from a trained model")
    p.add_argument("checkpoint", help="model.pt written by `jem train`")
    p.add_argument("--n", type=_positive, default=64)
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
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("plugins", help="list loaded plugins and the hooks they implement")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins, config=None)

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
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    p.set_defaults(func=cmd_doctor, config=None)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # Config values become defaults; flags given on the command line still win.
        config = _load_config(args.config)
        # argparse keeps a parser's actions private: read them to know the command's options.
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparser = commands.choices[args.command]
        known = {a.dest for a in subparser._actions}
        unknown = sorted(set(config) - known)
        if unknown:
            raise CLIError(
                f"config file {args.config!r} has unknown options for `jem {args.command}`: {', '.join(unknown)}"
            )
        _check_config_types(config, {a.dest: a for a in subparser._actions}, args.config)
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
