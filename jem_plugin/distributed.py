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
  DDP-wrapped module (the :class:`~jem_plugin.losses.GenerativeLossMixin` pattern, e.g. a
  LightningModule) is excluded from DDP's buffer broadcast by :func:`ignore_replay_buffers`;
  otherwise rank 0 would overwrite every rank's chains on every forward (and send the whole buffer
  over the network each step).
* **Checkpoints hold every rank's buffer.** :class:`DistributedCheckpointer` writes the shared
  state (model, optimizer, step) once from rank 0 and one ``.rank{r}.pt`` file per rank (buffer,
  sampler generator, RNG states), each atomically; the rank-0 file is written last, so it marks a
  complete checkpoint. Frameworks that write one file from rank 0 (Lightning, Accelerate) use
  :class:`PerRankState`, which gathers the ranks' states into that file.

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

import contextlib
import dataclasses
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from .checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from .errors import CheckpointError, JEMError
from .model import JEM, wrap

__all__ = [
    "DistInfo", "init_distributed", "cleanup", "get_rank", "get_world_size", "is_main_process",
    "barrier", "rank_seed", "rank_generator", "DistributedJEM", "wrap_ddp", "unwrap",
    "ignore_replay_buffers", "fully_shard_jem", "maybe_no_sync", "params_in_sync", "PerRankState",
    "save_distributed_checkpoint", "load_distributed_checkpoint", "rank_path",
    "DistributedCheckpointer", "select_rank_state", "skip_batches", "FSDP_NOTES",
]

# CheckpointError.reason values of jem_plugin.checkpoint (kept as strings: the same contract).
_CORRUPT, _MISSING, _MISMATCH = "corrupt", "missing", "mismatch"

FSDP_NOTES = (
    "FSDP2 (torch.distributed.fsdp.fully_shard) works with JEMLoss (tested on CPU/gloo) when the "
    "classifier is sharded (fully_shard_jem(jm) = fully_shard(jm.model)), not the JEM; sampling "
    "runs on the sharded module itself and all-gathers the parameters for every SGLD step. FSDP1 "
    "(FullyShardedDataParallel) does not: its pre-backward hooks fail under torch.autograd.grad, "
    "which SGLD uses for input gradients, and JEMLoss does not look through its wrapper."
)


