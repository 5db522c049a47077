"""Learning curves: the long row (issue 45, deliverable 1).

Every cell of the generalisation matrix ran at most 474 iterations; a user who adds ``JEMLoss`` to a
real pipeline runs tens of thousands. This benchmark trains the matrix's ~150-per-class row for
3,000+ iterations and evaluates it about every tenth of the run, so the curves say whether, after how
many iterations and at what cost the generative half starts paying.

It is a sibling of :mod:`benchmarks.bench_generalisation` and reuses its data sets, splits, judges,
reference distances, BatchNorm-statistics selection and evaluation (which are ``bench_generative``'s:
:func:`~benchmarks.bench_generative.start_run`, :func:`~benchmarks.bench_generative.train_step`,
:func:`~benchmarks.bench_generative.evaluate_run`); this module adds the long loop, its evaluation
points, the checkpoints that make it resumable, the curves and the targets table.

- **Data:** ``textures`` (judged on) and ``digits32`` (tuned on), the matrix's 150-per-class row
  (textures: 150 of the 500-per-class pool, chosen by the seed; digits: the whole pool of 1337,
  134 per class at most), batch 64.
- **Networks:** resnet10t (BatchNorm), convnext_atto (LayerNorm), wrn10-1 (no normalisation) and
  lcnet_050 (depthwise BatchNorm; cheaper than test_vit per iteration), each at its matrix learning
  rate (wrn10-1 3e-3, lcnet_050 1e-2, the others 3e-4).
- **Runs:** the cross-entropy ``baseline``; ``default``, ``jem train``'s choice for the row
  (:func:`jem_train_choice`: ``generative`` with p(x) weight 0.03, without the energy L2 on wrn10-1);
  ``generative`` as it is; ``cheap``, the choice with the cheaper iteration (below). Each recipe is
  judged against the baseline of the same data, network and seed at the same iteration.
- **Length:** ``ceil(3000 / batches per epoch)`` epochs (textures 125 epochs = 3,000 iterations;
  digits 143 = 3,003); the recipe's buffer and warm-up are sized for the whole run, as ``jem train``
  sizes them.
- **Evaluation** at the end of the epochs nearest each tenth of the run (10 points): the matrix's
  (test accuracy; ECE before and after a temperature fitted on the validation split; log p(x) AUROC on
  the four OOD sets, the baseline's being its energy score; the buffer's Fréchet distance in the
  judge's features and its init's; the judge on 100 class-conditional samples, 40 steps of the
  recipe's sampler from its init) on a copy of the model, so that the evaluation (a recipe with
  ``bn_stats_from_data`` recomputes its BatchNorm statistics, as ``jem train`` does at the end) never
  touches the run; the global and the run's random states are restored after it.
- **Resumable:** at each evaluation point the training state (model, optimiser, LR schedule, loss
  with its replay buffer and sampler, the run's generator, the global RNGs, epoch, CPU seconds) is
  checkpointed atomically (:mod:`jem_plugin.checkpoint`) under ``OUT/checkpoints/`` *before* the
  point is evaluated, and the cell's JSON (``OUT/cells/<cell>.json``) is rewritten as soon as the
  point exists. A killed run resumes from its last checkpoint (evaluating that point first if its
  JSON lacks it) and continues bit for bit as the uninterrupted run would; a finished cell
  (``"done": true``) is skipped and its checkpoint deleted.
- **Order:** :func:`plan` lists the most informative cells first (:data:`TIERS`: textures on
  resnet10t, baseline and ``default``; then digits32; then ``generative`` there, the other networks,
  the second seed), and two worker processes take them in that order, so partial results already
  answer something.

Budget (issue 45: at most 8 CPU-hours on 2 cores). CPU seconds per iteration (one thread, batch 64,
32x32 textures at 150 per class) from the generalisation matrix's cells of that row
(:func:`speed_from_matrix`: the same loop, 288 iterations per cell, medians over seeds, measured on
the shared machine, so rather upper bounds), baseline / ``jem train``'s choice / ``generative``:
resnet10t 0.17 / 0.50 / 0.90, convnext_atto 0.10 / 0.51 / 0.87, wrn10-1 0.09 / 0.46 / 0.81,
lcnet_050 0.05 / 0.30 / 0.42, test_vit 0.12 / 0.78 / 1.13 (so lcnet_050 is the fourth network); an
evaluation point 2-12 CPU seconds. At ~3,000 iterations and 10 points per cell the 23 cells of
:func:`plan` project to **7.8 CPU-hours** (``--plan`` prints the table; ``--probe`` measures afresh
into ``OUT/speed.json``): seed 0 of the baseline and the choice on all four networks and both data
sets (4.6 h), seed 1 of both on textures/resnet10t (0.6 h; the only cell with two seeds), and
``generative`` on textures everywhere and on digits/resnet10t (2.6 h). Each cell's JSON records its
own CPU seconds, so the table's cost column replaces the projection as cells finish. CPU seconds
grow with the machine's load: at a load average of 7 on the 2 cores, the first cells ran at 0.52
(baseline) and 2.5 (choice) CPU seconds per iteration on resnet10t, 3-5x the figures above, as
``profile_iteration`` measured beside them; the plan is sized on the lighter-load figures. Later, with
only two ``weight`` cells on the 2 cores (load 2), the choice's recipe at p(x) weight 0.3 on resnet10t
ran at 2.05-2.14 CPU seconds per iteration (each cell's JSON), about 4x the matrix's 0.50: a
3,000-iteration cell is nearer two hours of a core than half of one on this machine today. So
``--plan`` projects a run from this row's own CPU cells of it where there are some
(:func:`speed_on_the_row`), and a ``cheap`` cut from the choice's figure times the two's
side-by-side ratio in ``bench_train_step``.

    python -m benchmarks.bench_long_row --probe              # time a few iterations of each (net, run)
    python -m benchmarks.bench_long_row --plan               # the plan, in order, with its projected CPU time
    nohup nice -n 19 python -m benchmarks.bench_long_row > run.log 2>&1 &   # run (resumes; skips done cells)
    python -m benchmarks.bench_long_row --report             # curves + table (partial results too)

**On a GPU** (``--device cuda``; issue 45 items 4 and 5): the model, the loss (buffer, init) and the
chains train on the device, the chains and the loss drawing from their own device generator seeded
with the cell's seed (shuffling and augmentation stay on the CPU generator); each point is evaluated
by the same CPU code on copies of the model and loss moved to the CPU (:func:`cpu_copy_of_loss`), and
records the training wall seconds (``train_wall_s``, the device synchronised) beside the CPU seconds:
a GPU's cost is wall time, and the table's cost column uses it for GPU cells. ``--gpu-plan``
(:func:`gpu_plan`) orders resnet18 on textures at 10,000 iterations (baseline and ``jem train``'s
choice; the recipes' 3e-4, as resnet10t), the ``weight`` role at :data:`GPU_PX_WEIGHTS` on every
network (textures, then digits32), the ``dat`` role (the choice's recipe with DAT's PGD
negatives and logistic contrast in place of SGLD and p(x): ``bench_generative.start_run(negatives=
"dat")``) on textures/ and digits32/resnet10t, then every cell of the CPU plan not done here.
``--workers N --threads T`` share the GPU between N processes; ``--deadline-s S``: no cell starts
after S seconds, and a running one stops at its next point (``"stopped": "deadline"``).
``benchmarks/run_gpu_long_row.sh OUT [SECONDS]`` is the whole GPU part in one command, ending in
``OUT/long_row_gpu.tar.gz``; ``--merge-from`` brings its cells into ``OUT/cells`` (never over a done
cell) and ``--report`` then shows each cell's device.

    bash benchmarks/run_gpu_long_row.sh /tmp/out 480                          # on the GPU machine
    python -m benchmarks.bench_long_row --merge-from /tmp/out/long_row_gpu.tar.gz && python -m benchmarks.bench_long_row --report

**The cheap cut** (``--cheap``; issue 45 item 3): the ``cheap`` role is ``jem train``'s choice with
:mod:`benchmarks.bench_train_step`'s ``steps5_shared`` cut on top (:data:`CHEAP_CUT`: 5 SGLD steps
instead of 10, and the p(x) term's data energies from the classification forward; ~2.5x a
cross-entropy step on the CPU where the choice is ~4.7x). It may become the default only if it costs
nothing here, so it is judged against the same baseline cells as ``default`` and compared with the
choice point by point (:func:`cheap_against_choice`: per network, whether it meets each target at the
iterations the choice does, and its cost). :data:`CHEAP_TIERS` orders textures/resnet10t, textures
on the other networks, then digits32/resnet10t. Its cells are drawn dotted with triangles and named
``cheap: ...`` in the table; in ``jem train``'s evidence it is ``generative+cheap``, no recipe it
could switch to (:data:`CANDIDATE_ROLES`). ``--cheap-cut NAME`` runs another of ``CUTS`` in the same
role (``chains16_shared``: 16 chains per iteration instead of 32, each with the choice's 10 steps);
its cells are named by their settings, so that cuts coexist, and each is a triangle of its own in
the curves and a row of its own in the comparison.

    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.bench_long_row --cheap --workers 1   # resumes too
    OMP_NUM_THREADS=1 python -m benchmarks.bench_long_row --cheap --cheap-cut chains16_shared --networks resnet10t --workers 2

**A heavier p(x) weight** (``--px-weights W ...``; issue 45, the buffer FD target): the ``weight``
role is ``jem train``'s choice with its p(x) weight set to ``W`` (:data:`WEIGHT_ROLE`). The choice's
0.03 keeps accuracy but its buffer stays near its init on every textures cell of a normalised
network (wrn10-1, without, passes half with log p(x) far below); ``generative``'s 0.75
moves it past half by ~900 iterations at ~10 points of accuracy. A weight between is a registered
recipe's settings, so where it meets every target on the judged data, ``jem train``'s evidence can
switch to it, as to any recipe. Tune on digits32 first, then run only the chosen weight on textures
(``--datasets``, ``--networks``, ``--seeds`` pick the cells; ``--deadline-at`` stops them at a point,
to resume later).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_long_row --px-weights 0.3 --datasets digits32 --networks resnet10t

**Smoothed copies of the data as negatives** (``--px-weights W --smoothed``; :data:`SMOOTHED_ROLE`):
the weight role's recipe plus the ``smoothed_negatives`` loss term
(:mod:`jem_plugin.builtins.smoothed_negatives`: each training image likelier than a blurred copy of
itself), against what the weight role showed on textures: where its buffer moves, log p(x) ranks
the smooth digits above the textures. A candidate, not a recipe (the term is no recipe setting);
its cells are named ``generative+smoothed[...]`` and drawn thick dashed with stars.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_long_row --px-weights 0.3 --smoothed --datasets textures digits32 --networks resnet10t

**Coarse chain starts** (``--px-weights W --coarse``; :data:`COARSE_ROLE`): the weight role's recipe
with a quarter of its chains started from coarse images (the ``gaussian`` init's ``coarse``:
constant or low-resolution greys and colours, upsampled), against the simple modes its log p(x)
grew on textures where no chain went (``check_simple_inputs``: at 1,800 a flat grey image was rated
likelier than 61% of the test textures). With the recipe's ``reinit_freq`` 0 those chains persist,
so the p(x) term keeps pushing their energy up. Protocol, fixed before its first point: the share
0.25, not tuned; judged on textures with resnet10t (the cell its design was read from) and wrn10-1
(the other network whose buffer moves and whose log p(x) stays below, not looked at for the design);
it counts only if it meets the targets there where the weight role does not, and it stays a
candidate until digits32 shows it no worse.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_long_row --px-weights 0.3 --coarse --datasets textures --networks resnet10t wrn10-1 --workers 2 --threads 1

``--report`` writes ``OUT/long-row-<data>.png`` (copied to ``docs/img/``), ``OUT/summary.md`` and the
table into ``benchmarks/README.md``; a run writes ``OUT/summary.md`` and the PNGs after each cell.
"""

