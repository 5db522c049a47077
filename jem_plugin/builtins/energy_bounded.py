"""Energy-bounded fine-tuning (Liu et al. 2020, "Energy-based Out-of-distribution Detection").

A built-in loss-term plugin: registered as ``"energy_bounded"`` through the
``jem_register_loss_terms`` hook and used as

>>> loss_fn = jem.JEMLoss(sampler, buffer, px_weight=0.0)
>>> loss_fn.add_term("energy_bounded", outliers=outlier_loader)

With the free energy ``E(x) = -T * logsumexp(f(x) / T)``, the term is the squared hinge

``weight * ( mean relu(E(x_in) - m_in)^2 + mean relu(m_out - E(x_out))^2 )``

pushing in-distribution energies below ``m_in`` and auxiliary-outlier energies above ``m_out``
(Liu et al.'s code uses ``weight = 0.1``).

**Margins from the model's own energies.** The paper's CIFAR margins ``m_in = -25``,
``m_out = -7`` are tied to that network's energy scale. On another model they can demand
energies far from where the classifier sits (say ``-25`` when its energies are around ``-5``),
which forces the logits to grow and wrecked accuracy for users of the reference code. So by
default the margins are measured: over the first ``calibration_size`` in-distribution inputs
seen in training (at least one batch), ``m_in`` is the ``q_in`` quantile of their energies and
``m_out`` the ``q_out`` quantile of the outliers' energies (both default to the median: only
the less typical half of each set is pushed, and the energy scale stays where the model has
it). If that leaves ``m_out - m_in < min_gap`` (outliers currently no higher in energy than the
data), both margins are moved apart symmetrically around their midpoint to a gap of
``min_gap`` (default 1 nat), so the hinge still asks for separation. Pass ``m_in``/``m_out``
to fix them yourself; :func:`calibrate_margins` is the rule as a function.

**Outliers** (``outliers=``): a DataLoader or any iterable of auxiliary outlier batches
(cycled; tensors or ``(x, ...)`` tuples; Liu et al. use real outlier images); a callable
``x -> x_out``; ``"uniform"`` (noise uniform over the model's input domain); ``"samples"``
(the loss's own SGLD samples, no extra forward); or ``None`` (default) to use
``batch.extra["x_outlier"]`` supplied by the caller. Outliers from a
loader, callable or ``"uniform"`` take one extra forward, in the model's current mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import free_energy, unpack_batch
from ..errors import InvalidInputError
from ..plugins import hookimpl

__all__ = ["free_energy", "energy_bounded_loss", "calibrate_margins", "EnergyBoundedTerm", "jem_register_loss_terms"]


def energy_bounded_loss(energy_in: Tensor, energy_out: Tensor, m_in: float, m_out: float) -> Tensor:
    """Liu et al.'s squared hinge ``mean relu(E_in - m_in)^2 + mean relu(m_out - E_out)^2`` (unweighted).

    Usable from any training loop: compute the energies with :func:`free_energy` on the
    in-distribution and outlier logits, multiply by your weight (the paper: 0.1), add to the loss.
    """
    return F.relu(energy_in - m_in).pow(2).mean() + F.relu(m_out - energy_out).pow(2).mean()


def calibrate_margins(
    energy_in: Tensor, energy_out: Tensor, q_in: float = 0.5, q_out: float = 0.5, min_gap: float = 1.0
) -> tuple[float, float]:
    """Margins from measured energies: ``(quantile(E_in, q_in), quantile(E_out, q_out))``.

    When the result has ``m_out - m_in < min_gap``, both move apart around their midpoint to
    exactly ``min_gap``. See the module docstring for why.
    """
    for name, q in (("q_in", q_in), ("q_out", q_out)):
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"{name} must be a quantile in [0, 1], got {q!r}")
    if not (min_gap >= 0 and math.isfinite(min_gap)):
        raise ValueError(f"min_gap must be a finite number >= 0, got {min_gap!r}")
    e_in = energy_in.detach().reshape(-1).double()
    e_out = energy_out.detach().reshape(-1).double()
    if e_in.numel() == 0 or e_out.numel() == 0:
        raise InvalidInputError("calibrating the margins needs in-distribution and outlier energies")
    if not (torch.isfinite(e_in).all() and torch.isfinite(e_out).all()):
        raise InvalidInputError(
            "non-finite energies while calibrating the energy-bounded margins; "
            "check the model's logits, or pass m_in= and m_out= explicitly"
        )
    m_in, m_out = float(torch.quantile(e_in, q_in)), float(torch.quantile(e_out, q_out))
    if m_out - m_in < min_gap:
        mid = (m_in + m_out) / 2
        m_in, m_out = mid - min_gap / 2, mid + min_gap / 2
    return m_in, m_out


class EnergyBoundedTerm:
    """The ``energy_bounded`` loss term: ``term(jm, batch) -> (loss, metrics)``.

    Parameters
    ----------
    m_in, m_out: fixed margins; ``None`` (default) measures them from the model (module docstring).
    weight: multiplies the hinge (Liu et al.: 0.1).
    outliers: where outlier inputs come from (module docstring): ``None``, an iterable/DataLoader,
        a callable ``x -> x_out``, ``"uniform"`` or ``"samples"``.
    temperature: ``T`` of the free energy (Liu et al.: 1).
    q_in, q_out, min_gap: the margin rule of :func:`calibrate_margins`.
    calibration_size: in-distribution energies to collect before fixing measured margins (at
        least one batch is used; the term adds no loss until the margins are fixed).
    generator: ``torch.Generator`` for ``outliers="uniform"``.

    Metrics: ``e_in``, ``e_out`` (mean energies), ``m_in``, ``m_out``, ``in_violations`` and
    ``out_violations`` (fractions on the wrong side of their margin). ``state_dict()`` holds the
    margins (and any partial calibration) so a resumed run keeps them.
    """

    def __init__(
        self,
        m_in: float | None = None,
        m_out: float | None = None,
        weight: float = 0.1,
        outliers: Iterable | Callable[[Tensor], Tensor] | str | None = None,
        *,
        temperature: float = 1.0,
        q_in: float = 0.5,
        q_out: float = 0.5,
        min_gap: float = 1.0,
        calibration_size: int = 256,
        generator: torch.Generator | None = None,
    ) -> None:
        if (m_in is None) != (m_out is None):
            raise ValueError("give both m_in and m_out, or neither (then both are measured)")
        if m_in is not None and m_out is not None and not m_in < m_out:
            raise ValueError(
                f"m_in must be below m_out (in-distribution energies are lower), got m_in={m_in}, m_out={m_out}"
            )
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature!r}")
        if isinstance(outliers, str) and outliers not in ("uniform", "samples"):
            raise ValueError(
                f"outliers must be 'uniform', 'samples', an iterable of batches, a callable or None, got {outliers!r}"
            )
        if isinstance(calibration_size, bool) or not isinstance(calibration_size, int) or calibration_size < 1:
            raise ValueError(f"calibration_size must be a positive int, got {calibration_size!r}")
        calibrate_margins(torch.zeros(1), torch.zeros(1), q_in, q_out, min_gap)  # validates the rule
        self.m_in = None if m_in is None else float(m_in)
        self.m_out = None if m_out is None else float(m_out)
        self.weight = float(weight)
        self.outliers = outliers
        self.temperature = float(temperature)
        self.q_in, self.q_out, self.min_gap = q_in, q_out, min_gap
        self.calibration_size = calibration_size
        self.generator = generator
        self._iter: Iterator[Any] | None = None
        self._calib_in: list[Tensor] = []
        self._calib_out: list[Tensor] = []

    needs_samples = property(lambda self: self.outliers == "samples")

    @property
    def calibrated(self) -> bool:
        """True once both margins are set (given, measured, or loaded)."""
        return self.m_in is not None and self.m_out is not None

    def __repr__(self) -> str:
        margins = (
            f"m_in={self.m_in:.4g}, m_out={self.m_out:.4g}"
            if self.calibrated
            else f"margins measured (q_in={self.q_in}, q_out={self.q_out}, min_gap={self.min_gap})"
        )
        src = self.outliers if isinstance(self.outliers, str) or self.outliers is None else type(self.outliers).__name__
        return f"EnergyBoundedTerm({margins}, weight={self.weight}, outliers={src!r}, T={self.temperature})"

    # ------------------------------------------------------------------ outliers
    def _next_from_iterable(self) -> Tensor:
        # _outlier_energy comes here only for outliers that are not None, a string or a plain callable
        source = cast(Iterable, self.outliers)
        if self._iter is None:
            self._iter = iter(source)
        try:
            return unpack_batch(next(self._iter))[0]
        except StopIteration:
            self._iter = iter(source)  # next epoch of the outlier loader
            try:
                return unpack_batch(next(self._iter))[0]
            except StopIteration:
                raise InvalidInputError("the outlier loader is empty") from None

    def _outlier_energy(self, jm, batch) -> Tensor:
        src = self.outliers
        if src == "samples":
            logits = batch.logits_sample if batch.logits_sample is not None else batch.logits_cond
            if logits is None:
                raise InvalidInputError(
                    "outliers='samples' needs SGLD samples in the batch; turn on the p(x) or p(x|y) term of JEMLoss"
                )
            return free_energy(logits, self.temperature)
        x = batch.x
        if src is None:
            x_out = batch.extra.get("x_outlier")  # batch: the loss's LossBatch
            if x_out is None:
                raise InvalidInputError(
                    "energy_bounded needs outlier inputs: pass outliers=<DataLoader of auxiliary "
                    "outliers> (Liu et al.), outliers='uniform' (noise over the input domain), "
                    "outliers='samples' (the loss's SGLD samples) or a callable x -> x_out, or put "
                    "them in batch.extra['x_outlier']"
                )
        elif src == "uniform":
            x_out = jm.domain.uniform(x.shape[0], x.shape[1:], generator=self.generator, device=x.device, dtype=x.dtype)
        elif callable(src) and not hasattr(src, "__iter__"):  # the user's function, not their iterable
            x_out = src(x)
        else:
            x_out = self._next_from_iterable()
        if not isinstance(x_out, Tensor) or x_out.shape[1:] != x.shape[1:]:
            got = tuple(x_out.shape) if isinstance(x_out, Tensor) else type(x_out).__name__
            raise InvalidInputError(
                f"outlier inputs must be a tensor [N, {', '.join(map(str, x.shape[1:]))}] like the data, got {got}"
            )
        return free_energy(jm(x_out.to(device=x.device, dtype=x.dtype)), self.temperature)

    # ------------------------------------------------------------------ the term
    def __call__(self, jm, batch) -> tuple[Tensor, dict[str, Tensor | float]]:
        e_in = free_energy(batch.logits_data, self.temperature)
        e_out = self._outlier_energy(jm, batch)
        if not self.calibrated:
            self._calib_in.append(e_in.detach().float().cpu())
            self._calib_out.append(e_out.detach().float().cpu())
            if sum(t.numel() for t in self._calib_in) >= self.calibration_size:
                self.m_in, self.m_out = calibrate_margins(
                    torch.cat(self._calib_in), torch.cat(self._calib_out), self.q_in, self.q_out, self.min_gap
                )
                self._calib_in, self._calib_out = [], []
        metrics: dict[str, Tensor | float] = {"e_in": e_in.detach().mean(), "e_out": e_out.detach().mean()}
        m_in, m_out = self.m_in, self.m_out
        if m_in is None or m_out is None:  # not calibrated yet
            return e_in.new_zeros(()), metrics
        loss = self.weight * energy_bounded_loss(e_in, e_out, m_in, m_out)
        metrics.update(
            m_in=m_in,
            m_out=m_out,
            in_violations=(e_in.detach() > m_in).float().mean(),
            out_violations=(e_out.detach() < m_out).float().mean(),
        )
        return loss, metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "m_in": self.m_in,
            "m_out": self.m_out,
            "calib_in": torch.cat(self._calib_in) if self._calib_in else None,
            "calib_out": torch.cat(self._calib_out) if self._calib_out else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m_in, self.m_out = state.get("m_in"), state.get("m_out")
        self._calib_in = [state["calib_in"]] if state.get("calib_in") is not None else []
        self._calib_out = [state["calib_out"]] if state.get("calib_out") is not None else []


@hookimpl
def jem_register_loss_terms(register: Callable[..., None]) -> None:
    register(
        "energy_bounded",
        EnergyBoundedTerm,
        description="Liu et al. 2020 squared-hinge energy bounds (m_in, m_out measured from the model by default)",
    )
