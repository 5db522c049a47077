"""How far a run's samples got, as an independent judge sees them: the figures ``jem train``, ``jem
sample`` and the digits experiment report (built on :mod:`jem_plugin.sample_quality`, which computes
the numbers)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._checks import generator_on, model_device
from ..recipes import SamplerConfig
from ..sample_quality import sample_quality, train_judge

__all__ = ["sample_quality_figures", "dataset_sample_quality", "samples_against_data"]


def sample_quality_figures(
    judge,
    buffer,
    x_heldout: torch.Tensor,
    domain,
    *,
    x_cond: torch.Tensor | None = None,
    y_cond: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """The replay buffer's samples against held-out images as an independent ``judge`` sees them
    (:mod:`jem_plugin.sample_quality`), with the reference points beside them.

    Every Fréchet distance compares ``n`` images with the same ``n`` held-out images (one half of
    ``x_heldout``; FD depends on ``n``): ``fd_buffer`` (``n`` buffer samples), ``fd_init`` (``n``
    draws of the buffer's initial distribution: where the chains started) and
    ``fd_heldout_floor`` (the other held-out half: real against real, a reference, not a floor);
    ``fd_n_samples`` is ``n``. ``judge_acc_heldout``: the judge on real held-out images. With
    class-conditional samples ``x_cond``/``y_cond``: ``judge_acc_samples`` (share the judge puts in
    their class) and ``judge_acc_init`` (the same for per-class draws of the initial distribution,
    high for a per-class Gaussian init before any learning).
    """

    g = torch.Generator().manual_seed(seed)
    x_heldout = x_heldout.detach().cpu().float()
    half = len(x_heldout) // 2
    n = min(half, buffer.capacity)
    perm = torch.randperm(len(x_heldout), generator=g)
    ref, other = x_heldout[perm[half : half + n]], x_heldout[perm[:n]]
    shape = tuple(buffer.sample_shape)
    init = buffer.init_dist.sample(n, shape, domain, g, buffer.device).cpu()
    out = {
        "fd_buffer": sample_quality(judge, buffer.samples(n).cpu(), ref)["fd"],
        "fd_init": sample_quality(judge, init, ref)["fd"],
        "fd_heldout_floor": sample_quality(judge, other, ref)["fd"],
        "fd_n_samples": float(n),
    }
    if judge.test_accuracy is not None:
        out["judge_acc_heldout"] = float(judge.test_accuracy)
    if x_cond is not None and y_cond is not None:
        y_cond = y_cond.cpu().long()
        out["judge_acc_samples"] = judge.accuracy(x_cond.cpu(), y_cond)
        init_c = buffer.init_dist.sample(len(y_cond), shape, domain, g, buffer.device, y=y_cond.to(buffer.device))
        out["judge_acc_init"] = judge.accuracy(init_c.cpu(), y_cond)
    return out


# Judges trained in this process, by their training inputs: the same data and seed train the same
# judge (train_judge is deterministic and leaves the global RNG alone), so a process that runs jem
# train, jem sample or the demo several times on one data set (a notebook, a sweep) trains it once.
_JUDGES: OrderedDict[tuple, Any] = OrderedDict()
_JUDGES_KEPT = 4


def _content_key(*tensors: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _cached_judge(x, y, xh, yh, epochs: int, k: int, seed: int, device):
    """:func:`train_judge` on these inputs, trained once per process."""
    key = (_content_key(x, y, xh, yh), epochs, k, seed, str(device))
    if key in _JUDGES:
        _JUDGES.move_to_end(key)
        return _JUDGES[key]
    judge = train_judge(x, y, test=(xh, yh), epochs=epochs, num_classes=k, seed=seed, device=device)
    _JUDGES[key] = judge
    while len(_JUDGES) > _JUDGES_KEPT:
        _JUDGES.popitem(last=False)
    return judge


def _judge_for(
    train_ds,
    heldout_ds,
    num_classes: int | None,
    g: torch.Generator,
    seed: int,
    max_train: int,
    max_heldout: int,
    device=None,
):
    """An independent judge trained on (at most ``max_train`` of) ``train_ds``, and (at most
    ``max_heldout``) held-out images, both drawn with ``g``; returns ``(judge, held-out images,
    number of classes)``."""
    x, y = next(iter(DataLoader(train_ds, batch_size=min(len(train_ds), max_train), shuffle=True, generator=g)))
    xh, yh = next(iter(DataLoader(heldout_ds, batch_size=min(len(heldout_ds), max_heldout), shuffle=True, generator=g)))
    k = num_classes or int(y.max()) + 1
    # ~350 optimiser steps whatever the data size: seconds on a CPU
    epochs = max(2, min(15, 22500 // len(x)))
    return _cached_judge(x, y, xh, yh, epochs, k, seed, device), xh, k


def dataset_sample_quality(
    jm,
    buffer,
    train_ds,
    heldout_ds,
    *,
    sampler: SamplerConfig | None = None,
    seed: int = 0,
    max_train: int = 5000,
    max_heldout: int = 2000,
) -> dict[str, Any]:
    """:func:`sample_quality_figures` for ``jem train``'s end: a judge trained on (at most
    ``max_train`` of) ``train_ds``, the buffer against (at most ``max_heldout`` of) ``heldout_ds``,
    and class-conditional samples (at least 20 steps of the recipe's ``sampler``, conditional, from
    per-class init draws, about 100 in all). Returns ``{"skipped": reason}`` when the held-out
    split is too small."""

    if heldout_ds is None or len(heldout_ds) < 20:
        return {
            "skipped": f"sample quality needs >= 20 held-out images, got {len(heldout_ds or ())}; "
            "give --val-data or a larger --val-fraction"
        }
    g = torch.Generator().manual_seed(seed)
    dev = model_device(jm)
    judge, xh, k = _judge_for(train_ds, heldout_ds, jm.num_classes, g, seed, max_train, max_heldout, dev)
    y_cond = torch.arange(k, device=buffer.device).repeat_interleave(max(1, 100 // k))
    x0 = buffer.init_dist.sample(len(y_cond), tuple(buffer.sample_shape), jm.domain, g, buffer.device, y=y_cond)
    config = sampler or SamplerConfig()
    chains = dataclasses.replace(config, steps=max(20, config.steps)).build(generator_on(dev, g, seed))
    if config.colours == "data":
        chains.use_colours_of(buffer)
    jm.eval()
    x_cond = chains.sample(jm, x_init=x0, y=y_cond)
    return sample_quality_figures(judge, buffer, xh, jm.domain, x_cond=x_cond, y_cond=y_cond, seed=seed)


def samples_against_data(
    samples: torch.Tensor,
    starts: torch.Tensor,
    train_ds,
    heldout_ds,
    *,
    y: torch.Tensor | None = None,
    num_classes: int,
    seed: int = 0,
    max_train: int = 5000,
    max_heldout: int = 2000,
) -> dict[str, Any]:
    """How far chains moved towards the data, as a judge the model under test cannot fool sees it.

    A small CNN (:func:`~jem_plugin.sample_quality.train_judge`) is trained on (at most
    ``max_train`` of) ``train_ds``. Returns the Fréchet distance in its features from ``samples``
    and from their ``starts`` to the same held-out images (``fd_samples``, ``fd_starts``; equal
    sizes, so the two compare), the judge's accuracy on held-out images, and with labels ``y``
    the share of samples and of starts it puts in their class. ``{"skipped": reason}`` when the
    held-out split is too small.
    """
    if heldout_ds is None or len(heldout_ds) < 20:
        return {"skipped": f"the check needs >= 20 held-out images, got {len(heldout_ds or ())}"}
    g = torch.Generator().manual_seed(seed)
    judge, xh, _ = _judge_for(train_ds, heldout_ds, num_classes, g, seed, max_train, max_heldout)
    n = min(len(samples), len(xh))
    out: dict[str, Any] = {
        "fd_samples": sample_quality(judge, samples[:n].cpu(), xh[:n])["fd"],
        "fd_starts": sample_quality(judge, starts[:n].cpu(), xh[:n])["fd"],
        "n": n,
        "judge_acc_heldout": float(judge.test_accuracy or 0.0),
    }
    if y is not None:
        out["judge_acc_samples"] = judge.accuracy(samples.cpu(), y.cpu())
        out["judge_acc_starts"] = judge.accuracy(starts.cpu(), y.cpu())
    return out
