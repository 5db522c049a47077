"""Does the default JEM recipe hold on data it was never tuned on? (issue 31, deliverable 1)

A matrix of data sets x training-set sizes x networks x {the default recipe, the cross-entropy
baseline} x seeds, the other recipes on the ~150-per-class row, every cell against the same
three targets (held-out accuracy within 1 point of the baseline; log p(x) AUROC at least the
baseline energy score's on every OOD set; buffer Fréchet distance at most half its init's).
Training and evaluation are ``bench_generative``'s (:func:`~benchmarks.bench_generative.train_run`,
:func:`~benchmarks.bench_generative.evaluate_run`); this module adds the data, the splits, the
matrix, resumable per-cell results and the summary table.

Data sets (32x32 RGB, 10 classes):

- ``digits32``: scikit-learn's digits upsampled (bilinear), ImageNet-normalised, +-4 pixel shifts as
  augmentation (``bench_generative``'s 32x32 setting);
- ``textures``: :func:`jem_plugin.app.data.textures`, shapes in class-specific hues on procedural
  backgrounds, ImageNet-normalised, the same augmentation;
- ``folder``: the user's path: the digits written as PNG files with the README's helper
  (:func:`benchmarks.folders.write_digits_folder`, 32x32) into a temporary directory and read
  back through ``load_data("folder:PATH")`` as ``jem train --data folder:PATH`` reads them
  ([-1, 1]), trained without augmentation as ``jem train`` trains.

Splits, in this order: the test split first (digits: scikit-learn's 360 test digits, the same
images for ``digits32`` and ``folder``; textures: 50 per class from their own seed range), seen by
no selection step; then a validation split (digits: 10 per class of the 1437 training digits;
textures: 30 per class) on which the temperature is fitted and a recomputation of BatchNorm
statistics is kept or undone; the training pool is the rest (digits: 1337, ~134 per class, so
the digits' ~150-per-class row is their full set; textures: 500 per class). Rows of 40 and 150
per class take a seed-dependent subset of the pool.

Per cell: test accuracy, ECE before and after temperature scaling (fitted on the validation
split), log p(x) AUROC against uniform noise, photo crops (grey, digit-like patches for the
digits; colour crops for textures), a near set (digits transposed; textures with their colour
channels rolled: shapes intact, colour statistics not) and the other data set; the buffer's
Fréchet distance in an independent judge's features against its initial distribution's (as many
draws as buffer samples) and the held-out floor (test halves); the judge's accuracy on
class-conditional samples (40 steps of the recipe's sampler from its init) against its accuracy
on those init draws; training CPU seconds against the baseline's. A recipe that recomputes
BatchNorm statistics after training (``bn_stats_from_data``) keeps them only when the validation
accuracy is not worse (both test accuracies are recorded).

    python -m benchmarks.bench_generalisation --quick          # the quick subset (see README)
    nohup python -m benchmarks.bench_generalisation > /tmp/gen_full.log 2>&1 &   # the full matrix
    python -m benchmarks.bench_generalisation --summary-only --readme          # table from the cells

Every cell is one JSON file under ``--out``/cells/ (default ``benchmarks/results/generalisation/
{quick,full}``); a rerun skips the cells already there.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import functools
import glob
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import update_bn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_generative as G
from benchmarks.common import machine_info, md_table, target_mark, write_json
from benchmarks.folders import write_digits_folder
from jem_plugin import recipes as R
from jem_plugin.app import data as D
from jem_plugin.app import default_recipe as policy
from jem_plugin.app.model_files import load_data
from jem_plugin.sample_quality import Judge, JudgeNet, reference_points, train_judge

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generalisation")
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
DATASETS = ("digits32", "textures", "folder")
#: network name -> bench_generative.make_model spec, and its normalisation
NETWORKS = {
    "resnet10t": "resnet10t",
    "lcnet_050": "lcnet_050",
    "convnext_atto": "convnext_atto",
    "vit": "test_vit:img_size=32,patch_size=4",
    "wrn10-1": "wrn10-1",
}
NORMS = {
    "resnet10t": "BN",
    "lcnet_050": "depthwise BN",
    "convnext_atto": "LN",
    "vit": "ViT, LN",
    "wrn10-1": "none",
    "resnet18": "BN",  # the long row's GPU cell
}
#: Adam's learning rate for the networks that learn nothing in a row's iterations at the recipes'
#: 3e-4 (the baseline and every recipe of the cell use it, as ``jem train --lr``). Chosen by
#: ``--tune-lr`` on the tune set only: the baseline's *validation* accuracy on 40 digits per class,
#: seed 0 (results/generalisation/lr_tuning/); every other network keeps 3e-4.
NETWORK_LR: dict[str, float] = {"lcnet_050": 1e-2, "wrn10-1": 3e-3, "vit": 1e-3}
TUNE_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
SIZES = ("40", "150", "full")
OOD_NAMES = ("noise", "photos", "near", "other")
BATCH = 64
COND_STEPS, COND_PER_CLASS = G.COND_STEPS, G.COND_PER_CLASS
DIGITS_VAL_PER_CLASS = 10
TEXTURES_PER_CLASS = {"pool": 500, "val": 30, "test": 50}  # offsets 0, 100000, 200000
TINY_TEXTURES = {"pool": 6, "val": 2, "test": 3}
# (epochs for rows of <= 50 per class, <= 200 per class, more): CPU scale, the same for every run of a row
PLANS: dict[str, dict[str, Any]] = {
    "full": {
        "seeds": (0, 1, 2),
        "other_seeds": (0,),
        "sizes": SIZES,
        "networks": tuple(NETWORKS),
        "epochs": (30, 12, 6),
        "other_networks": tuple(NETWORKS),
    },
    "quick": {
        "seeds": (0,),
        "other_seeds": (0,),
        "sizes": ("40", "150"),
        "networks": ("resnet10t", "convnext_atto", "wrn10-1"),
        "epochs": (10, 3, 2),
        "other_networks": ("resnet10t",),
    },
}


def _read_json(path: str, default: Any = None) -> Any:
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def default_recipe(per_class: int | None = None, net: str | None = None) -> str:
    """What ``jem train`` uses with no recipe flag for ``per_class`` training images per class on
    the network ``net`` (:func:`jem_plugin.app.default_recipe.default_recipe_for`); with neither, the general
    default (:data:`jem_plugin.app.default_recipe.DEFAULT_RECIPE`)."""
    if per_class is None or net is None:
        return policy.DEFAULT_RECIPE
    return policy.default_recipe_for(per_class, batchnorm="BN" in NORMS.get(net, ""), lr=NETWORK_LR.get(net))


def default_settings(per_class: int, net: str) -> dict[str, float]:
    """The settings ``jem train`` changes in :func:`default_recipe`'s recipe for the cell
    (:func:`jem_plugin.app.default_recipe.default_settings_for`)."""
    norm = NORMS.get(net, "")
    return policy.default_settings_for(
        per_class, batchnorm="BN" in norm, lr=NETWORK_LR.get(net), normalised=norm != "none"
    )


def defaults_for(per_class: int, net: str) -> list[tuple[str, dict[str, float]]]:
    """The runs (recipe, changed settings) every cell of a row runs beside the baseline: ``jem
    train``'s choice and, where the rule picks another recipe or settings, the general default too
    (what the rule is judged against; :func:`plan` runs it on the other recipes' seeds)."""
    chosen = (default_recipe(per_class, net), default_settings(per_class, net))
    return [chosen] if chosen == (default_recipe(), {}) else [chosen, (default_recipe(), {})]


def default_label(per_class: int, net: str) -> str:
    """The table's name of ``jem train``'s choice for the cell, e.g. ``generative[px_weight=0.03]``."""
    run, settings = defaults_for(per_class, net)[0]
    return run_label({"run": run, "set": settings})


def other_recipes(with_paper: bool = False) -> list[str]:
    """Every registered recipe but the general default (``paper``, 20 steps on 64 chains from noise,
    only when asked: about 4x the default's time per iteration)."""
    return [r for r in R.RECIPES if r != default_recipe() and (with_paper or r != "paper")]


# ---------------------------------------------------------------------------- data
def _normalise(x_unit: torch.Tensor, mean, std) -> torch.Tensor:
    return (x_unit - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


@functools.lru_cache(maxsize=1)
def digits_split() -> dict[str, np.ndarray]:
    """Indices into the 1797 digits (scikit-learn's order): ``test`` (the same split as
    ``load_digits("test")``), ``val`` (10 per class of the training digits), ``pool`` (the rest)."""
    from sklearn.model_selection import train_test_split

    _, y = D.digits_tensors("all")
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=y.numpy())
    idx_train, idx_test = np.sort(idx_train), np.sort(idx_test)
    rng = np.random.default_rng(1234)
    yt = y.numpy()[idx_train]
    val = np.sort(np.concatenate([rng.permutation(idx_train[yt == k])[:DIGITS_VAL_PER_CLASS] for k in range(10)]))
    pool = np.setdiff1d(idx_train, val)
    return {"test": idx_test, "val": val, "pool": pool}


@functools.lru_cache(maxsize=1)
def _folder_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits written as 32x32 PNGs with ``write_digits_folder`` and read back through
    ``load_data("folder:PATH")``, exactly as ``jem train --data folder:PATH`` reads them; returned
    in scikit-learn's order (the folder holds each class's digits in that order)."""
    root = tempfile.mkdtemp(prefix="jem_gen_folder_")
    atexit.register(shutil.rmtree, root, True)
    write_digits_folder(root, per_class=10_000, size=32)
    ds, *_ = load_data(f"folder:{root}", train=True, image_size=32)
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.tensor(ds.targets)
    _, y_all = D.digits_tensors("all")
    order = np.concatenate([np.flatnonzero(y_all.numpy() == k) for k in range(10)])  # folder index -> digit index
    x_orig = torch.empty_like(x)
    x_orig[torch.from_numpy(order)] = x
    if not bool((y[torch.from_numpy(np.argsort(order))] == y_all).all()):
        raise RuntimeError("the digits folder's classes do not line up with the digits")
    return x_orig, y_all


@functools.cache
def _textures_unit(tiny: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    n = TINY_TEXTURES if tiny else TEXTURES_PER_CLASS
    return {
        part: D.textures(n[part], size=32, seed=0, offset=off)
        for part, off in (("pool", 0), ("val", 100_000), ("test", 200_000))
    }


@functools.cache
def dataset(name: str, tiny: bool = False) -> dict[str, Any]:
    """A data set of the matrix: its training pool, validation and test splits, OOD sets, the
    keywords ``jem.wrap`` needs, its augmentation (pixels of shift)."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    mean, std = G.IMAGENET_MEAN, G.IMAGENET_STD
    if name == "folder":
        mean = std = (0.5, 0.5, 0.5)  # what load_data("folder:...") gives: [0, 1] -> [-1, 1]
    wrap_kw = dict(mean=mean, std=std, input_size=(3, 32, 32), num_classes=10)
    dom = jem.wrap(torch.nn.Linear(1, 1), **wrap_kw).domain
    tex = _textures_unit(tiny)
    if name == "textures":
        parts = {p: (_normalise(x, mean, std), y) for p, (x, y) in tex.items()}
        xt_unit = tex["test"][0]
        n = len(xt_unit)
        digits_test = G.to32(D.digits_tensors("test")[0][: n if tiny else None])
        ood = {
            "photos": _normalise(D.photo_crops(n, 32, seed=1), mean, std),
            "near": _normalise(xt_unit[:, [1, 2, 0]], mean, std),  # hues turned by a third: no class's colours
            "other": digits_test,
        }
        shift = 4
    else:
        split = digits_split()
        x8_all, y_all = D.digits_tensors("all")
        if name == "digits32":
            x_all = G.to32(x8_all)
            photos = G.to32(D.photo_patches(len(split["test"]), size=8, seed=1))
            shift = 4
        else:
            x_all, y_folder = _folder_digits()
            assert bool((y_folder == y_all).all())
            # the photos as the folder shows digits: 8x8, each pixel a 4x4 block
            p8 = (D.photo_patches(len(split["test"]), size=8, seed=1) + 1) / 2
            photos = _normalise(p8.repeat_interleave(4, 2).repeat_interleave(4, 3).repeat(1, 3, 1, 1), mean, std)
            shift = 0  # jem train does not augment
        parts = {p: (x_all[idx], y_all[idx]) for p, idx in split.items()}
        if tiny:
            parts = {p: (x[: 10 * TINY_TEXTURES[p]], y[: 10 * TINY_TEXTURES[p]]) for p, (x, y) in parts.items()}
            photos = photos[: len(parts["test"][0])]
        xt = parts["test"][0]
        n = len(xt)
        ood = {
            "photos": photos,
            "near": D.transposed(xt),
            "other": _normalise(tex["test"][0][:n], mean, std),
        }
    xt = parts["test"][0]
    ood = {"noise": dom.uniform(len(xt), (3, 32, 32), generator=torch.Generator().manual_seed(2)), **ood}
    return {
        "name": name,
        "wrap_kw": wrap_kw,
        "shift": shift,
        "pool": parts["pool"],
        "val": parts["val"],
        "test": parts["test"],
        "ood": {k: ood[k] for k in OOD_NAMES},
        "tiny": tiny,
    }