# --------------------------------------------------------------------------- process group
@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank``, ``world_size``, ``local_rank``, its ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise JEMError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(backend: str | None = None, device: str | torch.device | None = None,
                     timeout_seconds: float | None = None) -> DistInfo:
    """Join the process group that ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).

    Without those variables (a plain ``python train.py``) nothing is initialised and a
    single-process :class:`DistInfo` is returned, so the same script runs both ways. ``backend``
    defaults to NCCL when CUDA is used and gloo otherwise; ``device`` defaults to
    ``cuda:LOCAL_RANK`` when CUDA is available, else CPU. Calling it again is harmless.
    """
    world = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())
    if world <= 1:
        return DistInfo(0, 1, 0, device, None)
    if not dist.is_available():
        raise JEMError("this PyTorch build has no torch.distributed; run without torchrun")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    kwargs: dict[str, Any] = {}
    if timeout_seconds is not None:
        import datetime

        kwargs["timeout"] = datetime.timedelta(seconds=timeout_seconds)
    dist.init_process_group(backend=backend, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def cleanup() -> None:
    """Leave the process group (if one was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _initialized() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if _initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if _initialized() and dist.get_world_size() > 1:
        dist.barrier()


# --------------------------------------------------------------------------- seeding
def rank_seed(seed: int, rank: int | None = None) -> int:
    """A seed for ``rank`` derived from ``seed``: distinct per rank, reproducible per run.

    Use it for everything that must differ across ranks (replay-buffer draws, SGLD noise); keep
    the plain ``seed`` for what must agree (model initialisation, ``DistributedSampler``).
    """
    rank = get_rank() if rank is None else rank
    # Golden-ratio stride: seeds of neighbouring ranks (and runs) are far apart.
    return (int(seed) + int(rank) * 0x9E3779B97F4A7C15) % (2**63 - 1)


def rank_generator(seed: int, device: str | torch.device = "cpu", rank: int | None = None) -> torch.Generator:
    """A ``torch.Generator`` seeded with :func:`rank_seed` (pass it to ``SGLD(generator=...)``).

    ``SGLD`` draws the buffer's initial chains, its restarts and the Langevin noise from it, so
    each rank's buffer holds different chains, and the generator's state is part of the
    checkpoint (through the sampler's ``state_dict``).
    """
    return torch.Generator(device=device).manual_seed(rank_seed(seed, rank))


# --------------------------------------------------------------------------- DDP
def unwrap(module: Any) -> Any:
    """The module under DDP / ``DataParallel`` wrappers (any depth); other objects unchanged."""
    while isinstance(module, (DistributedDataParallel, nn.DataParallel)):
        module = module.module
    return module


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
    @property
    def domain(self):
        return self.module.domain

    @property
    def num_classes(self) -> int | None:
        return self.module.num_classes

    @property
    def adapter(self):
        return self.module.adapter

    @property
    def model(self) -> nn.Module:
        return self.module.model

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
    from .buffer import ReplayBuffer

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
    if sync or not hasattr(module, "no_sync"):
        return contextlib.nullcontext()
    return module.no_sync()


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


# --------------------------------------------------------------------------- per-rank state
PER_RANK_FORMAT = "jem-plugin/per-rank/1"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class PerRankState:
    """Make an object's checkpoint hold one state per rank (for one-file checkpoint writers).

    Lightning and Accelerate write a checkpoint from rank 0 only; a replay buffer saved that way
    is rank 0's, and restoring it would give every rank the same chains. Wrap the object instead:
    ``state_dict()`` (which every rank calls while saving) gathers each rank's state to rank 0 as
    ``{"format", "world_size", "states": [state of rank 0, rank 1, ...]}``; ``load_state_dict``
    gives each rank its own entry back. Tensors travel through the CPU. In a single process it
    is a plain container of one state.
    """

    def __init__(self, obj: Any, dst: int = 0) -> None:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"PerRankState needs an object with state_dict()/load_state_dict(), got {type(obj).__name__}")
        self.obj = obj
        self.dst = dst

    def state_dict(self) -> dict[str, Any]:
        state = _to_cpu(self.obj.state_dict())
        world = get_world_size()
        if world == 1:
            return {"format": PER_RANK_FORMAT, "world_size": 1, "states": [state]}
        gathered: list[Any] | None = [None] * world if get_rank() == self.dst else None
        dist.gather_object(state, gathered, dst=self.dst)
        return {"format": PER_RANK_FORMAT, "world_size": world, "states": gathered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(select_rank_state(state))

    def __repr__(self) -> str:
        return f"PerRankState({type(self.obj).__name__})"


def select_rank_state(state: dict[str, Any], rank: int | None = None) -> Any:
    """This rank's entry of a :class:`PerRankState` state (checks the world size)."""
    if not isinstance(state, dict) or state.get("format") != PER_RANK_FORMAT:
        raise CheckpointError(
            "expected a per-rank state written by jem_plugin.distributed.PerRankState; this one was "
            "saved without it (load it with the object's own load_state_dict)")
    world, rank = get_world_size(), get_rank() if rank is None else rank
    states = state.get("states")
    if state.get("world_size") != world or not states or len(states) != world:
        raise CheckpointError(
            f"the checkpoint holds replay-buffer states for {state.get('world_size')} ranks, this run has "
            f"{world}: resume with the same number of processes (torchrun --nproc_per_node="
            f"{state.get('world_size')}), or start the buffers afresh")
    return states[rank]


# --------------------------------------------------------------------------- checkpoints
def rank_path(path: str | os.PathLike, rank: int) -> Path:
    """The per-rank companion file of checkpoint ``path``: ``ckpt-000100.pt`` -> ``ckpt-000100.rank1.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _shared_object(obj: Any) -> Any:
    # Save DDP-wrapped modules without the "module." prefix: the same checkpoint then loads in
    # a single process, and into the wrapper (whose module is the same object) under DDP.
    return unwrap(obj)


def _collective(fn, *args, **kwargs):
    """Run ``fn`` on every rank; if any rank fails, raise on every rank (no rank left waiting).

    Returns ``fn``'s result. A rank that failed re-raises its own exception; the others raise a
    :class:`CheckpointError` naming the failed rank, carrying the same ``reason``.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = exc
    world = get_world_size()
    if world == 1:
        if error is not None:
            raise error
        return result
    mine = None if error is None else (getattr(error, "reason", None), f"{type(error).__name__}: {error}")
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, mine)
    if error is not None:
        raise error
    for r, report in enumerate(reports):
        if report is not None:
            err = CheckpointError(f"rank {r} failed: {report[1]}")
            err.reason = report[0]  # type: ignore[attr-defined]
            raise err
    return result


def save_distributed_checkpoint(path: str | os.PathLike, *, per_rank: dict[str, Any] | None = None,
                                rng: bool = True, **shared: Any) -> Path:
    """Save a checkpoint from every rank: ``shared`` objects once (rank 0), ``per_rank`` ones per rank.

    Call it on every rank with the same arguments. ``shared`` holds what every rank agrees on
    (model, optimizer, scheduler, step); ``per_rank`` what each rank owns (the JEMLoss or replay
    buffer, the sampler, a data generator). Each rank writes ``rank_path(path, rank)`` atomically
    (with its global RNG states when ``rng``); after a barrier rank 0 writes ``path`` (atomically)
    with ``world_size``. ``path`` existing therefore means the whole checkpoint is complete. Needs
    a file system every rank sees. Returns ``path``.
    """
    path = Path(path)
    rank, world = get_rank(), get_world_size()
    for key in ("world_size", "rank"):
        if key in shared or key in (per_rank or {}):
            raise ValueError(f"{key!r} is reserved in distributed checkpoints")
    _collective(save_checkpoint, rank_path(path, rank), rng=rng, rank=rank, world_size=world,
                **(per_rank or {}))
    if rank == 0:
        _collective(save_checkpoint, path, rng=False, world_size=world,
                    **{k: _shared_object(v) for k, v in shared.items()})
    else:
        _collective(lambda: None)
    return path


def load_distributed_checkpoint(path: str | os.PathLike, *, per_rank: dict[str, Any] | None = None,
                                rng: bool = True, map_location: Any = "cpu", strict: bool = True,
                                **shared: Any) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_distributed_checkpoint` on every rank.

    Every rank reads the shared file into ``shared`` and its own rank file into ``per_rank`` (and
    restores its RNG states when ``rng``). Returns the plain values stored (``step`` ...). If any
    rank fails (missing, corrupt, mismatched files, another world size), every rank raises
    :class:`~jem_plugin.errors.CheckpointError`, so no rank is left waiting in a collective.
    """
    path = Path(path)
    rank, world = get_rank(), get_world_size()

    def _load() -> dict[str, Any]:
        extra = load_checkpoint(path, rng=False, map_location=map_location, strict=strict,
                                **{k: _shared_object(v) for k, v in shared.items()})
        saved_world = extra.pop("world_size", None)
        if saved_world != world:
            err = CheckpointError(
                f"checkpoint {str(path)!r} was written by {saved_world} processes, this run has {world}: "
                f"each rank has its own replay buffer, so resume with torchrun --nproc_per_node={saved_world}")
            err.reason = _MISMATCH  # type: ignore[attr-defined]
            raise err
        rfile = rank_path(path, rank)
        if not rfile.exists():
            err = CheckpointError(f"checkpoint {str(path)!r} has no file for rank {rank} ({rfile.name})")
            err.reason = _MISSING  # type: ignore[attr-defined]
            raise err
        local = load_checkpoint(rfile, rng=rng, map_location=map_location, strict=strict, **(per_rank or {}))
        local.pop("rank", None)
        local.pop("world_size", None)
        for key, value in local.items():
            extra.setdefault(key, value)
        return extra

    return _collective(_load)


class DistributedCheckpointer(Checkpointer):
    """:class:`~jem_plugin.checkpoint.Checkpointer` for DDP: shared state once, each rank's own state.

    >>> ckpt = DistributedCheckpointer("runs/ddp", every=100, keep=2)
    >>> start = ckpt.resume(model=jm, optimizer=opt, per_rank={"loss": loss_fn}).get("step", 0)
    >>> ...
    >>> ckpt.maybe_save(step, model=jm, optimizer=opt, per_rank={"loss": loss_fn})

    Call every method on every rank. Files: ``{prefix}-{step:09d}.pt`` (rank 0, written last) and
    ``{prefix}-{step:09d}.rank{r}.pt``; only checkpoints whose rank-0 file exists are listed, and
    rank 0 deletes older ones (and orphaned rank files of interrupted saves) beyond ``keep``.
    The directory must be visible to every rank (a shared file system across nodes).
    """

    def __init__(self, directory: str | os.PathLike, every: int = 1000, keep: int = 2,
                 prefix: str = "ckpt") -> None:
        super().__init__(directory, every=every, keep=keep, prefix=prefix)
        self._rank_pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.rank\d+\.pt")

    def save(self, step: int, *, per_rank: dict[str, Any] | None = None, **objects: Any) -> Path:
        """Save now on every rank (``step`` is stored too); rank 0 then prunes old checkpoints."""
        path = save_distributed_checkpoint(self.path_for(step), per_rank=per_rank, step=step, **objects)
        if get_rank() == 0:
            keep = {s for s, _ in self.checkpoints()[-self.keep:]}
            doomed = [p for s, p in self.checkpoints() if s not in keep]  # rank-0 file first: atomic drop
            for p in self.directory.iterdir():
                m = self._rank_pattern.fullmatch(p.name)
                if m and int(m.group(1)) not in keep:
                    doomed.append(p)
            for old in doomed + self._stale_tmp_files():
                try:
                    old.unlink()
                except OSError:
                    pass
        barrier()  # nobody starts the next save while rank 0 is still pruning
        return path

    def maybe_save(self, step: int, *, per_rank: dict[str, Any] | None = None, **objects: Any) -> Path | None:
        if step % self.every == 0:
            return self.save(step, per_rank=per_rank, **objects)
        return None

    def resume(self, *, per_rank: dict[str, Any] | None = None, **objects: Any) -> dict[str, Any]:
        """Load the newest complete checkpoint on every rank; ``{}`` when there is none.

        Rank 0 decides which checkpoints exist (all ranks then agree even on a lagging file
        system). A newest checkpoint that is unreadable on any rank is skipped (with a warning) on
        all of them; one that does not match the objects raises on every rank.
        """
        steps = [s for s, _ in self.checkpoints()] if get_rank() == 0 else None
        if get_world_size() > 1:
            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        for step in reversed(steps or []):
            try:
                return load_distributed_checkpoint(self.path_for(step), per_rank=per_rank, **objects)
            except CheckpointError as exc:
                if getattr(exc, "reason", None) not in (_CORRUPT, _MISSING):
                    raise
                warnings.warn(f"skipping unusable checkpoint of step {step}: {exc}", RuntimeWarning,
                              stacklevel=2)
        return {}


def skip_batches(loader: Sequence | Any, n: int) -> Iterator[Any]:
    """Iterate ``loader`` from batch ``n`` on (resume in the middle of an epoch).

    The skipped batches are still drawn (so a ``DistributedSampler``'s order, set with
    ``set_epoch``, is the one the interrupted run saw) but not used.
    """
    it = iter(loader)
    for _ in range(n):
        try:
            next(it)
        except StopIteration:
            return
    yield from it