from __future__ import annotations

import argparse
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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import bench_generalisation as GB
from benchmarks import bench_generative as G
from benchmarks.bench_train_step import CUTS
from benchmarks.common import machine_info, md_table, write_json
from jem_plugin.app.default_recipe import (  # jem train's policy: a move of it changes these lines only
    LONG_ROW_TARGETS,
    default_choice_for,
)
from jem_plugin.checkpoint import get_rng_state, load_checkpoint, save_checkpoint, set_rng_state
from jem_plugin.errors import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "long_row")
DOCS_IMG = os.path.join(os.path.dirname(HERE), "docs", "img")
DATASETS = ("textures", "digits32")  # judged on first
NETWORKS = ("resnet10t", "convnext_atto", "wrn10-1", "lcnet_050")
ROLES = ("baseline", "default", "generative", "dat", "cheap", "weight", "smoothed", "coarse")
#: the cut of jem train's choice the ``cheap`` role runs (issue 45 item 3: bench_train_step's
#: ``steps5_shared``, 5 SGLD steps and the p(x) term's data energies from the classification forward;
#: ~2.5x a cross-entropy step where the choice is ~4.8x), judged here before it may become the default
CHEAP_CUT = "steps5_shared"
#: roles that are candidates, not recipes: shown in the curves and tables, never in jem train's
#: evidence as a registered recipe it could switch to (:func:`targets_evidence`)
CANDIDATE_ROLES = ("dat", "cheap", "smoothed", "coarse")
#: ``--px-weights``: the ``weight`` role is jem train's choice with a heavier p(x) term (issue 45: the
#: buffer FD target, which the choice's 0.03 misses on every normalised textures cell and ``generative``'s 0.75
#: meets at the cost of ~10 points of accuracy). A registered recipe with changed settings, so jem
#: train's evidence may switch to it where it meets every target on data it was not tuned on. Tuned on
#: digits32 first; only the weight chosen there runs on textures.
WEIGHT_ROLE = "weight"
#: ``--px-weights W --smoothed``: the weight role's recipe plus the ``smoothed_negatives`` term (each
#: image likelier than a blurred copy of itself; :mod:`jem_plugin.builtins.smoothed_negatives`), against
#: the weight role's failure on textures: where its buffer moves, log p(x) ranks the smooth digits
#: above the textures. A candidate (:data:`CANDIDATE_ROLES`): the term is no recipe setting.
SMOOTHED_ROLE = "smoothed"
#: ``--px-weights W --coarse``: the weight role's recipe with a share :data:`COARSE_SHARE` of its chains
#: started from coarse images (constant or low-resolution greys and colours; the ``gaussian`` init's
#: ``coarse``), against the simple modes the weight role's log p(x) grew where no chain went (a flat
#: grey textures image likelier than 61% of the test textures at 1,800). A candidate: its design was read
#: off the resnet10t textures cell, so it cannot switch jem train's choice on that evidence.
COARSE_ROLE = "coarse"
#: the share of chain starts the coarse role draws coarse (fixed before its first run, not tuned)
COARSE_SHARE = 0.25
#: the roles that set the choice's p(x) weight (``px_weight=`` in :func:`cell`)
PX_ROLES = (WEIGHT_ROLE, SMOOTHED_ROLE, COARSE_ROLE)
#: the roles :func:`probe_speed` times and :func:`speed_from_matrix` reads: the weight role runs the
#: choice's recipe, at its speed (:func:`projected_cpu_s`)
TIMED_ROLES = tuple(r for r in ROLES if r not in PX_ROLES)
#: GPU-only networks (issue 45 item 5), not in the CPU plan; resnet18 at the recipes' 3e-4 as resnet10t
#: (BatchNorm, the matrix trains it at 3e-4 too), so no ``lr`` entry
GPU_NETWORKS = ("resnet18",)
GPU_ITERATIONS = 10000
#: the weight role's p(x) weights on a GPU (:func:`gpu_plan`; ``--px-weights`` with ``--gpu-plan``
#: replaces them): the one weight run on the CPU, on the networks the CPU had no time for
GPU_PX_WEIGHTS: tuple[float, ...] = (0.3,)
SIZE = "150"
ITERATIONS = 3000
EVALS = 10
CHECKPOINT_EVERY_S = 600.0
BATCH = GB.BATCH
OOD_NAMES = GB.OOD_NAMES
START, END = "<!-- long_row:start -->", "<!-- long_row:end -->"
HEADING = "## Long row: learning curves (bench_long_row)"