def pool_per_class(name: str, tiny: bool = False) -> int:
    """The most images of one class in a data set's training pool (without building the data)."""
    if tiny:
        return TINY_TEXTURES["pool"]
    if name == "textures":
        return TEXTURES_PER_CLASS["pool"]
    _, y = D.digits_tensors("all")
    return int(torch.bincount(y[torch.from_numpy(digits_split()["pool"])]).max())


def per_class_for(name: str, size: str, tiny: bool = False) -> int:
    """Images per class of a row: 40, 150 (at most what the pool holds: then the whole pool) or the whole pool."""
    available = pool_per_class(name, tiny)
    return available if size == "full" else min(int(size), available)


def training_subset(ds: dict[str, Any], per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` images of each class from the pool, chosen by ``seed`` (the whole pool when
    it holds no more)."""
    x, y = ds["pool"]
    counts = torch.bincount(y)
    if per_class >= int(counts.max()):
        return x, y
    rng = np.random.default_rng([seed, 31])
    idx = np.sort(
        np.concatenate([rng.permutation(np.flatnonzero(y.numpy() == k))[:per_class] for k in range(len(counts))])
    )
    return x[idx], y[idx]


def setting(ds: dict[str, Any], net: str, per_class: int, seed: int) -> dict[str, Any]:
    """The ``S`` dict of ``bench_generative`` for one cell (training subset, splits, OOD sets)."""
    x, y = training_subset(ds, per_class, seed)
    return {
        "name": f"{ds['name']}_{net}",
        "model": NETWORKS.get(net, net),
        "wrap_kw": ds["wrap_kw"],
        "shift": ds["shift"],
        "x": x,
        "y": y,
        "xv": ds["val"][0],
        "yv": ds["val"][1],
        "xt": ds["test"][0],
        "yt": ds["test"][1],
        "ood": ds["ood"],
    }


@functools.cache
def judge_for(name: str, tiny: bool = False, cache_dir: str | None = None):
    """The independent judge of a data set: trained once on its whole training pool (kept in
    ``cache_dir/judges/`` when given: training is deterministic, a rerun reads it back)."""
    path = os.path.join(cache_dir, "judges", f"{name}{'_tiny' if tiny else ''}.pt") if cache_dir else None
    if path and os.path.exists(path):
        stored = torch.load(path, weights_only=True)
        net = JudgeNet(3, 10)
        net.load_state_dict(stored["state"])
        return Judge(net, (3, 32, 32), test_accuracy=stored["test_accuracy"])
    ds = dataset(name, tiny)
    x, y = ds["pool"]
    judge = train_judge(x, y, epochs=1 if tiny else 15, test=(ds["test"][0], ds["test"][1]), seed=0)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"state": judge.net.state_dict(), "test_accuracy": judge.test_accuracy}, path)
    return judge


def references(name: str, tiny: bool = False, cache_dir: str | None = None) -> dict[str, Any]:
    """The judge's test accuracy and the reference distances of a data set."""
    ds, judge = dataset(name, tiny), judge_for(name, tiny, cache_dir)
    xt = ds["test"][0]
    dom = jem.wrap(torch.nn.Linear(1, 1), **ds["wrap_kw"]).domain
    g = torch.Generator().manual_seed(5)
    ref = reference_points(judge, xt, train=ds["pool"][0], init=dom.uniform(len(xt), (3, 32, 32), generator=g))
    return {
        "judge_test_accuracy": judge.test_accuracy,
        "fd_heldout_floor": ref["heldout_halves"],
        "fd_train": ref["train"],
        "fd_uniform": ref["init"],
        "n_pool": len(ds["pool"][1]),
        "n_val": len(ds["val"][1]),
        "n_test": len(xt),
        "pool_per_class": pool_per_class(name, tiny),
    }


# ---------------------------------------------------------------------------- one cell
def run_label(c: dict[str, Any]) -> str:
    """The run's name with the recipe settings it changed (``--set``), e.g. ``generative[px_weight=0.1]``."""
    changed = c.get("set") or {}
    run = c["run"] + (f"+{c['negatives']}" if c.get("negatives") else "")  # the long row's DAT cells
    return run + ("[" + ",".join(f"{k}={v:g}" for k, v in sorted(changed.items())) + "]" if changed else "")


def cell_name(c: dict[str, Any]) -> str:
    lr = f"_lr{c['lr']:g}" if "lr" in c else ""
    run = run_label(c).replace("[", "+").replace("]", "").replace("=", "")  # a file name without shell specials
    return f"{c['dataset']}_{c['per_class']}_{c['net']}_{run}_s{c['seed']}_e{c['epochs']}{lr}"


def _accuracy(model, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def evaluate_cell(S: dict[str, Any], res: dict[str, Any], judge: Any, tiny: bool, baseline: bool) -> dict[str, Any]:
    """``bench_generative.evaluate_run`` with the matrix's settings (log p(x) on the OOD sets, the
    judge on class-conditional samples from an init drawn like the buffer's; none for the
    baseline, which has no target there); the long row evaluates its points with it too."""
    return G.evaluate_run(
        S,
        res,
        judge,
        False,
        ood_methods=("logpx",),
        trace_rounds=(),
        cond_steps=2 if tiny else COND_STEPS,
        cond_per_class=0 if baseline else (1 if tiny else COND_PER_CLASS),
        init_like_buffer=True,
    )


def recompute_bn_statistics(S: dict[str, Any], model: torch.nn.Module) -> None:
    """The model's BatchNorm running statistics recomputed from the clean training set (torch's ``update_bn``)."""
    update_bn([S["x"][i : i + BATCH] for i in range(0, len(S["x"]), BATCH)], model)


def keep_better_bn_statistics(S: dict[str, Any], res: dict[str, Any]) -> dict[str, Any] | None:
    """For a recipe with ``bn_stats_from_data`` on a BatchNorm network: recompute the running
    statistics from the clean training set, keep them only when the validation accuracy is not
    worse, else restore those of training (kept as ``res["bn_as_trained"]`` either way). Both test
    accuracies are recorded."""
    r, model = res["recipe"], res["model"]
    if r is None or not r.bn_stats_from_data or not any(isinstance(m, _BatchNorm) for m in model.modules()):
        return None
    before = copy.deepcopy(model.state_dict())
    out = {
        "val_acc_as_trained": _accuracy(model, S["xv"], S["yv"]),
        "test_acc_as_trained": _accuracy(model, S["xt"], S["yt"]),
    }
    recompute_bn_statistics(S, model)
    out["val_acc_from_data"] = _accuracy(model, S["xv"], S["yv"])
    out["test_acc_from_data"] = _accuracy(model, S["xt"], S["yt"])
    out["kept"] = "from_data" if out["val_acc_from_data"] >= out["val_acc_as_trained"] else "as_trained"
    if out["kept"] == "as_trained":
        model.load_state_dict(before)
    res["bn_as_trained"] = before  # what training left, for a reader of the other statistics
    model.eval()
    res["jm"] = jem.wrap(model, **S["wrap_kw"])
    return out


def run_cell(c: dict[str, Any], out_dir: str, grids: bool = False) -> dict[str, Any]:
    """Train and evaluate one cell; its JSON goes to ``out_dir/cells/<name>.json``."""
    torch.set_num_threads(1)
    tiny = bool(c.get("tiny"))
    ds = dataset(c["dataset"], tiny)
    S = setting(ds, c["net"], c["per_class"], c["seed"])
    judge = judge_for(c["dataset"], tiny, out_dir)
    baseline = c["run"] == "baseline"
    row: dict[str, Any] = {**c, "n_train": len(S["y"]), "network": NETWORKS.get(c["net"], c["net"])}
    t0, c0 = time.perf_counter(), time.process_time()
    stage = "training"
    try:
        overrides = {**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})}
        res = G.train_run(
            S, c["run"], c["epochs"], seed=c["seed"], batch_size=BATCH, fit_init="train", overrides=overrides or None
        )
        stage = "evaluation"
        row["bn_selection"] = keep_better_bn_statistics(S, res)
        t1 = time.perf_counter()
        ev = evaluate_cell(S, res, judge, tiny, baseline)
    except Exception as exc:  # a diverged run is a result of the matrix, not the end of it
        msg = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        row.update(error=f"{stage}: {type(exc).__name__}: {msg}", wall_s=time.perf_counter() - t0)
        write_json(os.path.join(out_dir, "cells", cell_name(c) + ".json"), row)
        return row
    buf, xc, yc = ev.pop("buffer_samples", None), ev.pop("cond_samples", None), ev.pop("cond_labels", None)
    if grids and xc is not None:
        q = ev.get("buffer", {})
        title = (
            f"{cell_name(c)}: acc {ev['accuracy']:.3f}; class samples: judge acc {ev['cond']['judge_acc']:.2f} "
            f"(init {ev['cond']['judge_acc_init']:.2f})"
            + (f"; buffer FD {q['fd']:.1f} (init {ev['init_fd']:.1f})" if q else "")
        )
        os.makedirs(os.path.join(out_dir, "grids"), exist_ok=True)
        G.save_grid(os.path.join(out_dir, "grids", cell_name(c) + ".png"), title, res["jm"].domain, buf, xc, yc, judge)
    r = res["recipe"]
    row.update(
        ev,
        recipe=r.name if r is not None else "baseline",
        recipe_settings=str(r) if r is not None else "cross-entropy only",
        iterations=res["cost"]["iterations"],
        buffer_slots=res["cost"]["buffer_slots"],
        lr_used=res["cost"]["lr"],
        train_cpu_s=res["cost"]["train_cpu_s"],
        train_wall_s=res["cost"]["train_wall_s"],
        eval_wall_s=time.perf_counter() - t1,
        wall_s=time.perf_counter() - t0,
        cpu_s=time.process_time() - c0,
        history_last=res["history"][-1],
    )
    write_json(os.path.join(out_dir, "cells", cell_name(c) + ".json"), row)
    return row


def _run_cell_job(args: tuple) -> dict[str, Any]:
    c, out_dir, grids = args
    t = time.perf_counter()
    row = run_cell(c, out_dir, grids)
    print(
        f"[{time.strftime('%H:%M:%S')}] {cell_name(c)}: "
        + (row["error"] if "error" in row else f"acc {row['accuracy']:.3f}")
        + f", {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    return row


# ---------------------------------------------------------------------------- the matrix
def plan(
    mode: str = "full",
    datasets: Sequence[str] = DATASETS,
    networks: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    sizes: Sequence[str] | None = None,
    others: Sequence[str] | None = None,
    epochs: Sequence[int] | None = None,
    tiny: bool = False,
    others_everywhere: bool = False,
    settings: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """The cells of a plan (``PLANS[mode]`` with any of its parts replaced), cheapest rows first.
    ``others_everywhere``: the other recipes on every row, with the plan's seeds and networks (a
    comparison of recipes), not only on the 150 row, where the matrix's own others stay (so the
    comparison's table is a superset of the matrix's). ``settings``: recipe settings by flat name
    changed in every recipe cell (not the baseline's), to try a setting on the tune set and judge
    it on the others; the cells' names carry them."""
    p = PLANS[mode]
    networks = tuple(networks or p["networks"])
    seeds = tuple(p["seeds"] if seeds is None else seeds)
    sizes = tuple(sizes or p["sizes"])
    e_small, e_mid, e_big = tuple(epochs or p["epochs"])
    others = other_recipes() if others is None else list(others)
    other_nets = [n for n in p["other_networks"] if n in networks] if mode == "quick" else list(networks)
    cells: dict[str, dict[str, Any]] = {}
    for size in sizes:
        for name in datasets:
            per_class = per_class_for(name, size, tiny)
            ep = e_small if per_class <= 50 else (e_mid if per_class <= 200 else e_big)
            for net in networks:
                (choice, *beside) = defaults_for(per_class, net)
                runs = [("baseline", {}, seeds, networks), (*choice, seeds, networks)]
                # the general default beside the choice shows what the rule changed: on the other
                # recipes' seeds (every seed with others_everywhere), inside the matrix's 8 hours
                beside_seeds = seeds if others_everywhere else tuple(s for s in seeds if s in p["other_seeds"])
                runs += [(r, chosen, beside_seeds, networks) for r, chosen in beside]
                if others_everywhere:
                    runs += [(r, {}, seeds, networks) for r in others]
                if size == "150":  # a comparison keeps the matrix's own recipes on this row: its table shows them
                    row_others = other_recipes() if others_everywhere else others
                    runs += [(r, {}, tuple(p["other_seeds"]), other_nets) for r in row_others]
                for run, chosen, run_seeds, nets in runs:
                    if net not in nets:
                        continue
                    for seed in run_seeds:
                        c = dict(dataset=name, per_class=per_class, net=net, run=run, seed=seed, epochs=ep)
                        if net in NETWORK_LR:
                            c["lr"] = NETWORK_LR[net]
                        if run != "baseline" and (chosen or settings):
                            c["set"] = {**chosen, **(settings or {})}
                        if tiny:
                            c["tiny"] = True
                        cells.setdefault(cell_name(c), c)  # digits: the 150 row is the full set
    return list(cells.values())


def run(
    cells: Sequence[dict[str, Any]],
    out_dir: str,
    workers: int = 2,
    grids: bool = False,
    retry_failed: bool = False,
) -> list[dict[str, Any]]:
    """Run the cells not already in ``out_dir/cells`` (``retry_failed``: also those that failed)."""
    os.makedirs(os.path.join(out_dir, "cells"), exist_ok=True)
    todo = []
    for c in cells:
        path = os.path.join(out_dir, "cells", cell_name(c) + ".json")
        if os.path.exists(path):
            with open(path) as f:
                if not (retry_failed and "error" in json.load(f)):
                    continue
        todo.append(c)
    names = sorted({(c["dataset"], bool(c.get("tiny"))) for c in cells})
    t0, c0 = time.perf_counter(), time.process_time()
    refs_path = os.path.join(out_dir, "datasets.json")
    refs = _read_json(refs_path, {})
    for name, tiny in names:  # the data and judges, once, before the workers fork
        if name not in refs or any(c["dataset"] == name for c in todo):
            refs[name] = references(name, tiny, out_dir)
    write_json(refs_path, refs)
    setup = {"setup_wall_s": time.perf_counter() - t0, "setup_cpu_s": time.process_time() - c0}
    print(f"{len(cells) - len(todo)} of {len(cells)} cells done before; running {len(todo)}", flush=True)
    jobs = [(c, out_dir, grids) for c in todo]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            list(ex.map(_run_cell_job, jobs))
    else:
        for j in jobs:
            _run_cell_job(j)
    info = {
        "machine": machine_info(),
        "workers": workers,
        "cells_run": len(todo),
        "wall_s": time.perf_counter() - t0,
        **setup,
    }
    runs_path = os.path.join(out_dir, "runs.json")
    log = _read_json(runs_path, [])
    write_json(runs_path, log + [info])
    return load_cells(out_dir, cells)


def load_cells(out_dir: str, cells: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The cell results under ``out_dir`` (only those of ``cells`` when given)."""
    want = None if cells is None else {cell_name(c) for c in cells}
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "cells", "*.json"))):
        if want is None or os.path.basename(path)[:-5] in want:
            with open(path) as f:
                rows.append(json.load(f))
    return rows


# ---------------------------------------------------------------------------- summary
def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (data set, size, network, recipe): means over the seeds the recipe ran on,
    against the baseline on the same seeds, and the three targets."""
    by_key: dict[tuple, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["dataset"], r["per_class"], r["net"], run_label(r), r["epochs"]), {})[r["seed"]] = r
    out = []
    for (name, pc, net, run, ep), seeds in sorted(by_key.items(), key=lambda kv: _order(kv[0])):
        if run == "baseline":
            continue
        base_all = by_key.get((name, pc, net, "baseline", ep), {})
        paired = sorted(s for s in seeds if s in base_all)
        ok = [s for s in paired if "error" not in seeds[s] and "error" not in base_all[s]]
        e: dict[str, Any] = {
            "dataset": name,
            "per_class": pc,
            "net": net,
            "run": run,
            "epochs": ep,
            "seeds": paired,
            "failed": {s: seeds[s].get("error") or base_all[s].get("error") for s in paired if s not in ok},
            "default": run == default_label(pc, net),
        }
        if ok:
            rr, bb = [seeds[s] for s in ok], [base_all[s] for s in ok]
            e["n_train"] = rr[0]["n_train"]
            for k in ("accuracy", "ece", "ece_ts"):
                e[k], e["baseline_" + k] = _mean([x[k] for x in rr]), _mean([x[k] for x in bb])
            e["auroc"] = {s: _mean([x["auroc"]["logpx"][s] for x in rr]) for s in OOD_NAMES}
            e["baseline_auroc"] = {s: _mean([x["auroc"]["logpx"][s] for x in bb]) for s in OOD_NAMES}
            has_buf = all("buffer" in x for x in rr)
            e["buffer_fd"] = _mean([x["buffer"]["fd"] for x in rr]) if has_buf else None
            e["init_fd"] = _mean([x["init_fd"] for x in rr])
            e["judge_acc"] = _mean([x["cond"]["judge_acc"] for x in rr])
            e["judge_acc_init"] = _mean([x["cond"]["judge_acc_init"] for x in rr])
            e["cost"] = _mean([x["train_cpu_s"] / max(b["train_cpu_s"], 1e-9) for x, b in zip(rr, bb)])
            sel = [x["bn_selection"] for x in rr if x.get("bn_selection")]
            e["bn_kept_from_data"] = (sum(s["kept"] == "from_data" for s in sel), len(sel)) if sel else None
            e["targets"] = {
                "accuracy": e["accuracy"] >= e["baseline_accuracy"] - 0.01,
                "auroc": all(e["auroc"][s] >= e["baseline_auroc"][s] for s in OOD_NAMES),
                "fd": e["buffer_fd"] is not None and e["buffer_fd"] <= 0.5 * e["init_fd"],
            }
        out.append(e)
    return out


def _order(key: tuple) -> tuple:
    name, pc, net, label, _ = key
    run = label.split("[")[0]
    nets = list(NETWORKS)
    runs = [default_recipe(), *other_recipes(with_paper=True)]
    return (
        DATASETS.index(name) if name in DATASETS else 99,
        pc,
        nets.index(net) if net in nets else 99,
        runs.index(run) if run in runs else 99,
        label,
    )


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None or v != v else fmt.format(v)


def to_markdown(entries: Sequence[dict[str, Any]], refs: dict[str, Any], title: str = "") -> str:
    """The one table (and the lines a reader needs beside it)."""
    pool = {k: v.get("pool_per_class") for k, v in refs.items()}
    header = [
        "data",
        "per class",
        "network",
        "recipe",
        "seeds",
        "test acc (baseline)",
        "ECE / after T (baseline)",
        "log p(x) AUROC noise / photos / near / other",
        "baseline energy AUROC",
        "buffer FD (init)",
        "judge acc on class samples (init)",
        "cost x",
        "acc",
        "AUROC",
        "FD",
    ]
    rows = []
    for e in entries:
        pc = f"{e['per_class']}" + (" (all)" if pool.get(e["dataset"]) == e["per_class"] else "")
        recipe = f"**{e['run']}**" if e["default"] else e["run"]
        if e.get("bn_kept_from_data"):
            k, n = e["bn_kept_from_data"]
            recipe += f" (BN from data {k}/{n})"
        seeds = ",".join(map(str, e["seeds"])) or "-"
        if "accuracy" not in e:
            why = "; ".join(f"seed {s}: {m}" for s, m in e["failed"].items())[:120] or "no baseline"
            rows.append(
                [e["dataset"], pc, f"{e['net']} ({NORMS.get(e['net'], '?')})", recipe, seeds, f"failed: {why}"]
                + [""] * 9
            )
            continue
        if e["failed"]:
            seeds += f" ({len(e['failed'])} failed)"
        t = e["targets"]
        dacc = 100 * (e["accuracy"] - e["baseline_accuracy"])
        rows.append(
            [
                e["dataset"],
                pc,
                f"{e['net']} ({NORMS.get(e['net'], '?')})",
                recipe,
                seeds,
                f"{e['accuracy']:.3f} ({e['baseline_accuracy']:.3f}, {dacc:+.1f} pt)",
                f"{e['ece']:.3f} / {e['ece_ts']:.3f} ({e['baseline_ece']:.3f} / {e['baseline_ece_ts']:.3f})",
                " / ".join(f"{e['auroc'][s]:.3f}" for s in OOD_NAMES),
                " / ".join(f"{e['baseline_auroc'][s]:.3f}" for s in OOD_NAMES),
                f"{_f(e['buffer_fd'], '{:.1f}')} ({e['init_fd']:.1f})",
                f"{e['judge_acc']:.2f} ({e['judge_acc_init']:.2f})",
                f"{e['cost']:.1f}",
                target_mark(t["accuracy"]),
                target_mark(t["auroc"]),
                target_mark(t["fd"]),
            ]
        )
    lines = [title] if title else []
    for name, ref in refs.items():
        lines.append(
            f"- `{name}`: pool {ref['n_pool']} ({ref['pool_per_class']}+ per class), validation {ref['n_val']}, "
            f"test {ref['n_test']}; judge test accuracy {ref['judge_test_accuracy']:.3f}; judge FD of test halves "
            f"(held-out floor) {ref['fd_heldout_floor']:.1f}, training pool {ref['fd_train']:.1f}, uniform noise "
            f"{ref['fd_uniform']:.1f}"
        )
    done = [e for e in entries if "targets" in e]
    default = [e for e in done if e["default"]]
    if default:
        counts = {k: sum(e["targets"][k] for e in default) for k in ("accuracy", "auroc", "fd")}
        lines.append(
            f"- default recipe (`jem train`'s choice per row, in bold) meets: accuracy {counts['accuracy']}/{len(default)} rows, "
            f"AUROC {counts['auroc']}/{len(default)}, buffer FD {counts['fd']}/{len(default)}; all three on "
            f"{sum(all(e['targets'].values()) for e in default)}/{len(default)}"
        )
    lines += ["", md_table(header, rows)]
    return "\n".join(lines) + "\n"


def tune_lr(networks: Sequence[str], out_dir: str, lrs: Sequence[float] = TUNE_LRS, workers: int = 2) -> dict:
    """The baseline's learning rate per network, chosen on the tune set alone: its validation
    accuracy on 40 digits per class (seed 0, the 40 row's epochs); the test split is not read."""
    cells = [
        dict(dataset="digits32", per_class=40, net=n, run="baseline", seed=0, epochs=PLANS["full"]["epochs"][0], lr=lr)
        for n in networks
        for lr in lrs
    ]
    rows = run(cells, out_dir, workers=workers)
    out: dict[str, Any] = {}
    for n in networks:
        val = {r["lr"]: r.get("val_accuracy", -1.0) for r in rows if r["net"] == n}
        out[n] = {"validation_accuracy": val, "chosen": max(val, key=lambda k: (val[k], -k))}
        print(f"lr {n}: " + ", ".join(f"{k:g} -> {v:.3f}" for k, v in val.items()) + f"; chosen {out[n]['chosen']:g}")
    write_json(os.path.join(out_dir, "chosen.json"), out)
    return out


def validation_table(rows: Sequence[dict[str, Any]]) -> str:
    """What a tuning step may read: each run's *validation* accuracy against its baseline's on the
    same cell (data set, size, network, seed), in points; the test split is not shown."""
    base = {(r["dataset"], r["per_class"], r["net"], r["seed"]): r for r in rows if r["run"] == "baseline"}
    labels = sorted({run_label(r) for r in rows if r["run"] != "baseline"})  # a recipe, then its variants
    cells = sorted(base, key=lambda k: (k[0], k[1], list(NETWORKS).index(k[2]), k[3]))
    out = {(run_label(r), r["dataset"], r["per_class"], r["net"], r["seed"]): r for r in rows if r["run"] != "baseline"}
    header = ["data", "per class", "network", "seed", "baseline", *labels]
    body = []
    for k in cells:
        b = base[k].get("val_accuracy")
        if b is None:
            continue
        line = [k[0], str(k[1]), k[2], str(k[3]), f"{b:.2f}"]
        for lab in labels:
            r = out.get((lab, *k))
            v = None if r is None else r.get("val_accuracy")
            line.append("-" if v is None else f"{v:.2f} ({100 * (v - b):+.0f})")
        body.append(line)
    return md_table(header, body)


def accuracy_figure(entries: Sequence[dict[str, Any]], path: str) -> str:
    """A heat map a reader takes in at a glance: test accuracy minus the baseline's (points, mean
    over seeds) per row of the matrix (network, size, recipe) and data set; ``jem train``'s choice
    outlined, cells within the 1-point target marked. Returns ``path``."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    done = [e for e in entries if "accuracy" in e]
    if not done:
        raise ValueError("no finished cell to draw")
    sets = [d for d in DATASETS if any(e["dataset"] == d for e in done)]

    def size_label(e: dict[str, Any]) -> str:
        return "40" if e["per_class"] <= 50 else ("136-150" if e["per_class"] <= 200 else str(e["per_class"]))

    rows = list(
        dict.fromkeys(
            (e["net"], size_label(e), e["run"])
            for e in sorted(
                done,
                key=lambda e: (
                    list(NETWORKS).index(e["net"]) if e["net"] in NETWORKS else 99,
                    e["per_class"],
                    e["run"],
                ),
            )
        )
    )
    values = np.full((len(rows), len(sets)), np.nan)
    chosen = np.zeros_like(values, dtype=bool)
    few = np.zeros_like(values, dtype=bool)
    for e in done:
        i, j = rows.index((e["net"], size_label(e), e["run"])), sets.index(e["dataset"])
        values[i, j] = 100 * (e["accuracy"] - e["baseline_accuracy"])
        chosen[i, j] = bool(e["default"])
        few[i, j] = len(e["seeds"]) < 3
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#d9d9d9")
    norm = matplotlib.colors.TwoSlopeNorm(vmin=-40.0, vcenter=0.0, vmax=10.0)
    fig = Figure(figsize=(4.2 + 1.3 * len(sets), 1.5 + 0.32 * len(rows)))
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(sets)):
            v = values[i, j]
            text = "-" if np.isnan(v) else f"{v:+.1f}" + (" ok" if v >= -1.0 else "") + ("*" if few[i, j] else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=8, weight="bold" if chosen[i, j] else "normal")
            if chosen[i, j]:
                ax.add_patch(Rectangle((j - 0.45, i - 0.4), 0.9, 0.8, fill=False, edgecolor="black", lw=1.2))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(
        [f"{n} ({NORMS.get(n, '?')}, lr {NETWORK_LR.get(n, 3e-4):g}) · {sz}/class · {r}" for n, sz, r in rows],
        fontsize=8,
    )
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels([f"{d}\n{'(tuned on)' if d == 'digits32' else '(judged on)'}" for d in sets], fontsize=9)
    ax.tick_params(length=0)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="test accuracy - baseline's (points)")
    ax.set_title(
        "Test accuracy minus the cross-entropy baseline's, in points (mean of 3 seeds; *: fewer)\n"
        "'ok': within the 1-point target; boxed: what jem train picks with no --recipe",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


# ---------------------------------------------------------------------------- time
def probe_speed(networks: Sequence[str], runs: Sequence[str], iters: int = 4) -> dict[str, float]:
    """CPU seconds per training iteration of each network and run, from ``iters`` iterations
    (batch 64, 32x32 textures): what the projection of an unmeasured cell uses."""
    torch.set_num_threads(1)
    ds = dataset("textures")
    out = {}
    for net in networks:
        S = setting(ds, net, 40, 0)
        S["x"], S["y"] = S["x"][: BATCH * iters], S["y"][: BATCH * iters]
        for r in runs:
            res = G.train_run(S, r, 1, seed=0, batch_size=BATCH, fit_init="train")
            out[f"{net}/{r}"] = res["cost"]["train_cpu_s"] / res["cost"]["iterations"]
            print(f"speed {net}/{r}: {out[f'{net}/{r}']:.3f} s per iteration", flush=True)
    return out


def _cpu(r: dict[str, Any]) -> float:
    """A cell's CPU seconds (training and evaluation); for cells from before they were recorded,
    its wall time scaled by its training's CPU/wall ratio."""
    if "cpu_s" in r:
        return r["cpu_s"]
    return r["wall_s"] * r["train_cpu_s"] / max(r["train_wall_s"], 1e-9)


def timing(rows: Sequence[dict[str, Any]], speed: dict[str, float] | None = None, workers: int = 2) -> dict[str, Any]:
    """Measured time per cell (wall, and CPU: on a shared machine the wall time also counts other
    jobs' turns) and the full matrix's time projected for ``workers`` unshared cores: per cell, its
    iterations times the CPU seconds per iteration of its network and recipe in the measured cells
    (else the speed probe's, scaled by the median ratio of cells to probe where both measured), plus
    its evaluation (measured, else scaled by the network's speed)."""
    ok = [r for r in rows if "error" not in r]
    it: dict[str, float] = {}
    ev: dict[str, float] = {}
    for key in {f"{r['net']}/{r['run']}" for r in ok}:
        mine = [r for r in ok if f"{r['net']}/{r['run']}" == key]
        it[key] = statistics.median([r["train_cpu_s"] / max(r["iterations"], 1) for r in mine])
        ev[key] = statistics.median([_cpu(r) - r["train_cpu_s"] for r in mine])
    speed = dict(speed or {})
    scale = [it[k] / speed[k] for k in it if k in speed]
    f = statistics.median(scale) if scale else 1.0
    d = default_recipe()

    def s_iter(net: str, run: str) -> float | None:
        k = f"{net}/{run}"
        return it.get(k) or (speed[k] * f if k in speed else None)

    ev_rel = [ev[k] / v for k in ev if (v := s_iter(k.split("/")[0], d) or 0) > 0]
    total, missing = 0.0, set()
    full = plan("full")
    for c in full:
        s = s_iter(c["net"], c["run"])
        ref = s_iter(c["net"], d)
        if s is None or (f"{c['net']}/{c['run']}" not in ev and (ref is None or not ev_rel)):
            missing.add(f"{c['net']}/{c['run']}")
            continue
        e = ev.get(f"{c['net']}/{c['run']}")
        if e is None:
            e = statistics.median(ev_rel) * (ref or 0.0)
        total += c["epochs"] * math.ceil(10 * c["per_class"] / BATCH) * s + e
    return {
        "cells": len(ok),
        "cell_wall_s_total": sum(r["wall_s"] for r in ok),
        "cell_cpu_s_total": sum(_cpu(r) for r in ok),
        "cell_wall_s_median": statistics.median([r["wall_s"] for r in ok]) if ok else None,
        "cell_cpu_s_median": statistics.median([_cpu(r) for r in ok]) if ok else None,
        "cpu_s_per_iteration_cells": {k: round(v, 4) for k, v in sorted(it.items())},
        "s_per_iteration_probe": {k: round(v, 4) for k, v in sorted(speed.items())},
        "probe_to_cells": f,
        "full_matrix_cells": len(full),
        "full_matrix_projected_s": total / workers,
        "unmeasured": sorted(missing),
    }


# ---------------------------------------------------------------------------- README
START, END = "<!-- generalisation:start -->", "<!-- generalisation:end -->"
HEADING = "## Generalisation matrix (bench_generalisation)"


def write_readme(md: str, path: str = README, start: str = START, end: str = END, heading: str = HEADING) -> None:
    """Put ``md`` between the section's markers (``start``, ``end``) in ``path`` (the section,
    ``heading`` and markers are appended when missing); nothing else in the file changes."""
    with open(path) as f:
        text = f.read()
    block = f"{start}\n{md.rstrip()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, count=1, flags=re.S)
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def report(out_dir: str, cells: Sequence[dict[str, Any]] | None, mode: str, readme: str | None) -> str:
    rows = load_cells(out_dir, cells)
    refs_path = os.path.join(out_dir, "datasets.json")
    refs = _read_json(refs_path, {})
    entries = summarise(rows)
    speed_path = os.path.join(out_dir, "speed.json")
    tm = timing(rows, _read_json(speed_path, None))
    title = (
        f"`{mode}` plan, {len(rows)}{f' of its {len(cells)}' if cells is not None else ''} cells "
        f"({os.path.relpath(out_dir, os.path.dirname(README))}/cells); "
        f"mean over seeds; targets per row: test accuracy within 1 point of the baseline's, log p(x) AUROC "
        f">= the baseline energy score's on all four OOD sets, buffer FD <= half its init's. Cells took "
        f"{tm['cell_cpu_s_total'] / 60:.0f} CPU minutes (median cell {_f(tm['cell_cpu_s_median'], '{:.0f}')} CPU s; "
        f"{tm['cell_wall_s_total'] / 60:.0f} min of wall time in the workers); the full matrix "
        f"({tm['full_matrix_cells']} cells) is projected at {tm['full_matrix_projected_s'] / 3600:.1f} h on 2 "
        "unshared cores" + (f" (unmeasured: {', '.join(tm['unmeasured'])})" if tm["unmeasured"] else "") + "."
    )
    md = to_markdown(entries, refs, title)
    if any("accuracy" in e for e in entries):
        accuracy_figure(entries, os.path.join(out_dir, "accuracy.png"))
    write_json(os.path.join(out_dir, "summary.json"), {"entries": entries, "timing": tm, "references": refs})
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    if readme:
        write_readme(md, readme)
    return md


def parse_settings(pairs: Sequence[str], parser: argparse.ArgumentParser) -> dict[str, float]:
    """``["px_weight=0.1"]`` -> ``{"px_weight": 0.1}``; a name no recipe has, or a value that is not
    a number, ends the command with one line."""
    known = R.flat_names()
    out: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in known:
            parser.error(f"--set {pair}: no recipe setting {name!r}")
        try:
            out[name] = float(value)
        except ValueError:
            parser.error(f"--set {pair}: {value!r} is not a number")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick subset (PLANS['quick']): under 30 minutes")
    p.add_argument("--datasets", nargs="*", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--networks", nargs="*", default=None, choices=list(NETWORKS))
    p.add_argument("--seeds", nargs="*", type=int, default=None)
    p.add_argument("--sizes", nargs="*", default=None, choices=list(SIZES))
    p.add_argument("--others", nargs="*", default=None, help="recipes besides the default on the 150 row")
    p.add_argument("--with-paper", action="store_true", help="add the paper recipe to the others")
    p.add_argument(
        "--others-everywhere",
        action="store_true",
        help="the other recipes on every row, with the plan's seeds and networks (to compare recipes)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="recipe settings (flat names, numbers) changed in every recipe cell, e.g. px_weight=0.1",
    )
    p.add_argument("--epochs", nargs=3, type=int, default=None, metavar=("E40", "E150", "EFULL"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=None, help="default benchmarks/results/generalisation/{quick,full}")
    p.add_argument("--grids", action="store_true", help="a sample grid per cell under OUT/grids/")
    p.add_argument("--retry-failed", action="store_true")
    p.add_argument("--summary-only", action="store_true", help="no training: the table from the cells there")
    p.add_argument(
        "--probe-speed",
        action="store_true",
        help="time a few iterations of every network and recipe (OUT/speed.json) for the full matrix's projection",
    )
    p.add_argument(
        "--validation",
        action="store_true",
        help="with --summary-only: every run's validation accuracy against its baseline's (what tuning reads)",
    )
    p.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
    p.add_argument(
        "--tune-lr",
        action="store_true",
        help="choose the learning rate of --networks on the tune set (validation accuracy, 40 digits per class) and stop",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.tune_lr:
        tune_lr(a.networks or list(NETWORKS), a.out or os.path.join(RESULTS, "lr_tuning"), workers=a.workers)
        return
    mode = "quick" if a.quick else "full"
    out_dir = a.out or os.path.join(RESULTS, mode)
    others = a.others if a.others is not None else other_recipes(a.with_paper)
    cells = plan(
        mode,
        a.datasets,
        a.networks,
        a.seeds,
        a.sizes,
        others,
        a.epochs,
        others_everywhere=a.others_everywhere,
        settings=parse_settings(a.set, p),
    )
    if a.summary_only and a.validation:
        print(validation_table(load_cells(out_dir)))
        return
    if not a.summary_only:
        run(cells, out_dir, workers=a.workers, grids=a.grids, retry_failed=a.retry_failed)
    if a.probe_speed:
        runs = ["baseline", default_recipe(), *other_recipes(a.with_paper)]
        write_json(os.path.join(out_dir, "speed.json"), probe_speed(list(NETWORKS), runs))
    print(report(out_dir, cells, mode, README if a.readme else None))


if __name__ == "__main__":
    main()
