"""Named JEM training recipes: small, printable data a user can copy and change.

A :class:`Recipe` holds every setting that distinguishes the JEM family's published recipes
(sampler, replay buffer, loss weights, optimiser, sharpness-aware minimisation, which data the
``p(x)`` term sees). :meth:`Recipe.build_loss` turns one into a :class:`~jem_plugin.JEMLoss` for a
wrapped model; ``jem train --recipe NAME`` uses the same objects.

>>> import dataclasses, jem_plugin.recipes as R
>>> print(R.get_recipe("fast"))
>>> mine = dataclasses.replace(R.get_recipe("fast"), sgld_steps=10)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buffer import ReplayBuffer
from .errors import InvalidInputError, UnknownNameError
from .losses import JEMLoss
from .sam import SAM
from .sampling import SGLD

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "get_recipe"]


@dataclass(frozen=True)
class Recipe:
    """The settings of one JEM recipe. Print it to see them; ``dataclasses.replace`` to change one."""

    name: str
    summary: str
    # SGLD
    sgld_steps: int = 20
    step_size: float = 1.0
    noise: float = 0.01
    grad_clip: float | None = None  # proximal SGLD (JEM++): clamp each step's gradient
    sgld_batchnorm: str = "eval"  # chains see BatchNorm with "eval" (running) or "batch" statistics
    sgld_colours: str = "all"  # steps move every channel ("all") or the data's colour axes only ("data")
    # replay buffer
    buffer_size: int = 10000
    buffer_visits: float | None = None  # size the buffer for the run: at most buffer_size slots, few enough that
    # each is drawn about this often (build_loss(total_iters=)); None: buffer_size
    reinit_freq: float = 0.05  # a drawn slot restarts from the init with this probability: its chains are
    # then at most about 1 / reinit_freq draws old on average, whatever the run
    init: str = "uniform"  # a registered init distribution: "uniform", "gaussian", ...
    init_covariance: str = (
        "diagonal"  # "gaussian" init: "diagonal", "full" (JEM++, D x D), "lowrank" or "stationary" (any size)
    )
    init_rank: int = 32  # "lowrank" covariance: principal directions kept per class
    init_residual: float = 1.0  # "lowrank": share of the variance outside them drawn as isotropic noise
    n_samples: int | None = None  # chains per iteration (None: the batch size)
    class_conditional_px: bool = False  # p(x) chains drawn from p(y) p(x|y): one class per chain and buffer slot
    # loss
    px_weight: float = 1.0
    pxy_weight: float = 0.0
    l2_weight: float = 0.0  # energy L2 on data and sample energies
    data_noise: float = 0.03
    px_clean_data: bool = False  # the p(x) term sees the un-augmented batch (SADA-JEM): a loop that
    # augments passes it as px_data=; jem train does not augment, so there it is moot
    batchnorm: str = "joint"  # samples pass BatchNorm with the data ("joint") or on their own ("separate")
    bn_stats_from_data: bool = False  # after training, BatchNorm running statistics recomputed from the training
    # data (torch.optim.swa_utils.update_bn): "joint" mixes the samples into them
    # optimiser
    optimizer: str = "adam"  # "adam" or "sgd"
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_iters: int = 1000
    warmup_max_fraction: float = 0.1  # the warm-up never exceeds this fraction of the run
    sam_rho: float | None = None  # sharpness-aware minimisation radius (SADA-JEM: 2.0, adaptive)
    sam_adaptive: bool = True  # ASAM's scale-invariant neighbourhood (jem_plugin.sam.SAM)

    def __str__(self) -> str:
        rows = [f"recipe {self.name!r}: {self.summary}"]
        rows += [
            f"  {f.name:<20} {getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in ("name", "summary")
        ]
        return "\n".join(rows)

    def for_inputs(self, sample_shape: Sequence[int]) -> tuple[Recipe, list[str]]:
        """This recipe for inputs of ``sample_shape``, and what had to change (one line each).

        The image-only pieces (the stationary init, steps in the data's colours) need
        ``[C, H, W]`` inputs; for others they fall back to a diagonal covariance and free steps.
        """
        if len(tuple(sample_shape)) == 3:
            return self, []
        changes: dict[str, Any] = {}
        if self.init == "gaussian" and self.init_covariance == "stationary":
            changes["init_covariance"] = "diagonal"
        if self.sgld_colours != "all":
            changes["sgld_colours"] = "all"
        notes = [
            f"recipe {self.name!r}: inputs of shape {tuple(sample_shape)} are not images [C, H, W]: "
            f"{k} {getattr(self, k)!r} -> {v!r}"
            for k, v in changes.items()
        ]
        return dataclasses.replace(self, **changes), notes

    def warmup_for(self, total_iters: int) -> int:
        """Warm-up iterations for a run of ``total_iters``: the recipe's, capped to a fraction of the run."""
        return max(0, min(self.warmup_iters, int(self.warmup_max_fraction * total_iters)))

    def buffer_size_for(self, total_iters: int | None, batch_size: int | None = None) -> int:
        """Replay-buffer slots for a run of ``total_iters`` iterations.

        With ``buffer_visits`` set, a short run gets fewer slots than ``buffer_size``, so that each
        slot is still drawn about ``buffer_visits`` times. A chain drawn a few times stays near its
        initial distribution (issue 16, e79). ``batch_size``: the chains per iteration when
        ``n_samples`` is None. Never fewer slots than chains per iteration, never more than
        ``buffer_size``.
        """
        chains = self.n_samples or batch_size
        if self.buffer_visits is None or not total_iters or not chains:
            return self.buffer_size
        if not self.buffer_visits > 0:
            raise InvalidInputError(f"recipe {self.name!r}: buffer_visits must be positive, got {self.buffer_visits!r}")
        return min(self.buffer_size, max(chains, int(total_iters * chains / self.buffer_visits)))

    def build_loss(
        self,
        *,
        sample_shape: Sequence[int],
        num_classes: int | None = None,
        x_fit: torch.Tensor | None = None,
        y_fit: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        total_iters: int | None = None,
        batch_size: int | None = None,
        **overrides: Any,
    ):
        """A :class:`~jem_plugin.JEMLoss` with this recipe's sampler and buffer.

        ``x_fit``/``y_fit``: data to fit an informative initial distribution (``init="gaussian"``)
        from. ``total_iters`` (and ``batch_size`` when ``n_samples`` is None): the run's length,
        which sizes the buffer of a recipe with ``buffer_visits`` (:meth:`buffer_size_for`;
        without it such a recipe warns and keeps ``buffer_size``). ``overrides`` replace
        ``JEMLoss`` keywords.
        """
        if self.buffer_visits is not None and not total_iters:
            warnings.warn(
                f"recipe {self.name!r} sizes its replay buffer for the run: pass build_loss("
                f"total_iters=...); using buffer_size {self.buffer_size} (in a short run, chains "
                "drawn only a few times stay near their init)",
                RuntimeWarning,
                stacklevel=2,
            )
        buffer_size = self.buffer_size_for(total_iters, batch_size)
        sampler = SGLD(
            steps=self.sgld_steps,
            step_size=self.step_size,
            noise=self.noise,
            grad_clip=self.grad_clip,
            generator=generator,
            batchnorm=self.sgld_batchnorm,
            colours=self.sgld_colours,
        )
        cond = self.init != "uniform" or self.pxy_weight > 0 or self.class_conditional_px
        init_kwargs: dict[str, Any] | None = None
        if self.init == "gaussian":
            init_kwargs = {"covariance": self.init_covariance}
            if self.init_covariance == "lowrank":
                init_kwargs.update(rank=self.init_rank, residual=self.init_residual)
        buffer = ReplayBuffer(
            buffer_size,
            tuple(sample_shape),
            reinit_freq=self.reinit_freq,
            init=self.init,
            init_kwargs=init_kwargs,
            num_classes=num_classes if cond else None,
            device=device,
        )
        if x_fit is not None and hasattr(buffer.init_dist, "fit"):
            buffer.fit(
                x_fit.to(device) if device else x_fit,
                None if y_fit is None else (y_fit.to(device) if device else y_fit),
            )
        kwargs: dict[str, Any] = dict(
            px_weight=self.px_weight,
            pxy_weight=self.pxy_weight,
            l2_weight=self.l2_weight,
            data_noise=self.data_noise,
            n_samples=self.n_samples,
            class_conditional_px=self.class_conditional_px,
            generator=generator,
            batchnorm=self.batchnorm,
        )
        kwargs.update(overrides)
        loss = JEMLoss(sampler, buffer, **kwargs)
        return loss.to(device) if device is not None else loss

    def build_sam(self, optimizer: torch.optim.Optimizer):
        """:class:`~jem_plugin.sam.SAM` around ``optimizer`` when the recipe sets ``sam_rho``, else ``None``.

        Step it with ``sam.step(closure, model=model, loss_fn=loss_fn)`` (one sampling per
        iteration, BatchNorm statistics frozen on the second pass)."""
        if self.sam_rho is None:
            return None
        return SAM(optimizer, rho=self.sam_rho, adaptive=self.sam_adaptive)

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        """The recipe's optimiser over ``params`` (SAM, when ``sam_rho`` is set, wraps it in the training loop)."""
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        raise UnknownNameError(f"recipe {self.name!r}: unknown optimizer {self.optimizer!r}; use 'adam' or 'sgd'")


RECIPES: dict[str, Recipe] = {
    "paper": Recipe(
        "paper",
        "Grathwohl et al. 2019: 20 SGLD steps from uniform noise, Adam 1e-4, 1000 warm-up iterations",
    ),
    "fast": Recipe(
        "fast",
        "5 SGLD steps on 32 chains from a per-class Gaussian fitted from the data, energy L2 0.1, "
        "Adam 3e-4; samples pass BatchNorm on their own (batch statistics, running ones from data only). "
        "About 3-4x the cross-entropy cost, within a point of its accuracy",
        sgld_steps=5,
        n_samples=32,
        l2_weight=0.1,
        lr=3e-4,
        warmup_iters=200,
        init="gaussian",
        batchnorm="separate",
        sgld_batchnorm="batch",
    ),
    "jempp": Recipe(
        "jempp",
        "JEM++ (Yang & Ji 2021) sampling: 10 noise-free gradient-clamped steps from a per-class "
        "Gaussian (full covariance) fitted from the data, BatchNorm kept; the fast preset's optimiser "
        "(the paper's SGD 0.1 is for WRN-28-10 on CIFAR). No inner steps through the first layer: on a linear "
        "stem they move along the outer gradient, a larger step (benchmarks/check_inner_steps.py)",
        sgld_steps=10,
        noise=0.0,
        grad_clip=0.03,
        init="gaussian",
        init_covariance="full",
        n_samples=32,
        l2_weight=0.1,
        lr=3e-4,
        warmup_iters=200,
    ),
    "sadajem": Recipe(
        "sadajem",
        "SADA-JEM (2023): 5 noise-free gradient-clamped steps from a per-class Gaussian, "
        "adaptive SAM (rho 2) with BatchNorm statistics frozen on the second pass and one sampling per "
        "iteration, the p(x) term on the un-augmented batch; the fast preset's optimiser",
        sgld_steps=5,
        noise=0.0,
        grad_clip=0.03,
        init="gaussian",
        n_samples=32,
        l2_weight=0.1,
        lr=3e-4,
        warmup_iters=200,
        px_clean_data=True,
        sam_rho=2.0,
        sam_adaptive=True,
    ),
    "generative": Recipe(
        "generative",
        "For samples on BatchNorm networks: JEM++'s 10 noise-free gradient-clamped steps from a "
        "per-class Gaussian with a stationary covariance (each class's power spectrum; images of any size), "
        "steps confined to the data's colour axes, the p(x) term at weight 0.75 on the un-augmented batch "
        "(pass px_data= in your loop), samples in the data's BatchNorm pass, whose running statistics are "
        "recomputed from the training data after training (torch.optim.swa_utils.update_bn in your loop), "
        "a replay buffer of at most 10000 slots, each drawn about 40 times in the run (build_loss(total_iters=)) "
        "and never restarted from the init (reinit_freq 0: every chain in it began with the run); "
        "the fast preset's optimiser. Its buffer moves towards the data where fast's stays put, at a cost "
        "in calibration",
        sgld_steps=10,
        noise=0.0,
        grad_clip=0.03,
        init="gaussian",
        init_covariance="stationary",
        sgld_colours="data",
        n_samples=32,
        px_weight=0.75,
        l2_weight=0.1,
        lr=3e-4,
        warmup_iters=200,
        px_clean_data=True,
        bn_stats_from_data=True,
        buffer_visits=40,
        reinit_freq=0.0,
    ),
}


# jem train's default. `generative` moves its buffer towards the data on BatchNorm networks at
# 32x32 (test_resnet and resnet18), where `fast`'s stays where it started; it costs half a point
# of accuracy on average, a temperature of calibration and 1.5x fast's time (issue 16, e59-e89;
# README "Recipes").
DEFAULT_RECIPE = "generative"


def get_recipe(name: str) -> Recipe:
    """The recipe registered as ``name``; :class:`~jem_plugin.UnknownNameError` lists the choices."""
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownNameError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}") from None
