"""2D toy distributions, with their true log densities."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._common import _gen

TOY2D_NAMES = ("8gaussians", "2spirals", "checkerboard", "rings")

_8G_RADIUS, _8G_STD = 2.0, 0.2
_RING_RADII, _RING_STD = (0.75, 1.5, 2.25), 0.08
_SPIRAL_TURNS, _SPIRAL_RMAX, _SPIRAL_STD = 1.5, 2.5, 0.1


def _8g_means() -> Tensor:
    a = torch.arange(8, dtype=torch.float64) * (math.pi / 4)
    return torch.stack([torch.cos(a), torch.sin(a)], 1) * _8G_RADIUS


def _spiral(t: Tensor, cls: int) -> Tensor:
    # t in [0, 1] -> angle 0..turns*2pi, radius 0..rmax; class 1 is class 0 rotated by pi
    ang = t * (_SPIRAL_TURNS * 2 * math.pi)
    r = t * _SPIRAL_RMAX
    pts = torch.stack([r * torch.cos(ang), r * torch.sin(ang)], -1)
    return pts if cls == 0 else -pts


def toy2d(name: str = "8gaussians", n: int = 1000, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A 2D toy distribution: ``(x [n, 2] float32, y [n] long)`` with ``y`` the component
    (gaussian, spiral arm, filled square or ring) each point came from. Deterministic given
    ``seed``. :func:`toy2d_logpdf` gives the true log density."""
    g = _gen(seed)
    if name == "8gaussians":
        y = torch.randint(8, (n,), generator=g)
        x = _8g_means()[y] + _8G_STD * torch.randn(n, 2, generator=g, dtype=torch.float64)
    elif name == "2spirals":
        y = torch.randint(2, (n,), generator=g)
        t = torch.rand(n, generator=g, dtype=torch.float64).sqrt()  # uniform-ish along the arc
        x = torch.where(y[:, None] == 0, _spiral(t, 0), _spiral(t, 1))
        x = x + _SPIRAL_STD * torch.randn(n, 2, generator=g, dtype=torch.float64)
    elif name == "checkerboard":
        # 4x4 board on [-2, 2]^2; the 8 squares with (row + col) even are filled
        y = torch.randint(8, (n,), generator=g)
        row, k = y // 2, y % 2
        col = 2 * k + (row % 2)
        u = torch.rand(n, 2, generator=g, dtype=torch.float64)
        x = torch.stack([col + u[:, 0], row + u[:, 1]], 1) - 2.0
    elif name == "rings":
        y = torch.randint(len(_RING_RADII), (n,), generator=g)
        a = torch.rand(n, generator=g, dtype=torch.float64) * 2 * math.pi
        r = torch.tensor(_RING_RADII, dtype=torch.float64)[y]
        r = r + _RING_STD * torch.randn(n, generator=g, dtype=torch.float64)
        x = torch.stack([r * torch.cos(a), r * torch.sin(a)], 1)
    else:
        raise ValueError(f"unknown toy2d dataset {name!r}; choose one of {', '.join(TOY2D_NAMES)}")
    return x.float(), y.long()


def gaussian_mixture_logpdf(x: Tensor, means: Tensor, std: float | Tensor, weights: Tensor | None = None) -> Tensor:
    """Log density of an isotropic Gaussian mixture at ``x [N, D]`` (``means [K, D]``,
    ``std`` scalar or ``[K]``, ``weights [K]`` summing to 1, uniform by default)."""
    x = x.to(torch.float64)
    means = means.to(torch.float64)
    d = x.shape[1]
    std = torch.as_tensor(std, dtype=torch.float64).expand(means.shape[0])
    logw = (
        torch.full((means.shape[0],), -math.log(means.shape[0]), dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.float64).log()
    )
    const = logw - d * torch.log(std) - 0.5 * d * math.log(2 * math.pi)
    chunk = max(1, 2_000_000 // max(1, means.shape[0]))  # bound the [N, K] matrix in memory
    out = [torch.logsumexp(-0.5 * torch.cdist(xc, means).pow(2) / std**2 + const, dim=1) for xc in x.split(chunk)]
    return torch.cat(out) if out else x.new_zeros(0)


def toy2d_logpdf(name: str, x: Tensor) -> Tensor:
    """True log density of :func:`toy2d` ``name`` at ``x [N, 2]`` (float64; ``-inf`` off the
    checkerboard). ``2spirals`` is evaluated as a fine mixture of Gaussians along the arms."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if name == "8gaussians":
        return gaussian_mixture_logpdf(x, _8g_means(), _8G_STD)
    if name == "2spirals":
        # t = sqrt(u) has density 2t on [0, 1]; midpoint quadrature over t
        m = 2000
        t = (torch.arange(m, dtype=torch.float64) + 0.5) / m
        w = 2 * t / m
        means = torch.cat([_spiral(t, 0), _spiral(t, 1)])
        weights = torch.cat([w, w]) / 2
        return gaussian_mixture_logpdf(x, means, _SPIRAL_STD, weights / weights.sum())
    if name == "checkerboard":
        inside = (x.abs() < 2).all(1)
        cell = torch.floor(x + 2.0)
        filled = ((cell[:, 0] + cell[:, 1]) % 2 == 0) & inside
        return torch.where(filled, torch.full_like(x[:, 0], -math.log(8.0)), torch.full_like(x[:, 0], -math.inf))
    if name == "rings":
        # radius ~ N(r_k, s), angle uniform: p(x) = mean_k N(|x|; r_k, s) / (2 pi |x|)
        r = x.norm(dim=1).clamp_min(1e-12)
        radii = torch.tensor(_RING_RADII, dtype=torch.float64)
        comp = -0.5 * ((r[:, None] - radii) / _RING_STD) ** 2 - math.log(_RING_STD * math.sqrt(2 * math.pi))
        return torch.logsumexp(comp, 1) - math.log(len(_RING_RADII)) - torch.log(2 * math.pi * r)
    raise ValueError(f"unknown toy2d dataset {name!r}; choose one of {', '.join(TOY2D_NAMES)}")
