"""What JEM buys a user: the benefit ledger (issue 58).

Every benefit the JEM paper claims, measured per arm against the cross-entropy baseline of the same
data, network and seed, at the same iteration, with several seeds and a 95% interval on every
difference. It is a sibling of :mod:`benchmarks.bench_long_row` and trains its cells with
:func:`bench_long_row.run_cell` (one copy of the data, splits, judge, checkpoints and the long row's
own evaluation of each point: accuracy, ECE, the buffer's Fréchet distances, the judge); this module
adds the arms, the metrics the long row never recorded, per input so that they can be resampled,
the intervals, and the report.

**Arms** (:data:`ARMS`): ``baseline`` (cross-entropy); ``default`` (``jem train``'s choice for the
row, as on the long row); ``cheap`` (the default with the ``steps5_shared`` cut: 5 SGLD steps, the
p(x) term's data energies from the classification forward); ``finetune`` (the baseline's own
checkpoint at its first point, continued with the default's JEM loss for :data:`FINETUNE_SHARE` of
the run: what a user with a trained classifier would do); the presets ``jempp``, ``sadajem`` and
``generative``.

**Metrics per point** (:func:`evaluate_point`; each point's model is kept under
``OUT/models/<cell>/it<N>.pt``, git-ignored, so a new metric never needs a rerun: ``--evaluate``):

- accuracy on the test split;
- calibration: ECE and NLL raw and after a temperature fitted on the validation split;
- OOD, per set: AUROC of ``logpx`` (the negative free energy, which for T=1 *is* the energy
  score: on the baseline this row is the baseline's energy), ``msp`` and ``grad_norm`` (JEM's
  approximate mass), on every arm; on the baseline also every fitted detector of the 36, the best
  per set as a reference row (chosen on the test sets: an upper bound of what a post-hoc score
  gives, no interval);
- robustness: PGD L-inf at 2/255 and 8/255 (10 steps, cross-entropy, random start) on
  :data:`ROBUST_N` fixed test images, each model attacked directly; at a cell's last point each JEM
  arm also behind the SGLD defence (10 steps, :data:`DEFENCE_CHAINS` chains averaged), counted as
  the per-example worst of a transfer attack and BPDA+EOT (``robust_accuracy(attack="worst")``);
- samples (the long row's, from the cell's JSON): the buffer's FD over its init's, FD against the
  references, the judge on class-conditional samples above its accuracy on their init draws;
- cost: the cell's training CPU seconds per iteration, and ``--cost``: CPU seconds per iteration of
  every arm against cross-entropy measured side by side in one process (interleaved rounds).
  **Equal compute** is read off the curves: JEM at N iterations against the baseline at
  (cost ratio x N).

**Statistics** (:func:`paired_bootstrap`): for each benefit, the mean over seeds of the arm's value
minus the baseline's at the same seed and iteration, and a 95% percentile interval from a paired
bootstrap that resamples seeds and test inputs (the same draws for both arms; the OOD inputs of each
set drawn too), 2,000 draws, the index draws by scikit-learn's ``resample``. AUROCs of the resampled
scores are Mann-Whitney U statistics (scipy, vectorised over draws). A difference is called only when
its interval excludes 0. Sample metrics exist once per point, so their intervals resample seeds only.

**Decision rule**, written down on 2026-11-29 before any ledger cell ran (its own commit):

1. *What JEM buys*: per arm and benefit, the difference to the baseline with its interval, judged on
   textures (digits32 tunes only) at each cell's last point. A benefit is claimed only where the
   interval excludes 0; ``jem train``'s line says no more than that.
2. *The cheap cut* replaces the default only if, against the default (the same paired bootstrap,
   the default in the baseline's place) on textures at the last point with at least 3 seeds: the
   accuracy difference's lower bound is >= -1 point, and no other benefit is worse, i.e. no
   interval lies wholly on the worse side, for: ECE after scaling, NLL after scaling, the mean
   AUROC over the OOD sets of ``logpx`` and of ``msp`` (simpler inputs, ``other``, reported apart),
   PGD accuracy at 2/255 and 8/255 (direct), and the buffer's FD ratio. If it passes, the default's
   CPU iteration must then be at most 3x cross-entropy (``--cost``).
3. *Fine-tuning pays* if the same test, against the default at the default's last point, passes
   at the fine-tune's smaller cost (the baseline's iterations to its first point plus
   :data:`FINETUNE_SHARE` of the run at the JEM cost). Then ``jem train --weights FILE --model NAME``
   continues a user's trained classifier with the JEM loss.
4. The presets run one seed: reported with their differences, never switching the default (one seed
   gives no interval over seeds).

**Budget.** On the CPU (labelled *reduced*, issue 58): resnet10t on textures, 3 seeds of the
baseline, default, cheap and fine-tune arms to :data:`CPU_ITERATIONS` (points at ~750 and ~1,500),
the presets at one seed. On a GPU: :func:`gpu_plan`, the whole ledger in one call
(``benchmarks/run_gpu_ledger.sh``).

    OMP_NUM_THREADS=1 nohup nice -n 19 python -m benchmarks.bench_ledger --workers 2 > ledger.log 2>&1 &
    python -m benchmarks.bench_ledger --plan        # the cells, in order
    python -m benchmarks.bench_ledger --evaluate    # (re)evaluate kept point models lacking a metric
    python -m benchmarks.bench_ledger --cost        # CPU s per iteration, every arm beside cross-entropy
    python -m benchmarks.bench_ledger --report      # intervals, tables, figure, docs page
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_generalisation as GB
from benchmarks import bench_generative as G
from benchmarks import bench_long_row as LR
from benchmarks.common import write_json
from jem_plugin.app.ledger_evidence import LEDGER_EVIDENCE
from jem_plugin.checkpoint import get_rng_state, load_checkpoint, set_rng_state
from jem_plugin.errors import UntrainedDensityWarning
from jem_plugin.robustness import PGD, SGLDDefense, robust_accuracy

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "ledger")
#: the arms, in the order the tables show them
ARMS = ("baseline", "default", "cheap", "finetune", "jempp", "sadajem", "generative")
PRESETS = ("jempp", "sadajem", "generative")
CPU_ITERATIONS = 1500
CPU_EVALS = 2
GPU_ITERATIONS = 3000
GPU_EVALS = 4
#: the fine-tune arm's length, as a share of the baseline's run, from the baseline's first point
FINETUNE_SHARE = 0.2
SEEDS = (0, 1, 2)
ROBUST_N = 200
ROBUST_EPS_255 = (2, 8)
PGD_STEPS = 10
DEFENCE_STEPS = 10
DEFENCE_CHAINS = 4
SCORES = ("logpx", "msp", "grad_norm")
#: the benefits jem train's one line weighs (the docs page has every row)
HEADLINE = (
    "accuracy", "ece_raw", "ece_scaled", "nll_scaled", "auroc_logpx_mean", "auroc_msp_mean", "auroc_logpx_other",
    "robust_direct_2", "robust_direct_8",
)  # fmt: skip
#: the data set the ledger judges on (digits32 tunes)
JUDGED = "textures"
#: the simpler inputs of each data set (reported apart: a likelihood ranks them high, Nalisnick et al.)
SIMPLER = {"textures": ("other",), "digits32": ()}


# ---------------------------------------------------------------------------- the plan
def arm_cell(
    dataset: str, net: str, arm: str, seed: int, iterations: int, evals: int, tiny: bool = False, out_dir: str = RESULTS
) -> dict[str, Any]:
    """One cell of ``arm`` (a long-row cell with the ledger's length and points; the fine-tune arm
    starts from the baseline's first kept point under ``out_dir``)."""
    epochs = LR.epochs_for(dataset, iterations, tiny)
    if arm in ("baseline", "default", "cheap", "generative"):
        c = LR.cell(dataset, net, arm, seed, epochs, tiny)
    elif arm in ("jempp", "sadajem"):
        c = {**LR.cell(dataset, net, "generative", seed, epochs, tiny), "run": arm}
    elif arm == "finetune":
        base = LR.cell(dataset, net, "baseline", seed, epochs, tiny)
        start = LR.eval_epochs(epochs, evals)[0] * LR.batches_per_epoch(dataset, tiny)
        ft_epochs = max(1, round(FINETUNE_SHARE * epochs))
        c = LR.cell(dataset, net, "default", seed, ft_epochs, tiny)
        c["init_from"] = os.path.join(out_dir, "models", GB.cell_name(base), f"it{start}.pt")
        c["start_iteration"] = start
        c["evals"] = 1
    else:
        raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
    c["role"] = arm
    c.setdefault("evals", evals)
    return c


def plan(
    datasets: Sequence[str] = ("textures",),
    networks: Sequence[str] = ("resnet10t",),
    seeds: Sequence[int] = SEEDS,
    iterations: int = CPU_ITERATIONS,
    evals: int = CPU_EVALS,
    presets: bool = True,
    tiny: bool = False,
    out_dir: str = RESULTS,
) -> list[dict[str, Any]]:
    """The cells, most informative first, each arm with all its seeds before the next: the
    baselines; the fine-tunes (they start from the baselines' first points and cost a fifth of a
    default run); the default (what JEM buys, with its intervals); the cheap cut (judged against the
    default); then the presets at the first seed."""
    cells = []
    for d in datasets:
        for n in networks:
            mk = lambda arm, s: arm_cell(d, n, arm, s, iterations, evals, tiny, out_dir)
            for arm in ("baseline", "finetune", "default", "cheap"):
                cells += [mk(arm, s) for s in seeds]
            if presets:
                cells += [mk(p, seeds[0]) for p in PRESETS]
    return cells


def gpu_plan(tiny: bool = False, out_dir: str = RESULTS, iterations: int = GPU_ITERATIONS) -> list[dict[str, Any]]:
    """The GPU's ledger: resnet10t and wrn10-1 on textures (judged) and digits32 (tuned), then
    convnext_atto and resnet18 on textures, every arm and 3 seeds, to :data:`GPU_ITERATIONS`."""
    mk = lambda d, n: plan(d, n, SEEDS, iterations, GPU_EVALS, True, tiny, out_dir)
    return mk(("textures", "digits32"), ("resnet10t", "wrn10-1")) + mk(("textures",), ("convnext_atto", "resnet18"))


def merge_from(archive: str, out_dir: str = RESULTS) -> list[str]:
    """Bring a ``run_gpu_ledger.sh`` archive's cells and evaluated points into ``out_dir``
    (:func:`bench_long_row.merge_from` for the cells: a cell done here is never overwritten); a
    point's files come with its cell, where the archive's cell is the one kept here."""
    import tarfile
    import tempfile

    lines = LR.merge_from(archive, out_dir)
    taken = {ln.rsplit(": ", 1)[1][: -len(".json")] for ln in lines if ln.startswith(("added", "replaced"))}
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        os.makedirs(os.path.join(out_dir, "points"), exist_ok=True)
        for path in glob.glob(os.path.join(tmp, "**", "points", "*"), recursive=True):
            meta = path[: -len(".npz")] + ".json" if path.endswith(".npz") else path
            if GB._read_json(meta, {}).get("cell") in taken:
                shutil.copy(path, os.path.join(out_dir, "points", os.path.basename(path)))
    return lines


# ---------------------------------------------------------------------------- one point
def _paths(out_dir: str, name: str, iteration: int) -> tuple[str, str, str]:
    """The point's kept checkpoint, its per-input arrays and its metrics."""
    stem = os.path.join(out_dir, "points", f"{name}_it{iteration}")
    return os.path.join(out_dir, "models", name, f"it{iteration}.pt"), stem + ".npz", stem + ".json"


def keep_point(c: dict[str, Any], S: dict[str, Any], ctx: dict[str, Any], ckpt_path: str, iteration: int) -> None:
    """:func:`bench_long_row.run_cell`'s point hook: keep the point's checkpoint, then evaluate it."""
    out_dir = os.path.dirname(os.path.dirname(ckpt_path))
    name = GB.cell_name(c)
    kept, _, _ = _paths(out_dir, name, iteration)
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    shutil.copyfile(ckpt_path, kept)
    last = iteration == c["epochs"] * math.ceil(len(S["x"]) / LR.BATCH)
    rng, g_state = get_rng_state(), ctx["g"].get_state()
    try:  # the run goes on bit for bit as without the ledger's evaluation
        evaluate_point(c, S, ctx["model"], ctx["recipe"], iteration, out_dir, last)
    except Exception as exc:  # the model is kept: --evaluate retries; the training run goes on
        print(f"ledger {name} at {iteration}: not evaluated ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
    finally:
        set_rng_state(rng)
        ctx["g"].set_state(g_state)


def _robust(jm, x, y, defended: bool) -> dict[str, Any]:
    eps = [e / 255 for e in ROBUST_EPS_255]
    gen = torch.Generator().manual_seed(0)
    out = {"direct": robust_accuracy(jm, x, y, eps, PGD(steps=PGD_STEPS), generator=gen, progress=False)}
    if defended:
        defence = SGLDDefense(
            jm, steps=DEFENCE_STEPS, n_chains=DEFENCE_CHAINS, generator=torch.Generator().manual_seed(0)
        )
        out["defended"] = robust_accuracy(
            jm,
            x,
            y,
            [0.0, *eps],
            PGD(steps=PGD_STEPS),
            defence,
            attack="worst",
            generator=gen,
            progress=False,
        )
    return out


def evaluate_point(
    c: dict[str, Any],
    S: dict[str, Any],
    model: torch.nn.Module,
    recipe: Any,
    iteration: int,
    out_dir: str,
    last: bool,
    posthoc: bool = True,
) -> dict[str, Any]:
    """The ledger's metrics of one point, on a copy of ``model`` (BatchNorm statistics chosen as the
    long row chooses them); writes ``points/<cell>_it<N>.npz`` (per-input arrays) and ``.json``."""
    with warnings.catch_warnings():  # log p(x) of the cross-entropy baseline is the point, not a mistake
        warnings.simplefilter("ignore", UntrainedDensityWarning)
        return _evaluate_point(c, S, model, recipe, iteration, out_dir, last, posthoc)


def _evaluate_point(c, S, model, recipe, iteration, out_dir, last, posthoc) -> dict[str, Any]:  # evaluate_point's body
    t0 = time.process_time()
    model = copy.deepcopy(model).to("cpu").eval()  # evaluated on the CPU, as the long row evaluates
    res = {"model": model, "jm": jem.wrap(model, **S["wrap_kw"]), "loss_fn": None, "recipe": recipe}
    GB.keep_better_bn_statistics(S, res)
    jm = res["jm"].eval()
    arrays: dict[str, np.ndarray] = {}
    with torch.no_grad():
        logits, logits_val = jm(S["xt"]), jm(S["xv"])
    temperature = jem.calibration.fit_temperature(logits_val, S["yv"])
    yt = S["yt"]
    arrays["correct"] = (logits.argmax(1) == yt).numpy()
    for tag, z in (("raw", logits), ("scaled", logits / temperature)):
        logp = torch.log_softmax(z, 1)
        arrays[f"conf_{tag}"] = logp.exp().max(1).values.numpy()
        arrays[f"nll_{tag}"] = (-logp.gather(1, yt[:, None])[:, 0]).numpy()
    for s in SCORES:
        arrays[f"{s}__in"] = jem.ood.score(jm, S["xt"], s, progress=False).numpy()
        for o, xo in S["ood"].items():
            arrays[f"{s}__{o}"] = jem.ood.score(jm, xo, s, progress=False).numpy()
    pick = torch.randperm(len(yt), generator=torch.Generator().manual_seed(0))[:ROBUST_N]
    robust = _robust(jm, S["xt"][pick], yt[pick], defended=last and recipe is not None)
    for kind, r in robust.items():
        for e, ok in zip(r["eps"], r.pop("correct")):
            arrays[f"robust_{kind}_{round(e * 255)}"] = np.asarray(ok)
    meta: dict[str, Any] = {
        "cell": GB.cell_name(c),
        "arm": c["role"],
        "seed": c["seed"],
        "iteration": iteration + c.get("start_iteration", 0),
        "temperature": float(temperature),
        "robust": robust,
        "robust_images": pick.tolist(),
    }
    if posthoc and recipe is None:  # the reference row: every fitted detector of the 36 on the baseline
        table = jem.ood.evaluate_all(jm, S["xt"], S["ood"], fit_data=(S["x"], S["y"]), progress=False)
        meta["posthoc_auroc"] = {m: {o: round(v["auroc"], 4) for o, v in sets.items()} for m, sets in table.items()}
    meta["eval_cpu_s"] = time.process_time() - t0
    _, npz, js = _paths(out_dir, GB.cell_name(c), iteration)
    os.makedirs(os.path.dirname(npz), exist_ok=True)
    np.savez_compressed(npz, **arrays)
    write_json(js, meta)
    print(
        f"[{time.strftime('%H:%M:%S')}] ledger {meta['cell']} at {iteration}: {meta['eval_cpu_s']:.0f} CPU s",
        flush=True,
    )
    return meta


def evaluate_kept(out_dir: str = RESULTS, cells: Sequence[dict[str, Any]] | None = None, force: bool = False) -> int:
    """Evaluate every kept point model whose metrics are missing (``force``: all); returns how many."""
    done = 0
    for c in cells if cells is not None else plan(out_dir=out_dir):
        name = GB.cell_name(c)
        tiny = bool(c.get("tiny"))
        for kept in sorted(glob.glob(os.path.join(out_dir, "models", name, "it*.pt"))):
            iteration = int(os.path.basename(kept)[2:-3])
            if os.path.exists(_paths(out_dir, name, iteration)[2]) and not force:
                continue
            S = GB.setting(GB.dataset(c["dataset"], tiny), c["net"], c["per_class"], c["seed"])
            ctx = G.start_run(S, c["run"], c["epochs"] * math.ceil(len(S["x"]) / LR.BATCH), seed=c["seed"],
                              overrides={**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})} or None,
                              fit_init="train")  # fmt: skip
            load_checkpoint(kept, rng=False, model=ctx["model"])
            last = iteration == c["epochs"] * math.ceil(len(S["x"]) / LR.BATCH)
            evaluate_point(c, S, ctx["model"], ctx["recipe"], iteration, out_dir, last)
            done += 1
    return done


