"""Do JEM++'s inner steps through the first layer move a chain anywhere the outer gradient does not?

JEM++ (Yang & Ji 2021, after YOPO) takes, per SGLD step, one full backward for the gradient of
the energy ``E`` with respect to the first layer's output, ``p = dE/dh1``, then several cheap
"inner" steps through the first layer alone: ``x <- x + a * clamp(d<h1(x), p>/dx)``, ``p`` held
fixed. When the first layer is linear (a convolution or a patch embedding, preceded by the
input normalisation, itself affine), ``d<h1(x), p>/dx = W^T p`` is the outer gradient ``dE/dx``
itself, at every point the inner steps visit: they are the outer step repeated, i.e. a larger
step size. Their released script (5 outer steps, 5 inner of 0.2 with the clamp at 1) doubles
each step.

This script measures it on real networks: for the first module the forward calls (found by
forward hooks, as a library that only wraps the model would have to), the relative difference
between the inner-step direction and the outer gradient at the chain's point and after moving it.
As a contrast it repeats the measurement with the "first layer" taken through its first
nonlinearity, where the inner direction does change as the chain moves.

    python benchmarks/check_inner_steps.py [--out benchmarks/results/generative/inner_steps.md]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "generative", "inner_steps.md")
# modules that are affine in their input in eval mode: the prefix through them stays linear
AFFINE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Identity, nn.Dropout, nn.modules.batchnorm._BatchNorm)


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    import timm
    import torchvision

    from jem_plugin.app.nets import DigitsCNN

    out = {
        name: (timm.create_model(name, pretrained=False, num_classes=10), (3, 32, 32))
        for name in ("test_resnet", "resnet10t", "test_convnext", "test_efficientnet", "test_vit")
    }
    out["test_vit"] = (timm.create_model("test_vit", pretrained=False, num_classes=10, img_size=32), (3, 32, 32))
    out["torchvision resnet18"] = (torchvision.models.resnet18(num_classes=10), (3, 32, 32))
    out["jem DigitsCNN (8x8)"] = (DigitsCNN(num_classes=10), (1, 8, 8))
    return out


def _first_module(model: nn.Module, x: torch.Tensor, through_activation: bool) -> nn.Module:
    """The first leaf module the forward calls; with ``through_activation``, the first one that is
    not affine (an activation or a LayerNorm)."""
    order: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: order.append(m)) for m in model.modules() if not list(m.children())
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    if through_activation:
        return next(m for m in order if not isinstance(m, AFFINE))
    return order[0]


def _split_at(model: nn.Module, x: torch.Tensor, layer: nn.Module):
    """``(dE/dx, p = dE/dh, h(x') for any x')``: ``h`` the output of ``layer``, recomputed from
    the input by rerunning the forward up to it (the prefix, captured by a hook that stops there)."""

    class _Stop(Exception):
        pass

    captured: dict[str, torch.Tensor] = {}

    def keep(m, i, o):
        o.retain_grad()
        captured["h"] = o

    handle = layer.register_forward_hook(keep)
    xg = x.detach().clone().requires_grad_(True)
    energy = -torch.logsumexp(model(xg), 1).sum()
    energy.backward()
    handle.remove()
    p = captured["h"].grad.detach()

    def prefix(x2: torch.Tensor) -> torch.Tensor:
        def stop(m, i, o):
            captured["h"] = o
            raise _Stop

        hd = layer.register_forward_hook(stop)
        try:
            model(x2)
        except _Stop:
            pass
        finally:
            hd.remove()
        return captured["h"]

    return xg.grad.detach(), p, prefix


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(
    model: nn.Module, shape: tuple[int, ...], through_activation: bool, seed: int = 0
) -> tuple[str, float, float]:
    g = torch.Generator().manual_seed(seed)
    model.eval()
    x = torch.randn((8, *shape), generator=g)
    layer = _first_module(model, x, through_activation)
    grad, p, prefix = _split_at(model, x, layer)
    out = []
    # at the chain's point, then after five inner steps of 0.2 on the sign of the gradient
    for x2 in (x, (x + 5 * 0.2 * grad.sign()).detach()):
        x2 = x2.clone().requires_grad_(True)
        (inner,) = torch.autograd.grad((prefix(x2) * p).sum(), x2)
        out.append(_rel(inner, grad))
    return type(layer).__name__, out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    head = (
        "| model | first layer | inner vs outer direction, at the point / after moving | "
        "first non-affine module | at the point / after moving |"
    )
    rows = [head, "|---|---|---|---|---|"]
    for name, (model, shape) in _models().items():
        lin, a0, a1 = measure(model, shape, through_activation=False)
        act, b0, b1 = measure(model, shape, through_activation=True)
        # a module the input also bypasses (a ViT block's LayerNorm beside its residual) is no cut
        # of the network: the split does not hold even at the chain's point
        contrast = f"{b0:.1e} / {b1:.1e}" if b0 < 1e-4 else f"not a cut ({b0:.1e} at the point)"
        rows.append(f"| {name} | {lin} | {a0:.1e} / {a1:.1e} | {act} | {contrast} |")
        print(rows[-1], flush=True)
    text = (
        "# JEM++'s inner steps on networks with a linear first layer\n\n"
        "Relative L2 difference between the inner-step direction through the first layer "
        "(the first module the forward calls, `p = dE/dh` held fixed) and the outer gradient "
        "`dE/dx`, on 8 random inputs, at the chain's point and after five inner steps of 0.2. "
        "Randomly initialised models in eval mode. `python benchmarks/check_inner_steps.py`.\n\n"
        + "\n".join(rows)
        + "\n"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
