"""Checkpoints across ranks: shared state once, each rank's own state (replay buffer, RNGs) per rank."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ..checkpoint import Checkpointer, load_checkpoint, save_checkpoint
from ..errors import CheckpointError
from ._ddp import unwrap
from ._group import barrier, get_rank, get_world_size

# CheckpointError.reason values of jem_plugin.checkpoint (kept as strings: the same contract).
_CORRUPT, _MISSING, _MISMATCH = "corrupt", "missing", "mismatch"

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
        # Any object with state (a replay buffer, a loss, the user's own): duck-typed.
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"PerRankState needs an object with state_dict()/load_state_dict(), got {type(obj).__name__}"
            )
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
            "saved without it (load it with the object's own load_state_dict)"
        )
    world, rank = get_world_size(), get_rank() if rank is None else rank
    states = state.get("states")
    if state.get("world_size") != world or not states or len(states) != world:
        raise CheckpointError(
            f"the checkpoint holds replay-buffer states for {state.get('world_size')} ranks, this run has "
            f"{world}: resume with the same number of processes (torchrun --nproc_per_node="
            f"{state.get('world_size')}), or start the buffers afresh"
        )
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
    reason = error.reason if isinstance(error, CheckpointError) else None
    mine = None if error is None else (reason, f"{type(error).__name__}: {error}")
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, mine)
    if error is not None:
        raise error
    for r, report in enumerate(reports):
        if report is not None:
            raise CheckpointError(f"rank {r} failed: {report[1]}", reason=report[0])
    return result


def save_distributed_checkpoint(
    path: str | os.PathLike, *, per_rank: dict[str, Any] | None = None, rng: bool = True, **shared: Any
) -> Path:
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
    _collective(save_checkpoint, rank_path(path, rank), rng=rng, rank=rank, world_size=world, **(per_rank or {}))
    if rank == 0:
        _collective(
            save_checkpoint, path, rng=False, world_size=world, **{k: _shared_object(v) for k, v in shared.items()}
        )
    else:
        _collective(lambda: None)
    return path


def load_distributed_checkpoint(
    path: str | os.PathLike,
    *,
    per_rank: dict[str, Any] | None = None,
    rng: bool = True,
    map_location: Any = "cpu",
    strict: bool = True,
    **shared: Any,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_distributed_checkpoint` on every rank.

    Every rank reads the shared file into ``shared`` and its own rank file into ``per_rank`` (and
    restores its RNG states when ``rng``). Returns the plain values stored (``step`` ...). If any
    rank fails (missing, corrupt, mismatched files, another world size), every rank raises
    :class:`~jem_plugin.errors.CheckpointError`, so no rank is left waiting in a collective.
    """
    path = Path(path)
    rank, world = get_rank(), get_world_size()

    def _load() -> dict[str, Any]:
        extra = load_checkpoint(
            path,
            rng=False,
            map_location=map_location,
            strict=strict,
            **{k: _shared_object(v) for k, v in shared.items()},
        )
        saved_world = extra.pop("world_size", None)
        if saved_world != world:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was written by {saved_world} processes, this run has {world}: "
                f"each rank has its own replay buffer, so resume with torchrun --nproc_per_node={saved_world}",
                reason=_MISMATCH,
            )
        rfile = rank_path(path, rank)
        if not rfile.exists():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no file for rank {rank} ({rfile.name})", reason=_MISSING
            )
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

    def __init__(self, directory: str | os.PathLike, every: int = 1000, keep: int = 2, prefix: str = "ckpt") -> None:
        super().__init__(directory, every=every, keep=keep, prefix=prefix)
        self._rank_pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.rank\d+\.pt")

    def save(self, step: int, *, per_rank: dict[str, Any] | None = None, **objects: Any) -> Path:
        """Save now on every rank (``step`` is stored too); rank 0 then prunes old checkpoints."""
        path = save_distributed_checkpoint(self.path_for(step), per_rank=per_rank, step=step, **objects)
        if get_rank() == 0:
            keep = {s for s, _ in self.checkpoints()[-self.keep :]}
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
                if exc.reason not in (_CORRUPT, _MISSING):
                    raise
                warnings.warn(f"skipping unusable checkpoint of step {step}: {exc}", RuntimeWarning, stacklevel=2)
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
