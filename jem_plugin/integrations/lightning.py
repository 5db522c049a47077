"""JEM in PyTorch Lightning: the ``JEMLightningMixin`` recipe and a ready ``JEMLightningModule``.

The mixin is :class:`~jem_plugin.integrations.mixin.GenerativeLossMixin` plus what Lightning needs:

>>> import lightning as L
>>> from jem_plugin.integrations.lightning import JEMLightningMixin
>>> class Classifier(JEMLightningMixin, L.LightningModule):
...     def __init__(self):
...         super().__init__()
...         self.net = timm.create_model("resnet18", num_classes=10)
...         self.configure_jem("net", buffer=ReplayBuffer(10000, (3, 32, 32)), l2_weight=0.1)
...     def training_step(self, batch, batch_idx):
...         out = self.generative_loss(*batch)          # SGLD + one forward on [data; samples]
...         self.log_dict({f"train/{k}": v for k, v in out.metrics.items()})
...         return out.loss
...     def validation_step(self, batch, batch_idx):
...         x, y = batch
...         self.log("val/grad_norm", self.jem_score(x, "grad_norm").mean())  # fine under inference_mode
...     def configure_optimizers(self):
...         return torch.optim.Adam(self.parameters(), lr=1e-4)

What the mixin takes care of:

* **The buffer is in the checkpoint.** ``self.jem_loss`` is a submodule, so the replay buffer and
  the sampler state are in ``state_dict()`` and Lightning's ``.ckpt``; ``load_from_checkpoint`` and
  ``Trainer.fit(ckpt_path=...)`` restore them.
* **One buffer per rank under DDP.** Lightning writes checkpoints from rank 0 only, so the
  mixin's ``on_save_checkpoint`` (called on every rank) gathers every rank's JEM state into
  ``checkpoint["jem_per_rank"]`` (:class:`~jem_plugin.distributed.PerRankState`), and
  ``on_load_checkpoint`` hands each rank its own chains back. The buffers are excluded from DDP's
  buffer broadcast (:func:`~jem_plugin.distributed.ignore_replay_buffers`), which would otherwise
  copy rank 0's chains to every rank before every forward.
* **Evaluation under ``torch.inference_mode``.** Lightning validates and tests under
  ``inference_mode``, which forbids autograd. :meth:`jem_score` (gradient-based OOD scores) and
  :meth:`jem_sample` (SGLD) step out of it locally through
  :func:`jem_plugin.model.input_grad_enabled`; the parameters were created outside inference
  mode, so this is legal. Setting ``Trainer(inference_mode=False)`` is not needed.

If you override ``on_save_checkpoint``/``on_load_checkpoint``/``setup``, call ``super()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import free_energy, unpack_batch
from ..buffer import ReplayBuffer
from ..distributed import PerRankState, get_world_size, ignore_replay_buffers, select_rank_state
from ..losses import JEMLoss
from ..model import JEM
from .mixin import GenerativeLossMixin

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the standalone package's name for the same module
    except ImportError as exc:
        raise ImportError(
            "jem_plugin.integrations.lightning needs Lightning: pip install lightning "
            f"(or the extra: pip install 'jem-plugin[lightning]') ({exc})"
        ) from exc

__all__ = ["JEMLightningMixin", "JEMLightningModule", "PER_RANK_KEY"]

PER_RANK_KEY = "jem_per_rank"  # checkpoint entry holding every rank's JEM state


class JEMLightningMixin(GenerativeLossMixin):
    """Mix into a ``LightningModule`` (before it in the bases) and call :meth:`configure_jem`."""

    def configure_jem(self, *args: Any, **kwargs: Any) -> JEMLoss:
        loss = super().configure_jem(*args, **kwargs)
        ignore_replay_buffers(self)  # type: ignore[arg-type]  # a LightningModule is an nn.Module; the mixin's type does not say so
        return loss

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        # Before the strategy wraps the module in DDP: buffers created since configure_jem too.
        ignore_replay_buffers(self)  # type: ignore[arg-type]  # a LightningModule is an nn.Module; the mixin's type does not say so
        # The next class in the user's MRO may or may not define each hook: ask it, then chain.
        parent = getattr(super(), "setup", None)
        if parent is not None:
            parent(stage)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this on every rank before rank 0 writes: a collective is safe here.
        # configure_jem has run (nn.Module keeps submodules in _modules; a mixin cannot name it)
        if "jem_loss" in getattr(self, "_modules", {}) and get_world_size() > 1:
            checkpoint[PER_RANK_KEY] = PerRankState(self.jem_loss).state_dict()
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Runs before the state_dict is loaded: put this rank's own chains into it.
        per_rank = checkpoint.get(PER_RANK_KEY)
        if per_rank is not None and "state_dict" in checkpoint:
            own = select_rank_state(per_rank)
            checkpoint["state_dict"].update({f"jem_loss.{k}": v for k, v in own.items()})
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)

    # ------------------------------------------------------------------ evaluation helpers
    def jem_score(self, x: Tensor, method: str = "logpx", **kwargs: Any) -> Tensor:
        """OOD score of ``x`` (higher = more in-distribution); works inside ``validation_step``."""
        from .. import ood

        return ood.score(self.jem, x, method=method, progress=False, **kwargs)

    def jem_sample(
        self,
        n: int | None = None,
        *,
        steps: int | None = None,
        y: Tensor | None = None,
        x_init: Tensor | None = None,
        use_buffer: bool = False,
    ) -> Tensor:
        """SGLD samples; works inside ``validation_step`` (under ``inference_mode``).

        By default chains start from ``x_init`` or uniform noise with the training sampler's
        settings (``steps`` overrides its number of steps), leaving the replay buffer untouched;
        ``use_buffer=True`` continues the training chains instead (and writes them back).
        """
        from ..sampling import SGLD

        base: Any = self.jem_loss.sampler  # any Sampler; steps= rebuilds an SGLD from SGLD's settings
        sampler = base
        if steps is not None and steps != base.steps:
            sampler = SGLD(
                steps=steps,
                step_size=base.step_size,
                noise=base.noise,
                clamp=base.clamp,
                grad_clamp=base.grad_clamp,
                generator=base.generator,
            )
        buffer = self.jem_loss.buffer if use_buffer else None
        if use_buffer and buffer is None:
            raise ValueError("use_buffer=True needs a replay buffer: configure_jem(..., buffer=ReplayBuffer(...))")
        known = self.jem_loss.buffer  # None for a loss without one (cross-entropy only)
        shape = (
            None
            if x_init is not None or buffer is not None or not isinstance(known, ReplayBuffer)
            else known.sample_shape
        )
        return sampler.sample(self.jem, n, buffer=buffer, y=y, x_init=x_init, shape=shape)


class JEMLightningModule(JEMLightningMixin, pl.LightningModule):
    """A ready LightningModule: any classifier trained with JEM's loss, validated with OOD scores.

    Parameters
    ----------
    model: the classifier (timm, torchvision, your own), or its :class:`~jem_plugin.model.JEM`.
    lr, weight_decay: Adam settings (the paper: 1e-4, 0).
    warmup_iters: linear learning-rate warmup (the paper: 1000; 0 disables).
    val_scores: OOD scores logged as ``val/<name>`` means in validation (gradient scores such as
        ``"grad_norm"`` included: they work under Lightning's ``inference_mode``).
    val_sgld_steps: if > 0, validation also runs this many SGLD steps from noise on each batch and
        logs ``val/energy_sample`` (generation working in evaluation).
    sampler, buffer, wrap_options, **loss_kwargs: as for :meth:`configure_jem`
        (``px_weight``, ``pxy_weight``, ``l2_weight``, ``data_noise``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_iters: int = 0,
        val_scores: Sequence[str] = ("logpx", "grad_norm"),
        val_sgld_steps: int = 0,
        sampler: Any = None,
        buffer: nn.Module | None = None,
        wrap_options: dict | None = None,
        **loss_kwargs: Any,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "sampler", "buffer"])
        self.model = model.model if isinstance(model, JEM) else model
        self.configure_jem(
            model if isinstance(model, JEM) else "model",
            sampler=sampler,
            buffer=buffer,
            wrap_options=wrap_options,
            **loss_kwargs,
        )
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_iters = warmup_iters
        self.val_scores = tuple(val_scores)
        self.val_sgld_steps = val_sgld_steps

    def forward(self, x: Tensor) -> Tensor:
        return self.jem(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = unpack_batch(batch, need_labels=True)
        out = self.generative_loss(x, y)
        self.log_dict(
            {f"train/{k}": v for k, v in out.metrics.items() if k != "loss"}, prog_bar=False, batch_size=x.shape[0]
        )
        self.log("train/loss", out.loss.detach(), prog_bar=True, batch_size=x.shape[0])
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = unpack_batch(batch, need_labels=True)
        logits = self.jem(x)
        metrics = {
            "val/loss": F.cross_entropy(logits, y),
            "val/acc": (logits.argmax(1) == y).float().mean(),
            "val/logpx": -free_energy(logits).mean(),
        }
        for name in self.val_scores:
            if name != "logpx":
                metrics[f"val/{name}"] = self.jem_score(x, name).mean()
        if self.val_sgld_steps > 0:
            xs = self.jem_sample(
                x.shape[0],
                steps=self.val_sgld_steps,
                x_init=self.jem.domain.uniform(x.shape[0], x.shape[1:], device=x.device),
            )
            with torch.no_grad():
                metrics["val/energy_sample"] = free_energy(self.jem(xs)).mean()
        self.log_dict(metrics, prog_bar=True, batch_size=x.shape[0], sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if self.warmup_iters <= 0:
            return opt
        warm = self.warmup_iters
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: min(1.0, (it + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