# ---------------------------------------------------------------------------- the plan
@functools.cache
def jem_train_choice(per_class: int, net: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``jem train``'s recipe and changed settings for ``per_class`` training images per class on the
    network ``net`` at its matrix learning rate, read from the network's modules as ``jem train``
    reads them (the one place this module asks the policy)."""
    choice = default_choice_for(G.make_model(GB.NETWORKS.get(net, net)), per_class, lr=GB.NETWORK_LR.get(net))
    return choice.recipe, tuple(sorted(choice.settings.items()))


def batches_per_epoch(dataset: str, tiny: bool = False) -> int:
    """Batches of 64 in an epoch of the row's training set (the same for every seed)."""
    ds = GB.dataset(dataset, tiny)
    return math.ceil(len(GB.training_subset(ds, GB.per_class_for(dataset, SIZE, tiny), 0)[1]) / BATCH)


def epochs_for(dataset: str, iterations: int = ITERATIONS, tiny: bool = False) -> int:
    """Epochs of the row's size on ``dataset`` that make at least ``iterations`` iterations."""
    return math.ceil(iterations / batches_per_epoch(dataset, tiny))


def eval_epochs(epochs: int, evals: int = EVALS) -> list[int]:
    """The epochs after which a cell is evaluated: the ends of the epochs nearest each of ``evals``
    equal parts of the run (the last epoch always)."""
    return sorted({max(1, round(epochs * k / evals)) for k in range(1, evals + 1)})


def cell(
    dataset: str,
    net: str,
    role: str,
    seed: int,
    epochs: int,
    tiny: bool = False,
    px_weight: float | None = None,
    cut: str | None = None,
) -> dict[str, Any]:
    """One cell: the matrix's keys (so :func:`bench_generalisation.cell_name` names it) and its role;
    ``px_weight``: the ``weight`` and ``smoothed`` roles' p(x) weight (required there, refused
    elsewhere); ``cut``: the ``cheap`` role's cut of :data:`bench_train_step.CUTS` (default
    :data:`CHEAP_CUT`; refused for any other role)."""
    if (role in PX_ROLES) != (px_weight is not None):
        raise ValueError(f"px_weight goes with the roles {PX_ROLES} and only there (role {role!r}, {px_weight})")
    if cut is not None and (role != "cheap" or cut not in CUTS):
        raise ValueError(f"cut goes with the 'cheap' role and names one of {sorted(CUTS)} (role {role!r}, {cut!r})")
    per_class = GB.per_class_for(dataset, SIZE, tiny)
    c: dict[str, Any] = dict(dataset=dataset, per_class=per_class, net=net, run="baseline", seed=seed, epochs=epochs)
    if role in ("default", "dat", "cheap", *PX_ROLES):
        run, settings = jem_train_choice(per_class, net)
        c["run"] = run
        # the cut, or a heavier p(x) term, on top of the choice: names of their own, so the cells coexist
        on_top: dict[str, Any] = {}
        if role == "cheap":
            on_top = CUTS[cut or CHEAP_CUT]
        elif px_weight is not None:  # the weight, smoothed and coarse roles (checked above)
            on_top = {"px_weight": float(px_weight)}
            if role == COARSE_ROLE:
                on_top["init_coarse"] = COARSE_SHARE
        settings = tuple(sorted({**dict(settings), **on_top}.items()))
        if settings:
            c["set"] = dict(settings)
        if role == "dat":  # DAT's PGD negatives in place of the choice's SGLD (bench_generative.start_run)
            c["negatives"] = "dat"
        if role == SMOOTHED_ROLE:  # smoothed copies of the data as negatives, beside SGLD's
            c["negatives"] = "smoothed"
    elif role == "generative":
        c["run"] = "generative"
    if net in GB.NETWORK_LR:
        c["lr"] = GB.NETWORK_LR[net]
    c["role"] = role
    if cut not in (None, CHEAP_CUT):  # the first cut's cells, written before cuts were named, have none
        c["cut"] = cut
    if tiny:
        c["tiny"] = True
    return c


def cut_of(r: dict[str, Any]) -> str | None:
    """The cut of :data:`bench_train_step.CUTS` a ``cheap`` cell (or curve) runs; None for other roles."""
    return r.get("cut", CHEAP_CUT) if r.get("role") == "cheap" else None


#: the plan's tiers, most informative first: (data sets, networks, roles, seed); "first" and "rest":
#: the first network of NETWORKS and the others. Sized to the 8 CPU-hours (module docstring).
TIERS: tuple[tuple[str, str, tuple[str, ...], int], ...] = (
    ("judged", "first", ("baseline", "default"), 0),
    ("tuned", "first", ("baseline", "default"), 0),
    ("judged", "first", ("generative",), 0),
    ("judged", "rest", ("baseline", "default"), 0),
    ("tuned", "rest", ("baseline", "default"), 0),
    ("judged", "first", ("baseline", "default"), 1),
    ("judged", "rest", ("generative",), 0),
    ("tuned", "first", ("generative",), 0),
)
#: ``--cheap``'s tiers: the ``cheap`` role (:data:`CHEAP_CUT`) where the choice and its baseline ran,
#: judged data first: textures on resnet10t, textures on the other networks, then digits32/resnet10t
CHEAP_TIERS: tuple[tuple[str, str, tuple[str, ...], int], ...] = (
    ("judged", "first", ("cheap",), 0),
    ("judged", "rest", ("cheap",), 0),
    ("tuned", "first", ("cheap",), 0),
)


def plan(
    datasets: Sequence[str] = DATASETS,
    networks: Sequence[str] = NETWORKS,
    iterations: int = ITERATIONS,
    tiers: Sequence[tuple[str, str, tuple[str, ...], int]] = TIERS,
    tiny: bool = False,
    cut: str | None = None,
) -> list[dict[str, Any]]:
    """The cells in :data:`TIERS`' order: textures (judged on) on resnet10t, baseline and
    ``default``; the same on digits32 (tuned on); ``generative`` on textures/resnet10t; baseline and
    ``default`` on the other networks, textures then digits; seed 1 of textures/resnet10t;
    ``generative`` on the other networks (textures) and on digits/resnet10t. ``cut``: the
    ``cheap`` role's cut (:func:`cell`)."""
    datasets = [d for d in DATASETS if d in datasets]
    networks = [n for n in NETWORKS if n in networks]
    sets = {"judged": [d for d in datasets if d == "textures"], "tuned": [d for d in datasets if d != "textures"]}
    nets = {"first": networks[:1], "rest": networks[1:]}
    ep = {d: epochs_for(d, iterations, tiny) for d in datasets}
    cells: dict[str, dict[str, Any]] = {}
    for which, group, roles, seed in tiers:
        for d in sets[which]:
            for n in nets[group]:
                for r in roles:
                    c = cell(d, n, r, seed, ep[d], tiny, cut=cut if r == "cheap" else None)
                    cells.setdefault(GB.cell_name(c), c)  # where the choice is generative as it is, one cell
    return list(cells.values())


def weight_plan(
    datasets: Sequence[str],
    networks: Sequence[str],
    weights: Sequence[float],
    seeds: Sequence[int] = (0,),
    iterations: int = ITERATIONS,
    tiny: bool = False,
    role: str = WEIGHT_ROLE,
) -> list[dict[str, Any]]:
    """``--px-weights``: the ``weight`` role's cells (``role``: or the ``smoothed`` role's), per data
    set (judged first), network, seed and weight, in that order."""
    ep = {d: epochs_for(d, iterations, tiny) for d in DATASETS if d in datasets}
    return [
        cell(d, n, role, s, ep[d], tiny, px_weight=w)
        for d in ep
        for n in [n for n in NETWORKS + GPU_NETWORKS if n in networks]
        for s in seeds
        for w in weights
    ]


def gpu_plan(
    done_dir: str | None = os.path.join(RESULTS, "cells"),
    iterations: int = ITERATIONS,
    gpu_iterations: int = GPU_ITERATIONS,
    tiny: bool = False,
    skip_started: bool = False,
    px_weights: Sequence[float] = GPU_PX_WEIGHTS,
) -> list[dict[str, Any]]:
    """The GPU's order: resnet18 on textures, baseline and ``jem train``'s choice, ``gpu_iterations``
    (issue 45 item 5); the ``weight`` role at ``px_weights`` on every network, textures then digits32,
    seed 0 (:func:`weight_plan`); ``dat`` on textures/resnet10t and digits32/resnet10t, seed 0 (item
    4); then every cell of :func:`plan` not done in ``done_dir`` (the CPU's results), in plan order.
    ``skip_started``: also leave out every cell with a point in ``done_dir`` (a second GPU call, whose
    checkpoints from the first stayed on that machine, adds cells rather than restarting them)."""
    cells = [
        cell("textures", n, r, 0, epochs_for("textures", gpu_iterations, tiny), tiny)
        for n in GPU_NETWORKS
        for r in ("baseline", "default")
    ]
    cells += weight_plan(DATASETS, NETWORKS, px_weights, (0,), iterations, tiny)
    cells += [cell(d, NETWORKS[0], "dat", 0, epochs_for(d, iterations, tiny), tiny) for d in DATASETS]
    cells += plan(iterations=iterations, tiny=tiny)
    kept = []
    for c in cells:
        row = GB._read_json(os.path.join(done_dir, GB.cell_name(c) + ".json"), {}) if done_dir else {}
        if not (row.get("done") or (skip_started and row.get("points"))):
            kept.append(c)
    return kept


# ---------------------------------------------------------------------------- one cell
def _paths(out_dir: str, c: dict[str, Any]) -> tuple[str, str]:
    name = GB.cell_name(c)
    return os.path.join(out_dir, "cells", name + ".json"), os.path.join(out_dir, "checkpoints", name + ".pt")


def _state(ctx: dict[str, Any]) -> dict[str, Any]:
    """The objects whose state a checkpoint holds."""
    objs = dict(model=ctx["model"], optimizer=ctx["opt"], scheduler=ctx["sched"], generator=ctx["g"])
    if ctx["sam"] is not None:  # SAM recipes (sadajem): its state beside the base optimiser's
        objs["sam"] = ctx["sam"]
    if ctx["loss_fn"] is not None:
        objs["loss"] = ctx["loss_fn"]  # its replay buffer and sampler
    return objs


def _sync(device: str | torch.device | None) -> None:
    """Wait for the device's queued work, so that wall seconds measure it."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cpu_copy_of_loss(loss_fn: jem.JEMLoss, seed: int) -> jem.JEMLoss:
    """A copy of ``loss_fn`` (buffer, init, sampler, terms) on the CPU, for the CPU evaluation of a
    run trained on another device: its generators (the loss's and the sampler's, which live on the
    training device) are replaced by CPU generators seeded with ``seed``; the run's are untouched."""
    owners = [o for o in (loss_fn, loss_fn.sampler) if getattr(o, "generator", None) is not None]
    held = [o.generator for o in owners]
    for o in owners:  # not copied: a device generator, and the copy draws on the CPU anyway
        o.generator = None
    try:
        out = copy.deepcopy(loss_fn)
    finally:
        for o, gen in zip(owners, held):
            o.generator = gen
    out.to("cpu")
    for o in (out, out.sampler):
        if hasattr(o, "generator"):
            o.generator = torch.Generator().manual_seed(seed)
    return out


def evaluate_point(S: dict[str, Any], ctx: dict[str, Any], judge, baseline: bool, tiny: bool) -> dict[str, Any]:
    """The matrix's evaluation of the run as it stands, on a copy of its model (a recipe with
    ``bn_stats_from_data`` recomputes the copy's BatchNorm statistics, kept only when the
    validation accuracy is not worse); the run's and the global random states are left as they were.
    A run trained on a device (``ctx["device"]``) is evaluated on the CPU, as the others are: on
    copies of its model and loss moved there (:func:`cpu_copy_of_loss`)."""
    rng, g_state, c0 = get_rng_state(), ctx["g"].get_state(), time.process_time()
    model = copy.deepcopy(ctx["model"]).eval()
    loss_fn = ctx["loss_fn"]
    if ctx.get("device") is not None:
        model.to("cpu")
        loss_fn = None if loss_fn is None else cpu_copy_of_loss(loss_fn, ctx["seed"])
    res = {"model": model, "jm": jem.wrap(model, **S["wrap_kw"]), "loss_fn": loss_fn, "recipe": ctx["recipe"]}
    try:
        selection = GB.keep_better_bn_statistics(S, res)
        ev = GB.evaluate_cell(S, res, judge, tiny, baseline)
        if selection is not None:
            other, auroc = _logpx_auroc_with_other_bn(S, model, res["bn_as_trained"], selection["kept"])
            selection[f"auroc_{other}"] = auroc
    finally:
        set_rng_state(rng)
        ctx["g"].set_state(g_state)
    for k in ("buffer_samples", "cond_samples", "cond_labels"):
        ev.pop(k, None)
    ev["bn_selection"] = selection
    ev["eval_cpu_s"] = time.process_time() - c0
    return ev


def _logpx_auroc_with_other_bn(
    S: dict[str, Any], model: torch.nn.Module, as_trained: dict[str, Any], kept: str
) -> tuple[str, dict[str, float]]:
    """log p(x) AUROC on the OOD sets with the BatchNorm statistics the selection did not keep
    (``kept``; the evaluation's are those): how much the OOD ranking hangs on that choice, which is
    made on validation accuracy alone. Returns which statistics (``"as_trained"`` or
    ``"from_data"``) and the AUROCs; leaves ``model`` with its kept statistics."""
    kept_state = copy.deepcopy(model.state_dict())
    if kept == "from_data":
        model.load_state_dict(as_trained)
    else:
        GB.recompute_bn_statistics(S, model)
    model.eval()
    try:
        ood = jem.ood.evaluate_all(
            jem.wrap(model, **S["wrap_kw"]), S["xt"], S["ood"], methods=("logpx",), progress=False
        )
        other = "as_trained" if kept == "from_data" else "from_data"
        return other, {s: round(ood["logpx"][s]["auroc"], 4) for s in S["ood"]}
    finally:
        model.load_state_dict(kept_state)


def run_cell(
    c: dict[str, Any],
    out_dir: str,
    stop_after: int | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    device: str | None = None,
    deadline: float | None = None,
    threads: int = 1,
    point_hook: Callable[[dict[str, Any], dict[str, Any], dict[str, Any], str, int], None] | None = None,
) -> dict[str, Any]:
    """Train one cell to its last epoch, evaluating and checkpointing at :func:`eval_epochs`,
    resuming from its checkpoint; ``stop_after``: return after that many evaluation points of this
    call (a kill, for tests). The cell's JSON is rewritten after every point. Between points the
    state is also checkpointed at the end of the first epoch ``checkpoint_every_s`` seconds (wall)
    after the last checkpoint: a session that ends mid-cell loses at most that much.

    ``device``: where the model and loss train (``None``: the CPU, bit for bit as before; the points
    are evaluated on the CPU either way, :func:`evaluate_point`); the row records it, and each point
    its training wall seconds (``train_wall_s``, the device synchronised) beside the CPU seconds.
    ``deadline`` (``time.time()``): the cell stops at its first evaluation point after it, its JSON
    saying ``"stopped": "deadline"`` (not done; a later call resumes it from its checkpoint).
    ``threads``: ``torch.set_num_threads``. ``point_hook(c, S, ctx, ckpt_path, iteration)``: called
    after each point's JSON is written, with the point's checkpoint on disk (the benefit ledger keeps
    it and evaluates its own metrics there). ``c["init_from"]``: a checkpoint whose model weights a
    fresh cell starts from (a fine-tune of another cell's point)."""
    torch.set_num_threads(threads)
    tiny = bool(c.get("tiny"))
    json_path, ckpt_path = _paths(out_dir, c)
    stored = GB._read_json(json_path)
    row = stored or {**c, "name": GB.cell_name(c), "points": []}
    if row.get("done") or (stored and stored.get("device", "cpu") != str(device or "cpu")):  # another device's curve
        return row
    row.pop("error", None)  # retried
    ds = GB.dataset(c["dataset"], tiny)
    S = GB.setting(ds, c["net"], c["per_class"], c["seed"])
    judge = GB.judge_for(c["dataset"], tiny, out_dir)
    baseline = c["run"] == "baseline"
    n_batches = math.ceil(len(S["x"]) / BATCH)
    overrides = {**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})}

    def start() -> dict[str, Any]:
        return G.start_run(
            S,
            c["run"],
            c["epochs"] * n_batches,
            seed=c["seed"],
            batch_size=BATCH,
            overrides=overrides or None,
            fit_init="train",
            device=device,
            negatives=c.get("negatives"),
        )

    def start_from_init() -> dict[str, Any]:
        ctx = start()
        if c.get("init_from"):  # the network as another cell's point left it; the rest fresh
            load_checkpoint(c["init_from"], rng=False, model=ctx["model"])
        return ctx

    ctx = start_from_init()
    meta: dict[str, Any] = {"epoch": 0, "train_cpu_s": 0.0, "metrics": {}, "train_wall_s": 0.0}
    if os.path.exists(ckpt_path):
        try:
            extra = load_checkpoint(ckpt_path, **_state(ctx))
            meta = {k: extra.get(k, v) for k, v in meta.items()}  # train_wall_s: not in older checkpoints
        except CheckpointError as exc:
            if exc.reason not in ("mismatch", "corrupt"):
                raise
            # written by other code (the library's state changed) or damaged: the cell starts over,
            # so that no curve mixes two versions; the old files are kept beside, renamed
            print(f"{GB.cell_name(c)}: starting over ({exc.reason}: {str(exc)[:200]})", flush=True)
            for path in (ckpt_path, json_path):
                if os.path.exists(path):
                    os.replace(path, path + ".stale")
            row = {**c, "name": GB.cell_name(c), "points": []}
            ctx = start_from_init()
    r = ctx["recipe"]
    row.update(
        n_train=len(S["y"]),
        network=GB.NETWORKS.get(c["net"], c["net"]),
        iterations=c["epochs"] * n_batches,
        recipe_settings=str(r) if r is not None else "cross-entropy only",
        buffer_slots=ctx["loss_fn"].buffer.capacity if ctx["loss_fn"] is not None else None,
        lr_used=ctx["lr"],
        device=str(device or "cpu"),
    )
    row.pop("stopped", None)
    evals = eval_epochs(c["epochs"], c.get("evals", EVALS))
    done_points = {p["epoch"] for p in row["points"]}
    made = 0

    def add_point(epoch: int) -> None:
        nonlocal made
        point = {
            "epoch": epoch,
            "iteration": epoch * n_batches,
            "train_cpu_s": meta["train_cpu_s"],
            "train_wall_s": meta["train_wall_s"],
            "metrics": meta["metrics"],
            **evaluate_point(S, ctx, judge, baseline, tiny),
        }
        row["points"] = sorted([p for p in row["points"] if p["epoch"] != epoch] + [point], key=lambda p: p["epoch"])
        write_json(json_path, row)
        if point_hook is not None:
            point_hook(c, S, ctx, ckpt_path, point["iteration"])
        made += 1
        print(
            f"[{time.strftime('%H:%M:%S')}] {row['name']}: point {point['iteration']}/{row['iterations']}, "
            f"acc {point['accuracy']:.3f}, train {point['train_wall_s']:.0f} s wall, eval {point['eval_cpu_s']:.0f} CPU s",
            flush=True,
        )

    if meta["epoch"] in evals and meta["epoch"] not in done_points:  # killed between checkpoint and JSON
        add_point(meta["epoch"])
    saved_at = time.perf_counter()
    for epoch in range(meta["epoch"] + 1, c["epochs"] + 1):
        if stop_after is not None and made >= stop_after:
            return row
        t, t_wall = time.process_time(), time.perf_counter()
        perm = torch.randperm(len(S["x"]), generator=ctx["g"])
        for idx in perm.split(BATCH):
            metrics = G.train_step(ctx, S["x"][idx], S["y"][idx])
        _sync(device)
        meta["train_cpu_s"] += time.process_time() - t
        meta["train_wall_s"] += time.perf_counter() - t_wall
        if epoch in evals or time.perf_counter() - saved_at >= checkpoint_every_s:
            meta.update(epoch=epoch, metrics={k: round(float(v), 4) for k, v in metrics.items()})
            save_checkpoint(ckpt_path, **_state(ctx), **meta)
            saved_at = time.perf_counter()
        if epoch in evals:
            add_point(epoch)
            if deadline is not None and time.time() >= deadline and epoch < c["epochs"]:
                row["stopped"] = "deadline"
                write_json(json_path, row)
                return row
    row["done"] = True
    write_json(json_path, row)
    if os.path.exists(ckpt_path):
        os.remove(ckpt_path)
    return row


