"""Experimental init for ``bench_generative.py --plugin`` (issue 16, e55-): a per-class Gaussian
whose covariance is stationary (translation-invariant), i.e. diagonal in the Fourier basis.

The diagonal init draws each pixel independently: white noise, whose high frequencies the
scaled-up digits lack and the energy learns to spot (e50). The low-rank init without noise moves
but covers only each class's span. This one keeps the data's power spectrum (its pixel-to-pixel
correlations at every distance) and nothing of its shapes: draws are the class mean plus noise as
smooth as the data, on any image size, at C x H x W numbers per class.

``stationary``: per-class mean, one colour rotation shared by the classes (the principal axes of
the residuals' channels), and per class the mean power spectrum of each rotated channel.
``stationary_global``: the same with one mean and one spectrum for all classes (draws carry no
class: its chains must make the digit).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

import jem_plugin as jem
from jem_plugin._checks import draw


class StationaryInit(nn.Module):
    def __init__(self, per_class: bool = True, scale: float = 1.0) -> None:
        super().__init__()
        self.per_class, self.scale = per_class, float(scale)
        self.register_buffer("mean", torch.empty(0))      # [K, C, H, W]
        self.register_buffer("colour", torch.empty(0))    # [C, C]: residual channel axes
        self.register_buffer("amplitude", torch.empty(0))  # [K, C, H, W]: sqrt(power / (H W))

    @property
    def fitted(self) -> bool:
        return self.mean.numel() > 0

    @property
    def num_classes(self) -> int:
        return self.mean.shape[0] if self.fitted else 0

    @torch.no_grad()
    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None) -> "StationaryInit":
        x = x.detach().to(torch.float64)
        n, c, h, w = x.shape
        k = int(num_classes) if num_classes is not None else int(y.max()) + 1
        y = y.to(x.device, torch.long)
        counts = torch.bincount(y, minlength=k).clamp_min(1).to(x.dtype)
        means = torch.zeros(k, c, h, w, dtype=x.dtype, device=x.device).index_add_(0, y, x)
        means /= counts.view(k, 1, 1, 1)
        if not self.per_class:
            means = x.mean(0, keepdim=True).expand(k, c, h, w).clone()
        r = x - means[y]
        pix = r.permute(0, 2, 3, 1).reshape(-1, c)
        _, vecs = torch.linalg.eigh(pix.T @ pix / pix.shape[0])
        rot = torch.einsum("dc,nchw->ndhw", vecs.T, r)
        power = torch.fft.fft2(rot).abs().square()          # [N, C, H, W]
        if self.per_class:
            spec = torch.zeros(k, c, h, w, dtype=x.dtype, device=x.device).index_add_(0, y, power)
            spec /= counts.view(k, 1, 1, 1)
        else:
            spec = power.mean(0, keepdim=True).expand(k, c, h, w)
        self.mean, self.colour = means.float(), vecs.float()
        self.amplitude = (spec / (h * w)).sqrt().float()
        return self

    @torch.no_grad()
    def sample(self, n: int, shape: Sequence[int], domain, generator=None, device=None, y=None) -> Tensor:
        device = self.mean.device if device is None else device
        if y is None:
            y = draw(lambda s, **kw: torch.randint(0, self.num_classes, s, **kw), (n,), generator, device)
        y = y.to(device=device, dtype=torch.long)
        white = draw(torch.randn, (n, *shape), generator, device)
        rot = torch.fft.ifft2(torch.fft.fft2(white) * self.amplitude.to(device)[y]).real
        noise = torch.einsum("cd,ndhw->nchw", self.colour.to(device), rot)
        return domain.clamp(self.mean.to(device)[y] + self.scale * noise)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("mean", "colour", "amplitude"):
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


@jem.hookimpl
def jem_register_init_distributions(register):
    register("stationary", StationaryInit,
             description="per-class mean plus noise with the class's power spectrum (stationary covariance)")
    register("stationary_global", lambda **kw: StationaryInit(per_class=False, **kw),
             description="one mean plus noise with the data's power spectrum")
