"""JEM as a timm training task: ``JEMTask``, a ``timm.task.TrainingTask``.

Recent timm (the ``timm.task`` package; tested with timm 1.0.31) trains through *tasks*:
``result = task(input, target)`` returns a dict whose ``'loss'`` is backpropagated and whose
``'output'`` feeds the metrics; the task also says how to go distributed, what the eval model is
and what goes into checkpoints. ``JEMTask`` is a drop-in for ``timm.task.ClassificationTask``: in
timm's ``train.py`` (or your own loop around a task) replace

    task = ClassificationTask(model, criterion=train_loss_fn, device=device)

with

    from jem_plugin.integrations.timm_task import JEMTask
    task = JEMTask(model, criterion=train_loss_fn, device=device, px_weight=1.0, l2_weight=0.1,
                   sampler=jem_plugin.SGLD(steps=20), buffer=jem_plugin.ReplayBuffer(10000, (3, 32, 32)))

and everything else (optimizer, scheduler, AMP, EMA, ``task.prepare_distributed``,
``task.no_sync`` for accumulation, ``CheckpointSaver(task=...)``, ``resume_task_checkpoint``)
works unchanged:

* ``forward(input, target)`` returns ``{'loss', 'output', 'ce', 'px', 'energy_data',
  'energy_sample', 'energy_gap', ...}`` (JEMLoss's metrics as 0-d tensors); ``'output'`` holds the
  logits of the data batch from the same single forward as the loss.
* ``criterion`` (timm's label-smoothing or soft-target loss) replaces JEMLoss's own
  cross-entropy, so ``--smoothing`` and mixup/cutmix soft targets keep working; the generative
  terms use hard labels (``target.argmax(1)`` for soft targets, relevant only to p(x|y)).
* ``prepare_distributed`` wraps the JEM in DDP; SGLD runs on the bare module (see
  :mod:`jem_plugin.distributed`). timm seeds each rank differently, so each rank's replay buffer
  holds its own chains.
* The eval model (``get_eval_model``) is the bare timm classifier, so validation and the saved
  ``state_dict`` are exactly timm's (a JEMTask checkpoint loads into ``timm.create_model``); the
  replay buffer and sampler travel as ``task_state``. timm's ``CheckpointSaver`` runs on rank 0
  only, so under DDP it saves rank 0's buffer and every rank resumes from it (the chains then
  drift apart again through per-rank noise); use :mod:`jem_plugin.distributed`'s checkpoints for
  per-rank buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InvalidLabelError, JEMError
from ..losses import JEMLoss
from ..model import JEM, as_jem, wrap

try:
    from timm.task import TrainingTask
except ImportError as exc:  # pragma: no cover - timm is a dependency, but older versions lack tasks
    raise ImportError(
        "jem_plugin.integrations.timm_task needs timm's task API (timm.task."
        f"TrainingTask, e.g. timm 1.0.31); upgrade with `pip install -U timm` ({exc})"
    ) from exc

__all__ = ["JEMTask"]


def _classifier(module: Any) -> Any:
    """The user's classifier under DDP, EMA, torch.compile and JEM wrappers (what timm validates
    and saves); ``module`` itself if there is no JEM inside."""
    current = module
    for _ in range(8):  # DDP -> ModelEma -> compiled -> JEM, in any order
        if isinstance(current, JEM):
            return current.model
        inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        current = inner
    return module


class JEMTask(TrainingTask):
    """A timm ``TrainingTask`` that trains ``model`` with JEM's loss (Grathwohl et al. 2019).

    Parameters
    ----------
    model: the classifier (any timm model; or a :class:`~jem_plugin.model.JEM` already).
    criterion: optional timm classification loss (``LabelSmoothingCrossEntropy``,
        ``SoftTargetCrossEntropy`` for mixup, ...) used for the p(y|x) term instead of JEMLoss's
        plain cross-entropy (JEMLoss then runs with ``ce_weight=0``).
    loss_fn: a ready :class:`~jem_plugin.losses.JEMLoss`; otherwise one is built from
        ``sampler``, ``buffer`` and ``loss_kwargs`` (``px_weight``, ``pxy_weight``,
        ``l2_weight``, ``data_noise``, ...).
    wrap_options: passed to :func:`jem_plugin.wrap` (the timm adapter reads mean/std itself).
    device, dtype, verbose: as for every timm task.
    """

    def __init__(
        self,
        model: nn.Module,
        criterion: Callable[[Tensor, Tensor], Tensor] | None = None,
        loss_fn: JEMLoss | None = None,
        *,
        sampler: Any = None,
        buffer: nn.Module | None = None,
        wrap_options: dict | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        verbose: bool = True,
        **loss_kwargs: Any,
    ) -> None:
        super().__init__(device=device, dtype=dtype, verbose=verbose)
        jm = model if isinstance(model, JEM) else wrap(model, **(wrap_options or {}))
        if loss_fn is None:
            if criterion is not None:
                if loss_kwargs.get("ce_weight", 0.0) not in (0, 0.0):
                    raise ValueError("criterion replaces JEMLoss's cross-entropy: do not also pass ce_weight")
                loss_kwargs["ce_weight"] = 0.0
            loss_fn = JEMLoss(sampler=sampler, buffer=buffer, **loss_kwargs)
        else:
            if sampler is not None or buffer is not None or loss_kwargs:
                raise ValueError("pass either loss_fn or its parts (sampler, buffer, weights), not both")
            if criterion is not None and loss_fn.ce_weight != 0:
                raise ValueError(
                    f"criterion replaces the cross-entropy, but loss_fn has ce_weight={loss_fn.ce_weight}; "
                    "build it with JEMLoss(ce_weight=0, ...) or drop criterion"
                )
        if isinstance(criterion, nn.Module):
            criterion = criterion.to(device=self.device)
        self.criterion = criterion
        # the JEM; a DistributedJEM (DDP) around it after prepare_distributed
        self.trainable_module: nn.Module = jm.to(device=self.device)
        self.jem_loss = loss_fn.to(device=self.device)

    # ------------------------------------------------------------------ views
    @property
    def jem(self) -> JEM:
        """The bare JEM (under DDP too): score, sample or evaluate with it."""
        return as_jem(self.trainable_module, "JEMTask.jem")

    def get_eval_model(self, module: nn.Module | None = None, ema: bool = False) -> nn.Module | None:
        """The bare classifier (EMA copy when ``ema``): timm validates it and saves its weights."""
        resolved = super().get_eval_model(module=module, ema=ema)
        return None if resolved is None else _classifier(resolved)

    # ------------------------------------------------------------------ distributed
    def prepare_distributed(self, device_ids: list | None = None, **ddp_kwargs: Any) -> JEMTask:
        """Wrap the JEM in DDP (:func:`jem_plugin.distributed.wrap_ddp`); sampling stays on the bare module."""
        from ..distributed import wrap_ddp

        if device_ids is not None:
            ddp_kwargs["device_ids"] = device_ids
        self.trainable_module = wrap_ddp(self.trainable_module, **ddp_kwargs)
        return self

    # ------------------------------------------------------------------ training
    def forward(self, input: Tensor, target: Tensor) -> dict[str, Tensor]:
        """One JEM step's loss: ``{'loss', 'output', <metrics as 0-d tensors>}``."""
        labels = target
        if target.is_floating_point():
            if self.criterion is None:
                raise InvalidLabelError(
                    "JEMTask got soft (floating-point) targets, as mixup/cutmix produce; pass timm's "
                    "criterion (e.g. SoftTargetCrossEntropy()) to JEMTask(criterion=...), or disable "
                    "mixup/cutmix (--mixup 0 --cutmix 0)"
                )
            labels = target.argmax(dim=-1)
        out = self.jem_loss(self.trainable_module, input, labels)
        loss = out.loss
        if self.criterion is not None:
            loss = loss + self.criterion(out.logits, target)
        result: dict[str, Tensor] = {"loss": loss, "output": out.logits}
        names = [k for k in out.metrics if k != "loss"]
        if names:
            # One host-to-device copy for every metric (they are floats after JEMLoss's one transfer).
            values = torch.tensor([out.metrics[k] for k in names], device=loss.device)
            result.update(zip(names, values.unbind()))
        return result

    # ------------------------------------------------------------------ checkpoints
    def get_task_state(self, module: nn.Module | None = None, ema: bool = False) -> dict[str, Any]:
        """The replay buffer and sampler (``task_state`` in timm checkpoints); nothing for EMA."""
        if ema:
            return {}
        return {"jem_loss": self.jem_loss.state_dict()}

    def load_task_state(
        self, state: dict[str, Any] | None, strict: bool = True, module: nn.Module | None = None, ema: bool = False
    ) -> None:
        """Restore what :meth:`get_task_state` saved (timm calls this on resume); nothing for EMA."""
        if ema or not state:
            return
        if "jem_loss" not in state:
            if strict:
                raise JEMError(f"task_state has no 'jem_loss' entry (keys: {sorted(state)}); was it saved by JEMTask?")
            return
        self.jem_loss.load_state_dict(state["jem_loss"], strict=strict)
