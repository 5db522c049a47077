"""Scores of the softmax probabilities: ODIN (with its input step) and GEN."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._outputs import Outputs
from ...model import as_jem, input_grad_enabled, sampling_mode
from ._base import (
    _input_step,
    describe,
)


@describe(
    name="odin",
    needs_grad=True,
    description="ODIN: max softmax at temperature T after an eps input step (temperature=1000, eps=0.0014)",
    paper="Liang et al. 2018, Enhancing The Reliability of Out-of-distribution Image Detection in Neural Networks (ICLR)",
)
def odin(jm: Any, x: Tensor, temperature: float = 1000.0, eps: float = 0.0014) -> Tensor:
    """ODIN (Liang et al. 2018): the maximum softmax probability at temperature ``T`` of the input
    moved by ``eps`` against the gradient sign of ``-log S_yhat(x; T)``.

    ``eps`` is in units of the ``[0, 1]`` pixel range: the step in input space is
    ``eps * (high - low)`` per channel of the model's domain, i.e. ``eps / std`` for normalised
    images, as the ODIN code divides the gradient by the normalisation's std (pytorch-ood's
    ``norm_std``). Defaults are OpenOOD's (``T = 1000``, ``eps = 0.0014``).
    """
    t = float(temperature)
    if not t > 0 or not math.isfinite(t):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    core = as_jem(jm, "odin")
    with sampling_mode(core), input_grad_enabled(x) as xg:
        logits = core.logits(xg) / t
        loss = F.cross_entropy(logits, logits.argmax(1), reduction="sum")
        (g,) = torch.autograd.grad(loss, xg)
    x_hat = _input_step(core, x, g, eps)
    with torch.no_grad():
        return torch.softmax(core.logits(x_hat) / t, dim=1).max(dim=1).values


def _gen(jm: Any, out: Outputs, gamma: float = 0.1, M: int | None = None, clamp: float = 1e-7) -> Tensor:
    """:func:`gen` of a batch's outputs (its logits)."""
    if not float(gamma) > 0:
        raise ValueError(f"gamma must be positive, got {gamma!r}")
    if not 0.0 <= float(clamp) < 0.5:
        raise ValueError(f"clamp must be in [0, 0.5), got {clamp!r}")
    logp = torch.log_softmax(out.logits.double(), dim=1)
    k = logp.shape[1]
    m = min(k, 100) if M is None else int(M)
    if not 1 <= m <= k:
        raise ValueError(f"M must be in [1, {k}] (the number of classes), got {M!r}")
    top = logp.topk(m, dim=1).values  # descending: column 0 is the top class
    # log(1 - p): log1p(-p) is exact for p <= 1/2, which every class but the top one is; for the top
    # class, the log of the others' summed probabilities.
    log_rest = torch.log1p(-top.exp().clamp(max=0.5))
    others = logp.scatter(1, logp.argmax(dim=1, keepdim=True), float("-inf"))
    log_rest[:, 0] = torch.where(top[:, 0] > -math.log(2.0), torch.logsumexp(others, dim=1), log_rest[:, 0])
    if clamp > 0:  # p and 1 - p both in [clamp, 1 - clamp]
        lo, hi = math.log(clamp), math.log1p(-clamp)
        top, log_rest = top.clamp(lo, hi), log_rest.clamp(lo, hi)
    return -torch.exp(gamma * (top + log_rest)).sum(dim=1).float()


@describe(
    name="gen",
    description="GEN generalized entropy of the top-M probabilities (gamma=, M=, clamp=)",
    paper="Liu et al. 2023, GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection (CVPR)",
    reads=("logits",),
    score_outputs=_gen,
)
def gen(jm: Any, x: Tensor, gamma: float = 0.1, M: int | None = None, clamp: float = 1e-7) -> Tensor:
    """GEN (Liu et al. 2023): ``-sum_{j <= M} p_j^gamma (1 - p_j)^gamma`` over the ``M`` largest
    softmax probabilities (``M = min(K, 100)`` by default), a sum as the authors' code computes it.

    ``p`` is clamped to ``[clamp, 1 - clamp]`` as pytorch-ood does (its scores are then ours
    divided by ``M``): the power transform would otherwise let the far tail of tiny probabilities
    decide; on the four networks of ``benchmarks/bench_posthoc.py`` the clamp was never worse and
    on one better (mean AUROC 0.896 against 0.889 on resnet10t). ``clamp=0`` gives the formula
    exactly. Computed from the logits in log space, in float64, so ``1 - p`` of a top probability
    that rounds to 1 in float32 is the others' probability mass, not 0.
    """
    return _gen(jm, Outputs(jm.logits(x)), gamma, M, clamp)
