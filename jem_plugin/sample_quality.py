"""Sample quality the model under test cannot fool: an independent judge's features and accuracy.

A JEM's own accuracy on its class-conditional samples, and ``log p(x)`` against uniform noise,
can look perfect while the samples are noise (at 32x32 RGB a model can classify every one of its
noise-like samples "correctly"). This module measures samples with a *judge*: a small classifier
of another architecture, trained separately on the same data in seconds, never on samples.

- :func:`frechet_distance`: the Fréchet distance between two feature sets (FID's formula,
  ``|mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2))``), here in the judge's features.
- :func:`train_judge` -> :class:`Judge`: ``judge.features(x)``, ``judge.predict(x)``.
- :func:`sample_quality`: Fréchet distance of samples to held-out data in the judge's features,
  and the judge's accuracy on class-conditional samples.
- :func:`reference_points`: the same distance for held-out data against itself (split halves:
  the floor at that sample size), for the training data, and for the initial distribution.
- :func:`chain_trace`: the model's energy and the judge's distance along chains continued for
  more rounds: whether the energy landscape leads towards the data or to states that fool it.

The Fréchet distance is biased upwards at small sample sizes: compare numbers computed at the
same sizes (``reference_points`` splits the held-out set the same way ``sample_quality`` uses it).

>>> judge = train_judge(x_train, y_train, test=(x_test, y_test))  # seconds on a CPU
>>> q = sample_quality(judge, buffer.samples(500), x_test)        # {"fd": ..., "n_samples": 500}
>>> q = sample_quality(judge, x_cond, x_test, y_samples=y_cond)   # adds "judge_acc"
>>> t = chain_trace(jm, judge, buffer.samples(352), x_test, sampler=loss_fn.sampler, batch_size=32)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import model_device
from .errors import InvalidInputError, InvalidLabelError

__all__ = [
    "frechet_distance",
    "frechet_from_moments",
    "JudgeNet",
    "JudgeArch",
    "Judge",
    "train_judge",
    "sample_quality",
    "reference_points",
    "chain_trace",
]


# ---------------------------------------------------------------------------- Fréchet distance
def frechet_from_moments(mu_a: np.ndarray, cov_a: np.ndarray, mu_b: np.ndarray, cov_b: np.ndarray) -> float:
    """Fréchet (2-Wasserstein) distance squared between ``N(mu_a, cov_a)`` and ``N(mu_b, cov_b)``."""
    mu_a, mu_b = np.atleast_1d(np.asarray(mu_a, np.float64)), np.atleast_1d(np.asarray(mu_b, np.float64))
    cov_a, cov_b = np.atleast_2d(np.asarray(cov_a, np.float64)), np.atleast_2d(np.asarray(cov_b, np.float64))
    if mu_a.shape != mu_b.shape or cov_a.shape != cov_b.shape or cov_a.shape != (mu_a.size, mu_a.size):
        raise InvalidInputError(
            f"Fréchet distance needs means of one size D and D x D covariances; got means "
            f"{mu_a.shape}, {mu_b.shape} and covariances {cov_a.shape}, {cov_b.shape}"
        )
    # tr((A B)^1/2) = tr((A^1/2 B A^1/2)^1/2): symmetric eigenproblems only, so singular
    # covariances (dead ReLU features, fewer samples than dimensions) need no special case.
    w, v = np.linalg.eigh((cov_a + cov_a.T) / 2)
    sqrt_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = sqrt_a @ cov_b @ sqrt_a
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum()
    diff = mu_a - mu_b
    return float(max(0.0, diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2.0 * tr_covmean))


def _as_features(f: Any, what: str) -> np.ndarray:
    if isinstance(f, Tensor):
        f = f.detach().cpu().double().numpy()
    f = np.asarray(f, dtype=np.float64)
    if f.ndim != 2 or f.shape[0] < 2:
        raise InvalidInputError(f"{what} must be a [N, D] feature matrix with N >= 2, got shape {f.shape}")
    if not np.isfinite(f).all():
        raise InvalidInputError(f"{what} holds NaN/inf values; the features must be finite")
    return f


def frechet_distance(feats_a: Any, feats_b: Any) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets ``[N, D]`` and ``[M, D]``.

    The formula of FID (Heusel et al. 2017). Any feature extractor works; :class:`Judge`
    gives one that the model under test had no part in.
    """
    a, b = _as_features(feats_a, "feats_a"), _as_features(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise InvalidInputError(f"feature sets have different widths: {a.shape[1]} and {b.shape[1]}")
    return frechet_from_moments(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))


