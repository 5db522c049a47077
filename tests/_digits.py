"""sklearn's 8x8 digits in [-1, 1] and a few JEM training steps on them, for the tests that train a
user's small network with a loss and then ask what its energy learnt."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits

import jem_plugin as jem

#: the first TRAIN digits train; the rest are held out
TRAIN = 1400


def digits8() -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [1797, 1, 8, 8] in [-1, 1], y [1797])``."""
    d = load_digits()
    return torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0, torch.tensor(d.target)


def train_steps(jm: jem.JEM, loss_fn: jem.JEMLoss, steps: int, lr: float) -> jem.JEM:
    """``steps`` Adam steps of ``loss_fn`` on batches of 64 of the training digits (seed 0); ``jm`` in eval mode."""
    x, y = digits8()
    opt = torch.optim.Adam(jm.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        i = torch.randint(0, TRAIN, (64,), generator=g)
        out = loss_fn(jm, x[i], y[i])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return jm.eval()
