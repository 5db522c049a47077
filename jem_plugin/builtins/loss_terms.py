"""Built-in loss terms for :class:`~jem_plugin.losses.JEMLoss` (a built-in plugin).

Registered through the ``jem_register_loss_terms`` hook exactly like a third-party term, and
used as ``JEMLoss(terms={"energy_l2": {"weight": 0.1}})``.

A registered item is a factory ``factory(**kwargs)`` returning ``term(jm, batch) -> (loss,
metrics)`` where ``batch`` is a :class:`~jem_plugin.losses.LossBatch` (inputs, labels, logits and
energies of the data and of the SGLD samples, all from the loss's single forward). A term that
needs samples even when the p(x) and p(x|y) weights are 0 sets ``needs_samples = True``.

``energy_l2``
    ``weight * (mean E(x_data)^2 + mean E(x_sample)^2)``: the energy magnitude penalty of Du &
    Mordatch (2019) that the JEM authors recommend against divergence (strength around 0.1,
    wgrathwohl/JEM#4). Same value as ``JEMLoss(l2_weight=weight)``; as a term it can also be
    restricted to the data or the sample energies (``on=("data",)``).
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from ..plugins import hookimpl

__all__ = ["EnergyL2", "jem_register_loss_terms"]


class EnergyL2:
    """``weight * sum over the chosen sets of mean E^2`` (sets: ``"data"``, ``"sample"``)."""

    needs_samples = False  # uses sample energies when there are samples, data energies always

    def __init__(self, weight: float = 1.0, on: Sequence[str] = ("data", "sample")) -> None:
        weight = float(weight)
        if not weight >= 0:
            raise ValueError(f"energy_l2 weight must be >= 0, got {weight}")
        on = tuple(on)
        unknown = [o for o in on if o not in ("data", "sample")]
        if unknown or not on:
            raise ValueError(f"energy_l2 on= takes 'data' and/or 'sample', got {on!r}")
        self.weight = weight
        self.on = on

    def __repr__(self) -> str:
        return f"EnergyL2(weight={self.weight}, on={self.on})"

    def __call__(self, jm, batch) -> tuple[Tensor, dict[str, Tensor]]:
        metrics: dict[str, Tensor] = {}
        total = batch.energy_data.new_zeros(())
        if "data" in self.on:
            metrics["data"] = batch.energy_data.pow(2).mean()
            total = total + metrics["data"]
        sample_energies = batch.sample_energies
        if "sample" in self.on and sample_energies is not None:
            metrics["sample"] = sample_energies.pow(2).mean()
            total = total + metrics["sample"]
        return self.weight * total, metrics


@hookimpl
def jem_register_loss_terms(register):
    register("energy_l2", EnergyL2,
             description="weight * (mean E(x_data)^2 + mean E(x_sample)^2), the energy L2 regulariser")
