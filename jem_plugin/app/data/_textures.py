"""A generated 10-class colour image data set: a shape family per class, in a class-specific hue."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

#: The ten classes of :func:`textures`: a shape family each, drawn in a class-specific hue.
TEXTURE_CLASSES = ("disc", "ring", "bars", "cross", "triangle", "checker", "frame", "crescent", "dots", "star")
# Hue centre of each class (fractions of the colour circle): neighbours on the circle are 0.1 apart and
# each class's hue spreads with _TEX_HUE_STD, so colour narrows a class down without deciding it.
_TEX_HUES = (0.0, 0.5, 0.1, 0.6, 0.2, 0.7, 0.3, 0.8, 0.4, 0.9)
_TEX_HUE_STD = 0.06
_TEX_SUPERSAMPLE = 2


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray, v: np.ndarray) -> np.ndarray:
    """HSV in [0, 1] (arrays of one shape) -> RGB, stacked on the last axis."""
    h6 = (np.asarray(h) % 1.0) * 6.0
    c = v * s
    x = c * (1.0 - np.abs(h6 % 2.0 - 1.0))
    zero = np.zeros_like(c)
    sector = np.floor(h6).astype(int) % 6
    rgb = np.select(
        [sector[..., None] == k for k in range(6)],
        [np.stack(t, -1) for t in ((c, x, zero), (x, c, zero), (zero, c, x), (zero, x, c), (x, zero, c), (c, zero, x))],
    )
    return rgb + (v - c)[..., None]


def _texture_shape(k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Mask of class ``k``'s shape in its own frame (``u, v`` about [-1, 1] span the shape)."""
    r = np.hypot(u, v)
    inside = (np.abs(u) < 1) & (np.abs(v) < 1)
    if k == 0:  # disc
        return r < 1
    if k == 1:  # ring
        return (r < 1) & (r > 0.6)
    if k == 2:  # three parallel bars
        return inside & (np.floor((v + 1) * 2.5).astype(int) % 2 == 0)
    if k == 3:  # cross
        return ((np.abs(u) < 0.3) & (np.abs(v) < 1)) | ((np.abs(v) < 0.3) & (np.abs(u) < 1))
    if k == 4:  # triangle
        return (v > -0.6) & (v < 1 - np.sqrt(3) * np.abs(u) * 0.95)
    if k == 5:  # 3x3 checker patch
        return inside & ((np.floor((u + 1) * 1.5) + np.floor((v + 1) * 1.5)).astype(int) % 2 == 0)
    if k == 6:  # square frame
        return inside & (np.maximum(np.abs(u), np.abs(v)) > 0.62)
    if k == 7:  # crescent
        return (r < 1) & (np.hypot(u - 0.5, v) > 0.8)
    if k == 8:  # three dots in a row
        return (np.hypot(u + 0.68, v) < 0.32) | (r < 0.32) | (np.hypot(u - 0.68, v) < 0.32)
    # five-pointed star
    phi = np.arctan2(v, u)
    return r < 0.42 + 0.58 * ((1 + np.cos(5 * phi)) / 2) ** 2


