"""Experimental init distributions for ``bench_generative.py --plugin`` (issue 16, e48 and e50).

Each is the rank-8 per-class Gaussian (``GaussianInit(covariance=LowRank(rank=8))``) with its
isotropic noise (the variance outside the 8 directions) handled differently. Negatives with that
noise keep log p(x)'s OOD scores and never move; negatives without it move and lose near-OOD
(e35, e38). Registered through the same hook as the built-in inits:

``half_noisy``
    half the draws with the noise, half without: does a buffer holding both keep both?
``grey_noisy``
    the noise-free draws plus noise of the same standard deviation, one value per pixel shared by
    the channels (grey in pixels): is it the noise's colour the energy learns?
``smooth_noisy``
    the same noise drawn at a quarter of the resolution and scaled up bilinearly, as smooth as the
    scaled-up digits: is it its high frequencies?
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import jem_plugin as jem
from jem_plugin._checks import draw
from jem_plugin.builtins.init_distributions import GaussianInit
from jem_plugin.covariance import LowRank


class _NoiseVariant(nn.Module):
    """The rank-8 Gaussian fitted twice: with its noise (``noisy``) and without (``clean``)."""

    def __init__(self, rank: int = 8) -> None:
        super().__init__()
        self.noisy = GaussianInit(covariance=LowRank(rank=rank))
        self.clean = GaussianInit(covariance=LowRank(rank=rank, residual=0.0))

    @property
    def fitted(self) -> bool:
        return self.clean.fitted

    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None) -> _NoiseVariant:
        self.noisy.fit(x, y, num_classes)
        self.clean.fit(x, y, num_classes)
        return self

    def _classes(self, n: int, generator, device, y) -> Tensor:
        if y is not None:
            return y.to(device=device, dtype=torch.long)
        k = self.clean.num_classes
        return draw(lambda s, **kw: torch.randint(0, k, s, **kw), (n,), generator, device)


class HalfNoisyInit(_NoiseVariant):
    def __init__(self, rank: int = 8, share: float = 0.5) -> None:
        super().__init__(rank)
        self.share = float(share)

    def sample(self, n: int, shape: Sequence[int], domain, generator=None, device=None, y=None) -> Tensor:
        device = device or self.clean.mean.device
        y = self._classes(n, generator, device, y)
        a = self.noisy.sample(n, shape, domain, generator, device, y=y)
        b = self.clean.sample(n, shape, domain, generator, device, y=y)
        pick = draw(torch.rand, (n,), generator, device) < self.share
        return torch.where(pick.view(-1, *[1] * len(shape)), a, b)


class StructuredNoiseInit(_NoiseVariant):
    def __init__(self, smooth: bool, rank: int = 8) -> None:
        super().__init__(rank)
        self.smooth = smooth

    def sample(self, n: int, shape: Sequence[int], domain, generator=None, device=None, y=None) -> Tensor:
        device = device or self.clean.mean.device
        y = self._classes(n, generator, device, y)
        x = self.clean.sample(n, shape, domain, generator, device, y=y)
        c, h, w = shape
        if self.smooth:
            z = F.interpolate(
                draw(torch.randn, (n, 1, h // 4, w // 4), generator, device),
                size=(h, w),
                mode="bilinear",
                align_corners=False,
            )
            z = z / z.std()
        else:
            z = draw(torch.randn, (n, 1, h, w), generator, device)
        sigma = self.noisy.std.to(device)[y].view(n, 1, 1, 1)
        # Grey in pixels: each channel's noise scaled by its width in the normalised space (1/std).
        width = torch.tensor([hi - lo for lo, hi in zip(domain.low, domain.high)], device=device)
        width = (
            (width / width.mean()).view(1, -1, 1, 1) if width.numel() == c else torch.ones(1, c, 1, 1, device=device)
        )
        return domain.clamp(x + sigma * z.expand(n, c, h, w) * width)


@jem.hookimpl
def jem_register_init_distributions(register):
    register("half_noisy", HalfNoisyInit, description="rank-8 Gaussian, half the draws with its residual noise")
    register(
        "grey_noisy",
        lambda **kw: StructuredNoiseInit(smooth=False, **kw),
        description="rank-8 Gaussian span plus grey per-pixel noise",
    )
    register(
        "smooth_noisy",
        lambda **kw: StructuredNoiseInit(smooth=True, **kw),
        description="rank-8 Gaussian span plus grey noise at a quarter resolution, scaled up",
    )
