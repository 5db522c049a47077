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

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import model_device, unpack_batch, unwrap_parallel
from ._train_state import History, TrainState
from ._training_run import (
    _agree_on_divergence,
    _Checkpoints,
    _epoch_batches,
    _epoch_record,
    _finish,
    _multi_process,
    _note_rollback,
    _Position,
    _Progress,
    _Running,
    _stop_reason,
    _tick,
)
from .errors import DivergenceError, InvalidInputError
from .extensions import Extension, as_extension
from .recipes import JEMSetup, OptimConfig, Recipe
from .stability import DivergenceGuard

__all__ = ["fit", "FitOptions", "evaluate_classifier", "History", "TrainState", "warmup_schedule"]


# ---------------------------------------------------------------------------- helpers
def warmup_schedule(
    warmup_iters: int, iters_per_epoch: int = 1, decay_epochs: Sequence[int] = (), decay_rate: float = 0.3
) -> Callable[[int], float]:
    """LR multiplier for iteration ``it``: linear warmup over ``warmup_iters`` (as JEM's code:
    ``(it + 1) / warmup_iters``), times ``decay_rate`` per epoch boundary passed in ``decay_epochs``."""
    decay_epochs = sorted(int(e) for e in decay_epochs)

    def factor(it: int) -> float:
        f = min(1.0, (it + 1) / warmup_iters) if warmup_iters > 0 else 1.0
        epoch = it // max(1, iters_per_epoch)
        return f * decay_rate ** sum(epoch >= e for e in decay_epochs)

    return factor


def _batch_xy(batch: Any, device: torch.device) -> tuple[Tensor, Tensor]:
    x, y = unpack_batch(batch, need_labels=True)
    return x.to(device, non_blocking=True), torch.as_tensor(y).to(device, non_blocking=True)


def _is_xy(data: Any) -> bool:
    return isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor)


def _iter_values(data: Any) -> Iterable[tuple[Tensor, Tensor]]:
    if _is_xy(data):
        x, y = data
        for i in range(0, len(x), 512):
            yield x[i : i + 512], y[i : i + 512]
    else:
        for batch in data:
            x, y = unpack_batch(batch, need_labels=True)
            assert y is not None  # need_labels=True refuses batches without labels
            yield x, y


@torch.no_grad()
def evaluate_classifier(
    jm: nn.Module, x_test: Tensor | Iterable, y_test: Tensor | None = None, batch_size: int = 512
) -> dict[str, float]:
    """Accuracy and mean NLL of ``jm`` (any classifier returning logits) on ``(x_test, y_test)``
    tensors or on a loader of ``(x, y)`` batches. The model is evaluated in eval mode and its
    own mode restored."""
    device = model_device(jm) or torch.device("cpu")
    was_training = jm.training
    jm.eval()
    correct, nll, n = 0, 0.0, 0
    try:
        batches: Iterable[tuple[Tensor, Tensor]]
        if y_test is not None:
            if not isinstance(x_test, Tensor):
                raise TypeError(f"x_test must be a tensor when y_test is given, got {type(x_test).__name__}")
            batches = (
                (x_test[i : i + batch_size], y_test[i : i + batch_size]) for i in range(0, len(x_test), batch_size)
            )
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


# ---------------------------------------------------------------------------- one step
_AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_args(epochs: Any, guard_policy: Any, amp: Any, device: torch.device, multi: bool) -> None:
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0, got {epochs!r}")
    if guard_policy not in (None, "raise", "rollback"):
        raise ValueError(f"guard_policy must be 'raise', 'rollback' or None, got {guard_policy!r}")
    if amp not in _AMP:
        raise ValueError(f"amp must be 'off', 'bf16' or 'fp16', got {amp!r}")
    if amp == "fp16" and device.type != "cuda":
        raise ValueError(
            f"amp='fp16' needs a CUDA model (gradient scaling), the model is on {device}: "
            "use amp='bf16', which needs no scaler and runs on the CPU too"
        )
    if multi and guard_policy == "rollback":
        # A rollback on one rank would leave the others a step ahead (and waiting in DDP's
        # all-reduce): restoring would have to be collective.
        raise ValueError(
            "guard_policy='rollback' is not supported with multiple processes (DDP): "
            "use guard_policy='raise' (jem train --on-divergence raise) and resume "
            "from the last checkpoint with a safer setting"
        )


def _iters_per_epoch(loader: Any) -> int:
    try:
        n = len(loader)
    except TypeError:
        raise TypeError("train_loader needs a length (a DataLoader or a list of batches)") from None
    if n == 0:
        raise ValueError("train_loader is empty: no batches per epoch (check batch_size and drop_last)")
    return n