# ---------------------------------------------------------------------------- the judge
class JudgeNet(nn.Module):
    """A small BN-free CNN for ``[B, C, H, W]`` images (any size >= 4): three conv blocks, a
    ``feature_dim``-wide feature layer, a linear head. Deliberately unlike the models under test
    (no BatchNorm, ReLU, adaptive pooling)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, feature_dim: int = 64) -> None:
        super().__init__()
        w = width
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * w * 4, feature_dim),
            nn.ReLU(),
        )
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


@dataclass(frozen=True)
class JudgeArch:
    """The size of a :class:`JudgeNet`: conv ``width`` (channels of the first block) and
    ``feature_dim`` (the feature layer that Fréchet distances are measured in)."""

    width: int = 16
    feature_dim: int = 64

    def __post_init__(self) -> None:
        for name, value in (("width", self.width), ("feature_dim", self.feature_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"JudgeArch {name} must be a positive int, got {value!r}")


class Judge:
    """A trained judge: :meth:`features` for Fréchet distances, :meth:`predict` for accuracy.

    ``test_accuracy`` is its accuracy on the held-out data given to :func:`train_judge` (``None``
    when none was given): a judge that cannot classify real data says nothing about samples.
    """

    def __init__(
        self, net: nn.Module, input_shape: tuple[int, ...], test_accuracy: float | None = None, batch_size: int = 512
    ) -> None:
        self.net = net.eval()
        self.input_shape = tuple(input_shape)
        self.test_accuracy = test_accuracy
        self.batch_size = batch_size

    def __repr__(self) -> str:
        return f"Judge({type(self.net).__name__}, input_shape={self.input_shape}, test_accuracy={self.test_accuracy})"

    def _batches(self, x: Tensor, fn) -> Tensor:
        if not isinstance(x, Tensor) or tuple(x.shape[1:]) != self.input_shape:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise InvalidInputError(
                f"the judge was trained on inputs of shape {self.input_shape}, got {got}; pass samples "
                "in the same space (and normalisation) as the judge's training data"
            )
        dev = model_device(self.net)
        with torch.no_grad():
            return torch.cat([fn(c.to(dev, torch.float32)).cpu() for c in x.split(self.batch_size)])

    def features(self, x: Tensor) -> Tensor:
        """Penultimate-layer features ``[N, feature_dim]`` (CPU float)."""
        return self._batches(x, self.net.body)

    def logits(self, x: Tensor) -> Tensor:
        return self._batches(x, self.net)

    def predict(self, x: Tensor) -> Tensor:
        """Predicted classes ``[N]``."""
        return self.logits(x).argmax(1)

    def accuracy(self, x: Tensor, y: Tensor) -> float:
        """Fraction of ``x`` the judge assigns to class ``y``."""
        y = torch.as_tensor(y).reshape(-1).cpu().long()
        if y.shape[0] != x.shape[0]:
            raise InvalidLabelError(f"{y.shape[0]} labels for {x.shape[0]} inputs; give one label per input")
        return float((self.predict(x) == y).float().mean())


def train_judge(
    x: Tensor,
    y: Tensor,
    *,
    epochs: int = 15,
    batch_size: int = 64,
    lr: float = 2e-3,
    arch: JudgeArch = JudgeArch(),
    num_classes: int | None = None,
    test: tuple[Tensor, Tensor] | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Judge:
    """Train a :class:`JudgeNet` of size ``arch`` on ``(x, y)`` with plain cross-entropy (Adam, no
    augmentation).

    Seconds on a CPU for the digits (8x8 or 32x32 RGB). ``test=(x_test, y_test)``, held-out data,
    sets ``judge.test_accuracy``. Never train it on samples of the model under test.
    """
    if not isinstance(arch, JudgeArch):
        raise TypeError(f"train_judge: arch must be a JudgeArch, got {type(arch).__name__}")
    if test is not None and not (isinstance(test, (tuple, list)) and len(test) == 2):
        raise TypeError("train_judge: test must be the held-out pair (x_test, y_test)")
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise InvalidInputError(f"train_judge needs images [N, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
    y = torch.as_tensor(y).long().reshape(-1)
    if y.shape[0] != x.shape[0]:
        raise InvalidLabelError(f"{y.shape[0]} labels for {x.shape[0]} inputs; give one label per input")
    k = int(num_classes) if num_classes is not None else int(y.max()) + 1
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = JudgeNet(x.shape[1], k, width=arch.width, feature_dim=arch.feature_dim)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    net.to(dev).train()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    xd, yd = x.to(dev, torch.float32), y.to(dev)
    for _ in range(epochs):
        for idx in torch.randperm(len(xd), generator=g).split(batch_size):
            idx = idx.to(dev)
            loss = F.cross_entropy(net(xd[idx]), yd[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    judge = Judge(net, tuple(x.shape[1:]))
    if test is not None:
        judge.test_accuracy = judge.accuracy(*test)
    return judge


# ---------------------------------------------------------------------------- the measures
def sample_quality(judge: Judge, samples: Tensor, heldout: Tensor, y_samples: Tensor | None = None) -> dict[str, float]:
    """How close ``samples`` are to ``heldout`` data, as the independent ``judge`` sees them.

    Returns ``{"fd": Fréchet distance in judge features, "n_samples": N}`` and, when
    class-conditional ``y_samples`` are given, ``"judge_acc"``: the fraction of samples the judge
    puts in their class (chance is ``1 / num_classes``). Compare ``fd`` with
    :func:`reference_points` at the same sizes.
    """
    out: dict[str, float] = {
        "fd": frechet_distance(judge.features(samples), judge.features(heldout)),
        "n_samples": int(samples.shape[0]),
    }
    if y_samples is not None:
        out["judge_acc"] = judge.accuracy(samples, y_samples)
    return out


def reference_points(
    judge: Judge,
    heldout: Tensor,
    *,
    train: Tensor | None = None,
    init: Tensor | None = None,
    n: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """The numbers a sample-quality figure needs beside it.

    ``heldout_halves``: held-out data against itself, two random halves (the floor at that size);
    ``train``: ``n`` training inputs against the held-out data; ``init``: ``n`` draws of the
    initial distribution (the replay buffer's start) against the held-out data. ``n`` defaults to
    the held-out size; use the number of samples you measure.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(heldout.shape[0], generator=g)
    half = heldout.shape[0] // 2
    out = {
        "heldout_halves": frechet_distance(
            judge.features(heldout[perm[:half]]), judge.features(heldout[perm[half : 2 * half]])
        )
    }
    feats_h = judge.features(heldout)
    for name, x in (("train", train), ("init", init)):
        if x is not None:
            x = x if n is None else x[torch.randperm(x.shape[0], generator=g)[:n]]
            out[name] = frechet_distance(judge.features(x), feats_h)
    return out


def chain_trace(
    jm: nn.Module,
    judge: Judge,
    x_init: Tensor,
    heldout: Tensor,
    *,
    sampler: Any,
    rounds: Sequence[int] = (0, 4, 20),
    batch_size: int | None = None,
) -> dict[str, Any]:
    """The model's energy and the judge's Fréchet distance along chains continued from ``x_init``.

    Each entry of ``rounds`` (increasing) is a point on the chains: after ``rounds * sampler.steps``
    more steps of ``sampler`` (a copy: its settings, BatchNorm mode included, not its state).
    Where the energy landscape leads towards the data, the energy and the distance fall together.
    Chains whose energy falls to the held-out data's level or below while the distance stays or
    grows have found states that fool the model: low energy that looks nothing like the data
    (on a ResNet at 32x32, 100 more steps can take the buffer's energy below the data's while its
    distance grows).

    ``batch_size``: chains per batch, as in training (it matters for ``batchnorm="separate"``);
    ``None`` runs all at once. The chains are unconditional: ``E(x) = -logsumexp(logits)``.

    Returns ``{"heldout_energy": mean E of heldout, "trace": [{"rounds", "steps", "energy", "fd"}, ...]}``
    (energies in the sampler's BatchNorm mode, means over chains).
    """
    if not isinstance(x_init, Tensor) or not isinstance(heldout, Tensor):
        raise InvalidInputError("chain_trace needs tensors x_init [N, ...] and heldout [M, ...]")
    rounds = [int(r) for r in rounds]
    if not rounds or any(r < 0 for r in rounds) or rounds != sorted(rounds):
        raise ValueError(f"rounds must be increasing ints >= 0, got {rounds}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    tracer = copy.copy(sampler)  # the caller's sampler keeps its settings
    tracer.cuda_graph = "off"  # recording energies runs eagerly anyway; say nothing about it

    def advance(x: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        tracer.steps = steps
        size = batch_size or x.shape[0]
        outs, energies = [], []
        for i in range(0, x.shape[0], size):
            xc, diag = tracer.sample(
                jm,
                x_init=x[i : i + size],
                return_diagnostics=True,
                record_energies=True,
                record_trajectory=False,
                progress=False,
            )
            outs.append(xc.detach())
            energies.append(diag.energies[-1].detach().float())
        return torch.cat(outs), torch.cat(energies)

    _, e_heldout = advance(heldout, 0)
    feats_heldout = judge.features(heldout)  # once: the reference every round is measured against
    x, done, trace = x_init.detach(), 0, []
    for r in rounds:
        x, energy = advance(x, (r - done) * sampler.steps)
        done = r
        trace.append(
            {
                "rounds": r,
                "steps": r * sampler.steps,
                "energy": float(energy.mean()),
                "fd": frechet_distance(judge.features(x), feats_heldout),
            }
        )
    return {"heldout_energy": float(e_heldout.mean()), "trace": trace}
