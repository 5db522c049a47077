"""The colour axes of image data: which directions of the channel space the data vary along.

Grey digits fed to an RGB model vary along one axis of three; steps or draws off that axis add
colour the data never have, which an energy learns to spot as not-data. Shared by the
stationary Gaussian init (its colour rotation), the replay buffer (the projection it keeps from
its fit) and SGLD (which applies it to every step).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Axes whose variance is below this share of the largest carry nothing but rounding.
RELATIVE_FLOOR = 1e-6


def channel_axes(centred: Tensor) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of the channel covariance of ``centred`` ``[N, C, ...]`` (dim 1 is the
    channel): ``(variances [C] ascending, axes [C, C] as columns)``, in ``centred``'s dtype."""
    pixels = centred.movedim(1, -1).reshape(-1, centred.shape[1])
    return torch.linalg.eigh(pixels.T @ pixels / pixels.shape[0])


def colour_projection(x: Tensor) -> Tensor:
    """``[C, C]`` projection onto the channel axes along which ``x`` ``[N, C, ...]`` varies (float32;
    the identity for data that use every axis)."""
    x = x.detach().to(torch.float64)
    centred = x - x.mean(dim=[d for d in range(x.dim()) if d != 1], keepdim=True)
    variances, axes = channel_axes(centred)
    kept = axes[:, variances > RELATIVE_FLOOR * variances.max().clamp_min(torch.finfo(torch.float64).tiny)]
    if kept.shape[1] == x.shape[1]:
        return torch.eye(x.shape[1], device=x.device)
    return (kept @ kept.T).float()


def project_colours(t: Tensor, projection: Tensor) -> Tensor:
    """Apply the ``[C, C]`` ``projection`` to every pixel of ``t`` ``[N, C, ...]``."""
    return torch.einsum("cd,nd...->nc...", projection, t)
