"""A small, solid trainer for JEM and plain classifiers: :func:`fit` and :func:`evaluate_classifier`.

Used by ``jem train``, ``jem demo`` and the benchmarks; also a reference for writing your own
loop (the JEM part is three lines: ``out = loss_fn(jm, x, y)``, ``out.loss.backward()``,
``optimizer.step()``).

What it adds over a hand-written loop:

* Adam at the paper's 1e-4 with linear warmup (``warmup_iters``) and optional step decay.
* Exact resume: checkpoints (atomic, code-free; :mod:`jem_plugin.checkpoint`) hold the model,
  optimizer, scheduler, loss (replay buffer and sampler), every RNG, the position inside the
  epoch and the history, so a run stopped at any iteration (``max_seconds``, Ctrl-C, SIGKILL)
  continues bit for bit as if it had never stopped.
* A divergence guard (:mod:`jem_plugin.stability`): raise with remedies, or roll back and
  continue with a safer setting.
* A tqdm bar with live metrics, per-epoch metrics in a JSON-serialisable :class:`History`.
* DDP under ``torchrun``: pass ``jdist.wrap_ddp(jm)`` and a loader with a ``DistributedSampler``
  (``set_epoch`` is called for you). Checkpoints then hold the shared state once and each rank's
  own state (replay buffer, sampler, RNGs, running metrics) in per-rank files
  (:class:`~jem_plugin.distributed.DistributedCheckpointer`); stop decisions are agreed across
  ranks; epoch metrics are averaged over the ranks; the bar shows on rank 0 only.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import Checkpointer, get_rng_state, set_rng_state
from .errors import DivergenceError

__all__ = ["fit", "evaluate_classifier", "History", "TrainState", "warmup_schedule"]


# ---------------------------------------------------------------------------- history
@dataclass
class History:
    """Per-epoch metrics of a :func:`fit` run (JSON serialisable with :meth:`to_dict`).

    ``epochs`` holds one dict per finished epoch: ``epoch``, ``loss``, ``ce``, ``acc`` (train,
    on the noisy batches JEM trains on), ``energy_data``/``energy_sample``/``energy_gap`` (JEM),
    ``val_acc``/``val_nll`` (with ``val_data``), ``lr``, ``time`` (training wall seconds, without
    evaluation), ``cpu_time`` (process CPU seconds: comparable across runs on a busy machine) and
    ``iterations``.
    ``history["acc"]`` is the column of one metric. ``events`` records rollbacks and stops;
    ``stopped`` is ``None`` for a complete run, else why it stopped early (``"max_seconds"``,
    ``"callback"``).
    """

    epochs: list[dict[str, float]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None
    total_time: float = 0.0

    def __getitem__(self, metric: str) -> list[float]:
        return [rec[metric] for rec in self.epochs if metric in rec]

    def __len__(self) -> int:
        return len(self.epochs)

    def __contains__(self, metric: str) -> bool:
        return any(metric in rec for rec in self.epochs)

    @property
    def last(self) -> dict[str, float]:
        """The last epoch's metrics (``{}`` before the first epoch)."""
        return dict(self.epochs[-1]) if self.epochs else {}

    def columns(self) -> dict[str, list[float]]:
        """``{metric: [value per epoch]}`` (what :func:`~jem_plugin.viz.plot_training_curves` takes)."""
        keys: list[str] = []
        for rec in self.epochs:
            keys += [k for k in rec if k not in keys]
        return {k: self[k] for k in keys}

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": [dict(r) for r in self.epochs], "events": [dict(e) for e in self.events],
                "stopped": self.stopped, "total_time": self.total_time}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "History":
        return cls(epochs=[dict(r) for r in d.get("epochs", [])],
                   events=[dict(e) for e in d.get("events", [])],
                   stopped=d.get("stopped"), total_time=float(d.get("total_time", 0.0)))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


@dataclass
class TrainState:
    """What callbacks see. Set ``stop = True`` to end training after the current step/epoch."""

    jm: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: nn.Module | None
    history: History
    epoch: int = 0          # epochs finished
    iteration: int = 0      # optimizer steps taken
    metrics: dict[str, float] = field(default_factory=dict)  # last step's metrics
    stop: bool = False


