"""Monte-Carlo dropout (Gal & Ghahramani 2016): the network sampled with its dropout on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..._checks import unwrap_model
from ...model import as_jem
from ._base import describe

#: The dropout layers MCD turns on (every torch dropout; timm's DropPath and DropBlock are
#: stochastic depth and regularisation of training, not the dropout the paper samples).
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@contextmanager
def _dropout_on(model: nn.Module) -> Iterator[None]:
    """Every dropout layer of ``model`` with ``p > 0`` in training mode, the rest as it is (so
    BatchNorm keeps its running statistics); the modes restored after."""
    layers = [m for m in model.modules() if isinstance(m, DROPOUT) and float(m.p) > 0]
    if not layers:  # the network's kind, not bad data: evaluate_all reports it in mcd's row
        raise TypeError(
            f"mcd samples the network with its dropout on, and {type(model).__name__} has no dropout layer "
            "(nn.Dropout with p > 0): use a score of one forward pass (msp, logpx)"
        )
    modes = [m.training for m in layers]
    try:
        for m in layers:
            m.train()
        yield
    finally:
        for m, mode in zip(layers, modes):
            m.train(mode)


@describe(
    name="mcd",
    description="Monte-Carlo dropout: minus the class-averaged variance of the softmax over dropout samples (samples=30, mode='var', seed=0)",
    paper="Gal & Ghahramani 2016, Dropout as a Bayesian Approximation: Representing Model Uncertainty in Deep Learning (ICML)",
)
def mcd(jm: Any, x: Tensor, samples: int = 30, mode: str = "var", seed: int | None = 0) -> Tensor:
    """Monte-Carlo dropout (Gal & Ghahramani 2016): ``samples`` forward passes with the network's
    dropout layers on (every ``nn.Dropout`` and its 1d/2d/3d/alpha variants with ``p > 0``; the
    other layers stay in the mode they are in, BatchNorm in eval), then from the softmax
    probabilities ``p_s`` of the passes:

    - ``mode="var"`` (default): ``-mean_j var_s p_sj``, minus the variance over the passes
      (Bessel-corrected) averaged over the classes (Kendall et al.'s Bayesian SegNet);
    - ``mode="mean"``: ``max_j mean_s p_sj``, the maximum of the mean posterior.

    Costs ``samples`` forward passes; a network without dropout is refused in one line.
    ``seed``: the dropout masks are drawn from a generator seeded with it (the global random state
    is left as it was), so a batch scores the same every time; ``None`` draws from the global
    state. The masks are drawn for the whole batch at once, so an input's score depends on the
    batch it is scored in (as in the paper and pytorch-ood).

    pytorch-ood's ``MCD`` (same defaults: 30 samples, ``"var"``) puts the whole model in training
    mode except BatchNorm; ours turns on the dropout layers alone, which is the same on networks
    whose other layers behave alike in both modes. Its outlier score is minus ours.
    """
    n = samples
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"samples must be an integer >= 2 (a variance needs two passes), got {samples!r}")
    if mode not in ("var", "mean"):
        raise ValueError(f"mode must be 'var' or 'mean', got {mode!r}")
    core = as_jem(jm, "mcd")
    with _dropout_on(unwrap_model(core.model)), torch.no_grad():
        devices = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            probs = torch.stack([torch.softmax(core.logits(x).float(), dim=1) for _ in range(n)])
    if mode == "mean":
        return probs.mean(dim=0).max(dim=1).values
    return -probs.var(dim=0).mean(dim=1)