def _run_cell_job(args: tuple) -> str:
    c, out_dir, opts = args
    t = time.perf_counter()
    name = GB.cell_name(c)
    if opts.get("deadline") is not None and time.time() >= opts["deadline"]:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: not started (deadline)", flush=True)
        return name
    try:
        row = run_cell(c, out_dir, **opts)
        last = row["points"][-1] if row["points"] else {}
        msg = f"acc {last.get('accuracy', float('nan')):.3f} at {last.get('iteration')}"
        if row.get("stopped"):
            msg += f" of {row['iterations']} (stopped: {row['stopped']})"
    except Exception as exc:  # a diverged run is a result of the row, not the end of it
        json_path, _ = _paths(out_dir, c)
        row = GB._read_json(json_path) or {**c, "name": name, "points": []}
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        row["error"] = f"{type(exc).__name__}: {first}"
        write_json(json_path, row)
        msg = row["error"]
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {msg}, {time.perf_counter() - t:.0f} s", flush=True)
    return name


#: what ``deadline`` does to :func:`run`'s cells, as both CLIs that take it (this and bench_ledger) say
DEADLINE_HELP = "no cell starts, and a running one stops at its next point (a later call resumes it), after S s"


def run(
    cells: Sequence[dict[str, Any]],
    out_dir: str,
    workers: int = 2,
    retry_failed: bool = False,
    report_each: bool = True,
    device: str | None = None,
    deadline: float | None = None,
    threads: int = 1,
    point_hook: Callable[[dict[str, Any], dict[str, Any], dict[str, Any], str, int], None] | None = None,
) -> None:
    """Run the cells not done under ``out_dir`` in order (``retry_failed``: also those that failed),
    ``workers`` at a time; the summary and curves are rewritten as each cell finishes. ``device``,
    ``deadline``, ``threads``, ``point_hook`` (a module-level function: the workers pickle it):
    :func:`run_cell`'s (no cell starts after the deadline)."""
    todo = []
    for c in cells:
        row = GB._read_json(_paths(out_dir, c)[0], {})
        if row.get("done") or ("error" in row and not retry_failed):
            continue
        if row and row.get("device", "cpu") != str(device or "cpu"):  # merged from another device: its curve
            print(f"{GB.cell_name(c)}: left to {row.get('device')}, which started it", flush=True)
            continue
        todo.append(c)
    t0 = time.perf_counter()
    refs_path = os.path.join(out_dir, "datasets.json")
    refs = GB._read_json(refs_path, {})
    for name, tiny in sorted({(c["dataset"], bool(c.get("tiny"))) for c in cells}):
        if name not in refs:  # the data and judges, once, before the workers fork
            refs[name] = GB.references(name, tiny, out_dir)
        else:
            GB.dataset(name, tiny), GB.judge_for(name, tiny, out_dir)
    write_json(refs_path, refs)
    print(f"{len(cells) - len(todo)} of {len(cells)} cells done before; running {len(todo)}", flush=True)
    opts = dict(device=device, deadline=deadline, threads=threads, point_hook=point_hook)
    jobs = [(c, out_dir, opts) for c in todo]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            pending = {ex.submit(_run_cell_job, j) for j in jobs}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    f.result()
                if report_each:
                    report(out_dir, readme=None, docs=None, planned=len(cells))
    else:
        for j in jobs:
            _run_cell_job(j)
            if report_each:
                report(out_dir, readme=None, docs=None, planned=len(cells))
    runs_path = os.path.join(out_dir, "runs.json")
    write_json(
        runs_path,
        GB._read_json(runs_path, [])
        + [
            {
                "machine": machine_info(),
                "workers": workers,
                "threads": threads,
                "device": device or "cpu",
                "cells_run": len(todo),
                "wall_s": time.perf_counter() - t0,
            }
        ],
    )


# ---------------------------------------------------------------------------- time
def probe_speed(networks: Sequence[str] = NETWORKS, iters: int = 6, out_dir: str = RESULTS) -> dict[str, Any]:
    """CPU seconds per training iteration of each network and role (``iters`` iterations after one
    not timed, batch 64, textures at the row's size) and per evaluation point (once, untrained)."""
    torch.set_num_threads(1)
    ds = GB.dataset("textures")
    judge = GB.judge_for("textures", False, out_dir)
    out: dict[str, Any] = {"iteration": {}, "evaluation": {}}
    for net in networks:
        for role in TIMED_ROLES:
            c = cell("textures", net, role, 0, 1)
            S = GB.setting(ds, net, c["per_class"], 0)
            overrides = {**({"lr": c["lr"]} if "lr" in c else {}), **(c.get("set") or {})}
            ctx = G.start_run(S, c["run"], ITERATIONS, batch_size=BATCH, overrides=overrides or None, fit_init="train")
            batches = torch.randperm(len(S["x"]), generator=ctx["g"]).split(BATCH)[: iters + 1]
            G.train_step(ctx, S["x"][batches[0]], S["y"][batches[0]])
            t = time.process_time()
            for idx in batches[1:]:
                G.train_step(ctx, S["x"][idx], S["y"][idx])
            key = f"{net}/{role}"
            out["iteration"][key] = (time.process_time() - t) / iters
            if role != "generative":  # the default's evaluation costs what generative's does
                ev = evaluate_point(S, ctx, judge, role == "baseline", False)
                out["evaluation"][key] = ev["eval_cpu_s"]
            print(
                f"{key}: {out['iteration'][key]:.3f} CPU s per iteration"
                + (f", {out['evaluation'][key]:.0f} per evaluation" if key in out["evaluation"] else ""),
                flush=True,
            )
    out["machine"] = machine_info()
    out["load_average"] = os.getloadavg()
    return out


def speed_from_matrix(cells_dir: str = os.path.join(GB.RESULTS, "full", "cells")) -> dict[str, Any]:
    """:func:`probe_speed`'s figures from the generalisation matrix's textures cells at 150 per class
    (the same loop, 288 iterations each, medians over seeds): CPU seconds per iteration, and per
    evaluation (the cell's CPU seconds less its training's; the same evaluation as one point here)."""
    out: dict[str, Any] = {"iteration": {}, "evaluation": {}, "source": os.path.relpath(cells_dir, HERE)}
    rows = [GB._read_json(p) for p in glob.glob(os.path.join(cells_dir, "textures_150_*.json"))]
    for net in NETWORKS:
        for role in TIMED_ROLES:
            label = GB.run_label(cell("textures", net, role, 0, 1))
            mine = [r for r in rows if r["net"] == net and GB.run_label(r) == label and "error" not in r]
            if mine:
                key = f"{net}/{role}"
                out["iteration"][key] = statistics.median(r["train_cpu_s"] / r["iterations"] for r in mine)
                out["evaluation"][key] = statistics.median(GB._cpu(r) - r["train_cpu_s"] for r in mine)
    return out


