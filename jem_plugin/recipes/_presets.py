"""The named recipes (:data:`RECIPES`): the paper's and the ones measured since, each a
:class:`~jem_plugin.recipes.Recipe`. Public through :mod:`jem_plugin.recipes`."""

from __future__ import annotations

from typing import Any

from ..covariance import Full, Stationary
from ..errors import UnknownNameError
from ..inits import Gaussian
from ._tree import BufferConfig, LossConfig, OptimConfig, Recipe, SAMConfig, SamplerConfig

_FAST_OPTIM = OptimConfig(lr=3e-4, warmup_iters=200)
_CLAMPED: dict[str, Any] = dict(noise=0.0, grad_clamp=0.03)  # JEM++'s noise-free clamped steps

RECIPES: dict[str, Recipe] = {
    "paper": Recipe(
        "paper",
        "Grathwohl et al. 2019: 20 SGLD steps from uniform noise, Adam 1e-4, 1000 warm-up iterations",
    ),
    "fast": Recipe(
        "fast",
        "5 SGLD steps on 32 chains from a per-class Gaussian fitted from the data, energy L2 0.1, "
        "Adam 3e-4; samples pass BatchNorm on their own (batch statistics, running ones from data only). "
        "About 3-4x the cross-entropy cost; within a point of its accuracy on a BatchNorm ResNet at this "
        "learning rate, not on every network (docs/benchmarks.md)",
        sampler=SamplerConfig(steps=5, batchnorm="separate"),
        buffer=BufferConfig(init=Gaussian()),
        loss=LossConfig(n_samples=32, l2_weight=0.1),
        optim=_FAST_OPTIM,
    ),
    "jempp": Recipe(
        "jempp",
        "JEM++ (Yang & Ji 2021) sampling: 10 noise-free gradient-clamped steps from a per-class "
        "Gaussian (full covariance) fitted from the data, BatchNorm kept; the fast preset's optimiser "
        "(the paper's SGD 0.1 is for WRN-28-10 on CIFAR)",
        sampler=SamplerConfig(steps=10, **_CLAMPED),
        buffer=BufferConfig(init=Gaussian(covariance=Full())),
        loss=LossConfig(n_samples=32, l2_weight=0.1),
        optim=_FAST_OPTIM,
    ),
    "sadajem": Recipe(
        "sadajem",
        "SADA-JEM (2023): 5 noise-free gradient-clamped steps from a per-class Gaussian, "
        "adaptive SAM (rho 2) with BatchNorm statistics frozen on the second pass and one sampling per "
        "iteration, the p(x) term on the un-augmented batch; the fast preset's optimiser",
        sampler=SamplerConfig(steps=5, **_CLAMPED),
        buffer=BufferConfig(init=Gaussian()),
        loss=LossConfig(n_samples=32, l2_weight=0.1, px_clean_data=True),
        optim=_FAST_OPTIM,
        sam=SAMConfig(rho=2.0, adaptive=True),
    ),
    "generative": Recipe(
        "generative",
        "For samples on BatchNorm networks: JEM++'s 10 noise-free gradient-clamped steps from a "
        "per-class Gaussian with a stationary covariance (each class's power spectrum; images of any size), "
        "steps confined to the data's colour axes, the p(x) term at weight 0.75 on the un-augmented batch, "
        "samples in the data's BatchNorm pass, whose running statistics are recomputed from the training "
        "data after training, a replay buffer of at most 10000 slots, each drawn about 40 times in the run "
        "and never restarted from the init; the fast preset's optimiser. Its buffer moves towards the data "
        "where fast's stays put, at a cost in calibration",
        sampler=SamplerConfig(steps=10, colours="data", **_CLAMPED),
        buffer=BufferConfig(visits=40, reinit_freq=0.0, init=Gaussian(covariance=Stationary())),
        loss=LossConfig(n_samples=32, px_weight=0.75, l2_weight=0.1, px_clean_data=True),
        optim=_FAST_OPTIM,
        bn_stats_from_data=True,
    ),
}


def get_recipe(name: str) -> Recipe:
    """The recipe registered as ``name``; :class:`~jem_plugin.UnknownNameError` lists the choices."""
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown recipe {name!r}{UnknownNameError.did_you_mean(name, RECIPES)}; available: {', '.join(RECIPES)}"
        ) from None


def list_recipes() -> list[str]:
    """The names of the registered recipes."""
    return list(RECIPES)
