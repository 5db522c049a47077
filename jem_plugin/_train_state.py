"""What a :func:`~jem_plugin.training.fit` run records (:class:`History`) and what its callbacks
see (:class:`TrainState`). Both are re-exported by :mod:`jem_plugin.training`; they live here so
that the loop's pieces (``_training_run``) and the loop itself import them without a cycle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch
from torch import nn

__all__ = ["History", "TrainState"]


@dataclass
class History:
    """Per-epoch metrics of a :func:`fit` run (JSON serialisable with :meth:`to_dict`).

    ``epochs`` holds one dict per finished epoch: ``epoch``, ``loss``, ``ce``, ``acc`` (train,
    on the noisy batches JEM trains on), ``energy_data``/``energy_sample``/``energy_gap`` (JEM),
    ``val_acc``/``val_nll`` (with ``val_data``), ``lr``, ``time`` (training wall seconds, without
    evaluation), ``cpu_time`` (process CPU seconds: comparable across runs on a busy machine),
    ``iterations``, and the throughput ``img_per_s``, ``ms_per_iter`` and ``remaining_s`` (the
    projected time to the last epoch; per process under DDP, averaged over the ranks).
    ``history["acc"]`` is the column of one metric, ``history[-1]`` the last epoch. ``events``
    records rollbacks and stops; ``stopped`` is ``None`` for a complete run, else why it stopped
    early (``"max_seconds"``, ``"callback"``).
    """

    epochs: list[dict[str, float]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None
    total_time: float = 0.0

    @overload
    def __getitem__(self, key: str) -> list[float]: ...
    @overload
    def __getitem__(self, key: int) -> dict[str, float]: ...
    def __getitem__(self, key: str | int) -> list[float] | dict[str, float]:
        """``history["acc"]``: one metric's column; ``history[-1]``: one epoch's metrics (a copy).
        A metric that no recorded epoch has raises ``KeyError`` naming the ones they have, so a
        misspelt name is not read as "never measured"."""
        if isinstance(key, int) and not isinstance(key, bool):
            return dict(self.epochs[key])
        if not isinstance(key, str):
            raise TypeError(f"History is indexed by a metric name or an epoch index, got {type(key).__name__}")
        column = [rec[key] for rec in self.epochs if key in rec]
        if self.epochs and not column:
            raise KeyError(f"no epoch recorded the metric {key!r}; recorded: {', '.join(self.columns())}")
        return column

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
        return {
            "epochs": [dict(r) for r in self.epochs],
            "events": [dict(e) for e in self.events],
            "stopped": self.stopped,
            "total_time": self.total_time,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> History:
        return cls(
            epochs=[dict(r) for r in d.get("epochs", [])],
            events=[dict(e) for e in d.get("events", [])],
            stopped=d.get("stopped"),
            total_time=float(d.get("total_time", 0.0)),
        )

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
    epoch: int = 0  # epochs finished
    iteration: int = 0  # optimizer steps taken
    metrics: dict[str, float] = field(default_factory=dict)  # last step's metrics
    stop: bool = False
    val_data: Any = None  # the run's held-out data (what RecomputeBatchNorm decides on), or None
