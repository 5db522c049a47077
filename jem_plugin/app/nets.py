"""Small reference architectures for the examples, the demo, tests and benchmarks.

They are ordinary classifiers (``model(x) -> logits``); ``jem.wrap`` makes them JEMs. Two
choices matter for energy-based training: no BatchNorm (its batch statistics differ between
data and SGLD samples, the JEM paper drops it too) and activations whose input gradient never
vanishes (LeakyReLU as in JEM's Wide-ResNet, or SiLU/ELU): SGLD follows input gradients, and
ReLU zeroes them wherever a unit is off.
"""
from __future__ import annotations

from torch import Tensor, nn

__all__ = ["DigitsCNN", "ToyMLP"]


def _act(name: str) -> nn.Module:
    acts = {"silu": nn.SiLU, "swish": nn.SiLU, "elu": nn.ELU, "gelu": nn.GELU,
            "leaky_relu": lambda: nn.LeakyReLU(0.2), "relu": nn.ReLU, "softplus": nn.Softplus}
    if name not in acts:
        raise ValueError(f"unknown activation {name!r}; choose one of {', '.join(acts)}")
    return acts[name]()


class DigitsCNN(nn.Module):
    """A tiny CNN for ``[B, 1, 8, 8]`` digits (or any ``in_channels`` x 8 x 8 input).

    Two blocks of two 3x3 convolutions (``width`` then ``2 * width`` channels), each followed by
    2x2 pooling (8x8 -> 4x4 -> 2x2), and a linear head. No BatchNorm. LeakyReLU(0.2) as in
    JEM's Wide-ResNet by default. Measured on the digits (Adam 1e-4, 150 epochs): 0.978 test
    accuracy, against 0.94 for the same network with SiLU, average pooling and a hidden FC layer
    (which learns much more slowly at the paper's learning rate).
    """

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 1,
                 act: str = "leaky_relu", pool: str = "max") -> None:
        super().__init__()
        if pool not in ("max", "avg"):
            raise ValueError(f"pool must be 'max' or 'avg', got {pool!r}")
        w = width
        Pool = nn.MaxPool2d if pool == "max" else nn.AvgPool2d
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, w, 3, padding=1), _act(act),
            nn.Conv2d(w, w, 3, padding=1), _act(act),
            Pool(2),  # 8 -> 4
            nn.Conv2d(w, 2 * w, 3, padding=1), _act(act),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), _act(act),
            Pool(2),  # 4 -> 2
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 4, num_classes))
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class ToyMLP(nn.Module):
    """An MLP for 2D (or any ``in_dim``) toy data: ``depth`` hidden layers of ``hidden`` units
    with Swish (SiLU) or ELU, then ``num_classes`` logits (``num_classes=1``: a plain EBM whose
    single logit is ``-E(x)``)."""

    def __init__(self, in_dim: int = 2, num_classes: int = 8, hidden: int = 128, depth: int = 3,
                 act: str = "silu") -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = in_dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), _act(act)]
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
