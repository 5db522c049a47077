"""DDP and FSDP2 around a JEM: the wrapper, its unwrap, replay buffers kept out of DDP's sync."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .._checks import unwrap_parallel
from ..errors import JEMError
from ..model import JEM, wrap
from ._group import _initialized

FSDP_NOTES = (
    "FSDP2 (torch.distributed.fsdp.fully_shard) works with JEMLoss (tested on CPU/gloo) when the "
    "classifier is sharded (fully_shard_jem(jm) = fully_shard(jm.model)), not the JEM; sampling "
    "runs on the sharded module itself and all-gathers the parameters for every SGLD step. FSDP1 "
    "(FullyShardedDataParallel) does not: its pre-backward hooks fail under torch.autograd.grad, "
    "which SGLD uses for input gradients, and JEMLoss does not look through its wrapper."
)


# --------------------------------------------------------------------------- DDP
unwrap = unwrap_parallel  # the public name under jem_plugin.distributed


class DistributedJEM(DistributedDataParallel):
    """``DistributedDataParallel`` around a :class:`~jem_plugin.model.JEM`, built by :func:`wrap_ddp`.

    ``ddp_jm(x)`` is the training forward (gradients all-reduced at backward); pass ``ddp_jm`` to
    :class:`~jem_plugin.losses.JEMLoss`, which samples on :attr:`sampling_module`. The energy-view
    API (``domain``, ``num_classes``, ``energy``, ``log_px``, ...) is forwarded to the bare JEM for
    evaluation and scoring: those calls do not go through DDP and take part in no gradient sync.
    """

    module: JEM

    @property
    def sampling_module(self) -> JEM:
        """The bare JEM: what SGLD runs on (no DDP hooks, no buffer broadcast)."""
        return self.module

    # The JEM API, delegated (evaluation only: no DDP involvement).
    domain = property(lambda self: self.module.domain, doc="The bare JEM's input domain.")
    num_classes = property(lambda self: self.module.num_classes, doc="The bare JEM's number of classes.")
    adapter = property(lambda self: self.module.adapter, doc="The bare JEM's adapter.")
    model = property(lambda self: self.module.model, doc="The classifier inside the JEM.")

    def logits(self, x: Tensor) -> Tensor:
        return self.module.logits(x)

    def energy(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        return self.module.energy(x, y)

    def log_px(self, x: Tensor) -> Tensor:
        return self.module.log_px(x)

    def log_pxy(self, x: Tensor, y: Tensor) -> Tensor:
        return self.module.log_pxy(x, y)

    def log_py_given_x(self, x: Tensor, y: Tensor | None = None) -> Tensor:
        return self.module.log_py_given_x(x, y)


def _replay_buffer_names(module: nn.Module) -> list[str]:
    from ..buffer import ReplayBuffer

    names: list[str] = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, ReplayBuffer):
            for name, _ in sub.named_buffers():
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def ignore_replay_buffers(module: nn.Module) -> list[str]:
    """Exclude every :class:`~jem_plugin.buffer.ReplayBuffer` inside ``module`` from DDP's sync.

    Call it before wrapping ``module`` in DDP (:func:`wrap_ddp` and the Lightning integration do).
    DDP broadcasts all module buffers from rank 0 at construction and, with the default
    ``broadcast_buffers=True``, before every forward: a replay buffer inside the wrapped module
    would be replaced by rank 0's on every step. Returns the names now ignored (merged with any
    the module already had).
    """
    names = _replay_buffer_names(module)
    if names:
        # torch's DDP sets this on the user's module when something asked it to ignore names
        existing = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []) or [])
        merged = existing + [n for n in names if n not in existing]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, merged)
    return names


def wrap_ddp(model: nn.Module, *, wrap_options: dict | None = None, **ddp_kwargs: Any) -> DistributedJEM:
    """Wrap a classifier (or its :class:`~jem_plugin.model.JEM`) in DDP for JEM training.

    ``model`` is wrapped with :func:`jem_plugin.wrap` first if it is not a JEM yet
    (``wrap_options`` go there). Replay buffers inside it are excluded from DDP's buffer
    broadcast (:func:`ignore_replay_buffers`). ``ddp_kwargs`` go to
    ``DistributedDataParallel`` (e.g. ``device_ids=[local_rank]`` on GPU; on CPU leave it out).
    Needs an initialised process group (:func:`init_distributed` under ``torchrun``).
    """
    if not _initialized():
        raise JEMError(
            "wrap_ddp needs an initialised process group: launch with `torchrun --nproc_per_node=N "
            "script.py` and call jem_plugin.distributed.init_distributed() first (in a single "
            "process, use the JEM directly)"
        )
    if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        raise JEMError("the model is already wrapped in DDP/DataParallel; pass the bare model or JEM")
    jm = model if isinstance(model, JEM) else wrap(model, **(wrap_options or {}))
    ignore_replay_buffers(jm)
    if "device_ids" not in ddp_kwargs:
        param = next(jm.parameters(), None)
        if param is not None and param.device.type == "cuda":
            ddp_kwargs["device_ids"] = [param.device.index]
    return DistributedJEM(jm, **ddp_kwargs)


def fully_shard_jem(jm: JEM, **fsdp_kwargs: Any) -> JEM:
    """Shard a JEM's classifier with FSDP2 (``torch.distributed.fsdp.fully_shard(jm.model)``).

    The classifier, not the JEM, must be the FSDP2 root: the sampler calls ``jm.model`` directly.
    Shard inner blocks first if you want per-block sharding (``fully_shard(block)`` for each),
    then call this. ``fsdp_kwargs`` go to ``fully_shard`` (``mesh``, ``reshard_after_forward``,
    ``mp_policy``, ...). Returns ``jm``; pass it to ``JEMLoss`` as usual.
    """
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - torch < 2.6
        raise JEMError(f"FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6 ({exc})") from exc
    if not isinstance(jm, JEM):
        raise TypeError(f"fully_shard_jem needs a JEM (jem_plugin.wrap(model)), got {type(jm).__name__}")
    if not _initialized():
        raise JEMError("fully_shard_jem needs an initialised process group (init_distributed() under torchrun)")
    fully_shard(jm.model, **fsdp_kwargs)
    return jm


def maybe_no_sync(module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """``module.no_sync()`` unless ``sync`` (the last micro-batch of an accumulation group).

    >>> for i, (x, y) in enumerate(loader):
    ...     with maybe_no_sync(ddp_jm, sync=(i + 1) % accum == 0):
    ...         (loss_fn(ddp_jm, x, y).loss / accum).backward()
    ...     if (i + 1) % accum == 0:
    ...         opt.step(); opt.zero_grad()

    Works for any module: without a ``no_sync`` method (single process) it does nothing.
    """
    no_sync = getattr(module, "no_sync", None)  # DDP's (and DistributedJEM's) method; absent on a plain module
    if sync or no_sync is None:
        return contextlib.nullcontext()
    return no_sync()


@torch.no_grad()
def params_in_sync(module: nn.Module, *, buffers: bool = False) -> bool:
    """True on every rank when every rank holds bitwise the same parameters (and buffers).

    A debugging aid: it broadcasts rank 0's tensors (whole tensors for FSDP2 shards). Replay
    buffers are never compared (they are meant to differ). Always True in a single process.
    """
    if not _initialized() or dist.get_world_size() == 1:
        return True
    module = unwrap(module)

    def full(t: Tensor) -> Tensor:  # FSDP2 shards are DTensors: compare the whole tensor
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()

    tensors = [full(p) for p in module.parameters()]
    if buffers:
        skip = set(_replay_buffer_names(module))
        tensors += [full(b) for n, b in module.named_buffers() if n not in skip]
    ok = True
    for t in tensors:
        ref = t.clone()
        dist.broadcast(ref, src=0)
        ok = ok and torch.equal(ref, t)
    flag = torch.tensor([0 if ok else 1], device=tensors[0].device if tensors else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


@torch.no_grad()
def average_batchnorm_statistics(module: nn.Module) -> int:
    """Average every BatchNorm layer's running mean and variance over the ranks; returns how many
    layers. A no-op (returning the count) in a single process.

    For statistics each rank recomputed on its own shard, e.g. with
    ``torch.optim.swa_utils.update_bn(rank_loader, model)`` after a JEM run: without it, the
    checkpoint rank 0 writes holds statistics of its shard alone. The mean of the ranks' variances
    is ``update_bn``'s own estimate over their batches (it averages per-batch variances too).
    """
    layers = [
        m
        for m in unwrap(module).modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]
    if not _initialized() or dist.get_world_size() == 1:
        return len(layers)
    world = dist.get_world_size()
    for m in layers:
        for t in (m.running_mean, m.running_var):
            assert t is not None  # tracking layers hold both statistics (running_mean checked above)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t.div_(world)
    return len(layers)