# ---------------------------------------------------------------------------- helpers
def warmup_schedule(warmup_iters: int, iters_per_epoch: int = 1, decay_epochs: Sequence[int] = (),
                    decay_rate: float = 0.3) -> Callable[[int], float]:
    """LR multiplier for iteration ``it``: linear warmup over ``warmup_iters`` (as JEM's code:
    ``(it + 1) / warmup_iters``), times ``decay_rate`` per epoch boundary passed in ``decay_epochs``."""
    decay_epochs = sorted(int(e) for e in decay_epochs)

    def factor(it: int) -> float:
        f = min(1.0, (it + 1) / warmup_iters) if warmup_iters > 0 else 1.0
        epoch = it // max(1, iters_per_epoch)
        return f * decay_rate ** sum(epoch >= e for e in decay_epochs)

    return factor


def _device_of(jm: nn.Module) -> torch.device:
    p = next(jm.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _batch_xy(batch: Any, device: torch.device) -> tuple[Tensor, Tensor]:
    if isinstance(batch, Mapping):
        x, y = batch.get("x", batch.get("pixel_values", batch.get("image"))), batch.get("y", batch.get("labels", batch.get("label")))
    else:
        x, y = batch[0], batch[1]
    if x is None or y is None:
        raise ValueError("the training loader must yield (x, y) pairs or dicts with 'x'/'y' (or 'pixel_values'/'labels')")
    return x.to(device, non_blocking=True), torch.as_tensor(y).to(device, non_blocking=True)


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


def _iter_values(data: Any) -> Iterable[tuple[Tensor, Tensor]]:
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor):
        x, y = data
        for i in range(0, len(x), 512):
            yield x[i:i + 512], y[i:i + 512]
    else:
        for batch in data:
            yield (batch[0], batch[1]) if not isinstance(batch, Mapping) else (batch["x"], batch["y"])


@torch.no_grad()
def evaluate_classifier(jm: nn.Module, x_test: Tensor | Iterable, y_test: Tensor | None = None,
                        batch_size: int = 512) -> dict[str, float]:
    """Accuracy and mean NLL of ``jm`` (any classifier returning logits) on ``(x_test, y_test)``
    tensors or on a loader of ``(x, y)`` batches. The model is evaluated in eval mode and its
    own mode restored."""
    device = _device_of(jm)
    was_training = jm.training
    jm.eval()
    correct, nll, n = 0, 0.0, 0
    try:
        if y_test is not None:
            batches = ((x_test[i:i + batch_size], y_test[i:i + batch_size])
                       for i in range(0, len(x_test), batch_size))
        else:
            batches = _iter_values(x_test)
        for xb, yb in batches:
            xb, yb = xb.to(device), torch.as_tensor(yb).to(device)
            logits = jm(xb)
            correct += int((logits.argmax(1) == yb).sum())
            nll += float(F.cross_entropy(logits.float(), yb, reduction="sum"))
            n += yb.shape[0]
    finally:
        jm.train(was_training)
    if n == 0:
        raise ValueError("evaluate_classifier got no examples")
    return {"accuracy": correct / n, "nll": nll / n, "n": n}


