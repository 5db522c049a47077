"""Experimental init distributions for ``bench_generative.py --plugin`` (issue 16, e50-e51).

The rank-8 per-class Gaussian without its isotropic noise, plus noise of the same standard
deviation that the 32x32 digits could carry: ``grey_noisy`` draws one noise value per pixel shared
by the three channels (no colour), ``smooth_noisy`` draws it at a quarter of the resolution and
scales it up bilinearly (no colour, no high frequencies, as the digits themselves were made).
Question: which part of the noise do the energies learn to tell samples by?
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import jem_plugin as jem
from jem_plugin._checks import draw
from jem_plugin.builtins.init_distributions import GaussianInit


class StructuredNoiseInit(nn.Module):
    def __init__(self, smooth: bool, rank: int = 8) -> None:
        super().__init__()
        self.noisy = GaussianInit(covariance="lowrank", rank=rank)              # for its noise level
        self.clean = GaussianInit(covariance="lowrank", rank=rank, residual=0.0)
        self.smooth = smooth

    @property
    def fitted(self) -> bool:
        return self.clean.fitted

    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None) -> "StructuredNoiseInit":
        self.noisy.fit(x, y, num_classes)
        self.clean.fit(x, y, num_classes)
        return self

    def sample(self, n: int, shape: Sequence[int], domain, generator=None, device=None, y=None) -> Tensor:
        device = device or self.clean.mean.device
        if y is None:
            k = self.clean.num_classes
            y = draw(lambda s, **kw: torch.randint(0, k, s, **kw), (n,), generator, device)
        x = self.clean.sample(n, shape, domain, generator, device, y=y)
        c, h, w = shape
        if self.smooth:
            z = F.interpolate(draw(torch.randn, (n, 1, h // 4, w // 4), generator, device), size=(h, w),
                              mode="bilinear", align_corners=False)
            z = z / z.std()
        else:
            z = draw(torch.randn, (n, 1, h, w), generator, device)
        sigma = self.noisy.std.to(device)[y.to(device).long()].view(n, 1, 1, 1)
        # Grey in pixels: each channel's noise scaled by its width in the normalised space (1/std).
        width = torch.tensor([hi - lo for lo, hi in zip(domain.low, domain.high)], device=device)
        width = (width / width.mean()).view(1, -1, 1, 1) if width.numel() == c else torch.ones(1, c, 1, 1, device=device)
        return domain.clamp(x + sigma * z.expand(n, c, h, w) * width)


@jem.hookimpl
def jem_register_init_distributions(register):
    register("grey_noisy", lambda **kw: StructuredNoiseInit(smooth=False, **kw),
             description="rank-8 Gaussian span plus grey per-pixel noise")
    register("smooth_noisy", lambda **kw: StructuredNoiseInit(smooth=True, **kw),
             description="rank-8 Gaussian span plus grey noise at a quarter resolution, scaled up")
