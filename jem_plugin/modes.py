"""Put a model into "sampling mode" for the length of an SGLD chain, then restore it exactly.

SGLD needs gradients with respect to the *input* only. Two things go wrong if the model is left
as the training loop had it:

- BatchNorm in train mode normalises with batch statistics of the (bad) samples and updates its
  running statistics with them; Dropout makes the energy landscape random.
- Parameters that require grad make autograd record (and keep alive) a parameter-gradient graph
  on every step, which costs time and memory, and backward hooks (DDP!) may fire.

:func:`sampling_mode` switches every submodule to eval and every parameter to
``requires_grad=False``, and on exit restores each module's own ``training`` flag and each
parameter's own ``requires_grad`` flag (a frozen backbone stays frozen, a module the user had put
in eval stays in eval), also when the chain raises.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

__all__ = ["sampling_mode"]


@contextlib.contextmanager
def sampling_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Eval mode and frozen parameters inside the block; the exact previous flags after it.

    Cheap: one pass over the modules and parameters on entry and one on exit (it runs once per
    chain, not once per step). The flags are set directly rather than through ``module.eval()``
    so that user overrides of ``train()`` (e.g. "keep BatchNorm frozen") cannot switch a layer
    back to training behaviour mid-chain.

    >>> with sampling_mode(model):
    ...     x = sgld_chain(model, x)
    """
    # One traversal; record only what we change, so restoring touches exactly those flags.
    # Flags are written with object.__setattr__: nn.Module.__setattr__ costs ~10x more and
    # `training` is a plain attribute. A parameter shared between modules is recorded once.
    was_training: list[nn.Module] = []
    had_grad: list[nn.Parameter] = []
    seen: set[int] = set()
    stack = [module]  # iterative walk over _modules: several times cheaper than modules()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.training:
            was_training.append(m)
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                had_grad.append(p)
        stack.extend(c for c in m._modules.values() if c is not None)
    try:
        for m in was_training:
            _set(m, "training", False)
        for p in had_grad:
            p.requires_grad_(False)
        yield module
    finally:
        for m in was_training:
            _set(m, "training", True)
        for p in had_grad:
            p.requires_grad_(True)


_set = object.__setattr__