class _Running:
    """Sums of per-step metrics within an epoch (averaged at the epoch's end)."""

    def __init__(self, state: Mapping[str, Any] | None = None) -> None:
        self.sums: dict[str, float] = dict((state or {}).get("sums", {}))
        self.count = int((state or {}).get("count", 0))
        self.seconds = float((state or {}).get("seconds", 0.0))  # training wall time within the epoch
        self.cpu_seconds = float((state or {}).get("cpu_seconds", 0.0))  # process CPU time (robust to load)

    def add(self, metrics: Mapping[str, float]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.count += 1

    def means(self) -> dict[str, float]:
        return {k: v / max(1, self.count) for k, v in self.sums.items()}

    def state(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "count": self.count, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds}


def _call_callbacks(callbacks, hook: str, state: TrainState) -> None:
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is not None:
            fn(state)
        elif hook == "on_epoch_end" and callable(cb) and not hasattr(cb, "on_step_end"):
            cb(state)


def _multi_process() -> bool:
    """True under an initialised process group of more than one rank (DDP under torchrun)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(device: torch.device, *flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks (all_reduce MAX): all ranks stop after the same step, so
    none is left waiting in DDP's gradient all-reduce. Returned unchanged in a single process."""
    if not _multi_process():
        return flags
    import torch.distributed as dist

    t = torch.tensor([float(f) for f in flags],
                     device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def _mean_over_ranks(metrics: Mapping[str, float]) -> dict[str, float]:
    """An epoch's mean metrics averaged over the ranks (each trained on its share of the data)."""
    if not _multi_process():
        return dict(metrics)
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(metrics))  # objects: robust to ranks differing in keys
    return {k: sum(g[k] for g in gathered if k in g) / sum(k in g for g in gathered) for k in metrics}


def _set_epoch(loader: Any, epoch: int) -> None:
    """``DistributedSampler.set_epoch``: a new shuffle each epoch, the same on every rank."""
    sampler = getattr(loader, "sampler", None)
    if callable(getattr(sampler, "set_epoch", None)):
        sampler.set_epoch(epoch)


def _make_guard(policy: str | None, jm, optimizer, scheduler, loss_fn,
                guard_options: Mapping[str, Any] | None):
    if policy is None:
        return None
    from .stability import DivergenceGuard

    return DivergenceGuard(jm, optimizer, loss_fn=loss_fn, policy=policy, scheduler=scheduler,
                           **dict(guard_options or {}))


def _agree_on_divergence(device: torch.device, err: DivergenceError | None,
                         iteration: int) -> DivergenceError | None:
    """Under DDP: a divergence on any rank stops every rank at the same step (before the backward's
    gradient all-reduce, where the healthy ranks would otherwise wait for the one that stopped)."""
    (anywhere,) = _agree(device, err is not None)
    if anywhere and err is None:
        from .stability import REMEDY_TEXT

        err = DivergenceError(f"JEM training diverged at iteration {iteration}: another process diverged "
                              f"at this step (its error names the values); every process stops together. "
                              f"{REMEDY_TEXT}")
        err.iteration = iteration  # type: ignore[attr-defined]
    return err


def _train_step(jm, loss_fn, optimizer, scheduler, x: Tensor, y: Tensor, grad_clip: float | None,
                guard, multi: bool = False) -> dict[str, float]:
    """One optimisation step; returns the step's metrics (python floats)."""
    err = None
    iteration = guard.iteration if guard is not None else 0
    try:
        if loss_fn is not None:
            out = loss_fn(jm, x, y)  # the sampler raises DivergenceError on non-finite chains
            loss, metrics = out.loss, dict(out.metrics)
        else:
            logits = jm(x)
            loss = F.cross_entropy(logits, y)
            ce, acc = torch.stack([loss.detach().float(), (logits.argmax(1) == y).float().mean()]).tolist()
            metrics = {"loss": ce, "ce": ce, "acc": acc}
        if guard is not None:
            guard.check(loss, metrics)  # raises inside the guard's with-block on divergence
    except DivergenceError as exc:
        err = exc
    if multi and guard is not None:
        err = _agree_on_divergence(x.device, err, iteration)
    if err is not None:
        raise err
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(jm.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    return metrics


# ---------------------------------------------------------------------------- fit
def fit(jm: nn.Module, train_loader: Iterable, *, epochs: int,
        optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-4, warmup_iters: int = 1000,
        decay_epochs: Sequence[int] = (), decay_rate: float = 0.3,
        loss_fn: nn.Module | None = None, val_data: Any = None, eval_every: int = 1,
        checkpoint_dir: str | Path | None = None, checkpoint_every: int = 1,
        checkpoint_every_iters: int | None = None, keep_checkpoints: int = 2, resume: bool = True,
        guard_policy: str | None = "raise", guard_options: Mapping[str, Any] | None = None,
        progress: bool = True, callbacks: Sequence[Any] | None = None,
        max_seconds: float | None = None, grad_clip: float | None = None,
        desc: str | None = None) -> History:
    """Train ``jm`` on ``train_loader`` for ``epochs`` epochs; returns the :class:`History`.

    Parameters
    ----------
    jm: the wrapped classifier (``jem_plugin.wrap(model)``); any ``nn.Module`` returning logits
        works for the cross-entropy baseline.
    train_loader: yields ``(x, y)`` batches (a ``DataLoader``; its length is the epoch).
    epochs: total epochs (on resume, the run continues up to this many).
    optimizer: default ``Adam(lr=lr)`` over ``jm``'s parameters (the paper: 1e-4).
    warmup_iters: linear LR warmup over this many iterations (paper: 1000; 0 disables); applied
        to a given ``optimizer`` too. ``decay_epochs``/``decay_rate``: multiply the LR by
        ``decay_rate`` at each of these epochs (paper: 160, 180 and 0.3).
    loss_fn: a :class:`~jem_plugin.losses.JEMLoss` (``out = loss_fn(jm, x, y)``); ``None`` trains
        the plain cross-entropy baseline.
    val_data: ``(x, y)`` tensors or a loader: ``val_acc``/``val_nll`` every ``eval_every`` epochs.
    checkpoint_dir: where to save checkpoints (every ``checkpoint_every`` epochs, and every
        ``checkpoint_every_iters`` iterations if set, keeping ``keep_checkpoints``); with
        ``resume=True`` a run starts from the newest checkpoint there, exactly where it stopped.
    guard_policy: ``"raise"`` (default: :class:`~jem_plugin.errors.DivergenceError` naming the
        remedies at the first non-finite loss or ``|energy| > 1e4``; costs nothing but reading the
        metrics the progress bar shows anyway) or ``"rollback"`` (restore the last good state and
        continue with a safer setting), using :class:`~jem_plugin.stability.DivergenceGuard`
        (``guard_options`` go to it); ``None`` turns the check off.
    progress: a tqdm bar with live metrics.
    callbacks: objects with ``on_step_end(state)`` and/or ``on_epoch_end(state)`` methods, or
        callables ``cb(state)`` called at each epoch end (:class:`TrainState`; set
        ``state.stop = True`` to stop).
    max_seconds: stop cleanly once this much wall time has passed in this call (a checkpoint is
        saved first when ``checkpoint_dir`` is set, so the next call resumes from there).
    grad_clip: clip the parameter gradient norm to this value (off by default).
    """
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0, got {epochs!r}")
    if guard_policy not in (None, "raise", "rollback"):
        raise ValueError(f"guard_policy must be 'raise', 'rollback' or None, got {guard_policy!r}")
    multi = _multi_process()
    if multi and guard_policy == "rollback":
        # A rollback on one rank would leave the others a step ahead (and waiting in DDP's
        # all-reduce): restoring would have to be collective.
        raise ValueError("guard_policy='rollback' is not supported with multiple processes (DDP): "
                         "use guard_policy='raise' (jem train --on-divergence raise) and resume "
                         "from the last checkpoint with a safer setting")
    try:
        iters_per_epoch = len(train_loader)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError("train_loader needs a length (a DataLoader or a list of batches)") from None
    if iters_per_epoch == 0:
        raise ValueError("train_loader is empty: no batches per epoch (check batch_size and drop_last)")
    callbacks = list(callbacks or [])
    device = _device_of(jm)
    start_time = time.perf_counter()

    if optimizer is None:
        optimizer = torch.optim.Adam(jm.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_schedule(warmup_iters, iters_per_epoch, decay_epochs, decay_rate))
    history = History()
    state = TrainState(jm, optimizer, scheduler, loss_fn, history)
    running = _Running()
    epoch_rng: dict[str, Any] | None = None
    skip = 0  # batches of the current epoch already done (mid-epoch resume)

    if checkpoint_dir and multi:
        from .distributed import DistributedCheckpointer

        ckpt = DistributedCheckpointer(checkpoint_dir, every=1, keep=keep_checkpoints)
    else:
        ckpt = Checkpointer(checkpoint_dir, every=1, keep=keep_checkpoints) if checkpoint_dir else None
    # Under DDP each rank owns its loss state (replay buffer, sampler generator), running metrics
    # and RNG/loader states (per-rank files); the rest is shared and written once by rank 0.
    per_rank_keys = ("loss", "running", "epoch_rng", "loader_rng")

    def objects() -> dict[str, Any]:
        objs: dict[str, Any] = {"model": jm, "optimizer": optimizer, "scheduler": scheduler}
        if loss_fn is not None:
            objs["loss"] = loss_fn
        return objs

    def save(batch_in_epoch: int) -> None:
        if ckpt is None:
            return
        hist = history.to_dict()
        hist["total_time"] = history.total_time + (time.perf_counter() - start_time)
        items = dict(**objects(), epoch=state.epoch, batch_in_epoch=batch_in_epoch,
                     running=running.state(), epoch_rng=epoch_rng,
                     loader_rng=[g.get_state() for g in _loader_generators(train_loader)],
                     history=hist, guard=guard.state_dict() if guard is not None else None)
        if multi:
            per_rank = {k: items.pop(k) for k in per_rank_keys if k in items}
            ckpt.save(state.iteration, per_rank=per_rank, **items)
        else:
            ckpt.save(state.iteration, **items)

    resume_rng: dict[str, Any] | None = None
    guard_state: dict[str, Any] | None = None
    if ckpt is not None and resume:
        if multi:
            objs = objects()
            extra = ckpt.resume(per_rank={k: objs.pop(k) for k in per_rank_keys if k in objs}, **objs)
        else:
            extra = ckpt.resume(**objects())
        if extra:
            state.iteration = int(extra["step"])
            state.epoch = int(extra["epoch"])
            skip = int(extra["batch_in_epoch"])
            running = _Running(extra["running"])
            restored = History.from_dict(extra["history"])
            history.epochs, history.events, history.total_time = (
                restored.epochs, restored.events, restored.total_time)
            history.events.append({"event": "resumed", "epoch": state.epoch, "iteration": state.iteration})
            epoch_rng = extra.get("epoch_rng")
            guard_state = extra.get("guard")
            # The loader's own generators (shuffle order) continue where they were, too.
            for g, st in zip(_loader_generators(train_loader), extra.get("loader_rng") or []):
                g.set_state(st)
            if skip:
                # Global RNG is at the checkpoint's moment now; remember it, and the loader's.
                resume_rng = {"global": get_rng_state(), "loader": extra.get("loader_rng") or []}

    guard = _make_guard(guard_policy, jm, optimizer, scheduler, loss_fn, guard_options)
    if guard is not None and guard_state is not None:
        guard.load_state_dict(guard_state)

    bar = None
    if progress and (not multi or torch.distributed.get_rank() == 0):
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs * iters_per_epoch, initial=min(state.iteration, epochs * iters_per_epoch),
                   desc=desc or ("JEM" if loss_fn is not None else "baseline"), dynamic_ncols=True,
                   leave=True)

    jm.train()
    stop_reason: str | None = None
    try:
        while state.epoch < epochs and stop_reason is None:
            if skip and resume_rng is not None and epoch_rng is not None:
                # Replay the interrupted epoch's order: RNG as at the epoch's start, make the
                # iterator, skip the batches already done, then RNG as at the checkpoint.
                set_rng_state(epoch_rng["global"])
                for g, s in zip(_loader_generators(train_loader), epoch_rng["loader"]):
                    g.set_state(s)
                _set_epoch(train_loader, state.epoch)
                it = iter(train_loader)
                for _ in range(skip):
                    next(it)
                set_rng_state(resume_rng["global"])
                for g, s in zip(_loader_generators(train_loader), resume_rng["loader"]):
                    g.set_state(s)
                resume_rng = None
            else:
                skip = 0
                running = _Running()
                epoch_rng = {"global": get_rng_state(),
                             "loader": [g.get_state() for g in _loader_generators(train_loader)]}
                _set_epoch(train_loader, state.epoch)
                it = iter(train_loader)
            for b, batch in enumerate(it, start=skip):
                step_start, step_cpu = time.perf_counter(), time.process_time()
                x, y = _batch_xy(batch, device)
                if guard is None:
                    metrics = _train_step(jm, loss_fn, optimizer, scheduler, x, y, grad_clip, None)
                else:
                    guard.before_step(state.iteration)
                    metrics = None
                    with guard:  # a DivergenceError inside (sampler or check) meets the policy
                        metrics = _train_step(jm, loss_fn, optimizer, scheduler, x, y, grad_clip, guard,
                                              multi=multi)
                    if metrics is None:
                        # rolled back: model, optimizer, scheduler and loss state restored, safer
                        # settings applied; this batch is skipped
                        history.events.append({"event": "rollback", "epoch": state.epoch,
                                               "iteration": state.iteration, **guard.last_event})
                        if bar is not None:
                            bar.write(f"divergence at iteration {state.iteration}: rolled back "
                                      f"({', '.join(guard.last_event.get('changes', []))})")
                        continue
                state.iteration += 1
                state.metrics = metrics
                running.add(metrics)
                if bar is not None:
                    bar.update(1)
                    if state.iteration % 5 == 0 or b == iters_per_epoch - 1:
                        bar.set_postfix(_postfix(metrics, state.epoch + 1, epochs), refresh=False)
                _call_callbacks(callbacks, "on_step_end", state)
                running.seconds += time.perf_counter() - step_start
                running.cpu_seconds += time.process_time() - step_cpu
                done_in_epoch = b + 1
                out_of_time = max_seconds is not None and time.perf_counter() - start_time > max_seconds
                if multi:
                    state.stop, out_of_time = _agree(device, state.stop, out_of_time)
                if (state.stop or out_of_time) and done_in_epoch < iters_per_epoch:
                    stop_reason = "max_seconds" if out_of_time else "callback"
                    save(done_in_epoch)
                    break
                if ckpt is not None and checkpoint_every_iters and state.iteration % checkpoint_every_iters == 0 \
                        and done_in_epoch < iters_per_epoch:
                    save(done_in_epoch)
            if stop_reason is not None:
                break
            # ---- epoch end
            record = {"epoch": state.epoch + 1, **_mean_over_ranks(running.means()),
                      "lr": optimizer.param_groups[0]["lr"],
                      "iterations": running.count}
            if val_data is not None and ((state.epoch + 1) % eval_every == 0 or state.epoch + 1 == epochs):
                # The bare module under DDP (no wrapper forward, no buffer broadcast); every rank
                # evaluates the same parameters, so every rank's history agrees.
                net = _unwrap(jm) if multi else jm
                ev = evaluate_classifier(net, *val_data) if _is_xy(val_data) else evaluate_classifier(net, val_data)
                record["val_acc"], record["val_nll"] = ev["accuracy"], ev["nll"]
            record["time"] = running.seconds
            record["cpu_time"] = running.cpu_seconds
            history.epochs.append(record)
            state.epoch += 1
            skip = 0
            if bar is not None:
                bar.set_postfix(_postfix(record, state.epoch, epochs), refresh=True)
            _call_callbacks(callbacks, "on_epoch_end", state)
            out_of_time = max_seconds is not None and time.perf_counter() - start_time > max_seconds
            if multi:
                state.stop, out_of_time = _agree(device, state.stop, out_of_time)
            if ckpt is not None and (state.epoch % checkpoint_every == 0 or state.epoch == epochs
                                     or out_of_time or state.stop):
                running = _Running()
                save(0)
            if state.epoch < epochs and (out_of_time or state.stop):
                stop_reason = "max_seconds" if out_of_time else "callback"
    finally:
        if bar is not None:
            bar.close()
    history.stopped = stop_reason
    history.total_time += time.perf_counter() - start_time
    if stop_reason is not None:
        history.events.append({"event": "stopped", "reason": stop_reason, "epoch": state.epoch,
                               "iteration": state.iteration})
    return history


def _unwrap(module: nn.Module) -> nn.Module:
    from .distributed import unwrap

    return unwrap(module)


def _is_xy(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor)


def _postfix(metrics: Mapping[str, float], epoch: int, epochs: int) -> dict[str, str]:
    out = {"ep": f"{epoch}/{epochs}"}
    for key, label in (("loss", "loss"), ("acc", "acc"), ("val_acc", "val"), ("energy_gap", "gap")):
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            out[label] = f"{metrics[key]:.3g}"
    return out
