"""JEM with Hugging Face Accelerate: the replay buffer in ``save_state``/``load_state``, per rank.

>>> from accelerate import Accelerator
>>> from jem_plugin.integrations.accelerate import register_jem_state
>>> accelerator = Accelerator()
>>> jm, opt, loader = accelerator.prepare(jem.wrap(model), opt, loader)   # DDP when distributed
>>> loss_fn = jem.JEMLoss(jem.SGLD(), jem.ReplayBuffer(10000, (3, 32, 32))).to(accelerator.device)
>>> register_jem_state(accelerator, loss_fn)          # buffer + sampler, every rank's
>>> for x, y in loader:
...     with accelerator.accumulate(jm):              # no_sync on accumulation steps
...         out = loss_fn(jm, x, y)                   # samples on the bare module (see jem_plugin.distributed)
...         accelerator.backward(out.loss)
...         opt.step(); opt.zero_grad()
>>> accelerator.save_state("ckpt")                    # ... accelerator.load_state("ckpt") resumes

Why a helper rather than ``accelerator.register_for_checkpointing(loss_fn)``: Accelerate writes
registered objects from the main process only, so every rank would resume with rank 0's chains.
:func:`register_jem_state` registers a :class:`~jem_plugin.distributed.PerRankState` instead:
saving gathers every rank's state into that one file, loading gives each rank its own. (Accelerate
saves each process's RNG states itself.) Note that Accelerate reads registered objects back with
``torch.load(weights_only=False)``: load only checkpoints you wrote. ``save_state`` returns
without a barrier; call ``accelerator.wait_for_everyone()`` before another rank may read the
folder in the same run.
"""

from __future__ import annotations

from typing import Any

from ..distributed import PerRankState

__all__ = ["register_jem_state"]


def register_jem_state(accelerator: Any, *objects: Any) -> list[PerRankState]:
    """Register ``objects`` (a :class:`~jem_plugin.losses.JEMLoss`, a replay buffer, a sampler, ...)
    for ``accelerator.save_state``/``load_state``, one state per rank; returns the wrappers."""
    if not objects:
        raise ValueError("register_jem_state(accelerator, loss_fn, ...) needs at least one object")
    if not callable(getattr(accelerator, "register_for_checkpointing", None)):  # duck-typed: no accelerate import
        raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__name__}")
    wrapped = [PerRankState(obj) for obj in objects]
    accelerator.register_for_checkpointing(*wrapped)
    return wrapped
