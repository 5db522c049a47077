"""Integrations with the training frameworks users already run.

- :mod:`jem_plugin.integrations.mixin`: ``GenerativeLossMixin`` (also ``jem_plugin.GenerativeLossMixin``),
  JEM's loss in any class-based training loop (no framework needed).

Each other submodule imports its framework lazily, so ``import jem_plugin`` never needs them:

- :mod:`jem_plugin.integrations.timm_task`: ``JEMTask``, a timm ``TrainingTask`` (timm's
  task API) whose forward returns ``{'loss', 'output', ...}`` with JEM's generative loss.
- :mod:`jem_plugin.integrations.lightning`: ``JEMLightningModule`` and the ``JEMLightningMixin``
  recipe (needs ``lightning``): buffer in the checkpoint (one per rank), SGLD and gradient-based
  OOD scores inside ``validation_step`` under ``inference_mode``.
- :mod:`jem_plugin.integrations.accelerate`: ``register_jem_state`` registers the replay buffer
  (every rank's) for ``accelerator.save_state``/``load_state`` (needs ``accelerate``).

Plain PyTorch DDP lives in :mod:`jem_plugin.distributed`.
"""
