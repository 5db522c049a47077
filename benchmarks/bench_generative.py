"""The generative half on the networks users bring (issue 16), per JEM-family recipe, at CPU sizes.

Settings:

- ``digits32_<model>``: the bundled digits upscaled to 32x32 RGB (bilinear), ImageNet-normalised,
  a timm network with BatchNorm (``test_resnet`` by default; ``resnet10t``, ``resnet18`` ... with ``--model32``);
- ``digits8_cnn``: the BN-free :class:`~jem_plugin.app.nets.DigitsCNN` on the 8x8 digits in [-1, 1].

Recipes (:data:`jem_plugin.recipes.RECIPES`; every run uses a 1000-sample replay buffer so the
chains get long at these short runs, except a recipe that sizes its own for the run
(``buffer_visits``: ``generative``, 1104 slots at 60 epochs), and random translations of +-1 pixel (8x8) / +-4 (32x32)
as augmentation): ``baseline`` (cross-entropy, the fast preset's optimiser), ``fast`` (the
default), ``fast_uniform`` (the fast preset before issue 16: uniform init, samples in the data's
BatchNorm pass), ``jempp``, ``sadajem`` (SAM, p(x) on the un-augmented batch), ``generative``
(a stationary init, p(x) on the un-augmented batch). On the 32x32
setting, ``--bn-runs`` (default ``fast``) are repeated once per ``--bn-modes``: ``joint`` (one
forward over data and samples), ``separate`` (the samples' own train-mode pass, chains on running
statistics), ``eval`` (the samples' part in eval mode) and ``batch`` (``separate`` with chains on
their own batch statistics: the fast preset's own setting). ``--set NAME=VALUE`` changes recipe
settings (by their flat names, as ``jem train``'s flags) in every JEM run, ``--seeds`` repeats runs, ``--only 32|8`` picks a setting.

Measured per run: test accuracy and ECE (and ECE after temperature scaling, each half of the
test set scaled by a temperature fitted on the other: ``jem.calibration.cross_fitted_report``); OOD AUROC of ``logpx``, ``grad_norm`` and
``grad_norm_projected`` against uniform noise, photo patches and transposed digits; sample quality
from an independent judge (:mod:`jem_plugin.sample_quality`, trained here in seconds): the
Fréchet distance of 360 buffer samples to the 360 test images and of class-conditional samples
(40 steps of the recipe's sampler from its initial distribution, 10 per class), and the judge's
accuracy on the latter; reference points (test halves, train, initial distribution); the buffer's
chains continued for 4 and 20 more rounds of the recipe's sampler, with the model's energy and the
judge's distance along them (:func:`~jem_plugin.sample_quality.chain_trace`); training CPU seconds
against the baseline. Sample grids: ``<setting>_<run>.png``. ``--fit-init train`` fits informative
inits on the clean training set (as ``jem train`` does) instead of fitting them from the first
batches of the loop (``--fit-init loop``, up to 1024 examples:
:class:`~jem_plugin.extensions.FitInitFromBatches`).
A recipe with ``bn_stats_from_data`` (``generative``) is evaluated after its BatchNorm running
statistics are recomputed from the training set, as ``jem train`` leaves it; ``--bn-from-data``
reports every JEM run both ways.

    python benchmarks/bench_generative.py                 # ~25 CPU minutes (~13 on 2 cores)
    python benchmarks/bench_generative.py --quick         # seconds (smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import update_bn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from jem_plugin.app.data import digits_tensors, photo_patches, transposed, uniform_noise
from jem_plugin.builtins.pgd_negatives import DAT_RECIPE_CHANGES, PGDNegatives, use_pgd_negatives
from jem_plugin.extensions import FitInitFromBatches
from jem_plugin.inits import Uniform
from jem_plugin.recipes import OptimConfig, Recipe, get_recipe
from jem_plugin.sam import SAM
from jem_plugin.sample_quality import chain_trace, reference_points, sample_quality, train_judge

#: the optimiser's flat setting names (``lr``, ...): overrides that also reach the baseline
OPTIM_NAMES = frozenset(f.name for f in dataclasses.fields(OptimConfig))

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generative")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RECIPE_RUNS = ("baseline", "fast", "fast_uniform", "jempp", "sadajem", "generative")
OOD_METHODS = ("logpx", "grad_norm", "grad_norm_projected")
OOD_SETS = ("noise", "patches", "transposed")
BUFFER_SIZE = 1000
#: ``start_run(negatives="dat")``: what :func:`~jem_plugin.builtins.pgd_negatives.dat_setup` changes
#: in a recipe, applied to the run's own recipe instead of ``fast``
DAT_CHANGES = DAT_RECIPE_CHANGES
#: ``start_run(negatives=...)``: None (the recipe's own), DAT's PGD negatives, or smoothed copies of the data
NEGATIVES = (None, "dat", "smoothed")
COND_STEPS, COND_PER_CLASS = 40, 10
TRACE_ROUNDS = (0, 4, 20)  # the buffer's chains continued for this many more rounds of the recipe's sampler


# ---------------------------------------------------------------------------- data
def to32(x8: torch.Tensor) -> torch.Tensor:
    """8x8 digits in [-1, 1] -> 32x32 RGB, ImageNet-normalised (what a torchvision pipeline yields)."""
    x = F.interpolate(x8, size=(32, 32), mode="bilinear", align_corners=False)
    x = ((x + 1) / 2).clamp(0, 1).repeat(1, 3, 1, 1)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def load_setting(name: str, n_train: int | None = None, n_test: int | None = None) -> dict[str, Any]:
    """A setting's data: the first ``n_train`` training digits (default all), the first ``n_test``
    test digits (default all; each OOD set as large)."""
    x8, y = digits_tensors("train")
    xt8, yt = digits_tensors("test")
    if n_train is not None:
        x8, y = x8[:n_train], y[:n_train]
    if n_test is not None:
        xt8, yt = xt8[:n_test], yt[:n_test]
    n = len(xt8)
    patches8 = photo_patches(n, size=8, seed=1)
    if name.startswith("digits32"):
        model_name = name.split("_", 1)[1]
        wrap_kw = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, input_size=(3, 32, 32), num_classes=10)
        dom = jem.wrap(nn.Linear(1, 1), **wrap_kw).domain
        return dict(
            name=name,
            model=model_name,
            wrap_kw=wrap_kw,
            shift=4,
            x=to32(x8),
            y=y,
            xt=to32(xt8),
            yt=yt,
            ood={
                "noise": dom.uniform(n, (3, 32, 32), generator=torch.Generator().manual_seed(2)),
                "patches": to32(patches8),
                "transposed": to32(transposed(xt8)),
            },
        )
    wrap_kw = dict(data_range=(-1.0, 1.0), input_size=(1, 8, 8), num_classes=10)
    return dict(
        name=name,
        model="digits_cnn",
        wrap_kw=wrap_kw,
        shift=1,
        x=x8,
        y=y,
        xt=xt8,
        yt=yt,
        ood={"noise": uniform_noise(n, (1, 8, 8), seed=2), "patches": patches8, "transposed": transposed(xt8)},
    )


def make_model(name: str) -> nn.Module:
    if name == "digits_cnn":
        from jem_plugin.app.nets import DigitsCNN

        return DigitsCNN(num_classes=10)
    if name.startswith("wrn"):  # "wrn10-1": the JEM paper's Wide-ResNet, no normalisation (as --model takes it)
        from jem_plugin.nets import build_model

        return build_model(name, 10, 3)
    import timm

    name, _, extra = name.partition(":")  # "test_resnet:act_layer=silu": timm.create_model keywords
    kwargs = {k: _parse_value(v) for k, v in (kv.split("=", 1) for kv in extra.split(",") if kv)}
    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


def shift_augment(x: torch.Tensor, s: int, g: torch.Generator) -> torch.Tensor:
    """Random translation by up to ``s`` pixels (edge-replicated), one offset per image."""
    if s <= 0:
        return x
    pad = F.pad(x, (s, s, s, s), mode="replicate")
    dx, dy = torch.randint(0, 2 * s + 1, (2, x.shape[0]), generator=g).tolist()
    h, w = x.shape[-2:]
    return torch.stack([pad[i, :, a : a + h, b : b + w] for i, (a, b) in enumerate(zip(dx, dy))])


# ---------------------------------------------------------------------------- BatchNorm modes
BN_MODES = ("joint", "separate", "batch", "eval")


class SamplesInEvalMode(nn.Module):
    """The ``eval`` BatchNorm mode, which the library does not offer (it breaks training): in the
    joint forward the samples' part runs in eval mode (running statistics)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.n_data = model, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.n_data
        if not self.training or n is None or x.shape[0] <= n:
            return self.model(x)
        data = self.model(x[:n])
        self.model.eval()
        try:
            rest = self.model(x[n:])
        finally:
            self.model.train()
        return torch.cat([data, rest])