def _make_guard(
    policy: str | None, state: TrainState, options: Mapping[str, Any] | None, saved: Mapping[str, Any] | None
):
    """The :class:`~jem_plugin.stability.DivergenceGuard` for ``policy`` (its ``saved`` state restored)."""
    if policy is None:
        return None
    guard = DivergenceGuard(
        state.jm,
        state.optimizer,
        loss_fn=state.loss_fn,
        policy=policy,
        scheduler=state.scheduler,
        **dict(options or {}),
    )
    if saved is not None:
        guard.load_state_dict(dict(saved))
    return guard


class _Step:
    """One optimisation step on a batch: to the device (channels_last for images), the extensions'
    ``on_batch``, the loss under autocast, the divergence guard (agreed over the ranks), backward
    (scaled for fp16), gradient-norm clipping, the optimiser (or the extension that takes the step,
    e.g. SAM) and the scheduler. Returns the step's metrics, ``None`` after a rollback."""

    def __init__(
        self, state: TrainState, options: FitOptions, extensions: Sequence[Extension], max_grad_norm: float | None
    ) -> None:
        jm = state.jm
        self.state, self.jm, self.loss_fn = state, jm, state.loss_fn
        self.optimizer, self.scheduler = state.optimizer, state.scheduler
        self.device, self.dtype, self.channels_last = (
            (model_device(jm) or torch.device("cpu")),
            _AMP[options.amp],
            options.channels_last,
        )
        self.extensions = list(extensions)
        takers = [e for e in self.extensions if e.takes_step]
        if len(takers) > 1:
            raise InvalidInputError(f"at most one extension may take the optimiser step, got {takers}")
        self.taker = takers[0] if takers else None
        if self.taker is not None and options.amp == "fp16":
            raise InvalidInputError(
                f"{self.taker!r} takes two passes per step, which fp16 gradient scaling does not support: use amp='bf16'"
            )
        self.grad_clip, self.multi, self.guard, self.batch_size = max_grad_norm, _multi_process(), None, 0
        self.scaler = torch.amp.GradScaler("cuda") if options.amp == "fp16" else None
        if self.channels_last:
            jm.to(memory_format=torch.channels_last)  # 4-D weights only; the rest is unchanged
        jm.train()

    def __call__(self, batch: Any, iteration: int) -> dict[str, float] | None:
        x, y = _batch_xy(batch, self.device)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        self.batch_size = int(x.shape[0])
        for ext in self.extensions:
            ext.on_batch(self.state, x, y)
        if self.guard is None:
            return self._run(x, y)
        self.guard.before_step(iteration)
        metrics = None
        with self.guard:  # a DivergenceError inside (sampler or check) meets the policy
            metrics = self._run(x, y)
        return metrics

    def _loss(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, float]]:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            if self.loss_fn is not None:
                out = self.loss_fn(self.jm, x, y)  # the sampler raises DivergenceError on non-finite chains
                return out.loss, dict(out.metrics)
            logits = self.jm(x)
            loss = F.cross_entropy(logits, y)
        ce, acc = torch.stack([loss.detach().float(), (logits.argmax(1) == y).float().mean()]).tolist()
        return loss, {"loss": ce, "ce": ce, "acc": acc}

    def _checked_loss(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The loss, checked by the guard; a divergence on any rank stops every rank here."""
        err, guard = None, self.guard
        iteration = guard.iteration if guard is not None else 0  # before check() counts this step
        try:
            loss, metrics = self._loss(x, y)
            if guard is not None:
                guard.check(loss, metrics)  # raises inside the guard's with-block on divergence
        except DivergenceError as exc:
            err = exc
        if self.multi and guard is not None:
            err = _agree_on_divergence(x.device, err, iteration)
        if err is not None:
            raise err
        return loss, metrics

    def _backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.jm.parameters(), self.grad_clip)

    def _run(self, x: Tensor, y: Tensor) -> dict[str, float]:
        if self.taker is not None:
            passes: list[dict[str, float]] = []

            def closure() -> dict[str, float]:
                loss, metrics = (self._loss if passes else self._checked_loss)(x, y)
                self._backward(loss)
                passes.append(metrics)
                return metrics

            metrics = self.taker.run_step(self.state, closure)
            self.scheduler.step()
            return metrics
        loss, metrics = self._checked_loss(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        self._backward(loss)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return metrics


# ---------------------------------------------------------------------------- validation
def _validate(jm: nn.Module, val_data: Any, multi: bool) -> dict[str, float]:
    """``val_acc``/``val_nll`` on ``val_data``. Under DDP the bare module (no wrapper forward, no
    buffer broadcast); every rank evaluates the same parameters, so every rank's history agrees."""
    if multi:
        jm = unwrap_parallel(jm)
    ev = evaluate_classifier(jm, *val_data) if _is_xy(val_data) else evaluate_classifier(jm, val_data)
    return {"val_acc": ev["accuracy"], "val_nll": ev["nll"]}


# ---------------------------------------------------------------------------- fit
@dataclass(frozen=True)
class FitOptions:
    """How :func:`fit` runs, as opposed to what it trains (the recipe): validation, checkpoints,
    the divergence guard, precision, progress and time.

    ``eval_every``: validate every this many epochs (and after the last). Checkpoints go to
    ``checkpoint_dir`` at every epoch end and every ``checkpoint_every`` iterations
    (``keep_checkpoints`` kept); with ``resume`` a run continues exactly where the newest one
    stopped, and says so. ``guard_policy``: ``"raise"`` (a :class:`~jem_plugin.errors.DivergenceError`
    naming the remedies), ``"rollback"`` (restore and continue with a safer setting;
    ``guard_options`` go to :class:`~jem_plugin.stability.DivergenceGuard`) or ``None``. ``amp``:
    ``"off"``, ``"bf16"`` (autocast; CPU too) or ``"fp16"`` (CUDA, with a ``GradScaler``);
    ``channels_last`` puts the model and 4-D inputs in that memory format. ``progress``: a tqdm bar
    with metrics, images/s, ms/iteration and the time left; ``desc`` its label. ``max_seconds``:
    stop cleanly (after a checkpoint) once this much time has passed. ``decay_epochs`` /
    ``decay_rate``: the learning rate times ``decay_rate`` at each of these epochs.
    """

    eval_every: int = 1
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    resume: bool = True
    guard_policy: str | None = "raise"
    guard_options: Mapping[str, Any] | None = None
    amp: str = "off"
    channels_last: bool = False
    progress: bool = True
    max_seconds: float | None = None
    desc: str | None = None
    decay_epochs: tuple[int, ...] = ()
    decay_rate: float = 0.3


def fit(
    jm: nn.Module,
    train_loader: Iterable,
    recipe: Recipe | JEMSetup | None = None,
    *,
    epochs: int,
    optimizer: torch.optim.Optimizer | OptimConfig | None = None,
    loss_fn: nn.Module | None = None,
    val_data: Any = None,
    callbacks: Sequence[Any] | None = None,
    options: FitOptions | None = None,
) -> History:
    """Train ``jm`` (``jem_plugin.wrap(model)``, or any classifier for the cross-entropy baseline)
    on ``train_loader`` (``(x, y)`` batches; its length is the epoch) up to ``epochs`` epochs.

    ``recipe``: a :class:`~jem_plugin.recipes.Recipe` (built here on ``train_loader``'s data for a
    run of this length: sampler, buffer, loss, optimiser, warm-up, extensions such as SAM and the
    BatchNorm statistics recomputed from the data), a :class:`~jem_plugin.recipes.JEMSetup` you
    built, or ``None`` with your own ``loss_fn`` (a :class:`~jem_plugin.JEMLoss`; ``None`` trains the
    cross-entropy baseline). ``optimizer``: without a recipe, a ``torch.optim`` optimiser or an
    :class:`~jem_plugin.recipes.OptimConfig` (default: Adam 1e-4, a warm-up of 1000 iterations
    capped to a tenth of the run). ``val_data`` (``(x, y)`` tensors or a loader) gives
    ``val_acc``/``val_nll``. ``callbacks``: :class:`~jem_plugin.extensions.Extension` objects, run after
    the recipe's at the same named points; an object with some of their methods
    (``on_step_end(state)``, ``on_epoch_end(state)``, ...) or a callable ``fn(state)`` (at each epoch
    end) is one too (:func:`~jem_plugin.extensions.as_extension`; ``state.stop = True`` stops).
    ``options``: :class:`FitOptions` (checkpoints and exact resume, the divergence guard, precision,
    progress, a time limit).
    """
    setup, extensions = None, []
    if isinstance(recipe, (Recipe, JEMSetup)) and (loss_fn is not None or optimizer is not None):
        raise InvalidInputError(
            "fit(): a recipe brings its own loss and optimiser; give either recipe= or loss_fn=/optimizer="
        )
    if recipe is not None and not isinstance(recipe, (Recipe, JEMSetup)):
        raise InvalidInputError(f"fit(): recipe must be a Recipe or a JEMSetup, got {type(recipe).__name__}")
    options = options or FitOptions()
    device, multi = (model_device(jm) or torch.device("cpu")), _multi_process()
    _check_args(epochs, options.guard_policy, options.amp, device, multi)
    iters, start = _iters_per_epoch(train_loader), time.perf_counter()
    # Training's one extension mechanism: the callbacks are extensions, after the recipe's.
    extras = [as_extension(c) for c in callbacks or ()]
    if isinstance(recipe, Recipe):
        recipe = recipe.build(
            jm, train_loader, total_iters=epochs * iters, batch_size=getattr(train_loader, "batch_size", None)
        )
    opt: torch.optim.Optimizer
    if isinstance(recipe, JEMSetup):
        setup = recipe
        loss_fn, extensions, warmup = setup.loss, list(setup.extensions) + extras, setup.warmup_iters
        opt, max_grad_norm = setup.optimizer, setup.recipe.optim.max_grad_norm
    else:
        extensions = extras
        optim_cfg = optimizer if isinstance(optimizer, OptimConfig) else OptimConfig()
        # a torch optimiser keeps its own learning rate; the warm-up and clip are the default config's
        opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optim_cfg.build(jm.parameters())
        warmup, max_grad_norm = optim_cfg.warmup_for(epochs * iters), optim_cfg.max_grad_norm
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_schedule(warmup, iters, options.decay_epochs, options.decay_rate)
    )
    state = TrainState(jm, opt, scheduler, loss_fn, History(), val_data=val_data)
    step = _Step(state, options, extensions, max_grad_norm)
    ckpts = _Checkpoints(
        options.checkpoint_dir,
        every=options.checkpoint_every,
        keep=options.keep_checkpoints,
        loader=train_loader,
        objects=dict(model=jm, optimizer=opt, scheduler=scheduler, loss=loss_fn, scaler=step.scaler),
        config=setup.recipe.to_dict() if setup is not None else None,
    )
    pos = ckpts.resume(state) if options.resume else _Position()
    step.guard = guard = _make_guard(options.guard_policy, state, options.guard_options, pos.guard)
    log = _Progress(
        options.progress,
        epochs=epochs,
        iters_per_epoch=iters,
        iteration=state.iteration,
        desc=options.desc or ("JEM" if loss_fn is not None else "baseline"),
    )
    if pos.resumed:
        log.announce(f"resuming at epoch {state.epoch + 1}, iteration {state.iteration} of {epochs * iters}")
    for ext in extensions:
        ext.on_fit_start(state, train_loader)
    reason: str | None = None
    try:
        while state.epoch < epochs and reason is None:
            for b, batch in _epoch_batches(train_loader, state.epoch, pos):
                tick, metrics = _tick(), step(batch, state.iteration)
                if metrics is None:  # rolled back (model, optimizer, loss restored): batch skipped
                    _note_rollback(state, guard, log)
                    continue
                state.iteration, state.metrics = state.iteration + 1, metrics
                pos.running.add(metrics, step.batch_size)
                for ext in extensions:
                    ext.on_step_end(state)
                pos.running.tock(tick)
                log.step(state, pos.running, last_in_epoch=b == iters - 1)
                reason = _stop_reason(state, start, options.max_seconds, device) if b + 1 < iters else None
                if reason is not None or ckpts.due(state.iteration) and b + 1 < iters:
                    ckpts.save(state, pos, b + 1, guard, start)
                if reason is not None:
                    break
            if reason is not None:
                break
            record = _epoch_record(state, pos.running, epochs * iters - state.iteration)
            last = state.epoch + 1 == epochs
            if val_data is not None and ((state.epoch + 1) % options.eval_every == 0 or last):
                record.update(_validate(jm, val_data, multi))
            state.history.epochs.append(record)
            state.epoch, pos.skip, pos.running = state.epoch + 1, 0, _Running()
            log.epoch_end(record, state.epoch)
            for ext in extensions:
                ext.on_epoch_end(state)
            reason = _stop_reason(state, start, options.max_seconds, device)
            ckpts.save(state, pos, 0, guard, start)  # every epoch end (a no-op without checkpoint_dir)
            reason = reason if state.epoch < epochs else None
    finally:
        log.close()
    if reason is None:
        for ext in extensions:
            ext.on_fit_end(state, train_loader)
    return _finish(state, reason, start)