# ---------------------------------------------------------------------------- statistics
N_BOOT = 2000
ECE_BINS = 15  # as jem_plugin.calibration.ece
#: benefits, each (key, label, higher is better); the OOD and robustness rows are added per set/budget
BENEFITS_BASE = (
    ("accuracy", "accuracy", True),
    ("ece_raw", "ECE, raw", False),
    ("ece_scaled", "ECE, temperature-scaled", False),
    ("nll_raw", "NLL, raw", False),
    ("nll_scaled", "NLL, temperature-scaled", False),
)
#: the sample metrics (once per point: their intervals resample seeds only), from the long row's evaluation
SAMPLE_METRICS = (
    ("fd_ratio", "buffer FD / its init's", False),
    ("judge_gain", "judge accuracy above the init draws'", True),
)


def _ece(conf: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """ECE of each row of ``[B, n]`` confidences and correctness, :data:`ECE_BINS` equal bins
    (``(lo, hi]``, as :func:`jem_plugin.calibration.ece`): sum over bins of |sum(correct - conf)| / n."""
    bins = np.clip(np.ceil(conf * ECE_BINS).astype(np.int64) - 1, 0, ECE_BINS - 1)
    rows = np.arange(conf.shape[0])[:, None] * ECE_BINS + bins
    gaps = np.bincount(rows.ravel(), (correct - conf).ravel(), minlength=conf.shape[0] * ECE_BINS)
    return np.abs(gaps.reshape(conf.shape[0], ECE_BINS)).sum(1) / conf.shape[1]


def _auroc(inside: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """AUROC (in-distribution positive, ties half) of each row pair: the Mann-Whitney U statistic
    over the pairs (scipy, vectorised over the rows)."""
    from scipy.stats import mannwhitneyu

    u = mannwhitneyu(inside, outside, axis=-1, method="asymptotic").statistic
    return np.asarray(u) / (inside.shape[-1] * outside.shape[-1])


def draws(sizes: dict[str, int], n_boot: int = N_BOOT, seed: int = 0) -> dict[str, np.ndarray]:
    """``n_boot`` bootstrap draws of indices for each named sample (scikit-learn's ``resample``);
    row 0 is the identity, so that statistics at row 0 are the point estimates."""
    from sklearn.utils import resample

    rs = np.random.RandomState(seed)
    out = {}
    for name, n in sizes.items():
        idx = np.arange(n)
        out[name] = np.stack([idx] + [resample(idx, random_state=rs) for _ in range(n_boot)])
    return out


def point_statistics(arrays: dict[str, np.ndarray], d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every per-input benefit of one point under the draws ``d`` (row 0: no resampling)."""
    t = d["test"]
    out = {"accuracy": arrays["correct"][t].mean(1)}
    for tag in ("raw", "scaled"):
        out[f"ece_{tag}"] = _ece(arrays[f"conf_{tag}"][t], arrays["correct"][t].astype(float))
        out[f"nll_{tag}"] = arrays[f"nll_{tag}"][t].mean(1)
    for key in arrays:
        score, _, where = key.partition("__")
        if where and where != "in":
            out[f"auroc_{score}_{where}"] = _auroc(arrays[f"{score}__in"][t], arrays[key][d[f"ood_{where}"]])
        elif key.startswith("robust_"):
            out[key] = arrays[key].astype(float)[d["robust"]]
            out[key] = out[key].mean(1)
    return out


def _mean_over(out: dict[str, np.ndarray], score: str, sets: Sequence[str]) -> np.ndarray | None:
    rows = [out[f"auroc_{score}_{o}"] for o in sets if f"auroc_{score}_{o}" in out]
    return np.mean(rows, 0) if rows else None


def paired_bootstrap(
    arm: dict[int, dict[str, np.ndarray]],
    base: dict[int, dict[str, np.ndarray]],
    n_boot: int = N_BOOT,
    seed: int = 0,
    resample_seeds: bool = True,
) -> dict[str, dict[str, float]]:
    """Mean over seeds of ``arm - base`` for every statistic both have, and its 95% percentile
    interval: seeds resampled (scikit-learn's ``resample``), paired, on top of the inputs the
    statistics were already resampled over (``arm[seed][key]``: ``[1 + n_boot]``, row 0 the
    estimate). Only the seeds both have count. ``resample_seeds=False`` keeps the seeds fixed: the
    interval the test inputs alone give (how much more seeds could narrow it). Returns ``{key:
    {"diff", "lo", "hi", "arm", "base", "seeds"}}``."""
    from sklearn.utils import resample

    seeds = sorted(set(arm) & set(base))
    if not seeds:
        return {}
    rs = np.random.RandomState(seed)
    every = np.arange(len(seeds))
    picks = np.stack([every] + [resample(every, random_state=rs) if resample_seeds else every for _ in range(n_boot)])
    out = {}
    for key in sorted(set.intersection(*(set(arm[s]) & set(base[s]) for s in seeds))):
        a = np.stack([arm[s][key] for s in seeds])  # [seeds, 1 + n_boot]
        b = np.stack([base[s][key] for s in seeds])
        cols = np.arange(a.shape[1])[:, None] if a.shape[1] > 1 else np.zeros((n_boot + 1, 1), dtype=int)
        diff = (a - b)[picks, cols].mean(1)  # each draw: its seeds, at its own input draw
        lo, hi = np.percentile(diff[1:], [2.5, 97.5])
        out[key] = {
            "diff": float(diff[0]),
            "lo": float(lo),
            "hi": float(hi),
            "arm": float(a[:, 0].mean()),
            "base": float(b[:, 0].mean()),
            "seeds": len(seeds),
        }
    return out


# ---------------------------------------------------------------------------- reading the points
def load_points(out_dir: str = RESULTS) -> list[dict[str, Any]]:
    """Every evaluated point: its metrics JSON, its arrays, and the long row's evaluation of it
    (``row_point``, from the cell's JSON) with the cell's keys."""
    points = []
    for js in sorted(glob.glob(os.path.join(out_dir, "points", "*.json"))):
        meta = json.load(open(js))
        row = GB._read_json(os.path.join(out_dir, "cells", meta["cell"] + ".json"), {})
        own = meta["iteration"] - row.get("start_iteration", 0)
        rp = next((p for p in row.get("points", []) if p["iteration"] == own), None)
        with np.load(js[:-5] + ".npz") as z:
            arrays = {k: z[k] for k in z.files}
        points.append({**meta, "arrays": arrays, "row_point": rp, "dataset": row.get("dataset"), "net": row.get("net"),
                       "done": bool(row.get("done")), "iterations": row.get("iterations"), "row": row})  # fmt: skip
    return points


def _sample_metrics(rp: dict[str, Any] | None) -> dict[str, float]:
    """The long row's sample metrics of a point, where it has them (the baseline has none): the
    buffer's FD over its init's, its FD, and the judge's accuracy above its accuracy on the init draws."""
    out: dict[str, float] = {}
    fd, init = ((rp or {}).get("buffer") or {}).get("fd"), (rp or {}).get("init_fd")
    if fd is not None and init:
        out["fd_ratio"] = float(fd) / float(init)
        out["buffer_fd"] = float(fd)
    cond = (rp or {}).get("cond") or {}
    if cond.get("judge_acc") is not None and cond.get("judge_acc_init") is not None:
        out["judge_gain"] = float(cond["judge_acc"]) - float(cond["judge_acc_init"])
    return out


# ---------------------------------------------------------------------------- the report
DOCS_PAGE = os.path.join(os.path.dirname(HERE), "docs", "what-jem-buys.md")
DOCS_IMG = os.path.join(os.path.dirname(HERE), "docs", "img")
COST_JSON = "cost-{net}.json"  # one per network: its arms beside its own cross-entropy


def benefit_rows(sets: Sequence[str], simpler: Sequence[str]) -> list[tuple[str, str, bool]]:
    """The ledger's rows, in order: (statistic, label, higher is better)."""
    rows = list(BENEFITS_BASE)
    for score in SCORES:
        rows.append(
            (f"auroc_{score}_mean", f"AUROC {score}, mean of {', '.join(o for o in sets if o not in simpler)}", True)
        )
    for o in sets:
        for score in SCORES:
            rows.append(
                (f"auroc_{score}_{o}", f"AUROC {score}, {o}" + (" (simpler inputs)" if o in simpler else ""), True)
            )
    for e in ROBUST_EPS_255:
        rows.append((f"robust_direct_{e}", f"PGD L-inf {e}/255, attacked directly", True))
    for e in (0, *ROBUST_EPS_255):
        rows.append(
            (
                f"robust_defended_{e}",
                f"SGLD defence, worst of transfer and BPDA+EOT, {e}/255 (baseline undefended)",
                True,
            )
        )
    rows += list(SAMPLE_METRICS)
    return rows


def _statistics_of(
    points: Sequence[dict[str, Any]], d: dict[str, np.ndarray], sets: Sequence[str], simpler: Sequence[str]
):
    """Per point: every statistic under the draws, plus the derived rows (OOD means, the baseline's
    'defended' rows = its undefended ones, sample metrics as constants)."""
    for p in points:
        st = point_statistics(p["arrays"], d)
        for score in SCORES:
            m = _mean_over(st, score, [o for o in sets if o not in simpler])
            if m is not None:
                st[f"auroc_{score}_mean"] = m
        if p["arm"] == "baseline":
            clean = p["arrays"]["correct"][np.asarray(p["robust_images"])].astype(float)
            st["robust_defended_0"] = clean[d["robust"]].mean(1)
            for e in ROBUST_EPS_255:
                st[f"robust_defended_{e}"] = st[f"robust_direct_{e}"]
            for k, _, _ in SAMPLE_METRICS:  # the baseline has no sampler: its row reads the arm's value
                st[k] = np.zeros(1)
        else:
            for k, v in _sample_metrics(p["row_point"]).items():
                st[k] = np.full(1, v)
        p["stats"] = st


def comparisons(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's comparisons of one data set and network: every arm against the baseline at the
    same iteration (the fine-tune against the baseline's last point: the classifier a user has), and
    the decision rule's two (the cheap cut and the fine-tune against the default's last point)."""
    by: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for p in points:
        by.setdefault((p["arm"], p["iteration"]), {})[p["seed"]] = p
    its = {a: sorted(i for (arm, i) in by if arm == a) for a in ARMS}
    base_last = its["baseline"][-1] if its["baseline"] else None
    default_last = its["default"][-1] if its["default"] else None
    out = []
    for (arm, it), group in sorted(by.items(), key=lambda kv: (ARMS.index(kv[0][0]), kv[0][1])):
        if arm == "baseline":
            continue
        ref_it = base_last if arm == "finetune" else it
        if ("baseline", ref_it) in by:
            out.append({"arm": arm, "iteration": it, "against": "baseline", "against_iteration": ref_it, "group": group,
                        "ref": by[("baseline", ref_it)]})  # fmt: skip
        if (
            arm in ("cheap", "finetune")
            and default_last is not None
            and it == (its[arm][-1])
            and ("default", default_last) in by
        ):
            out.append({"arm": arm, "iteration": it, "against": "default", "against_iteration": default_last,
                        "group": group, "ref": by[("default", default_last)]})  # fmt: skip
    for cmp in out:
        pair = ({s: p["stats"] for s, p in cmp["group"].items()}, {s: p["stats"] for s, p in cmp["ref"].items()})
        cmp["result"] = paired_bootstrap(*pair)
        if cmp["against"] == "default":  # the rule's precision: how much of the interval more seeds could remove
            cmp["inputs_only"] = paired_bootstrap(*pair, resample_seeds=False)
    return out


def _seeds_text(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def precision_text(cmp: dict[str, Any]) -> str:
    """One sentence on the accuracy interval of a rule comparison: its half-width, and the half-width
    the test inputs alone give (seeds held fixed), beside the rule's 1-point margin: whether a
    non-inferior arm could pass at all with this many seeds and test images."""
    full, fixed = cmp["result"].get("accuracy"), cmp.get("inputs_only", {}).get("accuracy")
    if full is None or fixed is None:
        return ""
    half, half_inputs = 50 * (full["hi"] - full["lo"]), 50 * (fixed["hi"] - fixed["lo"])
    return (
        f"Precision: the accuracy difference's interval reaches {half:.1f} points either side of its mean "
        f"({_seeds_text(full['seeds'])}), {half_inputs:.1f} from the test inputs alone (seeds held fixed); the rule's "
        "margin is 1 point."
    )


def _fmt(v: float, key: str) -> str:
    pct = key.startswith(("accuracy", "robust", "ece", "judge"))
    return f"{100 * v:+.1f}" if pct else f"{v:+.3f}"


def _cell_text(r: dict[str, float] | None, key: str, higher: bool) -> str:
    if r is None:
        return ""
    lo, hi = r["lo"], r["hi"]
    called = lo > 0 or hi < 0
    better = (lo > 0) == higher if called else None
    mark = "" if not called else (" **better**" if better else " **worse**")
    return f"{_fmt(r['diff'], key)} [{_fmt(lo, key)}, {_fmt(hi, key)}]{mark}"


def _value_text(v: float, key: str) -> str:
    return f"{100 * v:.1f}" if key.startswith(("accuracy", "robust", "ece", "judge")) else f"{v:.3f}"


def decide(cmp: dict[str, Any], rows: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    """The decision rule (module docstring) for an arm against the default: non-inferior on accuracy
    (lower bound >= -1 point) and no rule benefit wholly on the worse side."""
    res = cmp["result"]
    rule_keys = ["ece_scaled", "nll_scaled", "auroc_logpx_mean", "auroc_msp_mean", "fd_ratio"]
    rule_keys += [f"robust_direct_{e}" for e in ROBUST_EPS_255]
    higher = {k: h for k, _, h in rows}
    failed = []
    acc = res.get("accuracy")
    if acc is None or acc["lo"] < -0.01:
        failed.append(f"accuracy (lower bound {100 * acc['lo']:+.1f} points)" if acc else "accuracy (no points)")
    for k in rule_keys:
        r = res.get(k)
        if r is not None and ((r["hi"] < 0) if higher[k] else (r["lo"] > 0)):
            failed.append(f"{k} ({_cell_text(r, k, higher[k])})")
    seeds = min((r["seeds"] for r in res.values()), default=0)
    if seeds < 3:
        failed.append(f"{_seeds_text(seeds)} (the rule asks for 3)")
    return {"passes": not failed, "failed": failed, "seeds": seeds}


def measure_cost(
    out_dir: str = RESULTS, net: str = "resnet10t", tiny: bool = False, rounds: int = 7, per_round: int = 3
) -> dict[str, Any]:
    """CPU seconds per training iteration of every arm's recipe beside cross-entropy, in one process:
    ``rounds`` rounds, each running ``per_round`` iterations of every arm in turn (so that the load
    of the machine falls on all alike); medians, and each arm's ratio to cross-entropy. Written to
    ``OUT/cost-<net>.json``."""
    torch.set_num_threads(1)
    dataset = "textures"
    ds = GB.dataset(dataset, tiny)
    per_class = GB.per_class_for(dataset, LR.SIZE, tiny)
    S = GB.setting(ds, net, per_class, 0)
    arms = ("baseline", "default", "cheap", *PRESETS)
    ctxs = {}
    for arm in arms:
        c = arm_cell(dataset, net, arm, 0, CPU_ITERATIONS, CPU_EVALS, tiny, out_dir)
        over = {**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})}
        ctxs[arm] = G.start_run(S, c["run"], CPU_ITERATIONS, seed=0, overrides=over or None, fit_init="train")
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 1):  # round 0 warms up, not counted
        for arm in arms:
            for _ in range(per_round):
                idx = torch.randint(len(S["x"]), (LR.BATCH,), generator=g)
                t = time.process_time()
                G.train_step(ctxs[arm], S["x"][idx], S["y"][idx])
                if r:
                    times[arm].append(time.process_time() - t)
    med = {a: statistics.median(v) for a, v in times.items()}
    out = {
        "net": net,
        "s_per_iteration": {a: round(v, 4) for a, v in med.items()},
        "ratio_to_ce": {a: round(v / med["baseline"], 2) for a, v in med.items()},
        "rounds": rounds,
        "per_round": per_round,
        "load_before": os.getloadavg(),
        "threads": 1,
    }
    write_json(os.path.join(out_dir, COST_JSON.format(net=net)), out)
    return out


def read_cost(out_dir: str, net: str) -> dict[str, Any]:
    """The network's ``--cost`` measurement (:func:`measure_cost`), ``{}`` where it has none."""
    return GB._read_json(os.path.join(out_dir, COST_JSON.format(net=net)), {})


def equal_compute(
    points: Sequence[dict[str, Any]], ratio: dict[str, float], dataset: str, net: str
) -> tuple[list[list[str]], list[int]]:
    """Each JEM arm at its iterations against the baseline at (cost ratio x N) iterations, read off
    the long row's baseline curves (to 3,000 iterations; the same data, network and seeds, a warm-up
    of 200 iterations where the ledger's has 151). Means over the long row's seeds; no interval.
    Returns the table's rows and the seeds the curves come from."""
    curves: dict[int, list[float]] = {}
    seeds = set()
    for path in glob.glob(os.path.join(LR.RESULTS, "cells", f"{dataset}_*_{net}_baseline_s*_e*.json")):
        row = json.load(open(path))
        seeds.add(int(row["seed"]))
        for q in row.get("points", []):
            curves.setdefault(q["iteration"], []).append(q["accuracy"])
    if not curves:
        return [], []
    its = sorted(curves)
    rows = []
    for arm in ARMS[1:]:
        for it in sorted({p["iteration"] for p in points if p["arm"] == arm}):
            if ("default" if arm == "finetune" else arm) not in ratio:  # the fine-tune runs the default's loss
                continue
            acc = [float(np.mean(p["arrays"]["correct"])) for p in points if p["arm"] == arm and p["iteration"] == it]
            own = it if arm != "finetune" else None
            if own is None:  # the baseline's iterations to its first point, then JEM's
                start = next(p for p in points if p["arm"] == arm)["row"].get("start_iteration", 0)
                budget = start + (it - start) * ratio["default"]
            else:
                budget = it * ratio[arm]
            at = max((i for i in its if i <= budget), default=None)
            if at is None:
                continue
            rows.append([arm, f"{it:,}", f"{100 * np.mean(acc):.1f}", f"{budget:,.0f}", f"{at:,}" + (" (its last)" if at == its[-1] and budget > at else ""),
                         f"{100 * np.mean(curves[at]):.1f}"])  # fmt: skip
    return rows, sorted(seeds)


def report(
    out_dir: str = RESULTS,
    docs_page: str | None = DOCS_PAGE,
    docs_img: str | None = DOCS_IMG,
    evidence: str | None = str(LEDGER_EVIDENCE),
) -> str:
    """Intervals and verdicts from every evaluated point: ``OUT/ledger.md``, ``OUT/ledger.json``, a
    figure per data set and network (``OUT/ledger-<data>-<net>.png``, copied to ``docs_img``), the
    docs page's tables (``docs_page``, between its markers) and the table ``jem train`` quotes
    (``evidence``: :data:`jem_plugin.app.ledger_evidence.LEDGER_EVIDENCE`)."""
    points = load_points(out_dir)
    parts, summary, costs = [], [], {}
    for key in sorted({(p["dataset"], p["net"]) for p in points}):
        dataset, net = key
        group = [p for p in points if (p["dataset"], p["net"]) == key]
        cost = costs[net] = read_cost(out_dir, net)
        ratio = cost.get("ratio_to_ce", {})
        a0 = group[0]["arrays"]
        sets = [k.split("__")[1] for k in a0 if k.startswith("logpx__") and k != "logpx__in"]
        simpler = SIMPLER.get(dataset, ())
        sizes = {"test": len(a0["correct"]), "robust": len(group[0]["robust_images"])}
        sizes.update({f"ood_{o}": len(a0[f"logpx__{o}"]) for o in sets})
        _statistics_of(group, draws(sizes), sets, simpler)
        rows = benefit_rows(sets, simpler)
        cmps = comparisons(group)
        parts.append(_section(dataset, net, group, cmps, rows, cost, ratio))
        for cmp in cmps:
            entry = {k: cmp[k] for k in ("arm", "iteration", "against", "against_iteration", "result")}
            entry.update(dataset=dataset, net=net, seeds=sorted(cmp["group"]))
            if cmp["against"] == "default":
                entry["rule"] = decide(cmp, rows)
            summary.append(entry)
        if group:
            fig = figure(cmps, rows, os.path.join(out_dir, f"ledger-{dataset}-{net}.png"), f"{dataset} / {net}")
            if fig and docs_img:
                shutil.copyfile(fig, os.path.join(docs_img, os.path.basename(fig)))
    md = "\n\n".join(parts)
    write_json(os.path.join(out_dir, "ledger.json"), {"comparisons": summary, "cost": costs})
    if evidence is not None:
        ratios = {n: c.get("ratio_to_ce", {}) for n, c in costs.items()}
        write_json(evidence, evidence_table(points, summary, ratios))
    with open(os.path.join(out_dir, "ledger.md"), "w") as f:
        f.write(md + "\n")
    if docs_page and os.path.exists(docs_page):
        _write_between(docs_page, md)
    return md


def evidence_table(
    points: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], ratios: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """What ``jem train`` may quote (:mod:`jem_plugin.app.ledger_evidence`): for each recipe arm (not
    the fine-tune: jem train trains from scratch) at its last point against the baseline, on the
    judged data, the benefits whose interval excludes 0, how many were measured, and its cost ratio
    on its own network (``ratios[net]``, from :func:`read_cost`)."""
    rows = [r for d in {p["dataset"] for p in points} for r in benefit_rows(_sets(points, d), SIMPLER.get(d, ()))]
    labels, higher = {k: lab for k, lab, _ in rows}, {k: h for k, _, h in rows}
    last: dict[tuple, dict[str, Any]] = {}
    for e in summary:
        if (
            e["against"] == "baseline"
            and e["arm"] != "finetune"
            and e["dataset"] in SIMPLER
            and e["dataset"] == "textures"
        ):
            last[(e["dataset"], e["net"], e["arm"])] = e  # in iteration order: the last one stays
    entries = []
    for (dataset, net, arm), e in sorted(last.items()):
        row = next(p["row"] for p in points if p["arm"] == arm and p["net"] == net and p["dataset"] == dataset)
        res = {k: v for k, v in e["result"].items() if k in HEADLINE}
        called = [
            {"label": labels[k], "unit": "points" if k.startswith(("accuracy", "ece", "robust")) else "",
             "diff": v["diff"], "lo": v["lo"], "hi": v["hi"], "better": (v["lo"] > 0) == higher[k]}
            for k, v in res.items()
            if v["lo"] > 0 or v["hi"] < 0
        ]  # fmt: skip
        entries.append(
            {"dataset": dataset, "net": net, "kind": _kind_of(net), "arm": arm, "recipe": row["run"],
             "settings": row.get("set") or {}, "iteration": e["iteration"], "seeds": len(e["seeds"]),
             "measured": len(res), "called": called, "cost_ratio": ratios.get(net, {}).get(arm)}
        )  # fmt: skip
    return {"source": "benchmarks/bench_ledger.py --report", "page": "docs/what-jem-buys.md", "entries": entries}


def _sets(points: Sequence[dict[str, Any]], dataset: str) -> list[str]:
    a0 = next(p["arrays"] for p in points if p["dataset"] == dataset)
    return [k.split("__")[1] for k in a0 if k.startswith("logpx__") and k != "logpx__in"]


def _kind_of(net: str) -> str:
    """The network kind jem train reads (BatchNorm, another normalisation, none)."""
    from jem_plugin.app.default_recipe import kind_name, network_kind

    return kind_name(*network_kind(G.make_model(GB.NETWORKS.get(net, net))))


START, END = "<!-- ledger:start -->", "<!-- ledger:end -->"


def _write_between(path: str, md: str) -> None:
    text = open(path).read()
    if START not in text or END not in text:
        raise ValueError(f"{path} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{START}\n{md}\n{END}{tail}")


def _section(dataset, net, group, cmps, rows, cost, ratio) -> str:
    seeds = {a: sorted({p["seed"] for p in group if p["arm"] == a}) for a in ARMS}
    its = {a: sorted({p["iteration"] for p in group if p["arm"] == a}) for a in ARMS}
    lines = [f"### {dataset} / {net}" + (" (judged)" if dataset == "textures" else " (tuned)")]
    lines.append(
        "Arms with points (seeds; iterations): "
        + "; ".join(
            f"{a} ({', '.join(map(str, seeds[a]))}; {', '.join(f'{i:,}' for i in its[a])})" for a in ARMS if seeds[a]
        )
        + "."
    )
    vs_base = [c for c in cmps if c["against"] == "baseline"]
    last = {}
    for c in vs_base:  # each arm's last point
        last[c["arm"]] = c
    if last:
        header = ["benefit", "baseline"] + [
            f"{a} at {c['iteration']:,} ({_seeds_text(len(c['group']))})" for a, c in last.items()
        ]
        table = []
        for key, label, higher in rows:
            if not any(key in c["result"] for c in last.values()):
                continue
            base = next((c["result"][key]["base"] for c in last.values() if key in c["result"]), None)
            sample = key in {k for k, _, _ in SAMPLE_METRICS}
            cells = [
                (_value_text(c["result"][key]["arm"], key) + " " + (_cell_text(c["result"][key], key, higher) if not sample
                 else f"[{_value_text(c['result'][key]['lo'], key)}, {_value_text(c['result'][key]['hi'], key)}]"))
                if key in c["result"] else ""
                for c in last.values()
            ]  # fmt: skip
            table.append(
                [
                    label + (" (higher is better)" if higher else " (lower is better)"),
                    "" if sample or base is None else _value_text(base, key),
                    *cells,
                ]
            )
        lines.append(
            "Each arm at its last point against the baseline (the fine-tune against the baseline's last point): "
            "the arm's mean, then the difference and its 95% interval (seeds x test inputs, paired). "
            "Accuracy, ECE and robustness in points. **better**/**worse**: the interval excludes 0."
            + (
                " A column of one seed resamples its test inputs only: its interval leaves out how much "
                "another seed would differ, and is narrower than a 3-seed column's for that reason."
                if any(len(c["group"]) == 1 for c in last.values())
                else ""
            )
        )
        if ratio:  # the price of each column, side by side (--cost)
            cost_cells = [
                (f"{ratio['default']:.1f}x for its {c['iteration'] - c['group'][min(c['group'])]['row'].get('start_iteration', 0):,} "
                 "JEM iterations, after the baseline's" if a == "finetune" else f"{ratio[a]:.1f}x")
                if ("default" if a == "finetune" else a) in ratio else ""
                for a, c in last.items()
            ]  # fmt: skip
            table.append(["CPU cost per iteration, x cross-entropy", "1.0x", *cost_cells])
        lines.append(LR.md_table(header, table))
    ref = posthoc_reference(group)
    if ref:
        lines.append(
            "Reference: the baseline's best fitted detector of the 36 per set at its last point (mean over seeds; "
            "chosen on the test sets, so an upper bound of what a post-hoc score gives; no interval): "
            + ", ".join(f"{o} {m} {v:.3f}" for o, (m, v) in ref.items())
            + "."
        )
    rule = [c for c in cmps if c["against"] == "default"]
    for c in rule:
        d = decide(c, rows)
        verdict = "passes" if d["passes"] else "does not pass: " + "; ".join(d["failed"])
        lines.append(
            f"**Rule, {c['arm']} at {c['iteration']:,} against the default at {c['against_iteration']:,}:** {verdict}. "
            + precision_text(c)
        )
    if cost:
        lines.append(
            "CPU seconds per iteration, side by side in one process (`--cost`, one thread, medians): "
            + ", ".join(f"{a} {v:.2f} ({ratio[a]:.1f}x)" for a, v in cost["s_per_iteration"].items())
            + f"; load average before {cost['load_before'][0]:.1f}."
        )
        eq, curve_seeds = equal_compute(group, ratio, dataset, net)
        if eq:
            lines.append(
                "At equal compute (the baseline's accuracy from the long row's curves, "
                f"{'seed' if len(curve_seeds) == 1 else 'seeds'} {', '.join(map(str, curve_seeds))}, no interval):"
            )
            lines.append(
                LR.md_table(
                    [
                        "arm",
                        "iterations",
                        "accuracy",
                        "baseline iterations at its cost",
                        "baseline point",
                        "baseline accuracy",
                    ],
                    eq,
                )
            )
    return "\n\n".join(lines)


def posthoc_reference(group: Sequence[dict[str, Any]]) -> dict[str, tuple[str, float]]:
    """Per OOD set, the baseline's fitted detector with the highest AUROC at its last point, mean
    over the seeds that have it: ``{set: (detector, auroc)}``."""
    base = [p for p in group if p["arm"] == "baseline" and p.get("posthoc_auroc")]
    if not base:
        return {}
    last = max(p["iteration"] for p in base)
    tables = [p["posthoc_auroc"] for p in base if p["iteration"] == last]
    pairs = {(m, o) for t in tables for m in t for o in t[m]}  # each mean once, over the seeds that have it
    means = {(m, o): float(np.mean([t[m][o] for t in tables if o in t.get(m, {})])) for m, o in pairs}
    out = {}
    for o in sorted({o for _, o in means}):
        m, v = max(((m, v) for (m, oo), v in means.items() if oo == o and np.isfinite(v)), key=lambda mv: mv[1])
        out[o] = (m, v)
    return out


def figure(cmps, rows, path: str, title: str) -> str | None:
    """Each arm's difference to the baseline at its last point, with its interval, per benefit,
    oriented so that right is better; a person reads the whole ledger at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {}
    for c in cmps:
        if c["against"] == "baseline":
            last[c["arm"]] = c
    keys = [
        (k, lab, h)
        for k, lab, h in rows
        if k not in {m for m, _, _ in SAMPLE_METRICS} and any(k in c["result"] for c in last.values())
    ]
    keys = [
        r
        for r in keys
        if not r[0].startswith("auroc_")
        or r[0].endswith("_mean")
        or r[0].endswith(tuple(f"_{o}" for s in SIMPLER.values() for o in s))
    ]
    if not last or not keys:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(keys) + 1.6))
    colours = dict(zip(ARMS[1:], ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red", "tab:brown")))
    n = len(last)
    for j, (arm, c) in enumerate(last.items()):
        for i, (k, _, higher) in enumerate(keys):
            r = c["result"].get(k)
            if r is None:
                continue
            sign = 1 if higher else -1
            scale = 100  # points of accuracy, ECE, robustness and AUROC; NLL in nats x100
            lo, hi = sorted((sign * r["lo"] * scale, sign * r["hi"] * scale))
            y = i + (j - (n - 1) / 2) * 0.8 / max(n, 1)
            ax.plot([lo, hi], [y, y], color=colours[arm], lw=2)
            ax.plot(sign * r["diff"] * scale, y, "o", color=colours[arm], ms=4, label=arm if i == 0 else None)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(keys)))
    short = lambda lab: lab.replace(" (baseline undefended)", "").replace(
        "worst of transfer and BPDA+EOT", "worst attack"
    )
    ax.set_yticklabels([short(lab) for _, lab, _ in keys], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(
        "difference to the baseline x100 (accuracy, ECE, robustness in points; AUROC; NLL in nats); right is better",
        fontsize=8,
    )
    ax.set_title(f"What JEM buys on {title}: each arm at its last point, 95% intervals", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.subplots_adjust(left=0.3)  # the benefits' names, whole
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- the command
def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--datasets", nargs="+", default=["textures"])
    ap.add_argument("--networks", nargs="+", default=["resnet10t"])
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", choices=ARMS, help="only these arms (the plan's order kept)")
    ap.add_argument(
        "--iterations", type=int, default=None, help=f"default {CPU_ITERATIONS} ({GPU_ITERATIONS} with --gpu)"
    )
    ap.add_argument("--evals", type=int, default=CPU_EVALS)
    ap.add_argument("--no-presets", action="store_true", help="leave out jempp, sadajem and generative")
    ap.add_argument("--gpu", action="store_true", help="the GPU's plan (gpu_plan) on --device")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=None, help=LR.DEADLINE_HELP)
    ap.add_argument("--tiny", action="store_true", help="tiny data and runs (tests, a first try on a new machine)")
    ap.add_argument("--plan", action="store_true", help="print the cells and exit")
    ap.add_argument("--evaluate", action="store_true", help="evaluate kept point models that lack metrics")
    ap.add_argument("--cost", action="store_true", help="CPU s per iteration of every arm beside cross-entropy")
    ap.add_argument("--report", action="store_true", help="intervals, tables and figure from the points so far")
    ap.add_argument("--merge-from", metavar="ARCHIVE", help="bring a run_gpu_ledger.sh archive's cells and points in")
    a = ap.parse_args(argv)
    if a.merge_from:
        print("\n".join(merge_from(a.merge_from, a.out)))
        return
    if a.gpu:
        cells = gpu_plan(a.tiny, a.out, a.iterations or GPU_ITERATIONS)
    else:
        iterations = a.iterations or CPU_ITERATIONS
        cells = plan(a.datasets, a.networks, a.seeds, iterations, a.evals, not a.no_presets, a.tiny, a.out)
    if a.arms:
        cells = [c for c in cells if c["role"] in a.arms]
    if a.plan:
        for c in cells:
            print(f"{c['role']:<10} {GB.cell_name(c)}")
        return
    if a.evaluate:
        print(f"{evaluate_kept(a.out, cells)} points evaluated")
        return
    if a.cost:
        print(json.dumps(measure_cost(a.out, a.networks[0], a.tiny), indent=1))
        return
    if a.report:
        print(report(a.out))
        return
    deadline = time.time() + a.deadline_s if a.deadline_s is not None else None
    LR.run(cells, a.out, a.workers, report_each=False, device=a.device, deadline=deadline, threads=a.threads,
           point_hook=keep_point)  # fmt: skip


if __name__ == "__main__":
    main()