def _texture_background(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
    """A procedural background ``[H, W, 3]``: two colours of any hue mixed by smooth noise,
    stripes, a gradient or fine grain. Its colours do not depend on the class."""
    n = yy.shape[0]
    hue = rng.random(2)
    sat = rng.uniform(0.15, 0.9, 2)
    val = rng.uniform(0.1, 0.75, 2)
    cols = _hsv_to_rgb(hue, sat, val)  # [2, 3]
    kind = rng.integers(4)
    t: np.ndarray
    if kind == 0:  # smooth noise: a coarse random grid, bicubically upsampled
        g = int(rng.integers(3, 7))
        coarse = torch.from_numpy(rng.random((1, 1, g, g)).astype(np.float32))
        up = torch.nn.functional.interpolate(coarse, size=(n, n), mode="bicubic", align_corners=True)
        t = up[0, 0].numpy().clip(0, 1)
    elif kind == 1:  # stripes at a random angle and frequency
        a = rng.uniform(0, np.pi)
        f = rng.uniform(1.5, 5.0)
        t = 0.5 + 0.5 * np.sin(2 * np.pi * f * (np.cos(a) * xx + np.sin(a) * yy) / n + rng.uniform(0, 2 * np.pi))
    elif kind == 2:  # linear gradient
        a = rng.uniform(0, 2 * np.pi)
        t = (np.cos(a) * xx + np.sin(a) * yy) / n
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    else:  # fine grain
        t = rng.random((n, n))
    return cols[0] * (1 - t[..., None]) + cols[1] * t[..., None]


def _texture_image(k: int, rng: np.random.Generator, size: int) -> np.ndarray:
    n = size * _TEX_SUPERSAMPLE
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float64) + 0.5
    img = _texture_background(rng, yy, xx)
    # a distractor blob of any hue, half of the time
    if rng.random() < 0.5:
        c = _hsv_to_rgb(rng.random(1), rng.uniform(0.3, 1, 1), rng.uniform(0.4, 1, 1))[0]
        by, bx = rng.uniform(0.1, 0.9, 2) * n
        blob = np.hypot(yy - by, xx - bx) < rng.uniform(0.04, 0.09) * n
        img[blob] = c
    # the class's shape: random place, scale and rotation; a hue around the class's own
    scale = rng.uniform(0.2, 0.34) * n
    cy, cx = rng.uniform(scale * 0.8, n - scale * 0.8, 2)
    a = rng.uniform(0, 2 * np.pi)
    du, dv = (xx - cx) / scale, (yy - cy) / scale
    u, v = np.cos(a) * du + np.sin(a) * dv, -np.sin(a) * du + np.cos(a) * dv
    mask = _texture_shape(k, u, v)
    hue = _TEX_HUES[k] + _TEX_HUE_STD * rng.standard_normal()
    fg = _hsv_to_rgb(np.array([hue]), rng.uniform(0.45, 1.0, 1), rng.uniform(0.55, 1.0, 1))[0]
    shade = 1 + 0.12 * (rng.random((n, n)) - 0.5)  # a grainy fill, not a flat colour
    img = np.where(mask[..., None], fg * shade[..., None], img)
    img = img.reshape(size, _TEX_SUPERSAMPLE, size, _TEX_SUPERSAMPLE, 3).mean(axis=(1, 3))  # anti-aliased
    img = img + 0.02 * rng.standard_normal(img.shape)
    return img.clip(0, 1).transpose(2, 0, 1).astype(np.float32)


def textures(n_per_class: int, size: int = 32, seed: int = 0, offset: int = 0) -> tuple[Tensor, Tensor]:
    """A generated 10-class colour image data set: ``(x [10 n, 3, size, size] in [0, 1], y [10 n])``.

    Each class is a shape family (:data:`TEXTURE_CLASSES`: disc, ring, bars, cross, triangle,
    checker patch, square frame, crescent, three dots, star) drawn at a random position, scale and
    rotation in a hue drawn around the class's own (neighbouring classes' hues overlap), over a
    procedural background whose two colours are of any hue (smooth noise, stripes, a gradient or
    fine grain), with a distractor blob of any colour in half of the images. Neither colour nor
    shape alone is trivial; a small CNN learns it from a few hundred images per class.

    Deterministic: image ``i`` of class ``k`` depends only on ``(seed, k, offset + i)``, so a
    larger ``n_per_class`` extends a smaller one and disjoint ``offset`` ranges give disjoint
    splits. Images are interleaved by class (``y = 0, 1, ..., 9, 0, 1, ...``): every prefix of
    ``10 m`` images holds ``m`` per class.
    """
    if n_per_class < 0 or size < 8:
        raise ValueError(f"n_per_class must be >= 0 and size >= 8, got {n_per_class} and {size}")
    k_count = len(TEXTURE_CLASSES)
    x = np.empty((n_per_class * k_count, 3, size, size), dtype=np.float32)
    for i in range(n_per_class):
        for k in range(k_count):
            rng = np.random.default_rng([int(seed), k, int(offset) + i])
            x[i * k_count + k] = _texture_image(k, rng, size)
    y = torch.arange(k_count).repeat(n_per_class)
    return torch.from_numpy(x), y
