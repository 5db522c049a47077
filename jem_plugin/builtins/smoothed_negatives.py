"""Smoothed copies of the data as negatives: each image should be likelier than a blurred copy of itself.

Likelihood models, energy models among them, tend to rank *simpler* inputs as likelier than the
data they were trained on (Nalisnick et al. 2019, "Do deep generative models know what they don't
know?"; Serrà et al. 2020, "Input complexity and out-of-distribution detection with
likelihood-based generative models"). On the long row (``benchmarks/bench_long_row.py``) JEM shows
it where its buffer moves: at p(x) weight 0.3 on 32x32 textures, log p(x) ranks the smooth grey
digits above the textures it was trained on (AUROC 0.51 where the cross-entropy baseline's energy
has 0.93), while the samples come close to the data.

This term is a negative data augmentation (after Sinha et al. 2021, "Negative data augmentation",
who use transformed data as negatives for GANs and contrastive learning) aimed at that bias: every
training image ``x`` is compared with a Gaussian-blurred copy ``s(x)`` of itself by a pairwise
logistic (Bradley-Terry) loss on the energies ``E(x) = -logsumexp f(x)``::

    L = weight * mean softplus(E(x) - E(s(x)))     (= -log sigmoid(E(s(x)) - E(x)))

Once an image is clearly likelier than its smoothed copy the gradient vanishes, so the term asks
for an ordering, never for energies to run off. Both sides of every comparison pass the network
together, in one forward of the batch and its copies (twice the batch), with BatchNorm layers
normalising by their running statistics, as an input is scored at test time (the running
statistics are not updated by it). The loss's own data energies are not reused: they were
normalised by the batch's statistics, and a network asked to rank those above running-statistics
energies of the copies learns the difference between the two normalisations instead of the
images' (on sklearn's digits it then ranked 96% of held-out images *below* their copies).

The blur is torchvision's ``gaussian_blur`` with one ``sigma`` per call drawn uniformly from
``sigma`` (pixels; the default ``(1, 3)`` is meant for 32x32 inputs: scale it with the image).

    loss_fn = jem.JEMLoss(sampler, buffer, px_weight=0.3)
    loss_fn.add_term("smoothed_negatives")              # weight 1, sigma in [1, 3] pixels

Metrics: ``win`` (fraction of images likelier than their smoothed copy), ``gap`` (mean
``E(s(x)) - E(x)``), ``sigma`` (this call's blur).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.transforms.v2 import functional as TF

from .._checks import free_energy, restore_generator
from ..errors import InvalidInputError
from ..model import running_bn_stats
from ..plugins import hookimpl

__all__ = ["SmoothedNegativesTerm", "smoothed_copy", "jem_register_loss_terms"]

TERM_NAME = "smoothed_negatives"


def smoothed_copy(x: Tensor, sigma: float) -> Tensor:
    """``x`` (``[N, C, H, W]``) blurred by a Gaussian of standard deviation ``sigma`` pixels; the
    kernel spans three sigmas each side, at most the image's shorter side."""
    if x.dim() != 4:
        raise InvalidInputError(f"smoothed negatives need images [N, C, H, W], got a tensor of shape {tuple(x.shape)}")
    side = min(x.shape[-2:])
    size = min(2 * math.ceil(3 * sigma) + 1, side if side % 2 else side - 1)
    return TF.gaussian_blur(x, [size, size], [sigma, sigma]) if size >= 3 else x


class SmoothedNegativesTerm:
    """The ``smoothed_negatives`` loss term (module docstring): ``weight * mean softplus(E(x) - E(s(x)))``.

    Parameters
    ----------
    weight: multiplies the term (1, as DAT weighs its logistic contrast beside the cross-entropy).
    sigma: ``(low, high)`` pixels: each call blurs the batch with one sigma drawn uniformly from
        it (a number: always that sigma).
    generator: ``torch.Generator`` for the draws (default: torch's global one); its state is saved
        with the loss (``state_dict``), so a resumed run draws what the uninterrupted one would.
    """

    def __init__(
        self, weight: float = 1.0, sigma: float | tuple[float, float] = (1.0, 3.0), *, generator: Any = None
    ) -> None:
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        low, high = (sigma, sigma) if isinstance(sigma, (int, float)) else tuple(sigma)
        if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
            raise ValueError(f"sigma must be a number > 0 or a pair 0 < low <= high (pixels), got {sigma!r}")
        self.weight, self.sigma, self.generator = float(weight), (float(low), float(high)), generator

    def __repr__(self) -> str:
        return f"SmoothedNegativesTerm(weight={self.weight}, sigma={self.sigma})"

    def _draw_sigma(self) -> float:
        low, high = self.sigma
        if low == high:
            return low
        g = self.generator
        return low + (high - low) * float(torch.rand((), generator=g, device=None if g is None else g.device))

    def __call__(self, jm: Any, batch: Any) -> tuple[Tensor, dict[str, Tensor | float]]:
        sigma = self._draw_sigma()
        x = batch.x_data.detach()
        with running_bn_stats(jm):  # one normalisation for both sides of each comparison
            e_data, e_smooth = free_energy(jm(torch.cat([x, smoothed_copy(x, sigma)]))).chunk(2)
        gap = e_smooth - e_data
        metrics: dict[str, Tensor | float] = {
            "win": (gap.detach() > 0).float().mean(),
            "gap": gap.detach().mean(),
            "sigma": sigma,
        }
        return self.weight * F.softplus(-gap).mean(), metrics

    def state_dict(self) -> dict[str, Any]:
        g = self.generator
        return {} if g is None else {"generator": g.get_state(), "generator_device": str(g.device)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("generator") is not None:
            self.generator = restore_generator(
                self.generator, state["generator"], state.get("generator_device"), "smoothed_negatives"
            )


@hookimpl
def jem_register_loss_terms(register: Callable[..., None]) -> None:
    register(
        TERM_NAME,
        SmoothedNegativesTerm,
        description="each image likelier than a Gaussian-blurred copy of itself (pairwise logistic on E(x))",
    )
