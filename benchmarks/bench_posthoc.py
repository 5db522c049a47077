"""Post-hoc OOD on the classifiers users already trained (issue 29): every jem-plugin score and
detector beside pytorch-ood's detectors, on the same model, the same images, in the same run.

Set-up:

- **Networks** trained here by cross-entropy on the bundled digits upscaled to 32x32 RGB
  (bilinear, ImageNet-normalised, +-4 pixel translations; :func:`benchmarks.bench_generative.to32`),
  Adam, batch 32, linear warm-up (the recipes' 200 iterations, capped) then cosine decay; the
  learning rate and epochs per network (:data:`NETWORKS`) bring each to 0.9-1.0 test accuracy:
  timm ``resnet10t`` (BatchNorm), ``lcnet_050`` (depthwise), ``convnext_atto`` (LayerNorm) and
  ``test_vit`` at ``img_size=32, patch_size=4`` (a ViT; ``vit_tiny`` at 32x32 costs ~20x more CPU).
- **JEM-trained twins** of ``resnet10t``: the same network, data and learning rate, trained from
  scratch with the library's ``fast`` recipe (5 SGLD steps; as many epochs as its cross-entropy
  twin) and its default ``generative`` recipe (10 steps, BatchNorm statistics recomputed from the
  training data after training, as the recipe says; half the epochs: it costs about twice as much
  per epoch), batch 64 beside the recipes' 32 chains (:data:`JEM_RECIPES`).
- **OOD sets** (360 images each, the size of the digits' test split): ``uniform`` (i.i.d. uniform
  pixels), ``gaussian`` (i.i.d. N(0.5, 0.25^2) pixels clipped to [0, 1]), ``transposed`` and
  ``inverted`` test digits, ``photo`` (crops of scikit-learn's two sample photos,
  :func:`jem_plugin.app.data.photo_patches`) and ``held_out``: digits 8-9 against digits 0-7 for a
  second model of the same network trained on 0-7 only (every detector fitted on that model's data).
- **Ours**: ``jem.ood.evaluate_all(jm, test, sets, "all", fit_data=train)``: every registered
  score; the fit-able detectors fitted on the training set. **pytorch-ood** (0.4): its
  detectors that apply to a plain classifier, at their defaults, on ``backbone(x) =
  model.forward_head(model.forward_features(x), pre_logits=True)`` and ``head =
  model.get_classifier()`` (what a timm user writes), fitted on the same training loader; their
  outlier scores negated.

Measured: AUROC (in-distribution positive; AUPR and FPR95 in the JSON) per score and set; the
time per 1000 images of one pass over all sets; for each detector both libraries have, the
largest difference between our scores and pytorch-ood's at matched settings (ASH at 90% and
SCALE at 85%, our defaults; ViM at our principal dimension; OpenMax on float64 logits with every
class predicted in each batch, :class:`EveryClassOpenMax`; MultiMahalanobis at our layer weights,
on the same pooled layers, :class:`LayerMahalanobis`; Gram at our powers, bounds and typical
deviations, in float64 with our denominators, on the same unpooled layers, :class:`LayerGram`)
and the throughput of both (Gram at our powers) on the
same 512 images (interleaved rounds, median of paired ratios). Targets of issue 29, per network.

    python -m benchmarks.bench_posthoc            # ~35 CPU minutes on one thread
    python -m benchmarks.bench_posthoc --quick    # a few minutes: 2 networks, short training

**One forward** (issue 46, ``--one-forward``): on each of the four networks (trained as above,
0-9 model only), ``evaluate_all`` over every score without an input gradient (one forward per
batch shared by all of them) beside the loop it replaced (:func:`per_detector_loop`: each
detector fitted by its own pass over the training digits, then each set scored by its own
passes), both on the test digits and the five far sets, interleaved rounds; ratio = median of
paired loop / shared times (target: 3x). Also counts the network's forwards each way and checks
that both give the same scores. Written to ``results/posthoc_one_forward.{json,md}``.

    python -m benchmarks.bench_posthoc --one-forward             # four networks, 3 rounds
    python -m benchmarks.bench_posthoc --one-forward --quick     # 2 networks, 1 epoch, 1 round
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jem_plugin as jem
from benchmarks import common
from benchmarks.bench_generative import IMAGENET_MEAN, IMAGENET_STD, build_loss, shift_augment, to32
from jem_plugin import ood
from jem_plugin.app.data import digits_tensors, photo_patches, transposed
from jem_plugin.extensions import FitInitFromBatches
from jem_plugin.recipes import Recipe, get_recipe

NAME = "posthoc"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NETWORKS = {  # name: (what it stands for, timm spec, Adam learning rate, epochs)
    "resnet10t": ("BatchNorm", "resnet10t", 2e-3, 12),
    # lcnet_050 at 5e-3 trained the 0-9 model (0.953) and not the 0-7 one (0.457): its rate is chosen
    # on the training split by validation accuracy, python -m benchmarks.tune_posthoc_lr (worst 0.83 at 1e-2)
    "lcnet_050": ("depthwise", "lcnet_050", 1e-2, 30),
    "convnext_atto": ("LayerNorm", "convnext_atto", 2e-3, 15),
    "test_vit": ("ViT", "test_vit:img_size=32,patch_size=4", 2e-3, 20),
}
#: Gradient-norm clipping per network (none elsewhere). lcnet_050 spikes to 3x its starting loss
#: in the warm-up on digits 0-7 and never recovers at any seed without it; chosen on the training
#: split by validation accuracy, python -m benchmarks.tune_posthoc_lr --clips none 1
CLIP_GRAD_NORM: dict[str, float] = {"lcnet_050": 1.0}
JEM_TWIN = "resnet10t"  # the network of the JEM-trained twins (when it is in the run; else the run's first)
#: The twins' recipes and epochs: ``fast`` (5 SGLD steps) for as long as the cross-entropy twin,
#: ``generative`` (the default recipe, 10 steps: ~2x fast's cost) for half as long: the CPU budget.
JEM_RECIPES = {"fast": 12, "generative": 6}
JEM_BATCH = 64  # data per iteration (the recipes' 32 chains beside it)
JEM_SCORES = ("logpx", "msp", "max_logit", "grad_norm", "grad_norm_projected")
SETS = ("uniform", "gaussian", "transposed", "inverted", "photo", "held_out")
# Our score -> pytorch-ood's detector of the same method.
SHARED = {
    "logpx": "EnergyBased",
    "msp": "MaxSoftmax",
    "max_logit": "MaxLogit",
    "gen": "GEN",
    "odin": "ODIN",
    "mahalanobis": "Mahalanobis",
    "relative_mahalanobis": "RMD",
    "vim": "ViM",
    "knn": "KNN",
    "react": "ReAct",
    "ash": "ASH",
    "scale": "SCALE",
    "gmm": "GMM",
    "mahalanobis_odin": "MahalanobisODIN",
    "openmax": "OpenMax",
    "multi_mahalanobis": "MultiMahalanobis",
    "gram": "Gram",
    "entropy": "Entropy",
    "kl_matching": "KLMatching",
    "dice": "DICE",
    "she": "SHE",
    "nnguide": "NNGuide",
    "fdbd": "fDBD",
    "nci": "NCI",
    "pnml": "PNML",
    "lts": "LTS",
    "rankfeat": "RankFeat",
    "vra": "VRA",
    "weighted_ebo": "WeightedEBO",
    "mcd": "MCD",
}
#: Our score at non-default settings for the equality check, where pytorch-ood cannot take ours
#: (its VRA clips each unit between its own percentiles: ours with ``per_unit=True``).
OURS_MATCHED: dict[str, dict[str, Any]] = {"vra": {"lower": 10, "upper": 90, "per_unit": True}}
TARGET_MARGIN = 0.005  # best of ours >= best of pytorch-ood - this, per set
EQUAL_TOL = 1e-4  # shared detectors: max |ours - theirs| <= EQUAL_TOL * max(1, max |ours|)
TARGET_THROUGHPUT = 0.95  # ours / theirs; as bench_scoring, 5% for the timing noise of a shared machine
BATCH = 256  # scoring
BATCH_TRAIN, LR = 32, 2e-3
N_OOD = 300  # images per OOD set (the held-out classes: every test 8 and 9)


# ---------------------------------------------------------------------------- data
def _pixels_to_input(p: Tensor) -> Tensor:
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (p - mean) / std


def far_sets(digits8: Tensor, g: torch.Generator, photo_seed: int) -> dict[str, Tensor]:
    """The five OOD sets other than held-out classes, as many images as ``digits8`` (8x8 digits):
    uniform and Gaussian noise drawn from ``g``, those digits transposed and inverted, and photo
    crops (seed ``photo_seed``), all at 32x32 RGB."""
    n = len(digits8)
    return {
        "uniform": _pixels_to_input(torch.rand(n, 3, 32, 32, generator=g)),
        "gaussian": _pixels_to_input((0.5 + 0.25 * torch.randn(n, 3, 32, 32, generator=g)).clamp(0, 1)),
        "transposed": to32(transposed(digits8)),
        "inverted": to32(-digits8),
        "photo": to32(photo_patches(n, size=8, seed=photo_seed)),
    }


def load_data(n_train: int | None = None, n_eval: int | None = None, n_ood: int | None = N_OOD) -> dict[str, Any]:
    """Digits at 32x32 RGB: train/test tensors, the five OOD sets of the full model, and the
    0-7 / 8-9 split of the held-out-classes model."""
    x8, y = digits_tensors("train")
    xt8, yt = digits_tensors("test")
    if n_train is not None:
        x8, y = x8[:n_train], y[:n_train]
    if n_eval is not None:
        xt8, yt = xt8[:n_eval], yt[:n_eval]
    n = min(len(xt8), n_ood or len(xt8))
    sets = far_sets(xt8[:n], torch.Generator().manual_seed(2), photo_seed=1)
    x, xt = to32(x8), to32(xt8)
    keep, keep_t = y < 8, yt < 8
    return dict(
        x=x,
        y=y,
        xt=xt,
        yt=yt,
        sets=sets,
        x07=x[keep],
        y07=y[keep],
        xt07=xt[keep_t],
        yt07=yt[keep_t],
        xt89=xt[~keep_t],
    )


def _wrap_kw(num_classes: int) -> dict[str, Any]:
    return dict(mean=IMAGENET_MEAN, std=IMAGENET_STD, input_size=(3, 32, 32), num_classes=num_classes)


# ---------------------------------------------------------------------------- training
def make_net(spec: str, num_classes: int) -> nn.Module:
    """A network with random weights: a timm name with ``key=value`` options after a colon
    (``"test_vit:img_size=32,patch_size=4"``), or ``"torchvision:<name>"``."""
    import timm

    if spec.startswith("torchvision:"):
        import torchvision

        return torchvision.models.get_model(spec.partition(":")[2], weights=None, num_classes=num_classes)
    name, _, extra = spec.partition(":")
    kwargs: dict[str, Any] = {}
    for kv in filter(None, extra.split(",")):
        k, v = kv.split("=", 1)
        kwargs[k] = int(v) if v.isdigit() else v
    return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)


def train(
    spec: str,
    x: Tensor,
    y: Tensor,
    num_classes: int,
    epochs: int,
    recipe: str | Recipe | None = None,
    seed: int = 0,
    lr: float = LR,
    bs: int = BATCH_TRAIN,
    eval_every: tuple[Tensor, Tensor] | None = None,
    init: nn.Module | None = None,
    clip: float | None = None,
    device: torch.device | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Cross-entropy (``recipe=None``) or a JEM recipe, both with Adam at ``lr`` (linear warm-up
    over the recipe's capped warm-up, then a cosine decay to 0); returns the model in eval mode
    and its cost (and the test accuracy per epoch with ``eval_every=(x, y)``). ``init``: start
    from that model's weights (a fine-tune) instead of a random initialisation. ``clip``: the
    gradients' global norm is clipped to it before each step. ``device``: where the model trains
    (cross-entropy only; the data moves there batch by batch)."""
    from torch.optim.swa_utils import update_bn

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_net(spec, num_classes)
    if init is not None:
        model.load_state_dict(init.state_dict())
    if device is not None:
        if recipe is not None:
            raise ValueError("train(device=...) runs the cross-entropy loop only")
        model.to(device)
    jm = jem.wrap(model, **_wrap_kw(num_classes))
    r = recipe if isinstance(recipe, Recipe) else get_recipe(recipe) if recipe else None
    base = r or get_recipe("generative")
    total = epochs * math.ceil(len(x) / bs)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warm = base.optim.warmup_for(total)

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * (i - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    curve = []
    loss_fn = fit_init = None
    if r is not None:
        if r.sam.rho is not None:
            raise ValueError(f"recipe {r.name!r} uses SAM, which this benchmark's loop does not run")
        # an informative init is fitted from the loop's first batches (the p(x) term's data)
        loss_fn = build_loss(r, {"x": x, "y": y}, total, bs, g, "loop", num_classes=num_classes)
        fit_init = FitInitFromBatches(loss_fn.buffer)
    model.train()
    t_cpu, t_wall = time.process_time(), time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(bs):
            xb_clean, yb = x[idx], y[idx]
            xb = shift_augment(xb_clean, 4, g)
            opt.zero_grad(set_to_none=True)
            if loss_fn is None:
                F.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
            else:
                assert r is not None and fit_init is not None
                px = xb_clean if r.loss.px_clean_data else None
                fit_init.on_batch(None, xb if px is None else px, yb)
                loss_fn(jm, xb, yb, px_data=px).loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
        if eval_every is not None:
            curve.append(round(accuracy(model.eval(), *eval_every), 4))
            model.train()
    if r is not None and r.bn_stats_from_data:
        update_bn(DataLoader(TensorDataset(x), batch_size=bs), model)
    cost = {
        "train_cpu_s": time.process_time() - t_cpu,
        "train_wall_s": time.perf_counter() - t_wall,
        "epochs": epochs,
        "lr": lr,
        "batch_size": bs,
        "clip_grad_norm": clip,
    }
    if curve:
        cost["test_acc_per_epoch"] = curve
    return model.eval(), cost


#: A run whose accuracy on its own training images (eval mode) stays below this did not train; it
#: is rerun with the next seed, at most FIT_TRIES runs in all (lcnet_050 fails on ~1150 digits at
#: some seeds: 0.26-0.46 test accuracy on digits 0-7 at seed 0). Reads the training data alone.
MIN_TRAIN_ACCURACY = 0.9
FIT_TRIES = 3


def train_until_fit(
    spec: str, x: Tensor, y: Tensor, num_classes: int, epochs: int, **kwargs: Any
) -> tuple[nn.Module, dict[str, Any]]:
    """:func:`train` from seed 0, rerun with seeds 1, 2 while the model's training accuracy stays
    below :data:`MIN_TRAIN_ACCURACY`; the cost records the seed kept and every run's training
    accuracy (the last run is kept when none fits)."""
    tried: list[float] = []
    for seed in range(FIT_TRIES):
        model, cost = train(spec, x, y, num_classes, epochs, seed=seed, **kwargs)
        tried.append(round(accuracy(model, x, y), 4))
        if tried[-1] >= MIN_TRAIN_ACCURACY:
            break
        _log(f"{spec}: training accuracy {tried[-1]:.3f} at seed {seed}: it did not train, rerun")
    cost.update(seed=seed, train_accuracy=tried)
    return model, cost


def train_network(
    name: str, D: dict[str, Any], epochs: int | None = None, curve: bool = False
) -> tuple[nn.Module, dict[str, Any], nn.Module, dict[str, Any]]:
    """``(model, cost, model_0_7, cost_0_7)``: the network's two models as the benchmark trains
    them (its learning rate, epochs unless given, clipping; ``curve``: the 0-9 model's test
    accuracy per epoch in its cost)."""
    _, spec, lr, default_epochs = NETWORKS[name]
    epochs = epochs or default_epochs
    clip = CLIP_GRAD_NORM.get(name)
    _log(f"{name}: training on digits 0-9 ({epochs} epochs)")
    every = (D["xt"], D["yt"]) if curve else None
    model, cost = train_until_fit(spec, D["x"], D["y"], 10, epochs, lr=lr, clip=clip, eval_every=every)
    _log(f"{name}: training on digits 0-7")
    model8, cost8 = train_until_fit(spec, D["x07"], D["y07"], 8, epochs, lr=lr, clip=clip)
    return model, cost, model8, cost8


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``(x, y)``, batches moved to the model's device."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        return float((torch.cat([model(b.to(dev)).cpu() for b in x.split(BATCH)]).argmax(1) == y).float().mean())


# ---------------------------------------------------------------------------- pytorch-ood
class Backbone(nn.Module):
    """What a timm user hands pytorch-ood as the encoder: the penultimate features ``[B, D]``
    (``maps=True``: as ``[B, D, 1, 1]`` maps, for its feature-map detectors)."""

    def __init__(self, model: nn.Module, maps: bool = False) -> None:
        super().__init__()
        self.model, self.maps = model, maps

    def forward(self, x: Tensor) -> Tensor:
        h = self.model.forward_head(self.model.forward_features(x), pre_logits=True)
        return h[:, :, None, None] if self.maps else h


class MapHead(nn.Module):
    """The classifier on ``[B, D, 1, 1]`` maps of the penultimate features."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.fc = model.get_classifier()

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(h.flatten(1))


class Features(nn.Module):
    """A CNN's last feature maps ``[B, C, H, W]`` (``forward_features``); :class:`Head` finishes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.forward_features(x)


class Head(Features):
    def forward(self, x: Tensor) -> Tensor:
        return self.model.forward_head(x)


def vim_dim(d: int) -> int:
    """Our ViM's default principal dimension (the paper's choices), also given to pytorch-ood's."""
    return 1000 if d >= 2048 else 512 if d >= 768 else d // 2


def _shaped_layer(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(backbone, head)`` for pytorch-ood's feature-map detectors: a CNN's last feature maps and
    ``forward_head``, a ViT's penultimate features as 1x1 maps (as ours choose)."""
    conv = torch.no_grad()(model.forward_features)(torch.zeros(1, 3, 32, 32)).dim() == 4
    return (Features(model), Head(model)) if conv else (Backbone(model, maps=True), MapHead(model))


def pytorch_ood_detectors(model: nn.Module, feature_dim: int) -> dict[str, tuple[Callable[[], Any], bool]]:
    """``{name: (build, needs input gradients)}``: pytorch-ood's detectors that apply to a plain
    classifier, at their defaults (the hyperparameters they require: DICE's sparsity ``p=0.9``,
    the paper's for CIFAR; ViM's ``d``, ours). Its feature-map detectors (ASH, SCALE, VRA,
    RankFeat) get a CNN's last feature maps and ``forward_head`` (pooling and classifier), as the
    ASH paper applies it; a ViT, which has no maps, its penultimate features as 1x1 maps. ReAct
    clips the penultimate features (the paper's layer; as 1x1 maps). MultiMahalanobis and Gram
    read the layers ours read (:class:`LayerMahalanobis`, :class:`LayerGram`). WeightedEBO gets
    ones as its class weights (a cross-entropy model has no VOS weights; ours defaults to ones
    then too). MCD samples the network's dropout and fails in its row on a network without an
    ``nn.Dropout`` (as ours refuses). Left out: NACUE (hand-picked layers), text embeddings
    (MCM), and GradNorm and GradUncertainty (per-example parameter gradients, 20x the cost of a
    forward pass, for this CPU budget)."""
    from pytorch_ood import detector as D

    enc, head = Backbone(model), model.get_classifier()
    flat, flat_head = Backbone(model, maps=True), MapHead(model)
    maps, maps_head = _shaped_layer(model)
    w, b = head.weight, head.bias
    std = list(IMAGENET_STD)
    return {
        "EnergyBased": (lambda: D.EnergyBased(model), False),
        "MaxSoftmax": (lambda: D.MaxSoftmax(model), False),
        "MaxLogit": (lambda: D.MaxLogit(model), False),
        "Entropy": (lambda: D.Entropy(model), False),
        "WeightedEBO": (lambda: D.WeightedEBO(model, torch.ones(head.out_features)), False),
        "MCD": (lambda: D.MCD(_with_dropout(model)), False),
        "GEN": (lambda: D.GEN(model), False),
        "KLMatching": (lambda: D.KLMatching(model), False),
        "TemperatureScaling": (lambda: D.TemperatureScaling(model), False),
        "OpenMax": (lambda: D.OpenMax(model), False),
        "MultiMahalanobis": (lambda: LayerMahalanobis(model), False),
        "Gram": (lambda: LayerGram(model), False),
        "ODIN": (lambda: D.ODIN(model, norm_std=std), True),
        "Mahalanobis": (lambda: D.Mahalanobis(enc), False),
        "MahalanobisODIN": (lambda: D.MahalanobisODIN(enc, norm_std=std), True),
        "RMD": (lambda: D.RMD(enc), False),
        "GMM": (lambda: D.GMM(enc), False),
        "KNN": (lambda: D.KNN(enc), False),
        "ViM": (lambda: D.ViM(enc, d=vim_dim(feature_dim), w=w, b=b), False),
        "ReAct": (lambda: D.ReAct(flat, flat_head), False),
        "ASH": (lambda: D.ASH(maps, maps_head), False),
        "SCALE": (lambda: D.SCALE(maps, maps_head), False),
        "VRA": (lambda: D.VRA(maps, maps_head), False),
        "RankFeat": (lambda: D.RankFeat(maps, maps_head), False),
        "DICE": (lambda: D.DICE(enc, w=w, b=b, p=0.9), False),
        "NNGuide": (lambda: D.NNGuide(enc, head), False),
        "SHE": (lambda: D.SHE(enc, head), False),
        "NCI": (lambda: D.NCI(enc, head), False),
        "LTS": (lambda: D.LTS(enc, head), False),
        "PNML": (lambda: D.PNML(enc, head), False),
        "fDBD": (lambda: D.fDBD(enc, head), False),
    }


def _with_dropout(model: nn.Module) -> nn.Module:
    """``model`` when it has a dropout layer with ``p > 0`` (what MC dropout samples), else a
    one-line refusal that becomes MCD's row (with no dropout its samples are all the same)."""
    drop = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    if not any(isinstance(m, drop) and float(m.p) > 0 for m in model.modules()):
        raise TypeError(f"{type(model).__name__} has no dropout layer (nn.Dropout with p > 0)")
    return model


class EveryClassOpenMax:
    """pytorch-ood's ``OpenMax`` as ours computes it (for the equality check only): on float64
    logits (its shifted Weibull tails are float32 otherwise, rounded at 1e-3), and with one extra
    row per class appended to each batch, predicted as that class, its scores dropped (it measures
    the distance only to the classes some input of the batch is predicted as, 0 for the others)."""

    requires_fit = True

    def __init__(self, model: nn.Module) -> None:
        from pytorch_ood import detector as D

        self.model = model
        self.det = D.OpenMax(None)

    def fit(self, loader: DataLoader) -> EveryClassOpenMax:
        with torch.no_grad():
            logits = torch.cat([self.model(x).double() for x, _ in loader])
        self.det.fit_logits(logits, torch.cat([y for _, y in loader]))
        return self

    def predict(self, x: Tensor) -> Tensor:
        logits = self.model(x).double()
        k = logits.shape[1]
        anchors = torch.eye(k, dtype=logits.dtype) * (logits.abs().max() + 1.0)  # row c: predicted as c
        return self.det.predict_logits(torch.cat([logits, anchors]))[: len(x)]


class LayerMahalanobis:
    """pytorch-ood's ``MultiMahalanobis`` on the layers ours reads by default (timm's
    ``feature_info`` stages), given their pooled outputs through its structured API
    (``fit_structured``/``predict_structured``), with its default ``alpha = 1`` or the given
    per-layer weights. Its ``predict(x)`` needs the layers as a chain of modules, each run on the
    previous one's output, which a ViT's blocks (class token, position embedding) and timm's
    stems are not; so both libraries read the same features here and differ only in the maths."""

    requires_fit = True

    def __init__(self, model: nn.Module, alpha: Sequence[float] | None = None) -> None:
        from pytorch_ood import detector as D

        self.jm = jem.wrap(model, **_wrap_kw(model.num_classes))
        layers = self.jm.feature_layers() or []
        self.det = D.MultiMahalanobis([nn.Identity()] * len(layers), alpha=None if alpha is None else list(alpha))

    def _pooled(self, x: Tensor) -> list[Tensor]:
        with torch.no_grad():
            return self.jm.layer_features(x)[0]

    def fit(self, loader: DataLoader) -> LayerMahalanobis:
        per_batch, ys = [], []
        for x, y in loader:
            per_batch.append(self._pooled(x))
            ys.append(y)
        self.det.fit_structured([torch.cat(z) for z in zip(*per_batch)], torch.cat(ys))
        return self

    def predict(self, x: Tensor) -> Tensor:
        return self.det.predict_structured(self._pooled(x))


class LayerGram:
    """pytorch-ood's ``Gram`` on the layers ours reads by default, their unpooled outputs
    (:meth:`jem_plugin.JEM.layer_maps`) handed to it in place of its chain of layers (as for
    :class:`LayerMahalanobis`), at its default powers ``1 .. L`` and random tenth of each class
    held out (drawn after ``torch.manual_seed(seed)``), or at ``powers`` (the throughput
    comparison: ours computes 10 by default, its default is one per layer). ``matched`` (for the
    equality check): our fitted ``gram`` detector,
    whose powers and typical deviations it then uses, its bounds set on every fit image as ours
    are, the maps in float64 as ours computes them, and our denominators ``|bound| + 1e-6``
    (its ``|bound + 1e-6|``, the original code's, is 0 at a bound of ``-1e-6`` and up to 6x
    smaller than ours on lcnet_050's near-zero bounds of negative statistics)."""

    requires_fit = True

    def __init__(
        self, model: nn.Module, matched: Any = None, seed: int = 0, powers: Sequence[int] | None = None
    ) -> None:
        from pytorch_ood import detector as D

        jm = jem.wrap(model, **_wrap_kw(model.num_classes))
        layers = jm.feature_layers() or []
        self.seed = seed

        class OnOurLayers(D.Gram):
            def _create_feature_list(self, data: Tensor) -> tuple[Tensor, list[Tensor]]:
                with torch.no_grad():
                    maps, logits = jm.layer_maps(data, layers)
                return logits, maps if matched is None else [m.double() for m in maps]

            if matched is not None:  # ours adds 1e-6 after the absolute value: |lo| + 1e-6, not |lo + 1e-6|

                @staticmethod
                def _deviation(g: Tensor, mins: Tensor, maxs: Tensor) -> Tensor:
                    dev = F.relu(mins - g) / (mins.abs() + 1e-6) + F.relu(g - maxs) / (maxs.abs() + 1e-6)
                    return dev.sum(dim=1)

        powers = powers if matched is None else matched.powers
        self.det = OnOurLayers(nn.Identity(), [nn.Identity()] * len(layers), model.num_classes, powers)
        self.det.to("cpu")
        self.matched = matched
        if matched is not None:
            self.det.validation_fraction = 0.0

    def fit(self, loader: DataLoader) -> LayerGram:
        torch.manual_seed(self.seed)  # its held-out split
        self.det.fit(loader)
        if self.matched is not None:
            self.det.layer_norm = self.matched.layer_norm.double()
        return self

    def predict(self, x: Tensor) -> Tensor:
        return self.det.predict(x)


def _our_fitted(model: nn.Module, loader: DataLoader, name: str) -> Any:
    """Our detector ``name`` at its defaults, fitted on ``model`` (what a matched setting reads)."""
    jm = jem.wrap(model, **_wrap_kw(model.num_classes))
    return ood.detector(name).fit(jm, loader, progress=False)


#: pytorch-ood at our settings where its own differ (for the equality check only): ASH and
#: SCALE at our percentiles, on the same activations as its defaults (a CNN's feature maps, a
#: ViT's penultimate features, as ours); OpenMax on float64 logits with every class predicted in
#: each batch (:class:`EveryClassOpenMax`); MultiMahalanobis with our layer weights (``alpha``
#: read off our fit on the same data); Gram at our powers, bounds and typical deviations
#: (:class:`LayerGram`); VRA on the penultimate features (ours reads) as 1x1 maps, at our
#: percentiles, beside ours per unit (:data:`OURS_MATCHED`).
def matched_detectors(model: nn.Module, fit: DataLoader) -> dict[str, Callable[[], Any]]:
    from pytorch_ood import detector as D

    maps, maps_head = _shaped_layer(model)
    vra = OURS_MATCHED["vra"]
    return {
        "VRA": lambda: D.VRA(
            Backbone(model, maps=True),
            MapHead(model),
            lower_percentile=vra["lower"] / 100,
            upper_percentile=vra["upper"] / 100,
        ),
        "ASH": lambda: D.ASH(maps, maps_head, variant="ash-s", percentile=0.90),
        "SCALE": lambda: D.SCALE(maps, maps_head, percentile=0.85),
        "OpenMax": lambda: EveryClassOpenMax(model),
        "MultiMahalanobis": lambda: LayerMahalanobis(
            model, alpha=_our_fitted(model, fit, "multi_mahalanobis").layer_weights
        ),
        "Gram": lambda: LayerGram(model, matched=_our_fitted(model, fit, "gram")),
    }


def _theirs_predict(det: Any, x: Tensor, grad: bool) -> Tensor:
    out = []
    for xb in x.split(BATCH):
        if grad:
            out.append(det.predict(xb).detach())
        else:
            with torch.no_grad():
                out.append(det.predict(xb))
    return -torch.cat(out).float()  # outlier scores -> ours (higher = in-distribution)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def run_pytorch_ood(
    build: Callable[[], Any], grad: bool, fit_loader: DataLoader, data_in: Tensor, sets: dict[str, Tensor]
) -> tuple[dict[str, Tensor] | None, dict[str, float], str | None]:
    """``(scores {"in", set: Tensor} or None, timing, failure)`` of one pytorch-ood detector."""
    try:
        det = build()
        t0 = time.perf_counter()
        if getattr(det, "requires_fit", False):
            det.fit(fit_loader)
        fit_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        s = {"in": _theirs_predict(det, data_in, grad)}
        for name, x in sets.items():
            s[name] = _theirs_predict(det, x, grad)
        elapsed = time.perf_counter() - t0
    except Exception as exc:  # a broken detector is a row of the table
        return None, {}, _one_line(exc)
    n = sum(len(v) for v in s.values())
    return s, {"seconds_per_1000": 1000 * elapsed / n, "fit_seconds": fit_s, "n_images": n}, None


def _records(name: str, s: dict[str, Tensor] | None, sets: Sequence[str], timing: dict, failure: str | None):
    nan = float("nan")
    rows = []
    for set_name in sets:
        r: dict[str, Any] = {"score": name, "set": set_name, "status": "ok", "reason": ""}
        if s is None:
            r.update(status="failed", reason=failure or "")
        elif not (torch.isfinite(s["in"]).all() and torch.isfinite(s[set_name]).all()):
            r.update(status="non-finite", reason="NaN/inf scores")
        else:
            r.update(ood.evaluate(s["in"], s[set_name]))
        for k in ("auroc", "aupr_in", "aupr_out", "fpr95"):
            r.setdefault(k, nan)
        r["seconds_per_1000"] = timing.get("seconds_per_1000", nan)
        r["fit_seconds"] = timing.get("fit_seconds", nan)
        rows.append(r)
    return rows


# ---------------------------------------------------------------------------- one network
def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _loader(x: Tensor, y: Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def score_pair(
    jm: Any, jm8: Any, D: dict[str, Any], methods: str | Sequence[str]
) -> tuple[ood.OODTable, dict[str, dict[str, Tensor]]]:
    """``methods`` on a network's two models, one ``evaluate_all`` each, the detectors that need
    fitting fitted on each model's training digits: the 0-9 model on the test digits against the
    five OOD sets, the 0-7 model on its test digits against the held-out classes. Returns the
    table of all six sets and the 0-9 model's scores (``{method: {set: scores}}``)."""
    t_main = ood.evaluate_all(jm, D["xt"], D["sets"], methods, fit_data=_loader(D["x"], D["y"]), progress=False)
    t_ho = ood.evaluate_all(
        jm8, D["xt07"], {"held_out": D["xt89"]}, methods, fit_data=_loader(D["x07"], D["y07"]), progress=False
    )
    return ood.OODTable(t_main.records + t_ho.records, t_main.methods, SETS, t_main.timing), t_main.scores


def score_network(
    name: str,
    D: dict[str, Any],
    epochs: int | None,
    methods: str | Sequence[str] = "all",
    theirs: Sequence[str] | None = None,
    timing_n: int = 512,
    timing_repeats: int = 3,
) -> dict[str, Any]:
    kind, spec = NETWORKS[name][:2]
    main_sets = {k: v for k, v in D["sets"].items()}
    model, cost, model8, cost8 = train_network(name, D, epochs, curve=True)
    acc, acc8 = accuracy(model, D["xt"], D["yt"]), accuracy(model8, D["xt07"], D["yt07"])
    _log(f"{name}: test accuracy {acc:.3f} (0-7 model: {acc8:.3f}); our scores")
    jm, jm8 = jem.wrap(model, **_wrap_kw(10)), jem.wrap(model8, **_wrap_kw(8))

    # ---- ours: one call per model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the JEM scores' warning on a cross-entropy model: expected here
        ours, s_main = score_pair(jm, jm8, D, methods)

    # ---- pytorch-ood: every detector, same models, same images
    feats_dim = int(jm.features(D["xt"][:2])[0].shape[1])
    builders, builders8 = pytorch_ood_detectors(model, feats_dim), pytorch_ood_detectors(model8, feats_dim)
    names = [t for t in builders if theirs is None or t in theirs]
    recs: list[dict[str, Any]] = []
    t_timing: dict[str, dict[str, float]] = {}
    scores_theirs: dict[str, dict[str, Tensor]] = {}
    for t in names:
        _log(f"{name}: pytorch-ood {t}")
        build, grad = builders[t]
        s, tm, fail = run_pytorch_ood(build, grad, _loader(D["x"], D["y"]), D["xt"], main_sets)
        s8, _, fail8 = run_pytorch_ood(
            builders8[t][0], grad, _loader(D["x07"], D["y07"]), D["xt07"], {"held_out": D["xt89"]}
        )
        recs += _records(t, s, list(main_sets), tm, fail)
        recs += _records(t, s8, ["held_out"], tm, fail8)
        if tm:
            t_timing[t] = tm
        if s is not None:
            scores_theirs[t] = s
    theirs_table = ood.OODTable(recs, names, SETS, t_timing)

    # ---- shared detectors: the same scores? (matched settings) and who is faster
    matched = matched_detectors(model, _loader(D["x"], D["y"]))
    equality: dict[str, Any] = {}
    for ours_name, t in SHARED.items():
        if ours_name not in s_main or t not in builders:
            continue
        if t in matched:
            s_t, _, fail = run_pytorch_ood(matched[t], False, _loader(D["x"], D["y"]), D["xt"], main_sets)
        else:
            s_t, fail = scores_theirs.get(t), None
        if s_t is None:
            equality[ours_name] = {"pytorch_ood": t, "failed": fail or "not scored"}
            continue
        s_o = s_main[ours_name]
        if ours_name in OURS_MATCHED:  # ours at the settings pytorch-ood can take
            det = ood.detector(ours_name, **OURS_MATCHED[ours_name]).fit(jm, _loader(D["x"], D["y"]), progress=False)
            s_o = {
                k: ood.score(jm, D["xt"] if k == "in" else main_sets[k], det, batch_size=BATCH, progress=False)
                for k in s_t
            }
        a = torch.cat([s_o[k] for k in s_t])
        b = torch.cat([s_t[k] for k in s_t])
        ok = torch.isfinite(a) & torch.isfinite(b)
        diff = float((a[ok] - b[ok]).abs().max()) if ok.any() else float("nan")
        scale = float(a[ok].abs().max()) if ok.any() else float("nan")
        au_diff = max(
            abs(ood.evaluate(s_o["in"], s_o[k])["auroc"] - ood.evaluate(s_t["in"], s_t[k])["auroc"]) for k in main_sets
        )
        # Up to a constant factor and offset (a documented scale convention): least squares a * theirs + c.
        A = torch.stack([b[ok].double(), torch.ones_like(b[ok].double())], 1)
        coef = torch.linalg.lstsq(A, a[ok].double().unsqueeze(1)).solution.squeeze(1)
        affine = float((A @ coef - a[ok].double()).abs().max())
        tol = EQUAL_TOL * max(1.0, scale)
        equality[ours_name] = {
            "pytorch_ood": t + (" (matched settings)" if t in matched else ""),
            "ours_settings": OURS_MATCHED.get(ours_name, "defaults"),
            "max_abs_diff": diff,
            "max_abs_score": scale,
            "equal": bool(diff <= tol),
            "affine": [float(coef[0]), float(coef[1])],
            "affine_max_diff": affine,
            "equal_up_to_affine": bool(affine <= tol),
            "max_auroc_diff": au_diff,
            "non_finite_pairs": int((~ok).sum()),
        }
        if t in matched:  # pytorch-ood's AUROCs at our settings, beside its defaults' in the table
            equality[ours_name]["auroc_theirs_matched"] = {
                k: ood.evaluate(s_t["in"], s_t[k])["auroc"] for k in main_sets
            }
    throughput = time_shared(jm, model, D, feats_dim, s_main, timing_n, timing_repeats)
    return {
        "kind": kind,
        "spec": spec,
        "accuracy": acc,
        "accuracy_0_7": acc8,
        "cost": cost,
        "cost_0_7": cost8,
        "feature_dim": feats_dim,
        "ours": ours.rows(),
        "ours_timing": ours.timing,
        "pytorch_ood": theirs_table.rows(),
        "pytorch_ood_timing": theirs_table.timing,
        "equality": equality,
        "throughput": throughput,
    }


def time_shared(jm, model, D, feats_dim, s_main, n: int, repeats: int) -> dict[str, Any]:
    """Ours and pytorch-ood's scoring time on the same ``n`` images, every shared detector,
    fitted beforehand (fitting excluded), interleaved rounds; ratio = median of paired
    t_theirs / t_ours (> 1: ours faster). Both at their defaults, except Gram: pytorch-ood's at
    our powers (its default computes one power per layer, ours 10)."""
    if repeats < 1:
        return {}
    X = torch.cat([D["xt"], *D["sets"].values()])[:n]
    builders = pytorch_ood_detectors(model, feats_dim)
    out: dict[str, Any] = {}
    fit = _loader(D["x"], D["y"])
    for ours_name, t in SHARED.items():
        if ours_name not in s_main or t not in builders:
            continue
        try:
            info = ood.score_info(ours_name)
            method: Any = ours_name
            if info["needs_fit"]:
                method = ood.detector(ours_name).fit(jm, fit, progress=False)
            build, grad = builders[t]
            if t == "Gram":  # the same work: its default computes one power per layer, ours 10
                build = functools.partial(LayerGram, model, powers=method.powers)
            det = build()
            if getattr(det, "requires_fit", False):
                det.fit(fit)
            times = common.interleaved(
                {
                    "ours": lambda: ood.score(jm, X, method, batch_size=BATCH, progress=False),
                    "theirs": lambda: _theirs_predict(det, X, grad),
                },
                repeats=repeats,
                warmup=1,
            )
        except Exception as exc:
            out[ours_name] = {"pytorch_ood": t, "failed": _one_line(exc)}
            continue
        out[ours_name] = {
            "pytorch_ood": t,
            "ours_ms_per_1000": 1e6 * statistics.median(times["ours"]) / len(X),
            "theirs_ms_per_1000": 1e6 * statistics.median(times["theirs"]) / len(X),
            "ratio": common.paired_ratio(times["theirs"], times["ours"]),
        }
    return out


def score_jem_twin(
    D: dict[str, Any],
    network: str,
    recipe: str | Recipe,
    epochs: int,
    methods: Sequence[str] = JEM_SCORES,
    init: tuple[nn.Module, nn.Module] | None = None,
) -> dict[str, Any]:
    """The JEM-trained twin of ``network`` (its learning rate, ``recipe``, from scratch, or
    fine-tuned from ``init``'s two models, 0-9 and 0-7) and the scores ``methods`` of its two
    models (0-9, and 0-7 for the held-out classes); detectors that need fitting are fitted on the
    training digits as on the cross-entropy twin."""
    kind, spec, lr, _ = NETWORKS[network]
    how = "from scratch" if init is None else "fine-tuned from the cross-entropy twin"
    name = recipe.name if isinstance(recipe, Recipe) else recipe
    _log(f"JEM twin {network} ({name} recipe, {how}): training on digits 0-9 ({epochs} epochs)")
    model, cost = train_until_fit(
        spec,
        D["x"],
        D["y"],
        10,
        epochs,
        recipe=recipe,
        lr=lr,
        bs=JEM_BATCH,
        eval_every=(D["xt"], D["yt"]),
        init=None if init is None else init[0],
        clip=CLIP_GRAD_NORM.get(network),
    )
    _log(f"JEM twin ({name}): training on digits 0-7")
    model8, cost8 = train_until_fit(
        spec,
        D["x07"],
        D["y07"],
        8,
        epochs,
        recipe=recipe,
        lr=lr,
        bs=JEM_BATCH,
        init=None if init is None else init[1],
        clip=CLIP_GRAD_NORM.get(network),
    )
    jm, jm8 = jem.wrap(model, **_wrap_kw(10)), jem.wrap(model8, **_wrap_kw(8))
    jm.trained_px = jm8.trained_px = True
    table, _ = score_pair(jm, jm8, D, methods)
    return {
        "network": network,
        "recipe": name,
        "settings": recipe.to_dict() if isinstance(recipe, Recipe) else None,
        "epochs": epochs,
        "accuracy": accuracy(model, D["xt"], D["yt"]),
        "accuracy_0_7": accuracy(model8, D["xt07"], D["yt07"]),
        "cost": cost,
        "cost_0_7": cost8,
        "scores": table.rows(),
        "mean_auroc": table.mean(),
    }


# ---------------------------------------------------------------------------- targets
def _auroc(rows: list[dict], score: str, set_name: str) -> float | None:
    for r in rows:
        if r["score"] == score and r["set"] == set_name and r["status"] == "ok":
            return float(r["auroc"])
    return None


def _mean_aurocs(rows: list[dict]) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["score"], []).append(r["auroc"] if r["status"] == "ok" else float("nan"))
    return {k: statistics.fmean(v) for k, v in by.items() if len(v) == len(SETS) and all(x == x for x in v)}


def targets(net: dict[str, Any], twins: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The issue's targets on one network; ``twins``: ``{recipe: JEM twin}`` of this network."""
    ours, theirs = net["ours"], net["pytorch_ood"]
    per_set = {}
    for s in SETS:
        best_o = max(((r["auroc"], r["score"]) for r in ours if r["set"] == s and r["status"] == "ok"), default=None)
        best_t = max(((r["auroc"], r["score"]) for r in theirs if r["set"] == s and r["status"] == "ok"), default=None)
        per_set[s] = {
            "ours": best_o,
            "pytorch_ood": best_t,
            "ok": None if best_o is None or best_t is None else best_o[0] >= best_t[0] - TARGET_MARGIN,
        }
    eq = {k: v.get("equal") for k, v in net["equality"].items()}
    thr = {k: v.get("ratio") for k, v in net["throughput"].items()}
    out: dict[str, Any] = {
        "best_per_set": per_set,
        "best_ok": all(v["ok"] for v in per_set.values() if v["ok"] is not None),
        "equal": eq,
        "equal_ok": all(bool(v) for v in eq.values()) if eq else None,
        "throughput": thr,
        "throughput_ok": all(v is not None and v >= TARGET_THROUGHPUT for v in thr.values()) if thr else None,
    }
    if twins:
        posthoc = {
            **{f"jem {k}": v for k, v in _mean_aurocs(ours).items()},
            **{f"pytorch-ood {k}": v for k, v in _mean_aurocs(theirs).items()},
        }
        best = max(posthoc.items(), key=lambda kv: kv[1]) if posthoc else None
        out["best_posthoc_on_twin"] = best
        out["jem"] = {}
        for recipe, twin in twins.items():
            m = twin["mean_auroc"].get("logpx")
            out["jem"][recipe] = {"logpx_mean": m, "ok": None if m is None or best is None else m > best[1]}
        oks = [v["ok"] for v in out["jem"].values() if v["ok"] is not None]
        out["jem_ok"] = any(oks) if oks else None
    return out


# ---------------------------------------------------------------------------- one forward (issue 46)
ONE_FORWARD = "posthoc_one_forward"
ONE_FORWARD_TARGET = 3.0  # evaluate_all over the gradient-free scores: at least this much faster than the loop


def gradient_free_scores() -> list[str]:
    """Every registered score that reads outputs of one plain forward (no input gradient, and not
    mcd, whose dropout samples are passes of their own): what shares one forward in ``evaluate_all``."""
    return [m for m in ood.available_scores() if ood.score_info(m)["reads"] is not None]


def per_detector_loop(
    jm: Any, x_in: Tensor, sets: dict[str, Tensor], methods: Sequence[str], fit: DataLoader
) -> dict[str, dict[str, Tensor]]:
    """``evaluate_all``'s loop before issue 46: each score on its own, a fitted one fitted by its
    own pass over ``fit`` (two for openmax), then the in-distribution data and every set scored
    by its own passes (one forward per score, set and batch), and the metrics per set."""
    out: dict[str, dict[str, Tensor]] = {}
    for m in methods:
        try:
            method: Any = ood.detector(m).fit(jm, fit, batch_size=BATCH) if ood.score_info(m)["needs_fit"] else m
            s = {name: ood.score(jm, x, method, batch_size=BATCH) for name, x in [("in", x_in), *sets.items()]}
        except TypeError:  # the network's kind refused (rankfeat, no maps): evaluate_all skips it too
            continue
        for name in sets:
            ood.evaluate(s["in"], s[name])
        out[m] = s
    return out


def _forward_counter(model: nn.Module) -> list[int]:
    """``[n]``: the passes through ``model`` so far (a pre-hook on its first layer with weights)."""
    first = next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    n = [0]
    first.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    return n


def time_one_forward(
    name: str, D: dict[str, Any], epochs: int | None, repeats: int, methods: Sequence[str] | None = None
) -> dict[str, Any]:
    """One network: ``evaluate_all`` over ``methods`` (default :func:`gradient_free_scores`) against
    :func:`per_detector_loop`, ``repeats`` interleaved rounds (the order alternating), the same
    model, images and batches."""
    _, spec, lr, default_epochs = NETWORKS[name]
    model, cost = train(spec, D["x"], D["y"], 10, epochs or default_epochs, lr=lr, clip=CLIP_GRAD_NORM.get(name))
    jm = jem.wrap(model, **_wrap_kw(10))
    methods, fit = list(methods or gradient_free_scores()), _loader(D["x"], D["y"])
    forwards = _forward_counter(model)
    times: dict[str, list[float]] = {"shared": [], "loop": []}
    # process CPU seconds (one thread): what a shared machine's load leaves nearly alone
    cpu: dict[str, list[float]] = {"shared": [], "loop": []}
    counts: dict[str, int] = {}
    shared: ood.OODTable | None = None
    loop: dict[str, dict[str, Tensor]] = {}
    _log(f"{name}: accuracy {accuracy(model, D['xt'], D['yt']):.3f}; {len(methods)} scores, {repeats} round(s)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Gaussian detectors' few-images warning at small sizes
        for r in range(repeats):
            for way in ("shared", "loop") if r % 2 == 0 else ("loop", "shared"):
                before, t0, c0 = forwards[0], time.perf_counter(), time.process_time()
                if way == "shared":
                    shared = ood.evaluate_all(
                        jm, D["xt"], D["sets"], methods, fit_data=fit, batch_size=BATCH, progress=False
                    )
                else:
                    loop = per_detector_loop(jm, D["xt"], D["sets"], methods, fit)
                times[way].append(time.perf_counter() - t0)
                cpu[way].append(time.process_time() - c0)
                counts[way] = forwards[0] - before
    assert shared is not None
    ratios = [lp / sh for lp, sh in zip(times["loop"], times["shared"])]
    diff = max(
        float((shared.scores[m][k] - loop[m][k]).abs().max()) / max(1.0, float(loop[m][k].abs().max()))
        for m in shared.scores
        if m in loop
        for k in loop[m]
    )
    res = {
        "spec": spec,
        "epochs": epochs or default_epochs,
        "cost": cost,
        "methods": methods,
        "failures": shared.failures(),
        "shared_s": times["shared"],
        "loop_s": times["loop"],
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "shared_cpu_s": cpu["shared"],
        "loop_cpu_s": cpu["loop"],
        "cpu_ratio": common.paired_ratio(cpu["loop"], cpu["shared"]),
        "forwards": counts,
        "max_rel_score_diff": diff,
    }
    _log(
        f"{name}: shared {min(times['shared']):.2f} s, loop {min(times['loop']):.2f} s, ratio {res['ratio']:.2f}x "
        f"(CPU time {res['cpu_ratio']:.2f}x)"
    )
    return res


def run_one_forward(
    networks: Sequence[str] | None = None,
    epochs: int | None = None,
    repeats: int = 3,
    n_train: int | None = None,
    n_eval: int | None = None,
    n_ood: int | None = N_OOD,
    methods: Sequence[str] | None = None,
) -> dict[str, Any]:
    """:func:`time_one_forward` on each network (default: the four), the same data for all;
    ``methods`` (default: every gradient-free score) for a smaller check."""
    D = load_data(n_train, n_eval, n_ood)
    res: dict[str, Any] = {
        "_machine": common.machine_info(),
        "settings": {
            "networks": list(networks or NETWORKS),
            "n_train": len(D["x"]),
            "n_test": len(D["xt"]),
            "n_ood": len(D["sets"]["uniform"]),
            "sets": list(D["sets"]),
            "batch_size": BATCH,
            "repeats": repeats,
            "target": ONE_FORWARD_TARGET,
        },
        "networks": {},
    }
    for name in res["settings"]["networks"]:
        res["networks"][name] = time_one_forward(name, D, epochs, repeats, methods)
    res["target_met"] = all(n["ratio"] >= ONE_FORWARD_TARGET for n in res["networks"].values())
    return res


def one_forward_markdown(res: dict[str, Any]) -> str:
    s = res["settings"]
    rows = [
        [
            name,
            f"{min(n['loop_s']):.2f}",
            f"{min(n['shared_s']):.2f}",
            f"**{n['ratio']:.2f}x**" if n["ratio"] >= ONE_FORWARD_TARGET else f"{n['ratio']:.2f}x",
            f"{n['cpu_ratio']:.2f}x" if "cpu_ratio" in n else "",
            f"{n['forwards']['loop']} / {n['forwards']['shared']}",
            f"{n['max_rel_score_diff']:.1e}",
        ]
        for name, n in res["networks"].items()
    ]
    head = ["network", "loop (s)", "shared (s)", "ratio", "CPU-time ratio", "forwards loop / shared"]
    head.append("max rel. score diff")
    return (
        f"`evaluate_all` over the {len(next(iter(res['networks'].values()))['methods'])} gradient-free scores, "
        f"one forward per batch shared by all, against the per-detector loop it replaced; {s['n_train']} fit "
        f"images, {s['n_test']} test images and {len(s['sets'])} sets of {s['n_ood']}, batch {s['batch_size']}; "
        f"fastest of {s['repeats']} interleaved round(s), ratio the median of paired ratios (target "
        f"{s['target']:g}x: {'met' if res['target_met'] else 'not met'}).\n\n" + common.md_table(head, rows)
    )


def write_one_forward(res: dict[str, Any], out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    machine = res.get("_machine") or common.machine_info()
    common.write_json(os.path.join(out_dir, f"{ONE_FORWARD}.json"), {"machine": machine, ONE_FORWARD: _strip(res)})
    md = one_forward_markdown(res)
    common.write_markdown(out_dir, ONE_FORWARD, machine, md)
    return md


# ---------------------------------------------------------------------------- run
def run(
    quick: bool = False,
    networks: Sequence[str] | None = None,
    epochs: int | None = None,
    jem_epochs: int | None = None,
    n_train: int | None = None,
    n_eval: int | None = None,
    n_ood: int | None = N_OOD,
    methods: str | Sequence[str] = "all",
    theirs: Sequence[str] | None = None,
    jem_twin: bool = True,
    jem_recipes: Sequence[str] | None = None,
    timing_n: int | None = None,
    timing_repeats: int | None = None,
    out_dir: str | None = OUT,
    **_: Any,
) -> dict[str, Any]:
    networks = list(networks or (["lcnet_050", "test_vit"] if quick else NETWORKS))
    if quick:
        epochs, jem_epochs = epochs or 3, jem_epochs or 2
    twin_net = JEM_TWIN if JEM_TWIN in networks else networks[0]
    recipes = {r: jem_epochs or epochs or JEM_RECIPES[r] for r in (jem_recipes or JEM_RECIPES)} if jem_twin else {}
    timing_n = timing_n or (128 if quick else 512)
    timing_repeats = timing_repeats if timing_repeats is not None else (1 if quick else 5)
    if quick:
        n_train, n_eval = n_train or 400, n_eval or 120
    D = load_data(n_train, n_eval, n_ood)
    t0, c0 = time.perf_counter(), time.process_time()
    res: dict[str, Any] = {
        "_machine": common.machine_info(),  # at the start: the load average the run began with
        "settings": {
            "networks": networks,
            "epochs": {n: epochs or NETWORKS[n][3] for n in networks},
            "lr": {n: NETWORKS[n][2] for n in networks},
            "batch_size": BATCH_TRAIN,
            "jem_twin": twin_net if recipes else None,
            "jem_recipes": recipes,
            "jem_batch_size": JEM_BATCH,
            "n_train": len(D["x"]),
            "n_test": len(D["xt"]),
            "n_ood": len(D["sets"]["uniform"]),
            "sets": list(SETS),
            "timing_n": timing_n,
            "timing_repeats": timing_repeats,
            "quick": quick,
        },
        "networks": {},
    }
    twins: dict[str, dict[str, Any]] = {}
    for recipe, ep in recipes.items():
        try:
            twins[recipe] = score_jem_twin(D, twin_net, recipe, ep)
            t = twins[recipe]
            _log(
                f"JEM twin ({recipe}): accuracy {t['accuracy']:.3f}, mean AUROC of logpx {t['mean_auroc'].get('logpx')}"
            )
        except jem.DivergenceError as exc:  # said in the results, not the end of the comparison
            res.setdefault("jem_twins_failed", {})[recipe] = str(exc)
            _log(f"JEM twin ({recipe}) diverged: {exc}")
    for name in networks:
        res["networks"][name] = score_network(name, D, epochs, methods, theirs, timing_n, timing_repeats)
        res["networks"][name]["targets"] = targets(res["networks"][name], twins if name == twin_net else None)
        _log(f"{name}: done; targets {json.dumps(_strip(res['networks'][name]['targets']))[:400]}")
    if twins:
        res["jem_twins"] = twins
    res["cpu_s"], res["wall_s"] = time.process_time() - c0, time.perf_counter() - t0
    return res


def _strip(obj: Any) -> Any:
    """The JSON-able part: tables (kept for the Markdown) dropped."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------- Markdown
def _fmt(v: float | None, best: bool = False) -> str:
    if v is None or v != v:
        return "-"
    return f"**{v:.3f}**" if best else f"{v:.3f}"


def network_markdown(name: str, net: dict[str, Any], twins: dict[str, dict[str, Any]] | None = None) -> str:
    ours_rows, theirs_rows = net["ours"], net["pytorch_ood"]
    cells: dict[tuple[str, str], float] = {}
    status: dict[str, str] = {}
    for prefix, rows in (("jem ", ours_rows), ("pytorch-ood ", theirs_rows)):
        for r in rows:
            if r["status"] == "ok":
                cells[(prefix + r["score"], r["set"])] = r["auroc"]
            else:
                status.setdefault(prefix + r["score"], f"{r['status']}: {r['reason']}")
    best = {s: max((v for (k, ss), v in cells.items() if ss == s), default=None) for s in SETS}
    timing = {
        **{"jem " + k: v for k, v in net["ours_timing"].items()},
        **{"pytorch-ood " + k: v for k, v in net["pytorch_ood_timing"].items()},
    }
    order: list[str] = []
    ours_names = list(dict.fromkeys(r["score"] for r in ours_rows))
    theirs_names = list(dict.fromkeys(r["score"] for r in theirs_rows))
    for o, t in SHARED.items():  # shared detectors side by side
        if o in ours_names:
            order.append("jem " + o)
        if t in theirs_names:
            order.append("pytorch-ood " + t)
    order += ["jem " + o for o in ours_names if o not in SHARED]
    order += ["pytorch-ood " + t for t in theirs_names if t not in SHARED.values()]
    rows = []
    for k in order:
        vals = [cells.get((k, s)) for s in SETS]
        mean = statistics.fmean(vals) if all(v is not None for v in vals) else None  # type: ignore[arg-type]  # None is ruled out by the all() beside it
        t = timing.get(k, {}).get("seconds_per_1000")
        label = k if k not in status else f"{k} ({status[k][:60]})"
        rows.append(
            [
                label,
                *(_fmt(v, v is not None and v == best[s]) for v, s in zip(vals, SETS)),
                _fmt(mean),
                "-" if t is None else f"{t:.3g}",
            ]
        )
    for recipe, twin in (twins or {}).items():  # the JEM-trained twins' log p(x), for the JEM target
        vals = [_auroc(twin["scores"], "logpx", s) for s in SETS]
        mean = statistics.fmean(vals) if all(v is not None for v in vals) else None  # type: ignore[arg-type]  # None is ruled out by the all() beside it
        rows.append([f"*JEM-trained twin (`{recipe}`): jem logpx*", *(_fmt(v) for v in vals), _fmt(mean), "-"])
    head = ["score", *SETS, "mean", "s / 1000 img"]
    return common.md_table(head, rows)


def _reruns(net: dict[str, Any]) -> str:
    """Where a model did not train at seed 0 and was rerun (:func:`train_until_fit`), say so."""
    said = []
    for which, cost in (("0-9", net["cost"]), ("0-7", net["cost_0_7"])):
        tried = cost.get("train_accuracy") or []
        if len(tried) > 1:
            accs = ", ".join(f"{a:.2f}" for a in tried)
            said.append(f"the {which} model kept seed {cost['seed']} (training accuracy by seed: {accs})")
    return f"; {'; '.join(said)}" if said else ""


def to_markdown(res: dict[str, Any]) -> str:
    st = res["settings"]
    lines = [
        f"Digits at 32x32 RGB ({st['n_train']} training, {st['n_test']} test images; held_out: a second model "
        f"on digits 0-7, OOD = test digits 8-9), {st['n_ood']} images per other OOD set; networks trained by "
        f"cross-entropy, Adam (learning rate and epochs per network below), batch {st['batch_size']}, linear "
        f"warm-up then cosine decay; JEM-trained twins of {st['jem_twin']}: "
        + ", ".join(f"`{r}` recipe {e} epochs" for r, e in st["jem_recipes"].items())
        + f" (batch {st['jem_batch_size']}, its CE twin's learning rate, from scratch). AUROC, "
        "in-distribution positive; **bold** = best per set over both libraries; s / 1000 img: one pass over the "
        f"in-distribution and every OOD set (fitting excluded). Total {res['cpu_s'] / 60:.0f} CPU minutes, "
        f"{res['wall_s'] / 60:.0f} wall minutes.",
        "",
    ]
    if res.get("note"):  # results merged from several runs (networks rerun): which comes from which
        lines += [res["note"], ""]
    twins = res.get("jem_twins") or {}
    for name, net in res["networks"].items():
        lines += [
            f"#### {name} ({net['kind']}): test accuracy {net['accuracy']:.3f} (0-7 model {net['accuracy_0_7']:.3f}); "
            f"{st['epochs'][name]} epochs at learning rate {st['lr'][name]:g}"
            + (
                f", gradient norm clipped to {net['cost']['clip_grad_norm']:g}"
                if net["cost"].get("clip_grad_norm")
                else ""
            )
            + ", "
            f"{(net['cost']['train_cpu_s'] + net['cost_0_7']['train_cpu_s']) / 60:.1f} CPU minutes for both models"
            + _reruns(net),
            "",
            network_markdown(name, net, twins if name == st["jem_twin"] else None),
            "",
        ]
        tg = net["targets"]
        miss = [
            f"{s} (ours {v['ours'][0]:.3f} {v['ours'][1]}, pytorch-ood {v['pytorch_ood'][0]:.3f} {v['pytorch_ood'][1]})"
            for s, v in tg["best_per_set"].items()
            if v["ok"] is False
        ]
        lines.append(
            f"- best jem score >= best pytorch-ood - {TARGET_MARGIN} on every set: "
            f"**{common.target_mark(tg['best_ok'])}**" + (f"; missed on {', '.join(miss)}" if miss else "")
        )
        eq = []
        for k, v in net["equality"].items():
            if "failed" in v:
                eq.append(f"{k} = {v['pytorch_ood']}: theirs failed ({v['failed'][:80]})")
            else:
                note = ""
                if not v["equal"]:
                    a, c = v["affine"]
                    note = (
                        f"; ours = {a:.4g} x theirs + {c:.3g} to {v['affine_max_diff']:.1e}"
                        if v["equal_up_to_affine"]
                        else " **differs**"
                    )
                eq.append(
                    f"{k} = {v['pytorch_ood']}: max |diff| {v['max_abs_diff']:.1e} (scores up to "
                    f"{v['max_abs_score']:.3g}; AUROC diff {v['max_auroc_diff']:.1e}){note}"
                )
        lines.append(
            f"- same scores as pytorch-ood (to {EQUAL_TOL:g} x max(1, max |score|)): **{common.target_mark(tg['equal_ok'])}**; "
            + "; ".join(eq)
        )
        thr = [
            f"{k} {v['ratio']:.2f}x ({v['ours_ms_per_1000']:.0f} vs {v['theirs_ms_per_1000']:.0f} ms / 1000)"
            if "ratio" in v
            else f"{k}: {v['failed'][:80]}"
            for k, v in net["throughput"].items()
        ]
        lines.append(
            f"- CPU throughput ours / pytorch-ood's (>= {TARGET_THROUGHPUT}: **{common.target_mark(tg['throughput_ok'])}**): "
            + ", ".join(thr)
        )
        if "jem_ok" in tg:
            b = tg["best_posthoc_on_twin"]
            each = ", ".join(
                f"`{r}` {v['logpx_mean']:.3f} ({common.target_mark(v['ok'])})" for r, v in tg["jem"].items()
            )
            lines.append(
                f"- a JEM-trained twin's logpx beats every post-hoc detector on this cross-entropy model on mean "
                f"AUROC (best post-hoc: {b[0]} {b[1]:.3f}): **{common.target_mark(tg['jem_ok'])}**; {each}"
            )
        lines.append("")
    for recipe, twin in twins.items():
        lines += [
            f"#### JEM twin: {twin['network']}, `{recipe}` recipe, {twin['epochs']} epochs: test accuracy "
            f"{twin['accuracy']:.3f} (0-7 model {twin['accuracy_0_7']:.3f}), training "
            f"{(twin['cost']['train_cpu_s'] + twin['cost_0_7']['train_cpu_s']) / 60:.1f} CPU minutes for both models",
            "",
        ]
        rows = []
        for sc in dict.fromkeys(r["score"] for r in twin["scores"]):
            vals = [_auroc(twin["scores"], sc, s) for s in SETS]
            mean = twin["mean_auroc"].get(sc)
            rows.append([f"jem {sc}", *(_fmt(v) for v in vals), _fmt(mean)])
        lines += [common.md_table(["score", *SETS, "mean"], rows), ""]
    return "\n".join(lines)


def write(res: dict[str, Any], out_dir: str, machine: dict[str, Any] | None = None) -> str:
    """``posthoc.json`` (unless re-rendering a saved one: ``machine`` given), ``posthoc.md`` and one
    heat map per network (ours, pytorch-ood's and the JEM twins' log p(x)); returns the Markdown."""
    from jem_plugin.viz import plot_ood_table

    os.makedirs(out_dir, exist_ok=True)
    if machine is None:
        machine = res.get("_machine") or common.machine_info()
        common.write_json(os.path.join(out_dir, f"{NAME}.json"), {"machine": machine, NAME: _strip(res)})
    md = to_markdown(res)
    common.write_markdown(out_dir, NAME, machine, md)
    twin_net = res["settings"].get("jem_twin")
    for name, net in res["networks"].items():
        rows = [{**r, "score": "jem " + r["score"]} for r in net["ours"]]
        rows += [{**r, "score": "pytorch-ood " + r["score"]} for r in net["pytorch_ood"]]
        if name == twin_net:
            for recipe, twin in (res.get("jem_twins") or {}).items():
                rows += [{**r, "score": f"JEM twin ({recipe}) logpx"} for r in twin["scores"] if r["score"] == "logpx"]
        plot_ood_table(rows, os.path.join(out_dir, f"{NAME}_{name}.png"), title=f"{name}: AUROC per score and OOD set")
    return md


def merge(parts: Sequence[str], twins_from: str | None = None, note: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(results, machine)`` of several runs' ``posthoc.json`` (one network or more each, e.g.
    ``--networks X --no-jem`` runs side by side), in the order given; a network in two parts is
    taken from the later. ``twins_from``: a ``posthoc.json`` whose JEM-trained twins (and their
    settings) join the merged results, and whose twin network's targets are judged against them
    again. The machine is the first part's (its load at the start); CPU and wall times add up."""
    saved = []
    for part in parts:
        path = part if part.endswith(".json") else os.path.join(part, f"{NAME}.json")
        with open(path) as f:
            saved.append(json.load(f))
    res: dict[str, Any] = {"settings": dict(saved[0][NAME]["settings"]), "networks": {}, "cpu_s": 0.0, "wall_s": 0.0}
    st = res["settings"]
    st["networks"], st["epochs"], st["lr"] = [], {}, {}
    for one in saved:
        r = one[NAME]
        for name, net in r["networks"].items():
            res["networks"][name] = net
            st["epochs"][name], st["lr"][name] = r["settings"]["epochs"][name], r["settings"]["lr"][name]
        res["cpu_s"] += r["cpu_s"]
        res["wall_s"] += r["wall_s"]
    st["networks"] = list(res["networks"])
    if twins_from:
        with open(twins_from) as f:
            old = json.load(f)[NAME]
        res["jem_twins"] = old["jem_twins"]
        for k in ("jem_twin", "jem_recipes", "jem_batch_size"):
            st[k] = old["settings"][k]
    twin_net = st.get("jem_twin")
    for name, net in res["networks"].items():
        net["targets"] = targets(net, res.get("jem_twins") if name == twin_net else None)
    if note:
        res["note"] = note
    return res, saved[0]["machine"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="jem-plugin benchmark: post-hoc OOD against pytorch-ood (issue 29)")
    p.add_argument("--quick", action="store_true", help="2 networks, 3 epochs, 400 training images: minutes")
    p.add_argument("--networks", nargs="*", default=None, choices=list(NETWORKS))
    p.add_argument("--epochs", type=int, default=None, help="cross-entropy epochs (default: per network; quick 3)")
    p.add_argument("--jem-epochs", type=int, default=None, help=f"the JEM twins' epochs (default {JEM_RECIPES})")
    p.add_argument("--no-jem", action="store_true", help="leave out the JEM-trained twin")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=OUT)
    p.add_argument("--render", action="store_true", help="rewrite the Markdown and figures from --out's posthoc.json")
    p.add_argument("--merge", nargs="+", default=None, help="merge these runs' posthoc.json (dirs or files) into --out")
    p.add_argument("--twins-from", default=None, help="--merge: take the JEM-trained twins from this posthoc.json")
    p.add_argument("--note", default="", help="--merge: a line on where each part comes from, shown in the Markdown")
    p.add_argument(
        "--one-forward",
        action="store_true",
        help="time evaluate_all over the gradient-free scores (one shared forward) against the per-detector loop",
    )
    p.add_argument("--repeats", type=int, default=None, help="--one-forward's interleaved rounds (default 3; quick 1)")
    args = p.parse_args(argv)
    if args.one_forward:
        common.set_threads(args.threads)
        res = run_one_forward(
            networks=args.networks or (["lcnet_050", "test_vit"] if args.quick else None),
            epochs=args.epochs or (1 if args.quick else None),
            repeats=args.repeats or (1 if args.quick else 3),
            n_train=400 if args.quick else None,
            n_eval=120 if args.quick else None,
        )
        md = write_one_forward(res, args.out)
        print(md)
        return res
    if args.merge:
        merged, machine = merge(args.merge, args.twins_from, args.note)
        os.makedirs(args.out, exist_ok=True)
        common.write_json(os.path.join(args.out, f"{NAME}.json"), {"machine": machine, NAME: _strip(merged)})
        md = write(merged, args.out, machine=machine)
        print(md)
        return merged
    if args.render:
        with open(os.path.join(args.out, f"{NAME}.json")) as f:
            saved = json.load(f)
        md = write(saved[NAME], args.out, machine=saved["machine"])
        print(md)
        return saved[NAME]
    common.set_threads(args.threads)
    res = run(
        quick=args.quick,
        networks=args.networks,
        epochs=args.epochs,
        jem_epochs=args.jem_epochs,
        jem_twin=not args.no_jem,
        out_dir=args.out,
    )
    md = write(res, args.out)
    print(md)
    return res


if __name__ == "__main__":
    main()
