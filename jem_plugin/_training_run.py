"""The named pieces of :func:`jem_plugin.training.fit` (private): running metrics, agreement
between processes, checkpoints and exact resume, the epoch's batches, progress and logging.

Each piece is small and does one thing; ``fit`` is the loop that strings them together.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ._train_state import History, TrainState
from .checkpoint import Checkpointer, get_rng_state, set_rng_state
from .distributed import DistributedCheckpointer
from .errors import DivergenceError
from .stability import DIVERGENCE_REMEDIES

_log = logging.getLogger("jem_plugin.training")


# ---------------------------------------------------------------------------- loader state, running metrics
def _loader_generators(loader: Any) -> list[torch.Generator]:
    """Every distinct torch.Generator that decides the loader's order (shuffle, worker seeds)."""
    gens: list[torch.Generator] = []
    cands = [getattr(loader, "generator", None), getattr(getattr(loader, "sampler", None), "generator", None)]
    bs = getattr(loader, "batch_sampler", None)
    cands.append(getattr(getattr(bs, "sampler", None), "generator", None))
    for g in cands:
        if isinstance(g, torch.Generator) and all(g is not h for h in gens):
            gens.append(g)
    return gens


class _Running:
    """Sums of per-step metrics within an epoch (averaged at the epoch's end), with the epoch's
    training time and images seen (throughput)."""

    def __init__(self, state: Mapping[str, Any] | None = None) -> None:
        state = state or {}
        self.sums: dict[str, float] = dict(state.get("sums", {}))
        self.count = int(state.get("count", 0))
        self.images = int(state.get("images", 0))
        self.seconds = float(state.get("seconds", 0.0))  # training wall time within the epoch
        self.cpu_seconds = float(state.get("cpu_seconds", 0.0))  # process CPU time (robust to load)

    def add(self, metrics: Mapping[str, float], images: int) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.count += 1
        self.images += images

    def tock(self, tick: tuple[float, float]) -> None:
        """Add the time since ``tick = (time.perf_counter(), time.process_time())``."""
        self.seconds += time.perf_counter() - tick[0]
        self.cpu_seconds += time.process_time() - tick[1]

    def means(self) -> dict[str, float]:
        return {k: v / max(1, self.count) for k, v in self.sums.items()}

    def throughput(self, remaining_iters: int) -> dict[str, float]:
        """Images per second, ms per iteration and the projected seconds for ``remaining_iters``."""
        if not self.count or self.seconds <= 0:
            return {}
        per_iter = self.seconds / self.count
        return {
            "img_per_s": self.images / self.seconds,
            "ms_per_iter": 1000.0 * per_iter,
            "remaining_s": per_iter * max(0, remaining_iters),
        }

    def state(self) -> dict[str, Any]:
        return {
            "sums": dict(self.sums),
            "count": self.count,
            "images": self.images,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
        }


def _tick() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


# ---------------------------------------------------------------------------- multi-process agreement
def _multi_process() -> bool:
    """True under an initialised process group of more than one rank (DDP under torchrun)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(device: torch.device, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks (all_reduce MAX): all ranks stop after the same step, so
    none is left waiting in DDP's gradient all-reduce. Returned unchanged in a single process."""
    if not _multi_process():
        return flags
    t = torch.tensor([float(f) for f in flags], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def _stop_reason(state: TrainState, start: float, max_seconds: float | None, device: torch.device) -> str | None:
    """``"max_seconds"``, ``"callback"`` (``state.stop``) or ``None``, agreed over the ranks."""
    out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
    state.stop, out_of_time = _agree(device, state.stop, out_of_time)
    return "max_seconds" if out_of_time else "callback" if state.stop else None


def _mean_over_ranks(metrics: Mapping[str, float]) -> dict[str, float]:
    """An epoch's mean metrics averaged over the ranks (each trained on its share of the data)."""
    if not _multi_process():
        return dict(metrics)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(metrics))  # objects: robust to ranks differing in keys
    return {k: sum(g[k] for g in gathered if k in g) / sum(k in g for g in gathered) for k in metrics}


def _set_epoch(loader: Any, epoch: int) -> None:
    """``DistributedSampler.set_epoch``: a new shuffle each epoch, the same on every rank."""
    set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _agree_on_divergence(device: torch.device, err: DivergenceError | None, iteration: int) -> DivergenceError | None:
    """Under DDP: a divergence on any rank stops every rank at the same step (before the backward's
    gradient all-reduce, where the healthy ranks would otherwise wait for the one that stopped)."""
    (anywhere,) = _agree(device, err is not None)
    if anywhere and err is None:
        err = DivergenceError(
            "another process diverged at this step (its error names the values); every process stops together",
            remedies=DIVERGENCE_REMEDIES,
            iteration=iteration,
        )
    return err