class ChainsOnRunningStatistics(jem.SGLD):
    """The ``separate`` BatchNorm mode, which the library's one knob does not offer: the loss passes
    the samples on their own (``SGLD(batchnorm="separate")``: their own train-mode forward, running
    statistics from data only) while the chains normalise with the running statistics, as
    ``"joint"``'s chains do."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "batchnorm": "separate"})

    def _chain(self, *args: Any, **kwargs: Any) -> Any:  # the chain driver that run and sample share
        self.batchnorm = "joint"  # the chains: running statistics
        try:
            return super()._chain(*args, **kwargs)
        finally:
            self.batchnorm = "separate"  # what the loss reads


def with_bn_mode(r: Recipe, mode: str) -> Recipe:
    """The recipe with samples passing BatchNorm as ``mode`` says: ``joint`` (JEMLoss's one
    forward, shared statistics; chains on the running statistics), ``separate`` (the samples in their
    own train-mode forward, running statistics from data only; chains on the running statistics:
    :func:`sampler_for` gives it :class:`ChainsOnRunningStatistics`), ``batch`` (``separate`` and
    chains normalised by their own batch statistics: JEM++'s passes)."""
    if mode in ("separate", "batch"):
        return r.replace(sgld_batchnorm="separate")
    # "joint", and "eval" (whose split into data and samples SamplesInEvalMode does inside the joint forward)
    return r.replace(sgld_batchnorm="joint")


def sampler_for(r: Recipe, bn_mode: str | None, generator: torch.Generator | None = None) -> jem.SGLD:
    """The recipe's sampler; in the ``separate`` BatchNorm mode its chains on the running statistics."""
    cfg = r.sampler
    if bn_mode != "separate":
        return cfg.build(generator)
    return ChainsOnRunningStatistics(
        steps=cfg.steps,
        step_size=cfg.step_size,
        noise=cfg.noise,
        grad_clamp=cfg.grad_clamp,
        clamp=cfg.clamp,
        colours=cfg.colours,
        generator=generator,
    )


def build_loss(
    r: Recipe,
    S: dict,
    total: int,
    batch_size: int,
    g: torch.Generator,
    fit_init: str,
    bn_mode: str | None = None,
    num_classes: int = 10,
) -> jem.JEMLoss:
    """The recipe's loss for a run of ``total`` iterations on ``S["x"], S["y"]``: its sampler
    (:func:`sampler_for`), its buffer sized for the run, the init fitted on the clean training set
    (``fit_init="train"``, as ``recipe.build`` and ``jem train`` do) or left for the loop to fit
    from its first batches (``"loop"``: :class:`~jem_plugin.extensions.FitInitFromBatches`)."""
    per_class = not isinstance(r.buffer.init, Uniform) or r.loss.pxy_weight > 0 or r.loss.class_conditional_px
    buffer = jem.ReplayBuffer(
        r.buffer.capacity_for(total, r.loss.n_samples or batch_size),
        tuple(S["x"].shape[1:]),
        reinit_freq=r.buffer.reinit_freq,
        init=r.buffer.init,
        num_classes=num_classes if per_class else None,
    )
    if fit_init == "train" and buffer.needs_fit:
        buffer.fit(S["x"], S["y"])
    return r.loss.build(sampler_for(r, bn_mode, g), buffer, g)


# ---------------------------------------------------------------------------- one run
def recipe_for(run: str, quick: bool, bn_mode: str | None = None, overrides: dict | None = None) -> Recipe | None:
    """The run's recipe; ``overrides``: settings by flat name (``recipe.replace``)."""
    if run == "baseline":
        return None
    r = get_recipe("fast" if run == "fast_uniform" else run)
    if run == "fast_uniform":  # the fast preset before issue 16: uniform init, samples in the data's BatchNorm pass
        r = dataclasses.replace(r.replace(init="uniform", sgld_batchnorm="joint"), name="fast_uniform")
    if bn_mode is not None:
        r = with_bn_mode(r, bn_mode)
    overrides = dict(overrides or {})
    if quick:
        r = r.replace(buffer_capacity=40, buffer_visits=None)
    elif "buffer_capacity" in overrides:  # a size asked for is the size used
        overrides.setdefault("buffer_visits", None)
    elif r.buffer.visits is None:  # a recipe that sizes its buffer for the run keeps that
        r = r.replace(buffer_capacity=BUFFER_SIZE)
    return r.replace(**overrides)


def use_dat_negatives(loss_fn: jem.JEMLoss, r: Recipe, generator: torch.Generator | None) -> PGDNegatives:
    """Swap ``loss_fn``'s SGLD for DAT's PGD negatives and add the ``logistic_contrast`` term, as
    :func:`~jem_plugin.builtins.pgd_negatives.dat_setup` does to ``fast``'s loss (``r``: the recipe
    with :data:`DAT_CHANGES`)."""
    return use_pgd_negatives(loss_fn, r.sampler.batchnorm, generator=generator)  # dat_setup's 20 steps, weight 1


def start_run(
    S: dict,
    run: str,
    total: int,
    seed: int = 0,
    bn_mode: str | None = None,
    quick: bool = False,
    batch_size: int = 64,
    overrides: dict | None = None,
    fit_init: str = "loop",
    device: str | torch.device | None = None,
    negatives: str | None = None,
) -> dict[str, Any]:
    """Everything a run of ``total`` iterations trains with, before its first step: the model (in
    train mode), its JEM, the recipe (``None``: the baseline), optimiser, warm-up schedule, SAM,
    loss (buffer sized for ``total``) and the generator ``g`` that shuffles, augments and drives
    the chains. :func:`train_step` takes one step of it; :func:`train_run` is the whole run.

    ``device``: ``None`` (the CPU, as always), or where the model and loss train; the chains and
    the loss then draw from their own generator on that device, seeded with ``seed`` (SGLD wants
    its generator where its chains are), while ``g`` stays on the CPU and shuffles and augments;
    :func:`train_step` moves each batch there. ``negatives="dat"``: the recipe with
    :data:`DAT_CHANGES` and :func:`use_dat_negatives` (PGD negatives, logistic contrast);
    ``negatives="smoothed"``: the recipe as it is, plus the ``smoothed_negatives`` term at its
    defaults (each image likelier than a blurred copy of itself; its sigma drawn from ``g_chains``)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_model(S["model"])
    if device is not None:  # before the optimiser is built: its state follows the parameters
        model.to(device)
    net = SamplesInEvalMode(model) if bn_mode == "eval" else model
    jm = jem.wrap(net, **S["wrap_kw"])
    r = recipe_for(run, quick, bn_mode, overrides)
    if negatives not in NEGATIVES:
        raise ValueError(f"negatives must be one of {NEGATIVES}, got {negatives!r}")
    if negatives is not None and r is None:
        raise ValueError(f"negatives={negatives!r} needs a recipe (the baseline has no negatives)")
    if negatives == "dat":
        r = r.replace(**DAT_CHANGES)
    # the baseline trains with the fast preset's optimiser, and the same optimiser overrides
    base = r or get_recipe("fast").replace(**{k: v for k, v in (overrides or {}).items() if k in OPTIM_NAMES})
    opt = base.optim.build(model.parameters())
    warm = base.optim.warmup_for(total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0)
    sam = SAM(opt, rho=r.sam.rho, adaptive=r.sam.adaptive) if r is not None and r.sam.rho is not None else None
    # fit_init "train": the informative init fitted on the clean training set, as `jem train` does;
    # "loop": fitted from the first batches (the p(x) term's data, else the augmented batch), as in
    # a user's own loop.
    g_chains = g if device is None else torch.Generator(device=device).manual_seed(seed)
    loss_fn = build_loss(r, S, total, batch_size, g_chains, fit_init, bn_mode) if r is not None else None
    if loss_fn is not None and negatives == "dat":
        use_dat_negatives(loss_fn, r, g_chains)
    if loss_fn is not None and negatives == "smoothed":
        loss_fn.add_term("smoothed_negatives", generator=g_chains)
    if loss_fn is not None and device is not None:
        loss_fn.to(device)  # its buffer and init with it
    fit_from_batches = FitInitFromBatches(loss_fn.buffer) if loss_fn is not None and fit_init == "loop" else None
    model.train()
    return dict(
        model=model,
        net=net,
        jm=jm,
        recipe=r,
        lr=base.optim.lr,
        opt=opt,
        sched=sched,
        sam=sam,
        loss_fn=loss_fn,
        fit_from_batches=fit_from_batches,
        g=g,
        shift=S["shift"],
        total=total,
        device=device,
        seed=seed,
    )


def train_step(ctx: dict[str, Any], x_clean: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """One training iteration of :func:`start_run`'s run on the clean batch ``x_clean, y``
    (augmented here with ``ctx["g"]``); returns its metrics."""
    r, model, opt, loss_fn, jm = ctx["recipe"], ctx["model"], ctx["opt"], ctx["loss_fn"], ctx["jm"]
    x = shift_augment(x_clean, ctx["shift"], ctx["g"])
    device = ctx.get("device")
    if device is not None:  # shuffled and augmented on the CPU with the run's generator, trained there
        x, y, x_clean = x.to(device), y.to(device), x_clean.to(device)
    if r is None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        metrics = {"loss": loss.item()}
    else:
        px = x_clean if r.loss.px_clean_data else None
        if ctx["fit_from_batches"] is not None:
            ctx["fit_from_batches"].on_batch(None, x if px is None else px, y)
        if isinstance(ctx["net"], SamplesInEvalMode):
            ctx["net"].n_data = x.shape[0] * (2 if px is not None else 1)

        def closure():
            out = loss_fn(jm, x, y, px_data=px)
            out.loss.backward()
            return out

        if ctx["sam"] is not None:
            out = ctx["sam"].step(closure, model=model, loss_fn=loss_fn)
        else:
            opt.zero_grad(set_to_none=True)
            out = closure()
            opt.step()
        metrics = out.metrics
    ctx["sched"].step()
    return metrics


def train_run(
    S: dict,
    run: str,
    epochs: int,
    seed: int = 0,
    bn_mode: str | None = None,
    quick: bool = False,
    batch_size: int = 64,
    overrides: dict | None = None,
    fit_init: str = "loop",
) -> dict[str, Any]:
    total = epochs * math.ceil(len(S["x"]) / batch_size)
    ctx = start_run(S, run, total, seed, bn_mode, quick, batch_size, overrides, fit_init)
    model, g = ctx["model"], ctx["g"]
    t_cpu, t_wall = time.process_time(), time.perf_counter()
    history = []
    for _ in range(epochs):
        perm = torch.randperm(len(S["x"]), generator=g)
        for idx in perm.split(batch_size):
            metrics = train_step(ctx, S["x"][idx], S["y"][idx])
        history.append({k: round(v, 4) for k, v in metrics.items()})
    cost = {
        "train_cpu_s": time.process_time() - t_cpu,
        "train_wall_s": time.perf_counter() - t_wall,
        "iterations": total,
        "buffer_slots": ctx["loss_fn"].buffer.capacity if ctx["loss_fn"] is not None else None,
        "lr": ctx["lr"],
    }
    model.eval()
    jm_eval = jem.wrap(model, **S["wrap_kw"])  # evaluation on the bare model
    return dict(model=model, jm=jm_eval, loss_fn=ctx["loss_fn"], recipe=ctx["recipe"], cost=cost, history=history)


def init_draws(S: dict, r, loss_fn, jm, n: int, y=None, seed: int = 3) -> torch.Tensor:
    """``n`` draws of the run's initial distribution (uniform for the baseline)."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(S["x"].shape[1:])
    if loss_fn is not None and loss_fn.buffer is not None:
        return loss_fn.buffer.init_dist.sample(n, shape, jm.domain, g, "cpu", y=y)
    return jm.domain.uniform(n, shape, generator=g)


def evaluate_run(
    S: dict,
    res: dict,
    judge,
    quick: bool,
    *,
    ood_methods: Sequence[str] = OOD_METHODS,
    trace_rounds: Sequence[int] | None = None,
    cond_steps: int | None = None,
    cond_per_class: int | None = None,
    init_like_buffer: bool = False,
) -> dict[str, Any]:
    """Accuracy, ECE, OOD AUROCs, sample quality of one trained run (``train_run``'s result).

    ``S["ood"]``: the OOD sets (any names). With a validation split ``S["xv"], S["yv"]`` the
    temperature behind ``ece_ts`` is fitted on it (else each half of the test set is scaled by
    one fitted on the other). ``trace_rounds``: rounds of :func:`chain_trace` (``()``: none;
    default (0, 1) quick, else :data:`TRACE_ROUNDS`); ``cond_steps``/``cond_per_class``: the
    class-conditional samples (default :data:`COND_STEPS` / :data:`COND_PER_CLASS`, 2 / 2 quick;
    ``cond_per_class=0``: none, and no ``cond`` entry);
    ``init_like_buffer``: the initial distribution's distance (``init_fd``) from as many draws as
    the buffer sample has (the Fréchet distance grows at small sizes), else from as many as the
    test set. ``cond["judge_acc_init"]``: the judge on the class draws the samples started from.
    """
    jm, r, loss_fn = res["jm"], res["recipe"], res["loss_fn"]
    with torch.no_grad():
        logits = jm(S["xt"])
    out: dict[str, Any] = {
        "accuracy": float((logits.argmax(1) == S["yt"]).float().mean()),
        "ece": jem.calibration.ece(logits, S["yt"], from_logits=True),
    }
    if S.get("xv") is not None:  # the temperature fitted on the validation split, applied to the test split
        with torch.no_grad():
            val_logits = jm(S["xv"])
        rep = jem.calibration.calibration_report(logits, S["yt"], fit_logits=val_logits, fit_labels=S["yv"])
        out["ece_ts"], out["temperature"] = rep["ece_after"], rep["temperature"]
        out["val_accuracy"] = float((val_logits.argmax(1) == S["yv"]).float().mean())
    else:
        out["ece_ts"] = jem.calibration.cross_fitted_report(logits, S["yt"])["ece_after"]
    ood = jem.ood.evaluate_all(jm, S["xt"], S["ood"], methods=ood_methods, progress=False)
    out["auroc"] = {m: {s: round(ood[m][s]["auroc"], 4) for s in S["ood"]} for m in ood_methods}
    n = len(S["xt"])
    rounds = ((0, 1) if quick else TRACE_ROUNDS) if trace_rounds is None else tuple(trace_rounds)
    n_init = n
    if loss_fn is not None and loss_fn.buffer is not None and loss_fn.buffer._is_init:
        buf = loss_fn.buffer.samples(min(n, loss_fn.buffer.capacity))
        n_init = len(buf) if init_like_buffer else n
        out["buffer"] = sample_quality(judge, buf, S["xt"])
        out["buffer_samples"] = buf
        if rounds:
            # Does the learned energy lead towards the data, or to low energy that looks like nothing?
            out["chains"] = chain_trace(
                jm,
                judge,
                buf,
                S["xt"],
                sampler=loss_fn.sampler,
                rounds=rounds,
                batch_size=r.loss.n_samples or 64,
            )
    out["init_fd"] = reference_points(judge, S["xt"], init=init_draws(S, r, loss_fn, jm, n_init), n=n_init)["init"]
    if cond_per_class == 0:
        return out
    per = cond_per_class or (2 if quick else COND_PER_CLASS)
    yc = torch.arange(10).repeat_interleave(per)
    x0 = init_draws(S, r, loss_fn, jm, len(yc), y=yc)
    ref = r or get_recipe("fast")
    # the training chains' settings, their BatchNorm mode included (ChainsOnRunningStatistics: "joint")
    chains = "joint" if loss_fn is not None and isinstance(loss_fn.sampler, ChainsOnRunningStatistics) else None
    sampler = dataclasses.replace(
        ref.sampler, steps=cond_steps or (2 if quick else COND_STEPS), batchnorm=chains or ref.sampler.batchnorm
    ).build(torch.Generator().manual_seed(4))
    if ref.sampler.colours == "data" and loss_fn is not None:  # the training chains' colour axes
        sampler.use_colours_of(loss_fn.buffer)
    xc = sampler.sample(jm, x_init=x0, y=yc)
    out["cond"] = sample_quality(judge, xc, S["xt"], y_samples=yc)
    out["cond"]["model_acc"] = float((jm(xc).argmax(1) == yc).float().mean())  # the model fools itself
    out["cond"]["judge_acc_init"] = judge.accuracy(x0, yc)
    out["cond_samples"], out["cond_labels"] = xc, yc
    return out


# ---------------------------------------------------------------------------- figures
def grid_buffer_index(n: int, shown: int = 80) -> torch.Tensor:
    """Which of ``n`` buffer samples the grid shows: evenly spread over all of them. The buffer's
    slots are grouped by the class of their initial draw, so its first 80 would show 2-3 classes."""
    return torch.linspace(0, n - 1, min(n, shown)).round().long()


def save_grid(
    path: str, title: str, domain, buf: torch.Tensor | None, xc: torch.Tensor, yc: torch.Tensor, judge
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = int((yc == 0).sum())
    if buf is not None:
        buf = buf[grid_buffer_index(len(buf))]
    ncols = per + (8 if buf is not None else 0) + (1 if buf is not None else 0)
    fig, axes = plt.subplots(10, ncols, figsize=(ncols * 0.9, 10 * 0.95 + 0.6), squeeze=False)
    pred = judge.predict(xc)

    def show(ax, img):
        img = domain.to_unit(img.unsqueeze(0))[0].clamp(0, 1)
        ax.imshow(
            (img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)).numpy(),
            cmap="gray",
            vmin=0,
            vmax=1,
            interpolation="nearest",
        )

    for row in range(10):
        for c in range(per):
            ax = axes[row, c]
            i = row * per + c
            show(ax, xc[i])
            ax.set_title(f"judge {int(pred[i])}", fontsize=6, color="green" if int(pred[i]) == row else "red", pad=1)
        axes[row, 0].set_ylabel(f"y={row}", fontsize=8)
        if buf is not None:
            axes[row, per].axis("off")
            for c in range(8):
                k = row * 8 + c
                if k < len(buf):
                    show(axes[row, per + 1 + c], buf[k])
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    if buf is not None:
        axes[0, per + 1].set_title("replay buffer ->", fontsize=7, loc="left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- driver
def _job(args: tuple) -> list[dict[str, Any]]:
    setting, run, epochs, bn_mode, quick, out_dir, n_train, overrides, tag, seed, fit_init, bn_from_data, n_test = args
    torch.set_num_threads(1)
    S = load_setting(setting, n_train, n_test)
    judge = _judge(S, quick)
    res = train_run(
        S,
        run,
        epochs,
        seed=seed,
        bn_mode=bn_mode,
        quick=quick,
        overrides=overrides if run != "baseline" else None,
        fit_init=fit_init,
    )
    key = run if bn_mode is None else f"{run}_bn_{bn_mode}"
    key += f"_{tag}" if tag and run != "baseline" else ""
    key += f"_seed{seed}" if seed else ""
    r = res["recipe"]
    if r is None:  # the cross-entropy baseline
        return [_evaluated_row(S, res, judge, quick, setting, key, epochs, out_dir)]
    recomputes = r.bn_stats_from_data  # as `jem train` does after training
    rows = []
    if bn_from_data or not recomputes:
        # The model as trained (for a recipe that recomputes: the other half of the pair)
        rows.append(
            _evaluated_row(
                S,
                res,
                judge,
                quick,
                setting,
                key.replace(run, run + "_bnastrained", 1) if recomputes else key,
                epochs,
                out_dir,
            )
        )
    if bn_from_data or recomputes:
        # The same trained model, its BatchNorm running statistics recomputed from the clean
        # training set (the joint pass mixed the samples into them)
        update_bn([S["x"][i : i + 64] for i in range(0, len(S["x"]), 64)], res["model"])
        res["model"].eval()
        res["jm"] = jem.wrap(res["model"], **S["wrap_kw"])
        rows.append(
            _evaluated_row(
                S,
                res,
                judge,
                quick,
                setting,
                key if recomputes else key.replace(run, run + "_bnfromdata", 1),
                epochs,
                out_dir,
            )
        )
    return rows


def _evaluated_row(S, res, judge, quick, setting, key, epochs, out_dir) -> dict[str, Any]:
    ev = evaluate_run(S, res, judge, quick)
    q = ev.get("buffer", {})
    title = (
        f"{setting} / {key}: acc {ev['accuracy']:.3f}; cond. samples (left, {COND_STEPS if not quick else 2} "
        f"steps from init): judge acc {ev['cond']['judge_acc']:.2f}, model acc {ev['cond']['model_acc']:.2f}"
        + (f"; buffer FD {q['fd']:.1f} (init {ev['init_fd']:.1f})" if q else "")
    )
    dom = res["jm"].domain
    ev["grid"] = os.path.basename(
        save_grid(
            os.path.join(out_dir, f"{setting}_{key}.png"),
            title,
            dom,
            ev.pop("buffer_samples", None),
            ev.pop("cond_samples"),
            ev.pop("cond_labels"),
            judge,
        )
    )
    ev["cost"] = dict(res["cost"])
    ev["history_last"] = res["history"][-1]
    ev["recipe"] = str(res["recipe"]) if res["recipe"] is not None else "cross-entropy only"
    return {"setting": setting, "run": key, "epochs": epochs, **ev}


def _judge(S: dict, quick: bool):
    return train_judge(S["x"], S["y"], epochs=2 if quick else 15, test=(S["xt"], S["yt"]), seed=0)


def references(setting: str, quick: bool, n_train: int | None, n_test: int | None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    S = load_setting(setting, n_train, n_test)
    t = time.process_time()
    judge = _judge(S, quick)
    judge_s = time.process_time() - t
    n = len(S["xt"])
    jm = jem.wrap(nn.Linear(1, 1), **S["wrap_kw"])
    gauss = jem.ReplayBuffer(10, tuple(S["x"].shape[1:]), init="gaussian", num_classes=10).fit(S["x"], S["y"]).init_dist
    g = torch.Generator().manual_seed(5)
    ref = reference_points(
        judge, S["xt"], train=S["x"], init=jm.domain.uniform(n, tuple(S["x"].shape[1:]), generator=g), n=n
    )
    ref["gaussian_init"] = reference_points(
        judge, S["xt"], init=gauss.sample(n, tuple(S["x"].shape[1:]), jm.domain, g, "cpu"), n=n
    )["init"]
    ref["uniform_init"] = ref.pop("init")
    yc = torch.arange(10).repeat_interleave(COND_PER_CLASS)  # the judge on the init's own class draws
    init_acc = judge.accuracy(gauss.sample(len(yc), tuple(S["x"].shape[1:]), jm.domain, g, "cpu", y=yc), yc)
    noise_q = sample_quality(
        judge,
        jm.domain.uniform(100, tuple(S["x"].shape[1:]), generator=g),
        S["xt"],
        y_samples=torch.arange(10).repeat_interleave(10),
    )
    return {
        "judge_test_accuracy": judge.test_accuracy,
        "judge_train_cpu_s": judge_s,
        "judge_acc_on_uniform_noise": noise_q["judge_acc"],
        "judge_acc_on_gaussian_init": init_acc,
        "fd": ref,
    }


def run(
    settings=("digits32_test_resnet", "digits8_cnn"),
    runs=RECIPE_RUNS,
    epochs32: int = 20,
    epochs8: int = 40,
    bn_modes: Sequence[str] = (),
    bn_runs: Sequence[str] = ("fast",),
    quick: bool = False,
    out_dir: str = OUT,
    workers: int = 2,
    n_train: int | None = None,
    overrides: dict | None = None,
    tag: str = "",
    seeds: Sequence[int] = (0,),
    fit_init: str = "loop",
    bn_from_data: bool = False,
    n_test: int | None = None,
) -> dict[str, Any]:
    """``runs`` with each recipe's own BatchNorm settings; then, on the 32x32 setting, each of
    ``bn_runs`` once per BatchNorm mode in ``bn_modes``. ``overrides``: recipe settings (flat names)
    changed in every JEM run (their names get ``_<tag>``). ``bn_from_data``: each JEM run is evaluated
    both with the BatchNorm running statistics of training and with those recomputed from the
    training set (a recipe with ``bn_stats_from_data`` is reported recomputed, as ``jem train``
    leaves it; the other half of the pair gets ``_bnfromdata`` / ``_bnastrained``). ``n_train`` /
    ``n_test``: the first so many training / test digits (default all; the OOD sets as many as the test's)."""
    os.makedirs(out_dir, exist_ok=True)
    jobs = []
    for s in settings:
        ep = epochs32 if s.startswith("digits32") else epochs8
        jobs += [
            (s, r, ep, None, quick, out_dir, n_train, overrides, tag, k, fit_init, bn_from_data, n_test)
            for k in seeds
            for r in runs
        ]
        if s.startswith("digits32"):
            jobs += [
                (s, r, ep, m, quick, out_dir, n_train, overrides, tag, k, fit_init, bn_from_data, n_test)
                for k in seeds
                for r in bn_runs
                for m in bn_modes
            ]
    t0 = time.perf_counter()
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            refs = {s: ex.submit(references, s, quick, n_train, n_test) for s in settings}
            rows = [row for rows in ex.map(_job, jobs) for row in rows]
            refs = {s: f.result() for s, f in refs.items()}
    else:
        refs = {s: references(s, quick, n_train, n_test) for s in settings}
        rows = [row for j in jobs for row in _job(j)]
    for row in rows:
        base = next((b for b in rows if b["setting"] == row["setting"] and b["run"].startswith("baseline")), None)
        if base is not None:
            row["cost_vs_baseline"] = row["cost"]["train_cpu_s"] / max(base["cost"]["train_cpu_s"], 1e-9)
    res = {
        "machine": {"threads_per_run": 1, "workers": workers, "wall_s": time.perf_counter() - t0},
        "settings": {
            "buffer_size": BUFFER_SIZE,
            "cond_steps": COND_STEPS,
            "epochs32": epochs32,
            "epochs8": epochs8,
            "batch_size": 64,
            "n_train": n_train,
            "n_test": n_test,
            "fit_init": fit_init,
            "bn_from_data": bn_from_data,
        },
        "references": refs,
        "rows": rows,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(to_markdown(res))
    return res


def to_markdown(res: dict[str, Any]) -> str:
    lines = ["# Generative quality per recipe (bench_generative.py)", ""]
    st = res["settings"]
    lines.append(
        f"Epochs: 32x32 {st['epochs32']}, 8x8 {st['epochs8']}; batch 64; replay buffer {st['buffer_size']} "
        "(a row that gives its slots: the recipe sized it for the run or --set sized it); "
        f"class-conditional samples: {st['cond_steps']} steps from the run's initial distribution; "
        f"informative inits fitted on {'the clean training set' if st.get('fit_init') == 'train' else 'the first batches of the loop (FitInitFromBatches)'}. "
        "FD = Fréchet distance to the 360 test images in the independent judge's features."
    )
    lines.append("")
    for s, ref in res["references"].items():
        fd = ref["fd"]
        lines.append(
            f"**{s}** judge: test accuracy {ref['judge_test_accuracy']:.3f}, accuracy on uniform noise "
            f"{ref['judge_acc_on_uniform_noise']:.2f}, on class draws of the per-class Gaussian "
            f"{ref.get('judge_acc_on_gaussian_init', float('nan')):.2f}; reference FD: test halves {fd['heldout_halves']:.2f}, "
            f"train {fd['train']:.2f}, uniform init {fd['uniform_init']:.1f}, Gaussian init "
            f"{fd['gaussian_init']:.1f}"
        )
        lines.append("")
    head = (
        "| setting | run | acc | ECE (after T) | logpx AUROC noise/patch/transp | grad_norm | grad_norm_proj | "
        "buffer FD (its init) | cond. FD | judge acc | model acc on own | CPU s | x baseline |"
    )
    lines += [head, "|" + "---|" * 13]
    for r in res["rows"]:
        a = r["auroc"]
        f3 = lambda m: "/".join(f"{a[m][s]:.3f}" for s in OOD_SETS)
        slots = r["cost"].get("buffer_slots")
        slots = f"; {slots} slots" if slots and slots != st["buffer_size"] else ""
        buf = f"{r['buffer']['fd']:.1f} ({r['init_fd']:.1f}{slots})" if "buffer" in r else f"- ({r['init_fd']:.1f})"
        lines.append(
            f"| {r['setting']} | {r['run']} | {r['accuracy']:.3f} | {r['ece']:.3f} ({r.get('ece_ts', float('nan')):.3f}) | {f3('logpx')} | "
            f"{f3('grad_norm')} | {f3('grad_norm_projected')} | {buf} | {r['cond']['fd']:.1f} | "
            f"{r['cond']['judge_acc']:.2f} | {r['cond']['model_acc']:.2f} | {r['cost']['train_cpu_s']:.0f} | "
            f"{r.get('cost_vs_baseline', float('nan')):.1f} |"
        )
    traced = [r for r in res["rows"] if "chains" in r]
    if traced:
        rounds = [t["rounds"] for t in traced[0]["chains"]["trace"]]
        lines += [
            "",
            "**The buffer's chains continued** for " + ", ".join(map(str, rounds[1:])) + " more rounds of "
            "each run's own sampler (its steps per round, its BatchNorm mode, 32 chains per batch): the "
            "model's mean energy E and the judge's Fréchet distance. Energy falling to the held-out data's "
            "while the distance does not fall means the chains found states that fool the model.",
            "",
            "| setting | run | steps | E | E held-out | FD |",
            "|---|---|---|---|---|---|",
        ]
        for r in traced:
            t = r["chains"]["trace"]
            arrow = lambda k, f: " → ".join(f.format(p[k]) for p in t)
            lines.append(
                f"| {r['setting']} | {r['run']} | {arrow('steps', '{}')} | {arrow('energy', '{:.2f}')} | "
                f"{r['chains']['heldout_energy']:.2f} | {arrow('fd', '{:.0f}')} |"
            )
    return "\n".join(lines) + "\n"


def register_plugin_files(paths: Sequence[str]) -> list[str]:
    """Register each Python file in ``paths`` as a jem plugin (its hook implementations at module
    level); returns the names they were registered under."""
    names = []
    for path in paths:
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names.append(jem.register(module, name=f"bench:{path}"))
    return names


def _parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"None": None, "True": True, "False": False}.get(v, v)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    p.add_argument("--epochs32", type=int, default=20)
    p.add_argument("--epochs8", type=int, default=40)
    p.add_argument(
        "--model32",
        default="test_resnet",
        help="timm model for the 32x32 setting (test_resnet, resnet10t; 'test_resnet:act_layer=silu' "
        "passes keywords to timm.create_model)",
    )
    p.add_argument("--runs", nargs="*", default=list(RECIPE_RUNS), choices=list(RECIPE_RUNS))
    p.add_argument(
        "--bn-modes",
        nargs="*",
        default=["joint", "separate", "eval"],
        choices=list(BN_MODES),
        help="BatchNorm modes to repeat --bn-runs with on the 32x32 setting (none: skip)",
    )
    p.add_argument("--bn-runs", nargs="*", default=["fast"], choices=list(RECIPE_RUNS[1:]))
    p.add_argument("--only", choices=("32", "8"), help="one setting only")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="recipe settings (flat names, as jem train's flags) changed in every JEM run, e.g. sgld_step_size=2 "
        "(run names get --tag)",
    )
    p.add_argument("--tag", default="")
    p.add_argument("--seeds", nargs="*", type=int, default=[0], help="one run per seed (names get _seedN for N > 0)")
    p.add_argument(
        "--fit-init",
        choices=("loop", "train"),
        default="loop",
        help="where an informative init is fitted: from the first batches of the loop (a user's loop, "
        "FitInitFromBatches: up to 1024 examples) or on the clean training set (what jem train does)",
    )
    p.add_argument(
        "--bn-from-data",
        action="store_true",
        help="evaluate each JEM run both with the BatchNorm running statistics of training and with "
        "those recomputed from the training set (torch.optim.swa_utils.update_bn): rows "
        "<run>_bnfromdata, or <run>_bnastrained for a recipe that recomputes them (generative)",
    )
    p.add_argument(
        "--plugin",
        nargs="*",
        default=[],
        metavar="FILE.py",
        help="register these files as jem plugins first (an init distribution to try: --set init=NAME)",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    register_plugin_files(a.plugin)  # before the worker processes fork, so they inherit them
    settings = tuple(
        s for s in (f"digits32_{a.model32}", "digits8_cnn") if a.only is None or s.endswith("cnn") == (a.only == "8")
    )
    overrides = {k: _parse_value(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    common = dict(
        bn_modes=a.bn_modes,
        bn_runs=a.bn_runs,
        out_dir=a.out,
        workers=a.workers,
        overrides=overrides,
        tag=a.tag,
        seeds=a.seeds,
        fit_init=a.fit_init,
        bn_from_data=a.bn_from_data,
    )
    if a.quick:
        res = run(settings, a.runs, 1, 1, quick=True, n_train=128, **common)
    else:
        res = run(settings, a.runs, a.epochs32, a.epochs8, **common)
    print(to_markdown(res))


if __name__ == "__main__":
    main()