def speed_on_the_row(cells_dir: str = os.path.join(RESULTS, "cells")) -> dict[str, float]:
    """The long row's own CPU seconds per iteration, per network and run (its label), from the
    cells trained on the CPU (their last point's clock): the medians over data sets and seeds. The
    matrix's figures (:func:`speed_from_matrix`) ran 288 iterations under another load; these are
    what this row's cells took."""
    rates: dict[str, list[float]] = {}
    for path in glob.glob(os.path.join(cells_dir, "*.json")):
        r = GB._read_json(path, {})
        own = _own_s_per_iteration(r) if r.get("device", "cpu") == "cpu" else None
        if own is not None:
            rates.setdefault(f"{r['net']}/{GB.run_label(r)}", []).append(own)
    return {k: statistics.median(v) for k, v in rates.items()}


def _own_s_per_iteration(r: dict[str, Any]) -> float | None:
    """A cell's seconds per training iteration at its last point, on its device's clock: CPU
    seconds on the CPU, wall seconds on a GPU (None before its first point)."""
    last = (r.get("points") or [None])[-1]
    own = last.get({"cpu": "train_cpu_s"}.get(r.get("device", "cpu"), "train_wall_s")) if last else None
    return own / last["iteration"] if own and last and last.get("iteration") else None


def projected_cpu_s(c: dict[str, Any], speed: dict[str, Any], row: dict[str, float] | None = None) -> float | None:
    """A cell's CPU seconds: its iterations at its own run's speed on this row where a cell of it
    trained on the CPU (``row``: :func:`speed_on_the_row`), else at its network and role's speed
    from the probe (``generative``'s evaluation as ``default``'s; the ``weight`` role at
    ``default``'s speed, the same recipe; a ``cheap`` cut at ``default``'s scaled by the two's
    side-by-side ratio in bench_train_step), plus its evaluation points."""
    role = "default" if c["role"] in (*PX_ROLES, "cheap") else c["role"]
    key = f"{c['net']}/{role}"
    it = speed["iteration"].get(key)
    if c["role"] == "cheap" and it is not None:
        timed = GB._read_json(TRAIN_STEP_CUTS, {}).get("train_step_cuts", {}).get("networks", {})
        ratios = timed.get(c["net"], {}).get("time", {})
        cut, choice = ratios.get(cut_of(c), {}).get("ratio"), ratios.get("choice", {}).get("ratio")
        it = it * cut / choice if cut and choice else None
    it = (row or {}).get(f"{c['net']}/{GB.run_label(c)}", it)
    ev = speed["evaluation"].get(key) or speed["evaluation"].get(key.replace("/generative", "/default"))
    if it is None or ev is None:
        return None
    iterations = c["epochs"] * batches_per_epoch(c["dataset"], bool(c.get("tiny")))
    return iterations * it + len(eval_epochs(c["epochs"], c.get("evals", EVALS))) * ev


def plan_table(
    cells: Sequence[dict[str, Any]], speed: dict[str, Any] | None, row: dict[str, float] | None = None
) -> str:
    """The plan in order with each cell's projected CPU hours (:func:`projected_cpu_s`) and the
    running total."""
    rows, total = [], 0.0
    for i, c in enumerate(cells, 1):
        s = projected_cpu_s(c, speed, row) if speed else None
        total += s or 0.0
        rows.append(
            [
                str(i),
                c["dataset"],
                c["net"],
                c["role"],
                GB.run_label(c),
                str(c["seed"]),
                str(c["epochs"]),
                "-" if s is None else f"{s / 3600:.2f}",
                f"{total / 3600:.2f}",
            ]
        )
    return md_table(["#", "data", "network", "role", "run", "seed", "epochs", "CPU h", "total CPU h"], rows)


# ---------------------------------------------------------------------------- curves and targets
def load_rows(out_dir: str) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "cells", "*.json"))):
        with open(path) as f:
            rows.append(json.load(f))
    return rows


