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
    """The cells, most informative first: every seed's baseline (the fine-tunes start from them),
    then per seed the default, its fine-tune and the cheap cut, then the presets at the first seed."""
    cells = []
    for d in datasets:
        for n in networks:
            mk = lambda arm, s: arm_cell(d, n, arm, s, iterations, evals, tiny, out_dir)
            cells += [mk("baseline", s) for s in seeds]
            for s in seeds:
                cells += [mk("default", s), mk("finetune", s), mk("cheap", s)]
            if presets:
                cells += [mk(p, seeds[0]) for p in PRESETS]
    return cells


def gpu_plan(tiny: bool = False, out_dir: str = RESULTS) -> list[dict[str, Any]]:
    """The GPU's ledger: resnet10t and wrn10-1 on textures (judged) and digits32 (tuned), then
    convnext_atto and resnet18 on textures, every arm and 3 seeds, to :data:`GPU_ITERATIONS`."""
    cells = plan(("textures", "digits32"), ("resnet10t", "wrn10-1"), SEEDS, GPU_ITERATIONS, GPU_EVALS, True, tiny, out_dir)
    cells += plan(("textures",), ("convnext_atto", "resnet18"), SEEDS, GPU_ITERATIONS, GPU_EVALS, True, tiny, out_dir)
    return cells


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
    finally:
        set_rng_state(rng)
        ctx["g"].set_state(g_state)


def _robust(jm, x, y, defended: bool) -> dict[str, Any]:
    eps = [e / 255 for e in ROBUST_EPS_255]
    gen = torch.Generator().manual_seed(0)
    out = {"direct": robust_accuracy(jm, x, y, eps, PGD(steps=PGD_STEPS), generator=gen, progress=False, per_example=True)}
    if defended:
        defence = SGLDDefense(jm, steps=DEFENCE_STEPS, n_chains=DEFENCE_CHAINS, generator=torch.Generator().manual_seed(0))
        out["defended"] = robust_accuracy(
            jm, x, y, [0.0, *eps], PGD(steps=PGD_STEPS), defence, attack="worst", generator=gen, progress=False, per_example=True
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


def _evaluate_point(
    c: dict[str, Any],
    S: dict[str, Any],
    model: torch.nn.Module,
    recipe: Any,
    iteration: int,
    out_dir: str,
    last: bool,
    posthoc: bool,
) -> dict[str, Any]:
    t0 = time.process_time()
    model = copy.deepcopy(model).eval()
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
    print(f"[{time.strftime('%H:%M:%S')}] ledger {meta['cell']} at {iteration}: {meta['eval_cpu_s']:.0f} CPU s", flush=True)
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


# ---------------------------------------------------------------------------- the command
def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--datasets", nargs="+", default=["textures"])
    ap.add_argument("--networks", nargs="+", default=["resnet10t"])
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--arms", nargs="+", choices=ARMS, help="only these arms (the plan's order kept)")
    ap.add_argument("--iterations", type=int, default=CPU_ITERATIONS)
    ap.add_argument("--evals", type=int, default=CPU_EVALS)
    ap.add_argument("--no-presets", action="store_true", help="leave out jempp, sadajem and generative")
    ap.add_argument("--gpu", action="store_true", help="the GPU's plan (gpu_plan) on --device")
    ap.add_argument("--device", default=None)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=None, help="no cell starts after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny data and runs (tests, a first try on a new machine)")
    ap.add_argument("--plan", action="store_true", help="print the cells and exit")
    ap.add_argument("--evaluate", action="store_true", help="evaluate kept point models that lack metrics")
    ap.add_argument("--cost", action="store_true", help="CPU s per iteration of every arm beside cross-entropy")
    ap.add_argument("--report", action="store_true", help="intervals, tables and figure from the points so far")
    a = ap.parse_args(argv)
    if a.gpu:
        cells = gpu_plan(a.tiny, a.out)
    else:
        cells = plan(a.datasets, a.networks, a.seeds, a.iterations, a.evals, not a.no_presets, a.tiny, a.out)
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
