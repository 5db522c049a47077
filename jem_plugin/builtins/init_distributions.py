"""Built-in initial distributions for SGLD chains (a built-in plugin, registered like any other).

Every replay-buffer slot starts from, and is occasionally restarted from, an initial distribution.
Registered through the ``jem_register_init_distributions`` hook:

``uniform``
    Uniform over the model's input domain (the JEM paper's choice).
``gaussian``
    Per-class Gaussian fitted from data (JEM++, Yang & Ji 2021): per-class mean and covariance,
    ``covariance=`` one of :mod:`jem_plugin.covariance`'s ``Diagonal()`` (the default), ``Full()``
    (as JEM++'s reference code does, with ``1e-4 I`` jitter), ``LowRank(rank, residual)`` (the
    ``rank`` leading principal directions plus isotropic noise: the pixel correlations of a full
    one at any image size) or ``Stationary()`` (images: the class's power spectrum, noise as
    smooth as the data and none of its shapes), clamped to the domain. Class-conditional draws
    use the given class; unconditional draws pick a class uniformly at random. Call
    ``buffer.fit(x, y)`` first. ``coarse=`` a share of the draws are :func:`coarse_images`
    instead: chains that start at the simple inputs a likelihood may rate above the data.
``normal``
    ``N(mean, std^2)`` per pixel, clamped to the domain.

A registered item is a factory ``factory(**kwargs)`` returning an object with
``sample(n, shape, domain, generator, device, y=None) -> Tensor`` and optionally ``fit(x, y)``,
``state_dict()``/``load_state_dict()``. The built-ins are ``nn.Module`` s so their fitted
parameters are buffers: they move with ``.to(device)`` and are saved with the replay buffer.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_labels
from .._checks import draw as _draw
from .._colours import channel_axes, colour_projection, project_colours
from ..adapter import InputDomain
from ..covariance import Covariance, Diagonal, Full, LowRank, Stationary
from ..errors import InvalidInputError, InvalidLabelError, JEMError
from ..plugins import hookimpl

__all__ = ["UniformInit", "GaussianInit", "NormalInit", "coarse_images", "jem_register_init_distributions"]

#: :func:`coarse_images`' grids: a constant image, then 2x2, 4x4 and 8x8 cells of colour
COARSE_GRIDS = (1, 2, 4, 8)


class UniformInit(nn.Module):
    """Uniform over the input domain (per channel for normalised inputs)."""

    def sample(
        self,
        n: int,
        shape: Sequence[int],
        domain: InputDomain,
        generator: torch.Generator | None = None,
        device=None,
        y: Tensor | None = None,
    ) -> Tensor:
        return domain.uniform(n, shape, generator=generator, device=device)

    def extra_repr(self) -> str:
        return "uniform over the input domain"


class NormalInit(nn.Module):
    """``N(mean, std^2)`` per pixel, clamped to the domain."""

    def __init__(self, mean: float = 0.0, std: float = 1.0) -> None:
        super().__init__()
        if not std > 0:
            raise ValueError(f"normal init needs std > 0, got {std}")
        self.mean, self.std = float(mean), float(std)

    def sample(
        self,
        n: int,
        shape: Sequence[int],
        domain: InputDomain,
        generator: torch.Generator | None = None,
        device=None,
        y: Tensor | None = None,
    ) -> Tensor:
        z = _draw(torch.randn, (n, *shape), generator, device)
        return domain.clamp(z.mul_(self.std).add_(self.mean))

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}"


def coarse_images(
    n: int,
    shape: Sequence[int],
    domain: InputDomain,
    generator: torch.Generator | None = None,
    device=None,
    grids: Sequence[int] = COARSE_GRIDS,
) -> Tensor:
    """``n`` coarse images ``[n, C, H, W]`` in ``domain``: each a ``g x g`` grid of random values
    (``g`` drawn from ``grids``, at most the image's size; ``1``: a constant image) upsampled
    bilinearly, grey (the same pixel value in every channel) for half of them and coloured for the
    other half; values uniform over the domain. The simplest inputs an image model meets, which
    likelihood models tend to rate above their data (Nalisnick et al. 2019; Serra et al. 2020);
    upsampled low-resolution starts are also how multigrid sampling begins (Gao et al. 2018)."""
    if len(shape) != 3:
        raise InvalidInputError(
            f"coarse images need image inputs [C, H, W], got samples of shape {tuple(shape)}; set the init's coarse=0"
        )
    c, h, w = (int(s) for s in shape)
    out = torch.empty(n, c, h, w, device=device)
    sizes = [min(int(g), h, w) for g in grids]
    pick = _draw(lambda s, **kw: torch.randint(0, len(grids), s, **kw), (n,), generator, device).cpu()
    grey = _draw(torch.rand, (n,), generator, device) < 0.5
    for i, g in enumerate(sizes):
        rows = (pick == i).nonzero().squeeze(1)
        if not rows.numel():
            continue
        u = _draw(torch.rand, (rows.numel(), c, g, g), generator, device)
        u = torch.where(grey[rows.to(grey.device)].view(-1, 1, 1, 1), u[:, :1].expand_as(u), u)
        out[rows.to(out.device)] = F.interpolate(u, size=(h, w), mode="bilinear", align_corners=False)
    lo, hi = domain.bounds(out)
    return out.mul_(hi - lo).add_(lo)


# Past this, a covariance (full: fp32 Cholesky factors, float64 while fitting; lowrank: the fp32
# factors) is refused with a one-line error instead of an out-of-memory crash. Full, 10 classes:
# 0.35 GiB at 3x32x32, 5.6 GiB at 3x64x64, 844 GiB at 3x224x224; lowrank, rank 8 at 3x224x224:
# 0.04 GiB for 10 classes, 4.5 GiB for 1000.
COVARIANCE_MAX_BYTES = 4 * 2**30
_DIAGONAL = Diagonal()
_COVARIANCE_TYPES = (Diagonal, Full, LowRank, Stationary)


def _per_class_matmul(v: Tensor, mats: Tensor, y: Tensor) -> Tensor:
    """Row ``i`` of ``v`` times ``mats[y[i]].T``, one matmul per class present: gathering the
    per-row matrices (``[n, D, D]`` for a full covariance) would not fit in memory."""
    out = v.new_empty(v.shape[0], mats.shape[1])
    for c in torch.unique(y).tolist():
        rows = (y == c).nonzero().squeeze(1)
        out[rows] = v[rows] @ mats[c].T
    return out


class GaussianInit(nn.Module):
    """Per-class Gaussian fitted from data (JEM++), clamped to the domain.

    Parameters
    ----------
    covariance: a :mod:`jem_plugin.covariance` value. ``Diagonal()`` (default: ``D`` numbers per
        class, cheap at any image size); ``Full()`` (``D x D`` per class, JEM++'s choice; stored as
        a Cholesky factor; refused past 4 GiB, about 3x58x58 inputs with 10 classes);
        ``LowRank(rank, residual)`` (probabilistic PCA: the ``rank`` leading principal directions
        of each class plus isotropic noise carrying ``residual`` times the rest of its variance,
        ``D x rank`` per class; fitted on fewer than ``rank`` examples of a class it draws from the
        same distribution as ``Full()``); ``Stationary()`` (images ``[N, C, H, W]`` only): a
        translation-invariant covariance, diagonal in the Fourier basis, i.e. the class's mean
        power spectrum per colour axis (the principal axes of the residuals' channels, shared by
        the classes); ``D`` numbers per class like ``Diagonal()``, but the draws keep the data's
        correlation between near and distant pixels, so they carry no per-pixel noise for the
        energy to tell them by.
    jitter: added to the variances (diagonal) or the covariance diagonal (full, low rank) so a
        constant pixel or a class with one example still gives a valid distribution (stationary:
        not used, its spectrum is valid as it is).
    scale: multiplies the standard deviation (``< 1`` draws closer to the class means).
    coarse: the share of draws replaced by :func:`coarse_images` (images only; ``0``: none, and no
        random numbers spent on them, so seeded runs without it are unchanged). For data whose
        pixels vary along fewer colour axes than the model has (grey digits in an RGB model) the
        coarse images are projected onto the data's axes, so that they are grey too.
    """

    #: ``fit(..., pool_missing=True)`` gives classes without examples the Gaussian of all examples.
    pools_missing_classes: ClassVar[bool] = True

    def __init__(
        self,
        covariance: Covariance = _DIAGONAL,
        jitter: float = 1e-4,
        scale: float = 1.0,
        coarse: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= float(coarse) <= 1.0:
            raise ValueError(f"gaussian init: coarse is a share in [0, 1], got {coarse!r}")
        self.coarse = float(coarse)
        # (weak reference to the means it was read from, axes [C, C] or None, centre [1, C, 1, 1]):
        # _in_data_colours' projection, read once per fit or load, not at every restarted chain
        self._coarse_colours: tuple[weakref.ref, Tensor | None, Tensor] | None = None
        if not isinstance(covariance, _COVARIANCE_TYPES):
            raise ValueError(
                "covariance must be Diagonal(), Full(), LowRank(rank, residual) or Stationary() from "
                f"jem_plugin.covariance, got {covariance!r}"
            )
        self.covariance: Covariance = covariance
        self._kind = self.covariance.kind  # the branch fit and sample take
        self.jitter, self.scale = float(jitter), float(scale)
        low = self.covariance if isinstance(self.covariance, LowRank) else LowRank()
        self.rank, self.residual = low.rank, low.residual
        # Fitted parameters are buffers so they travel with .to() and state_dict; empty until fit.
        self.register_buffer("mean", torch.empty(0))
        self.register_buffer(
            "std", torch.empty(0)
        )  # [K, D] (diagonal); [K] (lowrank); [K, C, H, W] per frequency (stationary)
        self.register_buffer("scale_tril", torch.empty(0))  # [K, D, D] (full)
        self.register_buffer("factor", torch.empty(0))  # [K, D, rank] (lowrank): cov = F F^T + std^2 I
        self.register_buffer("colour", torch.empty(0))  # [C, C] (stationary): the residuals' channel axes

    @property
    def fitted(self) -> bool:
        return self.mean.numel() > 0

    @property
    def num_classes(self) -> int:
        return self.mean.shape[0] if self.fitted else 0

    @torch.no_grad()
    def fit(self, x: Tensor, y: Tensor, num_classes: int | None = None, *, pool_missing: bool = False) -> GaussianInit:
        """Fit one Gaussian per class from data ``x`` ``[N, *shape]`` with labels ``y`` ``[N]``.

        ``pool_missing``: classes without examples get the Gaussian of all examples (what
        :class:`~jem_plugin.extensions.FitInitFromBatches` asks for: a few batches need not hold
        every class) instead of an error.
        """
        if not isinstance(x, Tensor) or not isinstance(y, Tensor):
            raise InvalidInputError("gaussian init: fit(x, y) needs tensors x [N, ...] and y [N]")
        flat = x.detach().reshape(x.shape[0], -1).to(torch.float64)  # float64: stable covariances
        y = check_labels(
            y, x.shape[0], num_classes=num_classes, device=flat.device, what="gaussian init: fit(x, y) labels"
        )
        if y.numel() == 0 or int(y.min()) < 0:
            raise InvalidLabelError("gaussian init: fit(x, y) needs a non-empty y of class indices >= 0")
        k = int(num_classes) if num_classes is not None else int(y.max()) + 1
        counts = torch.bincount(y, minlength=k)
        if pool_missing and counts.numel() == k and bool((counts == 0).any()):
            # Fit the present classes (renumbered 0..m-1) and one extra class m holding every
            # example (one copy of the data, whatever the number of missing classes), then give
            # the missing classes the extra class's parameters.
            present = counts > 0
            m = int(present.sum())
            renumber = torch.cumsum(present.long(), 0) - 1
            self.fit(torch.cat([x, x]), torch.cat([renumber[y], torch.full_like(y, m)]), num_classes=m + 1)
            rows = torch.where(present, renumber, m)
            for name in ("mean", "std", "scale_tril", "factor"):
                t = getattr(self, name)
                if t.numel():
                    setattr(self, name, t[rows.to(t.device)])
            return self
        if counts.numel() > k or bool((counts == 0).any()):
            missing = [c for c in range(k) if c >= counts.numel() or counts[c] == 0]
            raise InvalidLabelError(
                f"gaussian init: every class needs examples to fit its Gaussian; classes {missing} "
                f"have none (labels must lie in [0, {k})). Fit on data covering all classes."
            )
        d = flat.shape[1]
        if self._kind == Stationary.kind and x.dim() != 4:
            raise InvalidInputError(
                f"gaussian init: covariance=Stationary() needs images [N, C, H, W], got shape "
                f"{tuple(x.shape)}; use covariance=Diagonal() or LowRank() for other inputs"
            )
        if self._kind == Full.kind and k * d * d * 4 > COVARIANCE_MAX_BYTES:
            raise InvalidInputError(
                f"gaussian init: a full covariance for {k} classes of {d} values needs "
                f"{k * d * d * 4 / 2**30:.1f} GiB (D x D per class); use covariance=LowRank() or Diagonal() at this input size"
            )
        means = torch.zeros(k, d, dtype=torch.float64, device=flat.device)
        means.index_add_(0, y, flat)
        means /= counts.unsqueeze(1)
        centred = flat - means[y]
        if self._kind == Diagonal.kind:
            var = torch.zeros_like(means).index_add_(0, y, centred.square()) / counts.unsqueeze(1)
            self.std = (var + self.jitter).sqrt().float()
            self.scale_tril = self.factor = torch.empty(0, device=flat.device)
        elif self._kind == LowRank.kind:
            self.factor, self.std = self._fit_lowrank(centred, y, k, counts)
            self.scale_tril = torch.empty(0, device=flat.device)
        elif self._kind == Stationary.kind:
            self.colour, self.std = self._fit_stationary(centred.reshape(x.shape), y, k, counts)
            self.scale_tril = self.factor = torch.empty(0, device=flat.device)
        else:
            eye = torch.eye(d, dtype=torch.float64, device=flat.device)
            trils = []
            for c in range(k):
                sub = centred[y == c]
                cov = sub.T @ sub / sub.shape[0] + self.jitter * eye
                trils.append(torch.linalg.cholesky(cov))
            self.scale_tril = torch.stack(trils).float()
            self.std = self.factor = torch.empty(0, device=flat.device)
        if self._kind != Stationary.kind:
            self.colour = torch.empty(0, device=flat.device)
        self.mean = means.float()
        return self

    def _fit_lowrank(self, centred: Tensor, y: Tensor, k: int, counts: Tensor) -> tuple[Tensor, Tensor]:
        """Probabilistic PCA per class (Tipping & Bishop 1999): the leading ``rank`` directions scaled
        by their standard deviations, and the mean variance of the discarded ones as isotropic noise."""
        d = centred.shape[1]
        rank = min(self.rank, d, int(counts.max()))  # a class has at most as many directions as examples
        if k * d * rank * 4 > COVARIANCE_MAX_BYTES:
            fits = COVARIANCE_MAX_BYTES // (k * d * 4)
            if fits:
                raise InvalidInputError(
                    f"gaussian init: a rank-{rank} covariance for {k} classes of {d} values needs "
                    f"{k * d * rank * 4 / 2**30:.1f} GiB; use rank <= {fits} or covariance=Diagonal()"
                )
            raise InvalidInputError(
                f"gaussian init: even rank 1 for {k} classes of {d} values passes "
                f"{COVARIANCE_MAX_BYTES / 2**30:.0f} GiB; use covariance=Diagonal()"
            )
        factor = torch.zeros(k, d, rank, dtype=torch.float64, device=centred.device)
        noise_var = torch.zeros(k, dtype=torch.float64, device=centred.device)
        for c in range(k):
            sub = centred[y == c] / math.sqrt(int(counts[c]))
            # Thin SVD of the [n_c, D] rows: n_c x n_c work, never a D x D matrix.
            _, sv, vh = torch.linalg.svd(sub, full_matrices=False)
            kept = min(rank, sv.numel())
            factor[c, :, :kept] = vh[:kept].T * sv[:kept]
            if d > kept:
                noise_var[c] = self.residual * sv[kept:].square().sum() / (d - kept)
        return factor.float(), (noise_var + self.jitter).sqrt().float()

    def _fit_stationary(self, centred: Tensor, y: Tensor, k: int, counts: Tensor) -> tuple[Tensor, Tensor]:
        """The channels' principal axes (one rotation for all classes: grey data stay grey) and, per
        class, the mean power spectrum of each rotated channel as a standard deviation per frequency."""
        n, c, h, w = centred.shape
        _, axes = channel_axes(centred)
        spectrum = torch.zeros(k, c, h, w, dtype=centred.dtype, device=centred.device)
        for rows in torch.arange(n, device=centred.device).split(256):  # complex128 per chunk, not per data set
            power = torch.fft.fft2(torch.einsum("dc,nchw->ndhw", axes.T, centred[rows])).abs().square()
            spectrum.index_add_(0, y[rows], power)
        spectrum /= counts.view(k, 1, 1, 1)
        # A white draw's Fourier coefficients have variance H W: this std gives the data's spectrum.
        # No jitter: a zero is already a valid spectrum, and jitter would add white noise to the
        # colour axes the data lack (grey data would give coloured speckle the energy can spot).
        return axes.float(), (spectrum / (h * w)).sqrt().float()

    @torch.no_grad()
    def sample(
        self,
        n: int,
        shape: Sequence[int],
        domain: InputDomain,
        generator: torch.Generator | None = None,
        device=None,
        y: Tensor | None = None,
    ) -> Tensor:
        if not self.fitted:
            raise JEMError(
                "the 'gaussian' init distribution is fitted from data (JEM++): call "
                "buffer.fit(x_train, y_train) (or init.fit(x, y)) before sampling"
            )
        d = self.mean.shape[1]
        if math.prod(shape) != d:
            raise InvalidInputError(
                f"gaussian init was fitted on inputs of {d} values, asked for samples of shape "
                f"{tuple(shape)} ({math.prod(shape)} values); fit it on data of that shape"
            )
        if self._kind == Stationary.kind and tuple(shape) != tuple(self.std.shape[1:]):
            raise InvalidInputError(
                f"gaussian init (stationary) was fitted on images of shape {tuple(self.std.shape[1:])}, "
                f"asked for samples of shape {tuple(shape)}; fit it on data of that shape"
            )
        device = self.mean.device if device is None else device
        if y is None:
            y = _draw(lambda s, **kw: torch.randint(0, self.num_classes, s, **kw), (n,), generator, device)
        else:
            y = y.to(device=device, dtype=torch.long)
        z = _draw(torch.randn, (n, d), generator, device)
        mean = self.mean.to(device)
        if self._kind == Diagonal.kind:
            x = z.mul_(self.std.to(device)[y])
        elif self._kind == LowRank.kind:
            # The draw of torch.distributions.LowRankMultivariateNormal, written out so it takes
            # our generator: isotropic noise plus the class's factor times a latent draw.
            factor = self.factor.to(device)
            latent = _draw(torch.randn, (n, factor.shape[2]), generator, device)
            x = z.mul_(self.std.to(device)[y].unsqueeze(1)).add_(_per_class_matmul(latent, factor, y))
        elif self._kind == Stationary.kind:
            # White noise filtered to the class's spectrum, then turned back to the data's channels.
            spectral = torch.fft.fft2(z.view(n, *shape)).mul_(self.std.to(device)[y])
            x = torch.einsum("cd,ndhw->nchw", self.colour.to(device), torch.fft.ifft2(spectral).real).reshape(n, d)
        else:
            x = _per_class_matmul(z, self.scale_tril.to(device), y)
        x = domain.clamp(x.mul_(self.scale).add_(mean[y]).reshape(n, *shape))
        if self.coarse > 0:
            rows = (_draw(torch.rand, (n,), generator, device) < self.coarse).nonzero().squeeze(1)
            if rows.numel():
                x[rows] = self._in_data_colours(coarse_images(rows.numel(), shape, domain, generator, device), domain)
        return x

    def _in_data_colours(self, starts: Tensor, domain: InputDomain) -> Tensor:
        """``starts`` projected onto the colour axes the class means vary along, about their mean
        colour, where those are fewer than the model's channels (grey digits in an RGB model: grey
        starts); else as they are. A coloured start would never move: the recipes confine SGLD's
        steps to the data's colours. Read from the fitted means, so no state is added to the init."""
        cached = self._coarse_colours
        if cached is None or cached[0]() is not self.mean:  # fitted, loaded or moved since
            means = self.mean.view(-1, *starts.shape[1:])
            projection = colour_projection(means)
            every_axis = torch.equal(projection, torch.eye(projection.shape[0], device=projection.device))
            kept = None if every_axis or not bool(projection.any()) else projection
            cached = self._coarse_colours = (weakref.ref(self.mean), kept, means.mean((0, 2, 3)).view(1, -1, 1, 1))
        _, axes, mean_colour = cached
        if axes is None:
            return starts
        centre = mean_colour.to(starts.device)
        return domain.clamp(project_colours(starts - centre, axes.to(starts.device)) + centre)

    def __getstate__(self) -> dict:
        # The projection cache holds a weak reference, which pickle refuses; it is re-read on use.
        return {**self.__dict__, "_coarse_colours": None}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The fitted tensors have data-dependent shapes: resize the empty buffers before loading.
        for name in ("mean", "std", "scale_tril", "factor", "colour"):
            key = prefix + name
            if key in state_dict:
                cur = getattr(self, name)
                setattr(self, name, torch.empty_like(state_dict[key], device=cur.device, dtype=cur.dtype))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        fitted = f"fitted on {self.num_classes} classes of {self.mean.shape[1]} values" if self.fitted else "not fitted"
        coarse = f", coarse={self.coarse}" if self.coarse else ""
        return f"covariance={self.covariance!r}, jitter={self.jitter}, scale={self.scale}{coarse}, {fitted}"


@hookimpl
def jem_register_init_distributions(register):
    register("uniform", UniformInit, description="uniform over the input domain (JEM)")
    register("gaussian", GaussianInit, description="per-class Gaussian fitted from data (JEM++)")
    register("normal", NormalInit, description="N(mean, std^2) per pixel, clamped to the domain")