def _gaps(p: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """One point against its baseline's at the same iteration."""
    fd = p.get("buffer", {}).get("fd")
    return {
        "wall_s": p.get("train_wall_s"),
        "acc_gap": 100 * (p["accuracy"] - b["accuracy"]),
        "auroc_gap": min(p["auroc"]["logpx"][s] - b["auroc"]["logpx"][s] for s in OOD_NAMES),
        # each set's, so that which set the worst one is can be read (check_fd_auroc)
        **{f"auroc_gap_{s}": p["auroc"]["logpx"][s] - b["auroc"]["logpx"][s] for s in OOD_NAMES},
        "fd_ratio": None if fd is None else fd / p["init_fd"],
        "judge_acc": p.get("cond", {}).get("judge_acc"),
        "judge_acc_init": p.get("cond", {}).get("judge_acc_init"),
        "ece": p["ece"],
        "ece_ts": p["ece_ts"],
        "base_ece": b["ece"],
        "base_ece_ts": b["ece_ts"],
    }


def _device_pair(r: dict[str, Any], b: dict[str, Any]) -> str:
    """Where a recipe cell and its baseline trained: ``cuda``, or ``cuda (baseline cpu)``."""
    d, db = r.get("device", "cpu"), b.get("device", "cpu")
    return d if d == db else f"{d} (baseline {db})"


def _recipe_devices(device: str) -> list[str]:
    """The recipe's own devices in an entry's device string, which joins its seeds'
    :func:`_device_pair` s: ``"cuda, cpu (baseline cuda)"`` -> ``["cuda", "cpu"]``."""
    return [part.split(" (")[0] for part in device.split(", ")]


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def curves(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (data set, network, recipe): at each iteration evaluated for both the recipe and its
    baseline (same data, network, seed), the gaps averaged over the seeds that have both."""
    base = {(r["dataset"], r["net"], r["seed"]): r for r in rows if r["run"] == "baseline"}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["run"] != "baseline":
            groups.setdefault((r["dataset"], r["net"], GB.run_label(r), r.get("role", "")), []).append(r)
    out = []
    for (dataset, net, label, role), rs in groups.items():
        per_iter: dict[int, list[dict[str, Any]]] = {}
        seeds, cost, devices, per_it = set(), [], set(), []
        for r in rs:
            b = base.get((dataset, net, r["seed"]))
            if b is None:
                continue
            devices.add(_device_pair(r, b))
            own = _own_s_per_iteration(r)
            if own is not None:
                per_it.append(own)
            b_points = {p["iteration"]: p for p in b["points"]}
            for p in r["points"]:
                if p["iteration"] in b_points:
                    per_iter.setdefault(p["iteration"], []).append(_gaps(p, b_points[p["iteration"]]))
                    seeds.add(r["seed"])
            if r["points"] and b["points"]:
                pr, pb = r["points"][-1], b["points"][-1]
                # seconds per iteration against the baseline's on the same device: CPU seconds on the
                # CPU, wall seconds on a GPU (its cost); none across devices
                key = {"cpu": "train_cpu_s"}.get(r.get("device", "cpu"), "train_wall_s")
                if r.get("device", "cpu") == b.get("device", "cpu") and pr.get(key) and pb.get(key):
                    cost.append((pr[key] / pr["iteration"]) / max(pb[key] / pb["iteration"], 1e-9))
        points = [
            {"iteration": it, "seeds": len(gs), **{k: _mean([g[k] for g in gs]) for k in gs[0]}}
            for it, gs in sorted(per_iter.items())
        ]
        errors = [r["error"] for r in rs if "error" in r]
        out.append(
            dict(
                dataset=dataset,
                net=net,
                run=label,
                role=role,
                seeds=sorted(seeds),
                points=points,
                iterations=max((r.get("iterations", 0) for r in rs), default=0),
                done=all(r.get("done") for r in rs),
                cost=_mean(cost),
                s_per_iteration=_mean(per_it),
                errors=errors,
                device=", ".join(sorted(devices)),
                **({"cut": cut_of(rs[0])} if role == "cheap" else {}),
            )
        )
    order = {n: i for i, n in enumerate(NETWORKS)}
    roles = {n: i for i, n in enumerate(ROLES)}
    out.sort(key=lambda e: (DATASETS.index(e["dataset"]), order.get(e["net"], 99), roles.get(e["role"], 99)))
    return out


TARGETS = {
    "accuracy": lambda p: p["acc_gap"] >= -1.0,
    "auroc": lambda p: p["auroc_gap"] >= 0.0,
    "fd": lambda p: p["fd_ratio"] is not None and p["fd_ratio"] <= 0.5,
}


def first_met(points: Sequence[dict[str, Any]], target: str) -> str:
    """The first evaluated iteration at which ``target`` is met ("+ not at N" when the last point
    N misses it again), else "not yet (at N)"."""
    if not points:
        return "-"
    ok = (
        [p for p in points if TARGETS[target](p)]
        if target != "all"
        else [p for p in points if all(t(p) for t in TARGETS.values())]
    )
    last = points[-1]
    if not ok:
        return f"not yet (at {last['iteration']})"
    lost = ok[-1] is not last
    return f"{ok[0]['iteration']}" + (f", not at {last['iteration']}" if lost else "")


def _evidence_recipe(r: dict[str, Any]) -> str:
    """The recipe a cell gives jem train's table: the registered recipe's name, and for a candidate
    role (:data:`CANDIDATE_ROLES`) a name no recipe has (``generative+dat``, ``generative+cheap``)."""
    recipe = r["run"] + (f"+{r['negatives']}" if r.get("negatives") else "")
    role = r.get("role", "")
    return recipe + (f"+{role}" if role in CANDIDATE_ROLES and not recipe.endswith(f"+{role}") else "")


def targets_evidence(rows: Sequence[dict[str, Any]], entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The table ``jem train`` reads (:data:`jem_plugin.app.default_recipe.LONG_ROW_TARGETS`): per
    recipe cell, its network's kind, recipe and settings, how far it was evaluated and the first
    iteration at which each target held (None: not yet), and whether all three still held at its
    last point."""
    # a candidate's recipe (CANDIDATE_ROLES) is no registered recipe ("generative+dat",
    # "generative+cheap"): shown to jem train, which never switches to it
    settings = {(r["dataset"], r["net"], GB.run_label(r)): (_evidence_recipe(r), r.get("set") or {}) for r in rows}
    kinds = {"BN": "BN", "depthwise BN": "BN", "none": "none"}
    cells = []
    for e in entries:
        pts = e["points"]
        if not pts:
            continue
        recipe, changed = settings.get((e["dataset"], e["net"], e["run"]), (e["run"], {}))
        first: dict[str, int | None] = {}
        for t in ("accuracy", "auroc", "fd", "all"):
            ok = [p for p in pts if (all(f(p) for f in TARGETS.values()) if t == "all" else TARGETS[t](p))]
            first[t] = ok[0]["iteration"] if ok else None
        cells.append(
            dict(
                dataset=e["dataset"],
                net=e["net"],
                kind=kinds.get(GB.NORMS.get(e["net"], ""), "other"),
                role=e["role"],
                run=e["run"],
                recipe=recipe,
                settings=changed,
                seeds=e["seeds"],
                evaluated_to=pts[-1]["iteration"],
                planned=e["iterations"],
                first=first,
                met_at_last=all(t(pts[-1]) for t in TARGETS.values()),
            )
        )
    return {"source": "benchmarks/bench_long_row.py --report", "judged_on": ["textures"], "cells": cells}


def targets_table(entries: Sequence[dict[str, Any]]) -> str:
    header = [
        "data",
        "network",
        "recipe",
        "seeds",
        "evaluated to (of)",
        "acc within 1 pt",
        "log p(x) AUROC >= baseline energy",
        "buffer FD <= half init",
        "all three",
        "last: acc gap (pt)",
        "AUROC gap (min)",
        "FD / init",
        "ECE / after T (baseline)",
        "judge acc (init)",
        "cost x",
        "device",
    ]
    rows = []
    for e in entries:
        pts = e["points"]
        last = pts[-1] if pts else None
        recipe = {"default": f"**{e['run']}**", "cheap": f"cheap: {e['run']}", WEIGHT_ROLE: f"weight: {e['run']}"}.get(
            e["role"], e["run"]
        )  # a smoothed cell's run names its negatives: generative+smoothed[...]
        seeds = ",".join(map(str, e["seeds"])) or "-"
        if e["errors"]:
            seeds += f" (failed: {e['errors'][0][:60]})"
        of = f"{last['iteration']} ({e['iterations']})" if last else f"- ({e['iterations']})"
        cells = [e["dataset"], e["net"], recipe, seeds, of]
        cells += [first_met(pts, t) for t in ("accuracy", "auroc", "fd", "all")]
        if last:
            cells += [
                f"{last['acc_gap']:+.1f}",
                f"{last['auroc_gap']:+.3f}",
                GB._f(last["fd_ratio"], "{:.2f}"),
                f"{last['ece']:.3f} / {last['ece_ts']:.3f} ({last['base_ece']:.3f} / {last['base_ece_ts']:.3f})",
                f"{GB._f(last['judge_acc'], '{:.2f}')} ({GB._f(last['judge_acc_init'], '{:.2f}')})",
                GB._f(e["cost"], "{:.1f}"),
            ]
        else:
            cells += ["-"] * 6
        cells.append(e.get("device") or "cpu")
        rows.append(cells)
    return md_table(header, rows)


#: the legend's name of each role's line style
ROLE_LEGEND = {
    "default": "jem train's choice",
    SMOOTHED_ROLE: "smoothed: the weight + smoothed negatives",
    COARSE_ROLE: f"coarse: the weight, {COARSE_SHARE:.0%} of chains from coarse images",
}
#: the cheap role's lines: thicker, with a triangle per cut (the same in every figure), so that they
#: stand apart from the choice's; a cut not named here gets ">"
CUT_MARKERS = {"steps5_shared": "^", "chains16_shared": "<"}
#: the weight role's markers, one per p(x) weight drawn (its lines dash-dot-dotted)
WEIGHT_MARKERS = ("D", "v", "P", "X")
WEIGHT_STYLE = (0, (7, 2, 1, 2, 1, 2))
#: a colour per network, the same in every long-row figure
NET_COLOURS = dict(zip(NETWORKS + GPU_NETWORKS, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red")))


def _cut_text(cut: str) -> str:
    """A cut and the settings it puts on the choice, for a legend or a caption."""
    return f"{cut} ({', '.join(f'{k}={v}' for k, v in CUTS[cut].items())})"


def _px_weight(run: str) -> str:
    """The p(x) weight in a run's label (``generative[l2_weight=0,px_weight=0.3]``: ``0.3``): one
    marker per weight, whatever else a network's choice changes."""
    found = re.search(r"px_weight=([^,\]]+)", run)
    return found.group(1) if found else run


def _line_kw(e: dict[str, Any], weights: Sequence[str]) -> dict[str, Any]:
    """The marker and width of an entry's line: a cut's own triangle, a weight's own marker."""
    if e["role"] == "cheap":
        return {"lw": 2.2, "marker": CUT_MARKERS.get(cut_of(e) or "", ">"), "ms": 4}
    if e["role"] == SMOOTHED_ROLE:
        return {"lw": 2.2, "marker": "*", "ms": 6}
    if e["role"] == COARSE_ROLE:
        return {"lw": 2.2, "marker": "o", "ms": 4}
    if e["role"] == WEIGHT_ROLE:
        return {"marker": WEIGHT_MARKERS[weights.index(_px_weight(e["run"])) % len(WEIGHT_MARKERS)], "ms": 4}
    return {}


def curves_figure(entries: Sequence[dict[str, Any]], dataset: str, path: str) -> str:
    """The curves of one data set: accuracy gap, AUROC gap, FD ratio and the judge on class samples
    against iterations, a colour per network, a line style per recipe; targets dotted."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    mine = [e for e in entries if e["dataset"] == dataset and e["points"]]
    if not mine:  # a figure all the same, so that the docs can always show it
        fig = Figure(figsize=(11, 2))
        fig.text(0.5, 0.5, f"{dataset}: no point of the long row evaluated yet", ha="center", va="center")
        fig.savefig(path, dpi=110)
        return path
    nets = [n for n in NETWORKS + GPU_NETWORKS if any(e["net"] == n for e in mine)]
    colours = NET_COLOURS
    styles: dict[str, Any] = {
        "default": "-",
        "generative": "--",
        "dat": "-.",
        "cheap": (0, (1, 1.5)),
        WEIGHT_ROLE: WEIGHT_STYLE,
        SMOOTHED_ROLE: (0, (4, 1)),
        COARSE_ROLE: (0, (2, 1)),
    }
    weights = sorted({_px_weight(e["run"]) for e in mine if e["role"] == WEIGHT_ROLE})
    cuts = sorted({c for e in mine if (c := cut_of(e))}, key=list(CUTS).index)
    panels = [
        ("acc_gap", "test accuracy - baseline's (points)", -1.0, "within 1 point"),
        ("auroc_gap", "log p(x) AUROC - baseline energy's\n(worst of the 4 OOD sets)", 0.0, ">= baseline on all"),
        ("fd_ratio", "buffer Fréchet distance / its init's", 0.5, "half the init's"),
        ("judge_acc", "judge accuracy on class samples", None, None),
    ]
    fig = Figure(figsize=(11, 7.6))
    axes = fig.subplots(2, 2, sharex=True).ravel()
    for ax, (key, label, target, tlabel) in zip(axes, panels):
        for e in mine:
            xs = [p["iteration"] for p in e["points"] if p[key] is not None]
            ys = [p[key] for p in e["points"] if p[key] is not None]
            if xs:
                marker = "s" if "cuda" in e.get("device", "") else "o"  # squares: trained on a GPU
                ax.plot(
                    xs,
                    ys,
                    ls=styles.get(e["role"], ":"),
                    color=colours.get(e["net"], "k"),
                    **{"marker": marker, "ms": 3, "lw": 1.5, **_line_kw(e, weights)},
                )
        if key == "acc_gap":
            lo = min((p[key] for e in mine for p in e["points"]), default=-5)
            ax.set_ylim(max(lo - 1, -40), None)
        if target is not None:  # always in view, whatever the points' range
            lo, hi = ax.get_ylim()
            pad = 0.1 * max(hi - lo, abs(target) * 0.2, 0.02)
            ax.set_ylim(min(lo, target - pad), max(hi, target + pad))
            ax.axhline(target, color="0.3", ls=":", lw=1)
            ax.annotate(
                f"target: {tlabel}",
                (0.01, target),
                xycoords=("axes fraction", "data"),
                fontsize=7,
                color="0.3",
                va="bottom",
            )
        if key == "judge_acc":
            init = _mean([p["judge_acc_init"] for e in mine for p in e["points"]])
            if init is not None:
                ax.axhline(init, color="0.6", ls="-.", lw=1)
                ax.annotate(
                    "the init's draws", (0.01, init), xycoords=("axes fraction", "data"), fontsize=7, color="0.4"
                )
        ax.set_xlim(0, 1.02 * max(e["iterations"] for e in mine))  # the whole run: how far it has got
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[2:]:
        ax.set_xlabel("training iterations (batch 64)", fontsize=9)
    handles = [Line2D([], [], color=colours[n], lw=2, label=f"{n} ({GB.NORMS.get(n, '?')})") for n in nets]
    roles = sorted({e["role"] for e in mine}, key=lambda r: ROLES.index(r) if r in ROLES else 9)
    handles += [
        Line2D(
            [],
            [],
            color="k",
            ls=styles.get(r, ":"),
            label=ROLE_LEGEND.get(r, r),
            **_line_kw({"role": r}, weights),
        )
        for r in roles
        if r not in (WEIGHT_ROLE, "cheap")
    ]
    handles += [
        Line2D(
            [],
            [],
            color="k",
            ls=styles["cheap"],
            label=f"cheap: the choice with {cut}",
            **_line_kw({"role": "cheap", "cut": cut}, weights),
        )
        for cut in cuts
    ]
    handles += [
        Line2D(
            [],
            [],
            color="k",
            ls=WEIGHT_STYLE,
            label=f"weight: p(x) {w}",
            **_line_kw({"role": WEIGHT_ROLE, "run": f"px_weight={w}"}, weights),
        )
        for w in weights
    ]
    if any("cuda" in e.get("device", "") for e in mine):
        handles.append(Line2D([], [], color="k", ls="", marker="s", ms=4, label="trained on a GPU"))
    ncol = min(len(handles), 4)  # rows of at most four, so that the legend fits the figure's width
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    seeds = sorted({s for e in mine for s in e["seeds"]})
    choices = sorted({e["run"] for e in mine if e["role"] == "default"})
    role_note = f"solid: jem train's choice, {' or '.join(choices)}" if choices else "no choice cell yet"
    if cuts:
        role_note += f";\ndotted with triangles: the choice with {', '.join(map(_cut_text, cuts))}"
    if weights:
        role_note += ";\ndash-dot-dotted: the choice at a heavier p(x) weight (weight: p(x) ...)"
    smoothed = sorted({_px_weight(e["run"]) for e in mine if e["role"] == SMOOTHED_ROLE})
    if smoothed:
        role_note += (
            f";\nthick dashed with stars: p(x) {', '.join(smoothed)} plus smoothed copies of the data as negatives"
        )
    coarse = sorted({_px_weight(e["run"]) for e in mine if e["role"] == COARSE_ROLE})
    if coarse:
        role_note += f";\nthick short-dashed with dots: p(x) {', '.join(coarse)}, {COARSE_SHARE:.0%} of chains from coarse images"
    fig.suptitle(
        f"{dataset} ({'tuned on' if dataset == 'digits32' else 'judged on'}), ~150 per class: each recipe against the "
        f"cross-entropy baseline at the same iteration\n(mean over seeds {','.join(map(str, seeds))} where both ran; "
        f"{role_note})",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.025 * math.ceil(len(handles) / ncol) + 0.015, 1, 1))
    fig.savefig(path, dpi=110)
    return path


def dat_wall_figure(entries: Sequence[dict[str, Any]], path: str) -> str | None:
    """DAT's PGD negatives against SGLD (``jem train``'s choice) at the same training wall time
    (issue 45 item 4): accuracy gap, AUROC gap and FD ratio against wall seconds, a row per data
    set, for each network with a ``dat`` curve; only curves trained on the ``dat`` one's device.
    ``None`` when no ``dat`` cell has a point yet."""
    dats = [e for e in entries if e["role"] == "dat" and e["points"]]
    if not dats:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    keys = [
        ("acc_gap", "accuracy - baseline's (pt)"),
        ("auroc_gap", "AUROC gap (worst OOD set)"),
        ("fd_ratio", "FD / init's"),
    ]

    def trained_on(e: dict[str, Any]) -> set[str]:
        return set(_recipe_devices(e["device"]))

    fig = Figure(figsize=(11, 3.2 * len(dats)))
    axes = fig.subplots(len(dats), 3, squeeze=False)
    for row, d in zip(axes, dats):
        pair = [d] + [
            e
            for e in entries
            if e["role"] == "default"
            and (e["dataset"], e["net"]) == (d["dataset"], d["net"])
            and trained_on(e) == trained_on(d)
        ]
        for ax, (key, label) in zip(row, keys):
            for e in pair:
                pts = [p for p in e["points"] if p[key] is not None and p.get("wall_s") is not None]
                name = "DAT (PGD)" if e["role"] == "dat" else f"SGLD ({e['run']})"
                ax.plot(
                    [p["wall_s"] for p in pts],
                    [p[key] for p in pts],
                    "-." if e["role"] == "dat" else "-",
                    marker="o",
                    ms=3,
                    label=name,
                )
            ax.set_title(f"{d['dataset']} / {d['net']} on {d['device']}", fontsize=8)
            ax.set_xlabel("training wall seconds", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


#: bench_train_step's side-by-side timing of the choice and its cuts (CPU, batch 64, 32x32)
TRAIN_STEP_CUTS = os.path.join(HERE, "results", "train_step_cuts.json")


def cheap_against_choice(rows: Sequence[dict[str, Any]], entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per data set and network with a ``cheap`` curve and a ``default`` one: the two compared at the
    iterations both were evaluated, on the seeds the cheap one ran (each against its own baseline of
    that seed). Per target (:data:`TARGETS`): the iterations where the choice meets it, those of them
    the cheap cut misses, and where only the cheap cut meets it; per gap the worst of cheap's less
    the choice's over those points (accuracy and AUROC gaps: higher is better; FD ratio: the
    choice's less cheap's, so that negative is worse throughout); each one's seconds per iteration
    on its own device, cost against its baseline, and bench_train_step's side-by-side CPU cost
    (x a cross-entropy iteration) where it timed that network."""
    side = GB._read_json(TRAIN_STEP_CUTS, {}).get("train_step_cuts", {}).get("networks", {})
    out = []
    for ch in entries:
        if ch["role"] != "cheap" or not ch["seeds"]:
            continue
        where = (ch["dataset"], ch["net"])
        mine = [r for r in rows if (r["dataset"], r["net"]) == where and r["seed"] in ch["seeds"]]
        d = next((e for e in curves(mine) if e["role"] == "default"), None)
        if d is None:
            continue
        dp = {p["iteration"]: p for p in d["points"]}
        both = [(dp[p["iteration"]], p) for p in ch["points"] if p["iteration"] in dp]
        targets = {}
        for t, met in TARGETS.items():
            targets[t] = dict(
                choice=[pd["iteration"] for pd, _ in both if met(pd)],
                missed=[pd["iteration"] for pd, pc in both if met(pd) and not met(pc)],
                only_cheap=[pd["iteration"] for pd, pc in both if met(pc) and not met(pd)],
            )
        worst: dict[str, float | None] = {}
        for key, sign in (("acc_gap", 1), ("auroc_gap", 1), ("fd_ratio", -1)):
            diffs = [sign * (pc[key] - pd[key]) for pd, pc in both if pc[key] is not None and pd[key] is not None]
            worst[key] = min(diffs) + 0.0 if diffs else None  # + 0.0: no "-0.00"
        timed = side.get(ch["net"], {}).get("time", {})
        out.append(
            dict(
                dataset=ch["dataset"],
                net=ch["net"],
                cut=cut_of(ch),
                seeds=ch["seeds"],
                iterations=[pd["iteration"] for pd, _ in both],
                points=[
                    {"iteration": pd["iteration"], **{k: (pd[k], pc[k]) for k in ("acc_gap", "auroc_gap", "fd_ratio")}}
                    for pd, pc in both
                ],
                targets=targets,
                worst=worst,
                no_worse=all(v is not None and v >= 0 for v in worst.values()) and bool(both),
                s_per_iteration={"default": d["s_per_iteration"], "cheap": ch["s_per_iteration"]},
                device={"default": d["device"], "cheap": ch["device"]},
                cost={"default": d["cost"], "cheap": ch["cost"]},
                side_by_side_ce={
                    "default": timed.get("choice", {}).get("ratio"),
                    "cheap": timed.get(cut_of(ch), {}).get("ratio"),
                },
            )
        )
    return out


def _verdict(t: dict[str, list[int]]) -> str:
    """Whether the cheap cut meets a target at the iterations the choice does (one table cell)."""
    if not t["choice"]:
        text = "choice: never; cheap: " + (", ".join(map(str, t["only_cheap"])) if t["only_cheap"] else "never")
        return text
    text = (
        f"no: misses {', '.join(map(str, t['missed']))} of the choice's {len(t['choice'])}"
        if t["missed"]
        else f"yes, all {len(t['choice'])} of the choice's"
    )
    return text + (f"; cheap also at {', '.join(map(str, t['only_cheap']))}" if t["only_cheap"] else "")


def cheap_table(versus: Sequence[dict[str, Any]]) -> str:
    """:func:`cheap_against_choice` as a table: per data set and network, whether the cheap cut
    meets each target at the iterations the choice does, its worst shortfall, and its cost."""

    def clock(device: str) -> str:  # CPU seconds for a recipe trained on the CPU, else wall seconds
        return "CPU s" if _recipe_devices(device)[0] == "cpu" else "wall s"

    rows = []
    for v in versus:
        w, sp, dev = v["worst"], v["s_per_iteration"], v["device"]
        rows.append(
            [
                v["dataset"],
                v["net"],
                v["cut"],
                ",".join(map(str, v["seeds"])),
                f"{v['iterations'][-1]} ({len(v['iterations'])} points)" if v["iterations"] else "-",
                *(_verdict(v["targets"][t]) for t in TARGETS),
                f"{GB._f(w['acc_gap'], '{:+.1f}')} / {GB._f(w['auroc_gap'], '{:+.3f}')} / {GB._f(w['fd_ratio'], '{:+.2f}')}",
                " / ".join(
                    f"{GB._f(sp[r], '{:.3f}')} {clock(dev[r])} ({dev[r].split(' (')[0]})" for r in ("default", "cheap")
                ),
                " / ".join(GB._f(v["cost"][r], "{:.1f}") for r in ("default", "cheap")),
                " / ".join(GB._f(v["side_by_side_ce"][r], "{:.2f}") for r in ("default", "cheap")),
            ]
        )
    header = [
        "data",
        "network",
        "cut",
        "seeds",
        "both evaluated to",
        "acc within 1 pt where the choice is",
        "AUROC >= baseline energy where the choice is",
        "FD <= half init where the choice is",
        "worst cheap - choice: acc pt / AUROC / FD ratio (choice's - cheap's)",
        "s per iteration: choice / cheap (device)",
        "cost x baseline: choice / cheap",
        "CPU x CE side by side (bench_train_step): choice / cheap",
    ]
    return md_table(header, rows)


def bn_statistics_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per point of every cell that recorded log p(x) with both BatchNorm statistics
    (:func:`_logpx_auroc_with_other_bn`): which the validation accuracy kept, the two validation
    accuracies, and the worst-set log p(x) AUROC gap to the baseline energy with each; "" if none."""
    base = {
        (r["dataset"], r["net"], r["seed"]): {p["iteration"]: p for p in r["points"]}
        for r in rows
        if r["run"] == "baseline"
    }
    lines = []
    for r in rows:
        b = base.get((r["dataset"], r["net"], r["seed"]), {})
        for p in r["points"]:
            sel, bp = p.get("bn_selection") or {}, b.get(p["iteration"])
            other = next((k for k in ("auroc_as_trained", "auroc_from_data") if k in sel), None)
            if other is None or bp is None:
                continue
            with_stats = {sel["kept"]: p["auroc"]["logpx"], other[len("auroc_") :]: sel[other]}
            worst = {k: min(v[s] - bp["auroc"]["logpx"][s] for s in OOD_NAMES) for k, v in with_stats.items()}
            lines.append(
                f"| {r['dataset']} | {r['net']} | {GB.run_label(r)} | {r['seed']} | {p['iteration']} | {sel['kept']} | "
                f"{sel['val_acc_as_trained']:.3f} / {sel['val_acc_from_data']:.3f} | "
                f"{worst['as_trained']:+.3f} / {worst['from_data']:+.3f} |"
            )
    if not lines:
        return ""
    head = (
        "| data | network | recipe | seed | iteration | kept (validation accuracy) | validation accuracy: as trained / "
        "from data | worst-set log p(x) AUROC - baseline energy's: as trained / from data |\n|---|---|---|---|---|---|---|---|"
    )
    return head + "\n" + "\n".join(lines)


def to_markdown(
    entries: Sequence[dict[str, Any]],
    refs: dict[str, Any],
    n_cells: int,
    n_done: int,
    cpu_h: float,
    planned: int | None = None,
    versus: Sequence[dict[str, Any]] = (),
    bn_table: str = "",
    cells_dir: str = "benchmarks/results/long_row/cells",
) -> str:
    of = f" of the plan's {planned}" if planned else ""
    lines = [
        f"{n_cells} cells started{of}, {n_done} finished "
        f"({cpu_h:.1f} CPU hours so far; "
        f"`{cells_dir}`). Per cell, the first evaluated iteration at which each target "
        "holds on the mean over its seeds, judged against the baseline of the same data, network and seed at "
        'the same iteration ("not yet (at N)": not met up to iteration N, the last evaluated; ", not at N": '
        "met earlier and missed at the last point); then the last point's values. **Bold**: `jem train`'s "
        "choice. Cost: seconds per iteration against the baseline's on the same device (CPU seconds on the "
        "CPU, wall seconds on a GPU, whose points are evaluated on the CPU all the same); device: where "
        "the recipe and its baseline trained.",
        "",
    ]
    for name, ref in refs.items():
        lines.append(
            f"- `{name}`: judge test accuracy {ref['judge_test_accuracy']:.3f}; judge FD of test halves "
            f"(held-out floor) {ref['fd_heldout_floor']:.1f}, training pool {ref['fd_train']:.1f}, uniform noise "
            f"{ref['fd_uniform']:.1f}"
        )
    lines += ["", targets_table(entries) if entries else "(no recipe cell evaluated beside its baseline yet)"]
    if versus:
        lines += [
            "",
            f"**The cheap cuts against the choice** (issue 45 item 3: `cheap` is `jem train`'s choice with one of "
            f"`bench_train_step`'s cuts: {'; '.join(sorted({_cut_text(v['cut']) for v in versus}))}; "
            "a cut may become the default only if it is no worse on textures). At the iterations both were evaluated, on the cheap cell's seeds: whether it meets each "
            "target where the choice does; the worst of cheap's gap less the choice's over those points (negative: "
            "cheap worse); seconds per training iteration on each one's device (CPU and GPU seconds do not compare); "
            "cost against the baseline on the same device; and the two timed side by side on the CPU.",
            "",
            cheap_table(versus),
        ]
    if bn_table:
        lines += [
            "",
            "**Which BatchNorm statistics log p(x) is read with.** A recipe with `bn_stats_from_data` recomputes "
            "its BatchNorm statistics from the training data and keeps them only where the validation accuracy "
            "(300 images on textures) is not lower, else keeps those of training, which the joint pass mixed "
            "with the samples. Points that recorded log p(x) both ways (the worst-set gap is what the targets "
            "read; the table above has the kept one's):",
            "",
            bn_table,
        ]
    return "\n".join(lines) + "\n"


def report(
    out_dir: str = RESULTS,
    readme: str | None = GB.README,
    docs: str | None = DOCS_IMG,
    planned: int | None = None,
    targets: str | None = None,
) -> str:
    """Curves (``OUT/long-row-<data>.png``, copied to ``docs``), ``OUT/summary.md`` and
    ``summary.json``, and the table in ``readme``; from whatever cells exist (``planned``: how many
    the plan has, for the first line). ``targets``: where to write the targets table jem train reads
    (:func:`targets_evidence`; ``--report`` on the committed results writes the package's)."""
    rows = load_rows(out_dir)
    entries = curves(rows)
    refs = GB._read_json(os.path.join(out_dir, "datasets.json"), {})
    cpu_h = sum(
        (r["points"][-1]["train_cpu_s"] + sum(p["eval_cpu_s"] for p in r["points"])) for r in rows if r["points"]
    )
    versus = cheap_against_choice(rows, entries)
    n_done = sum(bool(r.get("done")) for r in rows)
    cells_dir = os.path.relpath(os.path.join(out_dir, "cells"), os.path.dirname(HERE))
    if cells_dir.startswith(".."):  # outside the repository: where it is
        cells_dir = os.path.join(os.path.abspath(out_dir), "cells")
    md = to_markdown(
        entries, refs, len(rows), n_done, cpu_h / 3600, planned, versus, bn_statistics_table(rows), cells_dir
    )
    for d in DATASETS:
        png = curves_figure(entries, d, os.path.join(out_dir, f"long-row-{d}.png"))
        if png and docs:
            os.makedirs(docs, exist_ok=True)
            shutil.copy(png, os.path.join(docs, os.path.basename(png)))
    wall = dat_wall_figure(entries, os.path.join(out_dir, "long-row-dat-wall.png"))
    if wall and docs:
        shutil.copy(wall, os.path.join(docs, os.path.basename(wall)))
    write_json(os.path.join(out_dir, "summary.json"), {"entries": entries, "references": refs, "cheap": versus})
    if targets:
        write_json(targets, targets_evidence(rows, entries))
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(md)
    if readme:
        GB.write_readme(md, readme, START, END, HEADING)
    return md


def merge_from(archive: str, out_dir: str = RESULTS) -> list[str]:
    """Unpack a ``run_gpu_long_row.sh`` archive's cells into ``out_dir/cells``: a cell done here is
    never overwritten; one not done here (or absent) takes the archive's, when that is done or has
    more points (the replaced cell's checkpoint is set aside as ``.stale``, so that no run resumes
    it into a curve of two devices; :func:`run` leaves a cell another device started to that device).
    Its ``runs.json`` entries are appended to ``out_dir/runs.json`` and its log kept as
    ``out_dir/gpu-<archive>.log``. Returns a line per cell. Stop a CPU run before merging: it
    rewrites the JSON of the cell it is training."""
    import tarfile
    import tempfile

    lines = []
    os.makedirs(os.path.join(out_dir, "cells"), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        for path in sorted(glob.glob(os.path.join(tmp, "**", "cells", "*.json"), recursive=True)):
            new = GB._read_json(path)
            dest = os.path.join(out_dir, "cells", os.path.basename(path))
            old = GB._read_json(dest, {})
            state = "done" if new.get("done") else f"{len(new.get('points', []))} points"
            if old.get("done"):
                lines.append(f"kept (done here): {os.path.basename(path)}")
            elif old and not new.get("done") and len(old.get("points", [])) >= len(new.get("points", [])):
                lines.append(f"kept (as many points here): {os.path.basename(path)}")
            else:
                shutil.copy(path, dest)
                ckpt = os.path.join(out_dir, "checkpoints", os.path.basename(path)[: -len(".json")] + ".pt")
                if os.path.exists(ckpt):
                    os.replace(ckpt, ckpt + ".stale")
                lines.append(
                    f"{'replaced' if old else 'added'} ({new.get('device', 'cpu')}, {state}): {os.path.basename(path)}"
                )
        base = os.path.basename(archive).split(".")[0]
        for path in glob.glob(os.path.join(tmp, "**", "runs.json"), recursive=True):
            runs_path = os.path.join(out_dir, "runs.json")
            added = [{**r, "merged_from": os.path.basename(archive)} for r in GB._read_json(path, [])]
            write_json(runs_path, GB._read_json(runs_path, []) + added)
        for path in glob.glob(os.path.join(tmp, "**", "*.log"), recursive=True):
            shutil.copy(path, os.path.join(out_dir, f"gpu-{base}.log"))
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--datasets", nargs="*", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--networks", nargs="*", default=list(NETWORKS), choices=list(NETWORKS))
    p.add_argument("--iterations", type=int, default=ITERATIONS, help="at least this many per cell")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--retry-failed", action="store_true")
    p.add_argument("--probe", action="store_true", help="time each (network, run) and stop (OUT/speed.json)")
    p.add_argument("--plan", action="store_true", help="print the plan with its projected CPU time and stop")
    p.add_argument("--report", action="store_true", help="no training: curves, table, README section and docs figure")
    p.add_argument("--device", default=None, help="train on this device (e.g. cuda); evaluation stays on the CPU")
    p.add_argument("--deadline-s", type=float, default=None, help=DEADLINE_HELP)
    p.add_argument("--deadline-at", type=float, default=None, help="the same, at this time.time() (a script's clock)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--gpu-plan", action="store_true", help="the GPU's order (gpu_plan): resnet18, dat, the CPU plan's rest"
    )
    p.add_argument("--gpu-iterations", type=int, default=GPU_ITERATIONS, help="the resnet18 cells' iterations")
    p.add_argument("--done-dir", default=os.path.join(RESULTS, "cells"), help="--gpu-plan skips the cells done here")
    p.add_argument("--skip-started", action="store_true", help="--gpu-plan: also skip cells with points in --done-dir")
    p.add_argument(
        "--cheap", action="store_true", help="the cheap role's plan (CHEAP_TIERS): the choice with --cheap-cut"
    )
    p.add_argument(
        "--cheap-cut", default=CHEAP_CUT, choices=list(CUTS), help="--cheap: which of bench_train_step's cuts"
    )
    p.add_argument(
        "--px-weights",
        nargs="+",
        type=float,
        default=None,
        help="the weight role's plan: jem train's choice at these p(x) weights (--datasets, --networks, --seeds)",
    )
    p.add_argument(
        "--smoothed", action="store_true", help="--px-weights: the smoothed role (the weight plus smoothed negatives)"
    )
    p.add_argument(
        "--coarse",
        action="store_true",
        help=f"--px-weights: the coarse role (the weight, {COARSE_SHARE:.0%}% of chains started from coarse images)",  # %% for argparse
    )
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="--px-weights: the seeds")
    p.add_argument("--tiny", action="store_true", help="the tiny data sets (a smoke test of the plumbing)")
    p.add_argument("--limit", type=int, default=None, help="only the first N cells of the plan")
    p.add_argument("--no-report", action="store_true", help="no summary or curves after the run")
    p.add_argument("--merge-from", default=None, help="a run_gpu_long_row.sh tar.gz: its cells into OUT/cells")
    a = p.parse_args(argv)
    deadline = a.deadline_at if a.deadline_s is None else time.time() + a.deadline_s
    torch.set_num_threads(1)  # the parent: no OpenMP pool for the forked workers (each sets its --threads) to inherit
    out_dir = os.path.abspath(a.out)
    os.makedirs(out_dir, exist_ok=True)
    if a.merge_from:
        for line in merge_from(a.merge_from, out_dir):
            print(line)
        return
    if a.probe:
        write_json(os.path.join(out_dir, "speed.json"), probe_speed(a.networks, out_dir=out_dir))
        return
    if a.gpu_plan:
        weights = GPU_PX_WEIGHTS if a.px_weights is None else a.px_weights
        cells = gpu_plan(a.done_dir, a.iterations, a.gpu_iterations, a.tiny, a.skip_started, weights)
    elif a.px_weights:
        if a.smoothed and a.coarse:
            p.error("--smoothed and --coarse are two roles: run them one at a time")
        role = SMOOTHED_ROLE if a.smoothed else COARSE_ROLE if a.coarse else WEIGHT_ROLE
        cells = weight_plan(a.datasets, a.networks, a.px_weights, a.seeds, a.iterations, a.tiny, role)
    else:
        tiers = CHEAP_TIERS if a.cheap else TIERS
        cells = plan(a.datasets, a.networks, a.iterations, tiers, tiny=a.tiny, cut=a.cheap_cut if a.cheap else None)
    cells = cells[: a.limit] if a.limit is not None else cells
    if a.plan:
        speed = GB._read_json(os.path.join(out_dir, "speed.json")) or speed_from_matrix()
        print(plan_table(cells, speed, speed_on_the_row(os.path.join(out_dir, "cells"))))
        return
    if a.report:
        of_record = out_dir == os.path.abspath(RESULTS)  # only the committed results speak for jem train and the docs
        if of_record:
            print(report(out_dir, planned=len(cells), targets=str(LONG_ROW_TARGETS)))
        else:
            print(report(out_dir, readme=None, docs=None, planned=len(cells)))
        return
    run(
        cells,
        out_dir,
        workers=a.workers,
        retry_failed=a.retry_failed,
        report_each=not a.no_report,
        device=a.device,
        deadline=deadline,
        threads=a.threads,
    )
    if not a.no_report:
        print(report(out_dir, readme=None, docs=None))


if __name__ == "__main__":
    main()