# ---------------------------------------------------------------------------- checkpoints and resume
@dataclass
class _Position:
    """Where the run stands inside the current epoch (saved in checkpoints, restored on resume)."""

    running: _Running = field(default_factory=_Running)
    epoch_rng: dict[str, Any] | None = None  # RNG states at the epoch's start (replays its order)
    skip: int = 0  # batches of the epoch already done (mid-epoch resume)
    resume_rng: dict[str, Any] | None = None  # RNG states at the checkpoint, set after the replay
    guard: dict[str, Any] | None = None
    resumed: bool = False  # restored from a checkpoint


class _Checkpoints:
    """fit's checkpoints: what goes in (shared state; each rank's own state in per-rank files
    under DDP), when (every ``every`` iterations and at epoch ends), and resume."""

    # Under DDP each rank owns its loss state (replay buffer, sampler generator), running metrics
    # and RNG/loader states; the rest is shared and written once by rank 0.
    PER_RANK = ("loss", "running", "epoch_rng", "loader_rng")

    def __init__(
        self,
        directory: str | Path | None,
        *,
        every: int | None,
        keep: int,
        loader: Any,
        objects: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint_every must be an int >= 1 (iterations) or None, got {every!r}")
        self.every, self.multi, self.loader = every, _multi_process(), loader
        self.objects = {k: v for k, v in objects.items() if v is not None}  # no loss_fn, no scaler
        self.config = dict(config) if config is not None else None  # the recipe, as plain data
        self.ckpt: Checkpointer | None = None
        if directory and self.multi:
            self.ckpt = DistributedCheckpointer(directory, every=1, keep=keep)
        elif directory:
            self.ckpt = Checkpointer(directory, every=1, keep=keep)

    def due(self, iteration: int) -> bool:
        return self.ckpt is not None and self.every is not None and iteration % self.every == 0

    def save(self, state: TrainState, pos: _Position, batch_in_epoch: int, guard, start: float) -> None:
        if self.ckpt is None:
            return
        hist = state.history.to_dict()
        hist["total_time"] = state.history.total_time + (time.perf_counter() - start)
        items = dict(
            **self.objects,
            epoch=state.epoch,
            batch_in_epoch=batch_in_epoch,
            running=pos.running.state(),
            epoch_rng=pos.epoch_rng,
            loader_rng=[g.get_state() for g in _loader_generators(self.loader)],
            history=hist,
            guard=guard.state_dict() if guard is not None else None,
            config=self.config,
        )
        if self.multi:
            per_rank = {k: items.pop(k) for k in self.PER_RANK if k in items}
            self.ckpt.save(state.iteration, per_rank=per_rank, **items)
        else:
            self.ckpt.save(state.iteration, **items)

    def resume(self, state: TrainState) -> _Position:
        """Restore the newest checkpoint (if any) into the objects and ``state``; where it stopped."""
        if self.ckpt is None:
            return _Position()
        objs = dict(self.objects)
        if self.multi:
            per_rank = {k: objs.pop(k) for k in self.PER_RANK if k in objs}
            extra = self.ckpt.resume(per_rank=per_rank, **objs)
        else:
            extra = self.ckpt.resume(**objs)
        if not extra:
            return _Position()
        _warn_if_config_changed(extra.get("config"), self.config)
        state.iteration, state.epoch = int(extra["step"]), int(extra["epoch"])
        restored = type(state.history).from_dict(extra["history"])
        h = state.history
        h.epochs, h.events, h.total_time = restored.epochs, restored.events, restored.total_time
        h.events.append({"event": "resumed", "epoch": state.epoch, "iteration": state.iteration})
        pos = _Position(
            _Running(extra["running"]),
            extra.get("epoch_rng"),
            int(extra["batch_in_epoch"]),
            guard=extra.get("guard"),
            resumed=True,
        )
        # The loader's own generators (shuffle order) continue where they were, too.
        for g, st in zip(_loader_generators(self.loader), extra.get("loader_rng") or []):
            g.set_state(st)
        if pos.skip:
            # Global RNG is at the checkpoint's moment now; remember it, and the loader's.
            pos.resume_rng = {"global": get_rng_state(), "loader": extra.get("loader_rng") or []}
        return pos


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _warn_if_config_changed(saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> None:
    """A run resumed under a recipe other than the one that wrote its checkpoint: say which
    settings differ (the tensor state is restored either way)."""
    if saved is None or current is None:
        return
    a, b = _flatten(saved), _flatten(current)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in ("summary",))
    if changed:
        _log.warning(
            "resuming a run written with different recipe settings: %s",
            ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in changed),
        )


