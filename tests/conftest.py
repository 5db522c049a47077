"""Shared fixtures. Tests run on CPU with one thread: the machine (and CI) has 2 cores."""

from __future__ import annotations

import os

os.environ.setdefault("JEM_DISABLE_PLUGINS", "")  # installed third-party plugins stay visible unless a test says so
# The commands tests start as processes (jem train, examples, torchrun) get one thread too: the
# suite runs in two processes on CI's two cores, where a second thread per process only contends.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


_NEEDS_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def cuda(test):
    """A CUDA-only test: marked gpu (`-m "not gpu"` leaves it out), skipped where no GPU is (CI)."""
    for mark in reversed(_NEEDS_GPU):
        test = mark(test)
    return test


# ``@pytest.mark.parametrize("device", DEVICES)``: a test on the CPU everywhere, and on the GPU where one is.
DEVICES = ["cpu", pytest.param("cuda", marks=_NEEDS_GPU)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts on one thread and leaves it so: a benchmark a test runs sets its own count."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


class TinyCNN(torch.nn.Module):
    """A small classifier with BatchNorm and Dropout: the layers that break naive JEM code."""

    def __init__(self, num_classes: int = 10, in_ch: int = 1):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(in_ch, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.SiLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1),
            torch.nn.SiLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Dropout(0.1),
        )
        self.head = torch.nn.Linear(16, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


@pytest.fixture
def tiny_cnn():
    return TinyCNN()


def train_by_cross_entropy(model: torch.nn.Module, x, y, epochs: int, lr: float = 3e-3) -> torch.nn.Module:
    """``model`` trained by cross-entropy with Adam, batches of 64 in a seeded order; in eval mode."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()
