"""An experimental init distribution for ``bench_generative.py --plugin`` (issue 16, e48-e49).

``half_noisy``: the rank-8 per-class Gaussian, half its draws with the isotropic noise of the
variance outside the 8 directions and half without. Negatives with that noise keep log p(x)'s
OOD scores and never move; negatives without it move and lose near-OOD (e35, e38): does a buffer
holding both keep both? Registered through the same hook as the built-in inits.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

import jem_plugin as jem
from jem_plugin._checks import draw
from jem_plugin.builtins.init_distributions import GaussianInit


class HalfNoisyInit(nn.Module):
    def __init__(self, rank: int = 8, share: float = 0.5) -> None:
        super().__init__()
        self.noisy = GaussianInit(covariance="lowrank", rank=rank)
        self.clean = GaussianInit(covariance="lowrank", rank=rank, residual=0.0)
        self.share = float(share)

    @property
    def fitted(self) -> bool:
        return self.noisy.fitted

    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None) -> "HalfNoisyInit":
        self.noisy.fit(x, y, num_classes)
        self.clean.fit(x, y, num_classes)
        return self

    def sample(self, n: int, shape: Sequence[int], domain, generator=None, device=None, y=None) -> Tensor:
        if y is None:
            k = self.noisy.num_classes
            y = draw(lambda s, **kw: torch.randint(0, k, s, **kw), (n,), generator, device or self.noisy.mean.device)
        a = self.noisy.sample(n, shape, domain, generator, device, y=y)
        b = self.clean.sample(n, shape, domain, generator, device, y=y)
        pick = draw(torch.rand, (n,), generator, a.device) < self.share
        return torch.where(pick.view(-1, *[1] * len(shape)), a, b)


@jem.hookimpl
def jem_register_init_distributions(register):
    register("half_noisy", HalfNoisyInit, description="rank-8 Gaussian, half the draws with its residual noise")
