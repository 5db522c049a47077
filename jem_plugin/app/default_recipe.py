"""``jem train``'s default recipe: what it trains with when no ``--recipe`` is given, chosen by
the data and the network (:func:`default_choice`), from the generalisation matrix's measurements
(benchmarks/README.md, "Generalisation matrix"). The app and the benchmarks read it; the library
does not."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from torch import nn

from ..recipes import RECIPES, Recipe, get_recipe

#: Where the command's lines send a user for the measurements behind its choices: the docs'
#: Benchmarks page, which includes the benchmarks' full report (the wheel ships no benchmarks/).
BENCHMARKS_PAGE = "docs/benchmarks.md"

__all__ = [
    "DEFAULT_RECIPE",
    "SMALL_DATA_RECIPE",
    "SMALL_DATA_PER_CLASS",
    "DEFAULT_PX_WEIGHT",
    "NO_NORMALISATION_L2_WEIGHT",
    "RAISED_LR_FACTOR",
    "DefaultChoice",
    "default_choice",
    "default_choice_for",
    "default_recipe_for",
    "default_settings_for",
    "generative_half",
    "lr_raised",
    "recipe_record",
    "network_kind",
    "LONG_ROW_TARGETS",
]

# jem train's default recipe. On its own it lost accuracy against a cross-entropy baseline almost
# everywhere in the generalisation matrix (benchmarks/README.md, "Generalisation matrix"), so jem
# train lowers its p(x) weight (DEFAULT_PX_WEIGHT below) wherever it picks it.
DEFAULT_RECIPE = "generative"
# ... except on small data with BatchNorm: with at most this many training images in the smallest
# class, `generative` lost accuracy against the baseline on resnet10t where `fast` held it (40 per
# class, three data sets, three seeds: benchmarks/README.md, "Generalisation matrix"). On the
# LayerNorm, ViT and normalisation-free networks both lost (fast as much or more): there it stays.
SMALL_DATA_RECIPE = "fast"
SMALL_DATA_PER_CLASS = 50


# ... and only at about the recipes' own learning rate: raised more than this many times (to the
# rate a cross-entropy baseline needed), `fast` lost more accuracy than `generative` on a BatchNorm
# network at 40 per class (lcnet_050 at 1e-2: on all three data sets), and both lost far more.
RAISED_LR_FACTOR = 3.0

# Wherever jem train picks `generative`, its p(x) term at this weight instead of its own 0.75. At
# 0.75 it lost 2-43 points of accuracy at 40 per class on the four networks where `fast` is not the
# choice, 0.6-37 at 136-150 per class (seed 0), and 1.7-9.9 on resnet10t above 50 per class. The
# weight was chosen on the tune set alone (the digits' validation split at 40 per class: mean +0.5
# points against the baseline on those four networks, where 0.1 gave -3.0 and 0.75 -28.5;
# benchmarks/results/generalisation/px_tuning/). Judged on the test split, 3 seeds, on all three
# data sets: within a point of the baseline on 6 of 12 cells at 40 per class, 10 of 15 at 136-150
# and 4 of 5 at 500 (textures), where 0.75 held 3 of the 32 (one seed each); wrn10-1 (no
# normalisation) lost 2-22 points, until its energy L2 went too (below). Its buffer stays near its init's Fréchet distance, except
# on resnet10t above 50 per class: mostly a classifier with a weak energy term.
DEFAULT_PX_WEIGHT = 0.03

# ... and on a network without normalisation layers, its energy L2 at this weight instead of 0.1.
# With the L2, wrn10-1 (the matrix's one such network) lost 2-22 points at 0.03 at every size.
# Without it, it held validation accuracy on the tune set (digits, 40 per class, seed 0: +12 points
# against the L2's; on test_vit -22, which is why it stays elsewhere); judged on the test split,
# 3 seeds, on all three data sets: -1.5 / +3.3 / +3.1 points at 40 per class, +2.5 / +0.4 / +0.6 at 136-150,
# -1.6 at 500 (benchmarks/README.md, "Generalisation matrix").
# Its buffer then drifts from the data (Fréchet distance above its init's): accuracy, not samples.
NO_NORMALISATION_L2_WEIGHT = 0.0


@dataclass(frozen=True)
class DefaultChoice:
    """What ``jem train`` trains with when no ``--recipe`` is given (:func:`default_choice`).

    ``recipe``: the registered recipe's name; ``settings``: flat settings changed in it (flags the
    user gives win); ``reason``: the kind of data and network the rule saw, as a phrase ("a network
    without BatchNorm"), for the one line that says why."""

    recipe: str
    settings: dict[str, float]
    reason: str


def default_choice(
    per_class: int | None, batchnorm: bool, lr: float | None = None, normalised: bool = True
) -> DefaultChoice:
    """``jem train``'s recipe and settings for training data whose smallest class has ``per_class``
    images, on a network with or without BatchNorm (``batchnorm``) and with or without any
    normalisation layer (``normalised``; BatchNorm is one), at the learning rate ``lr`` (``None``:
    the recipe's own).

    :data:`SMALL_DATA_RECIPE` as it is for small data on a BatchNorm network at about its own rate;
    else :data:`DEFAULT_RECIPE` with its p(x) term at :data:`DEFAULT_PX_WEIGHT`, and on a network
    without normalisation layers its energy L2 at :data:`NO_NORMALISATION_L2_WEIGHT`.

    >>> default_choice(40, batchnorm=True).recipe
    'fast'
    >>> default_choice(500, batchnorm=False, normalised=False).settings
    {'px_weight': 0.03, 'l2_weight': 0.0}
    """
    small = per_class is not None and per_class <= SMALL_DATA_PER_CLASS
    raised = lr is not None and lr_raised(lr, SMALL_DATA_RECIPE)
    if small and batchnorm and not raised:
        return DefaultChoice(
            SMALL_DATA_RECIPE,
            {},
            f"a BatchNorm network whose smallest class has {per_class} training images (at most {SMALL_DATA_PER_CLASS})",
        )
    settings = {"px_weight": DEFAULT_PX_WEIGHT}
    if not (normalised or batchnorm):
        settings["l2_weight"] = NO_NORMALISATION_L2_WEIGHT
        reason = "a network without normalisation layers"
    elif not batchnorm:
        reason = "a network without BatchNorm"
    elif small:  # where the small-data recipe would be the choice but for the raised learning rate
        reason = f"a BatchNorm network at --lr {lr:g} (over {RAISED_LR_FACTOR:g}x {SMALL_DATA_RECIPE}'s)"
    else:
        reason = (
            f"a BatchNorm network whose smallest class has {per_class} training images (over {SMALL_DATA_PER_CLASS})"
            if per_class is not None
            else "a BatchNorm network"
        )
    return DefaultChoice(DEFAULT_RECIPE, settings, reason)


# torch's normalisation layers, and any other whose class is named for one (timm's RmsNorm, ...)
_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def _is_normalisation(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith(("norm", "norm1d", "norm2d"))


def network_kind(model: nn.Module) -> tuple[bool, bool]:
    """``(batchnorm, normalised)``: whether ``model`` has a BatchNorm layer, and any normalisation
    layer (BatchNorm is one), read from its modules as ``jem train`` reads them."""
    modules = list(model.modules())
    batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)
    return batchnorm, any(_is_normalisation(m) for m in modules)


def default_choice_for(model: nn.Module, per_class: int | None, lr: float | None = None) -> DefaultChoice:
    """:func:`default_choice` for ``model`` (a classifier or its JEM), its kind read by
    :func:`network_kind`."""
    batchnorm, normalised = network_kind(model)
    return default_choice(per_class, batchnorm, lr=lr, normalised=normalised)


def default_recipe_for(per_class: int | None, batchnorm: bool, lr: float | None = None) -> str:
    """:func:`default_choice`'s recipe name (the benchmarks' label for ``jem train``'s choice)."""
    return default_choice(per_class, batchnorm, lr).recipe


def default_settings_for(
    per_class: int | None, batchnorm: bool, lr: float | None = None, normalised: bool = True
) -> dict[str, float]:
    """:func:`default_choice`'s changed settings (empty where the recipe runs as registered)."""
    return default_choice(per_class, batchnorm, lr, normalised).settings


def recipe_record(recipe: Recipe) -> dict[str, Any]:
    """``recipe.to_dict()`` labelled as it ran: a recipe changed from its registered one keeps its
    settings, but its ``name`` says "paper, changed" and its ``summary`` lists each changed setting
    (registered value -> this one) after the registered summary, so that a report's settings block
    does not show the paper's summary above other values.

    >>> recipe_record(get_recipe("paper").replace(sgld_steps=5))["summary"].endswith("changed here: sgld_steps 20 -> 5")
    True
    """
    record = recipe.to_dict()
    if recipe.name not in RECIPES:
        return record
    registered = get_recipe(recipe.name).flat()
    changed = [f"{k} {registered[k]!r} -> {v!r}" for k, v in recipe.flat().items() if registered.get(k) != v]
    if changed:
        record["name"] = f"{recipe.name}, changed"
        record["summary"] = f"{recipe.name}'s recipe ({recipe.summary}), changed here: " + ", ".join(changed)
    return record


def lr_raised(lr: float, recipe: str) -> bool:
    """Whether ``lr`` is more than :data:`RAISED_LR_FACTOR` times the registered ``recipe``'s."""
    return lr > RAISED_LR_FACTOR * get_recipe(recipe).optim.lr


# ---------------------------------------------------------------------------- the long row's evidence
#: The long row's targets table (benchmarks/bench_long_row.py writes it with its report): per cell,
#: the first evaluated iteration at which each target held. jem train reads it to say when the
#: generative half starts paying, and to switch to a recipe that met every target on data it was not
#: tuned on, once the user's run is at least that long.
LONG_ROW_TARGETS = Path(__file__).with_name("long_row_targets.json")
_TARGETS_PHRASE = (
    "accuracy within a point of cross-entropy, log p(x) AUROC at least the baseline energy's on every OOD set, "
    "buffer FD at most half its init's"
)


@cache
def read_table(path: Path) -> dict[str, Any]:
    """A JSON table the package ships (the long row's targets, the benefit ledger's evidence);
    ``{}`` where it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a build without the table says nothing rather than fail a run
        return {}


def kind_name(batchnorm: bool, normalised: bool) -> str:
    """The long row's network kinds: "BN" (BatchNorm anywhere), "other" (another normalisation), "none"."""
    return "BN" if batchnorm else ("other" if normalised else "none")


def _registered(cell: dict[str, Any]) -> bool:
    return cell.get("recipe") in RECIPES


def generative_half(
    choice: DefaultChoice,
    iterations: int,
    batchnorm: bool,
    normalised: bool = True,
    table: dict[str, Any] | None = None,
) -> tuple[DefaultChoice, str | None]:
    """What the long row says about the generative half of a run of ``iterations`` iterations with
    ``choice`` on a network of this kind (``batchnorm``, ``normalised`` as :func:`default_choice`
    takes them): ``(the choice, one line)``.

    Only cells of the data the recipes were not tuned on (``table["judged_on"]``) and of the same
    kind of network count. Where a registered recipe met all three targets there after N iterations
    (and still met them at its last evaluation), and this run has at least N, that recipe is the
    choice; where the run is shorter, the line says how many iterations the generative half needs.
    Where no recipe met them, the line says how far the measurements go and what to expect.
    ``table``: the targets table (default: :data:`LONG_ROW_TARGETS`); the line is None without one.

    >>> table = {"judged_on": ["textures"], "cells": [dict(dataset="textures", net="resnet10t", kind="BN",
    ...     recipe="fast", settings={}, run="fast", evaluated_to=3000, first={"all": 1200}, met_at_last=True)]}
    >>> choice, line = generative_half(default_choice(500, True), 5000, True, table=table)
    >>> choice.recipe
    'fast'
    """
    table = read_table(LONG_ROW_TARGETS) if table is None else table
    kind = kind_name(batchnorm, normalised)
    cells = [
        c for c in table.get("cells", []) if c.get("dataset") in table.get("judged_on", ()) and c.get("kind") == kind
    ]
    if not cells:
        return choice, None
    where = f"on {cells[0]['dataset']} at ~150 images per class"
    ready = sorted(
        (c for c in cells if _registered(c) and c["first"].get("all") is not None and c.get("met_at_last")),
        key=lambda c: c["first"]["all"],
    )
    if ready:
        best = ready[0]
        n = int(best["first"]["all"])
        if iterations >= n:
            same = best["recipe"] == choice.recipe and dict(best.get("settings") or {}) == choice.settings
            if not same:
                choice = DefaultChoice(
                    best["recipe"],
                    dict(best.get("settings") or {}),
                    f"a run of {iterations} iterations, past the {n} after which {best['run']} met every target "
                    f"of the long row {where} with {best['net']}",
                )
            return choice, (
                f"the generative half: on the long row ({BENCHMARKS_PAGE}) {best['run']} met all three targets "
                f"({_TARGETS_PHRASE}) after {n} iterations {where} with {best['net']}; this run has {iterations}"
            )
        return choice, (
            f"log p(x) and samples need about {n} iterations at this size ({best['run']} with {best['net']} {where}, "
            f"the long row in {BENCHMARKS_PAGE}); this run has {iterations}: until then, expect a classifier "
            "with a weak energy term"
        )
    measured = max(int(c.get("evaluated_to") or 0) for c in cells)
    nets = ", ".join(sorted({c["net"] for c in cells}))
    head = (
        f"the generative half: on the long row ({BENCHMARKS_PAGE}) no recipe met all three targets "
        f"({_TARGETS_PHRASE}) within the {measured} iterations measured {where} on {nets}; this run has {iterations}"
    )
    if iterations > measured:  # past the measurements: say so, rather than extend them
        return choice, (
            f"{head}, longer than any measured: up to {measured}, expect a classifier with a weak energy term and "
            "samples near their init; past it nothing was measured, so judge the samples (jem sample) and "
            "log p(x) (jem ood) of this run itself"
        )
    return choice, f"{head}: expect a classifier with a weak energy term, and samples near their init"