# ---------------------------------------------------------------------------- the epoch's batches
def _epoch_batches(loader: Any, epoch: int, pos: _Position) -> Iterator[tuple[int, Any]]:
    """``(index, batch)`` for the epoch. After a mid-epoch resume the interrupted epoch's order is
    replayed (RNG as at the epoch's start, the batches already done skipped, then RNG as at the
    checkpoint); otherwise a fresh epoch starts and its RNG states are remembered."""
    gens = _loader_generators(loader)
    if pos.skip and pos.resume_rng is not None and pos.epoch_rng is not None:
        set_rng_state(pos.epoch_rng["global"])
        for g, s in zip(gens, pos.epoch_rng["loader"]):
            g.set_state(s)
        _set_epoch(loader, epoch)
        it = iter(loader)
        for _ in range(pos.skip):
            next(it)
        set_rng_state(pos.resume_rng["global"])
        for g, s in zip(gens, pos.resume_rng["loader"]):
            g.set_state(s)
        pos.resume_rng = None
    else:
        pos.skip, pos.running = 0, _Running()
        pos.epoch_rng = {"global": get_rng_state(), "loader": [g.get_state() for g in gens]}
        _set_epoch(loader, epoch)
        it = iter(loader)
    return enumerate(it, start=pos.skip)


def _epoch_record(state: TrainState, running: _Running, remaining_iters: int) -> dict[str, float]:
    """The finished epoch's metrics: means over its steps (and the ranks), LR, throughput, times."""
    means = _mean_over_ranks({**running.means(), **running.throughput(remaining_iters)})
    return {
        "epoch": state.epoch + 1,
        **means,
        "lr": state.optimizer.param_groups[0]["lr"],
        "iterations": running.count,
        "time": running.seconds,
        "cpu_time": running.cpu_seconds,
    }


# ---------------------------------------------------------------------------- progress and logging
def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _postfix(metrics: Mapping[str, float], epoch: int, epochs: int) -> dict[str, str]:
    out = {"ep": f"{epoch}/{epochs}"}
    for key, label in (
        ("loss", "loss"),
        ("acc", "acc"),
        ("val_acc", "val"),
        ("energy_gap", "gap"),
        ("img_per_s", "img/s"),
        ("ms_per_iter", "ms/it"),
    ):
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            out[label] = f"{metrics[key]:.3g}"
    if "remaining_s" in metrics:
        out["left"] = _duration(metrics["remaining_s"])
    return out


class _Progress:
    """The tqdm bar (rank 0 only) with live metrics and throughput, and announcements, which go
    to the ``jem_plugin.training`` logger and onto the bar."""

    def __init__(self, enabled: bool, *, epochs: int, iters_per_epoch: int, iteration: int, desc: str) -> None:
        self.epochs, self.iters, self.total = epochs, iters_per_epoch, epochs * iters_per_epoch
        self.bar = None
        if enabled and (not _multi_process() or dist.get_rank() == 0):
            self.bar = tqdm(
                total=self.total, initial=min(iteration, self.total), desc=desc, dynamic_ncols=True, leave=True
            )

    def announce(self, message: str) -> None:
        _log.info(message)
        if self.bar is not None:
            self.bar.write(message)

    def step(self, state: TrainState, running: _Running, last_in_epoch: bool) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if state.iteration % 5 == 0 or last_in_epoch:
            shown = {**state.metrics, **running.throughput(self.total - state.iteration)}
            self.bar.set_postfix(_postfix(shown, state.epoch + 1, self.epochs), refresh=False)

    def epoch_end(self, record: Mapping[str, float], epoch: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix(_postfix(record, epoch, self.epochs), refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _note_rollback(state: TrainState, guard, log: _Progress) -> None:
    state.history.events.append(
        {"event": "rollback", "epoch": state.epoch, "iteration": state.iteration, **guard.last_event}
    )
    log.announce(
        f"divergence at iteration {state.iteration}: rolled back ({', '.join(guard.last_event.get('changes', []))})"
    )


def _finish(state: TrainState, reason: str | None, start: float) -> History:
    history = state.history
    history.stopped = reason
    history.total_time += time.perf_counter() - start
    if reason is not None:
        history.events.append(
            {"event": "stopped", "reason": reason, "epoch": state.epoch, "iteration": state.iteration}
        )
    return history
