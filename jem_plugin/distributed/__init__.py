"""JEM training across processes: DDP under ``torchrun``, per-rank replay buffers and checkpoints.

The few-line JEM addition stays the same; three things change under
``DistributedDataParallel`` (DDP):

* **Sample on the bare module, train through the wrapper.** SGLD only needs input gradients.
  Every forward through DDP prepares the gradient reducer for a backward and, for a model with
  buffers (BatchNorm), first broadcasts rank 0's buffers. Sampling through the wrapper therefore
  costs one broadcast per Langevin step and makes every rank's chains use rank 0's BatchNorm
  statistics, and with ``static_graph=True`` it silently desynchronises the ranks' parameters
  (measured with torch 2.14; ``tests/test_distributed.py`` pins the correct behaviour).
  :class:`~jem_plugin.losses.JEMLoss` looks through the wrapper: ``loss_fn(ddp_jm, x, y)`` samples
  with ``ddp_jm.module`` and sends the concatenated ``[data; samples]`` batch through ``ddp_jm``
  once, so gradients are all-reduced exactly once per step, and ``ddp_jm.no_sync()`` (gradient
  accumulation, :func:`maybe_no_sync`) is respected.
* **One replay buffer per rank.** Each process keeps its own chains (seeded differently per rank
  with :func:`rank_generator`), like the data each rank sees. A buffer that lives *inside* the
  DDP-wrapped module (the :class:`~jem_plugin.integrations.mixin.GenerativeLossMixin` pattern, e.g. a
  LightningModule) is excluded from DDP's buffer broadcast by :func:`ignore_replay_buffers`;
  otherwise rank 0 would overwrite every rank's chains on every forward (and send the whole buffer
  over the network each step).
* **Checkpoints hold every rank's buffer.** :class:`DistributedCheckpointer` writes the shared
  state (model, optimizer, step) once from rank 0 and one ``.rank{r}.pt`` file per rank (buffer,
  sampler generator, RNG states), each atomically; the rank-0 file is written last, so it marks a
  complete checkpoint. Frameworks that write one file from rank 0 (Lightning, Accelerate) use
  :class:`PerRankState`, which gathers the ranks' states into that file.
* **BatchNorm statistics recomputed after training** (``torch.optim.swa_utils.update_bn``, as the
  ``generative`` recipe does) see only each rank's shard: :func:`average_batchnorm_statistics`
  averages them over the ranks before rank 0 saves the model.

>>> from jem_plugin import distributed as jdist
>>> info = jdist.init_distributed()                      # reads torchrun's env; gloo on CPU
>>> ddp_jm = jdist.wrap_ddp(jem.wrap(model).to(info.device))
>>> sampler = jem.SGLD(generator=jdist.rank_generator(seed))   # different chains per rank
>>> loss_fn = jem.JEMLoss(sampler, jem.ReplayBuffer(10000, (3, 32, 32), num_classes=None))
>>> out = loss_fn(ddp_jm, x, y); out.loss.backward(); opt.step()

FSDP
----
* FSDP2 works, on CPU with gloo too (tested in ``tests/test_distributed.py``: ranks stay in sync
  and match DDP to 1e-5). Shard the *classifier*, not the JEM: :func:`fully_shard_jem` does
  ``fully_shard(jm.model)``. The sampler calls ``jm.model`` directly (no wrapper dispatch per
  Langevin step), so FSDP2 hooks on the JEM itself would be skipped and SGLD would fail with
  "got mixed torch.Tensor and DTensor". FSDP2 shards through hooks on the module itself, so there
  is no bare module to sample on: each SGLD step all-gathers the parameters, as any FSDP forward
  does.
* FSDP1 (the ``FullyShardedDataParallel`` wrapper) does not work for JEM training: its
  pre-backward hooks (``register_multi_grad_hook`` on the forward inputs) raise "A leaf node was
  passed to _will_engine_execute_node but we are currently running autograd.grad()" on the first
  SGLD step, because SGLD takes input gradients with ``torch.autograd.grad``; and ``JEMLoss``
  rejects an FSDP1 wrapper around the JEM. Use FSDP2.
* :class:`DistributedCheckpointer` writes shared state from rank 0 only, which for a sharded model
  is one shard: save FSDP model/optimizer state with ``torch.distributed.checkpoint`` and use
  ``per_rank=`` here for the replay buffers.
"""

from __future__ import annotations

from ._checkpoint import (
    PER_RANK_FORMAT,
    DistributedCheckpointer,
    PerRankState,
    load_distributed_checkpoint,
    rank_path,
    save_distributed_checkpoint,
    select_rank_state,
    skip_batches,
)
from ._ddp import (
    FSDP_NOTES,
    DistributedJEM,
    average_batchnorm_statistics,
    fully_shard_jem,
    ignore_replay_buffers,
    maybe_no_sync,
    params_in_sync,
    unwrap,
    wrap_ddp,
)
from ._group import (
    DistInfo,
    barrier,
    cleanup,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    rank_generator,
    rank_seed,
)

__all__ = [
    "DistInfo",
    "init_distributed",
    "cleanup",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "rank_seed",
    "rank_generator",
    "DistributedJEM",
    "wrap_ddp",
    "unwrap",
    "ignore_replay_buffers",
    "average_batchnorm_statistics",
    "fully_shard_jem",
    "maybe_no_sync",
    "params_in_sync",
    "PerRankState",
    "save_distributed_checkpoint",
    "load_distributed_checkpoint",
    "rank_path",
    "DistributedCheckpointer",
    "select_rank_state",
    "skip_batches",
    "FSDP_NOTES",
    "PER_RANK_FORMAT",
]
