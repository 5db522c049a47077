"""The process group: joining torchrun's, rank and world size, per-rank seeds."""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import JEMError


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


def init_distributed(
    backend: str | None = None, device: str | torch.device | None = None, timeout_seconds: float | None = None
) -> DistInfo:
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
    """Leave the process group (if one was joined). Garbage (a DDP wrapper and its reducer, in
    reference cycles) is collected first, while the interpreter is whole: gloo work freed during
    interpreter shutdown can abort a process whose run had finished (pytorch/pytorch#179291)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
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
