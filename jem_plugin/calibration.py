"""Calibration of a classifier's confidences: ECE, MCE, NLL, Brier, reliability diagrams, temperature scaling.

JEM's claim is better calibration than a plain classifier (Grathwohl et al. 2019, Sec. 5.1).
The fair baseline for that claim is temperature scaling (Guo et al. 2017), a one-parameter
post-hoc fix; :func:`calibration_report` reports every metric before and after it.

Every metric takes ``probs`` ``[N, K]`` (rows are distributions) and integer ``labels`` ``[N]``,
or logits with ``from_logits=True``. Tensors, numpy arrays and lists are accepted.

ECE / MCE (Naeini et al. 2015; Guo et al. 2017): predictions are grouped by confidence
``max_k p_k`` into ``n_bins`` equal-width bins ``(i/n, (i+1)/n]``; with ``acc_b`` and
``conf_b`` the accuracy and mean confidence of bin ``b``,
``ECE = sum_b |B_b|/N * |acc_b - conf_b|`` and ``MCE = max_b |acc_b - conf_b|`` over non-empty
bins. NLL is the mean ``-log p_y``; Brier is the original multi-class score
``mean_n sum_k (p_nk - 1[k = y_n])^2`` (Brier 1950; range ``[0, 2]``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_labels
from .errors import InvalidScoresError

__all__ = [
    "ece",
    "mce",
    "nll",
    "brier",
    "accuracy",
    "calibration_bins",
    "TemperatureScaler",
    "fit_temperature",
    "calibration_report",
    "cross_fitted_report",
]


# ---------------------------------------------------------------------- inputs
def _as_2d(values: Any, what: str) -> Tensor:
    if not isinstance(values, Tensor):
        try:
            values = torch.as_tensor(np.asarray(values, dtype=np.float64))
        except (TypeError, ValueError) as exc:
            raise InvalidScoresError(f"{what} must be a [N, K] array of numbers: {exc}") from exc
    values = values.detach().cpu()
    if not values.is_floating_point():
        values = values.double()
    if values.dim() != 2:
        raise InvalidScoresError(
            f"{what} must be [N, K] (one row per input, one column per class), got shape {tuple(values.shape)}"
        )
    if values.shape[0] == 0:
        raise InvalidScoresError(f"{what} is empty: need at least one prediction")
    if values.shape[1] < 2:
        raise InvalidScoresError(f"{what} needs at least 2 classes, got {values.shape[1]} column(s)")
    bad = ~torch.isfinite(values)
    if bad.any():
        raise InvalidScoresError(f"{what} contains {int(bad.sum())} non-finite value(s) (NaN/inf)")
    return values.double()


def _as_labels(labels: Any, n: int, k: int) -> Tensor:
    if isinstance(labels, Tensor):
        labels = labels.detach()
    elif not isinstance(labels, np.ndarray):
        labels = np.asarray(labels)
    return check_labels(labels, n, num_classes=k, device="cpu", what="labels (one per prediction)")


def _probs(values: Any, labels: Any, from_logits: bool) -> tuple[Tensor, Tensor]:
    """Validated float64 probabilities and long labels."""
    v = _as_2d(values, "logits" if from_logits else "probs")
    y = _as_labels(labels, v.shape[0], v.shape[1])
    if from_logits:
        return torch.softmax(v, dim=1), y
    if float(v.min()) < -1e-6 or float(v.max()) > 1 + 1e-6:
        raise InvalidScoresError(
            f"probs must lie in [0, 1], got values from {float(v.min()):.4g} to {float(v.max()):.4g}; "
            "for logits pass from_logits=True"
        )
    row_err = float((v.sum(1) - 1).abs().max())
    if row_err > 1e-3:
        raise InvalidScoresError(
            f"each row of probs must sum to 1 (largest deviation {row_err:.3g}); for logits pass "
            "from_logits=True, for unnormalised scores apply softmax first"
        )
    return v, y


def _check_bins(n_bins: int) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return n_bins


# ---------------------------------------------------------------------- metrics
def calibration_bins(probs: Any, labels: Any, n_bins: int = 15, *, from_logits: bool = False) -> dict[str, np.ndarray]:
    """Per-bin statistics behind ECE, MCE and the reliability diagram.

    Returns ``{"edges" [n_bins+1], "count", "accuracy", "confidence" [n_bins]}``; accuracy and
    confidence are NaN for empty bins. Bin ``b`` holds confidences in ``(edges[b], edges[b+1]]``.
    """
    p, y = _probs(probs, labels, from_logits)
    n_bins = _check_bins(n_bins)
    conf, pred = p.max(dim=1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    # (lo, hi] bins as in Guo et al.'s reference code; confidence >= 1/K > 0 so bin 0 is well defined.
    idx = (torch.bucketize(conf, edges, right=False) - 1).clamp(0, n_bins - 1)
    count = torch.bincount(idx, minlength=n_bins).double()
    acc_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct)
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = (acc_sum / count).numpy()
        cmean = (conf_sum / count).numpy()
    return {"edges": edges.numpy(), "count": count.numpy().astype(np.int64), "accuracy": acc, "confidence": cmean}


def ece(probs: Any, labels: Any, n_bins: int = 15, *, from_logits: bool = False) -> float:
    """Expected calibration error with ``n_bins`` equal-width confidence bins (default 15)."""
    b = calibration_bins(probs, labels, n_bins, from_logits=from_logits)
    nonempty = b["count"] > 0
    gaps = np.abs(b["accuracy"][nonempty] - b["confidence"][nonempty])
    return float((b["count"][nonempty] * gaps).sum() / b["count"].sum())


def mce(probs: Any, labels: Any, n_bins: int = 15, *, from_logits: bool = False) -> float:
    """Maximum calibration error: the largest ``|accuracy - confidence|`` over non-empty bins."""
    b = calibration_bins(probs, labels, n_bins, from_logits=from_logits)
    nonempty = b["count"] > 0
    return float(np.abs(b["accuracy"][nonempty] - b["confidence"][nonempty]).max())


def nll(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Mean negative log-likelihood ``-log p_y`` (exact log-softmax for logits)."""
    if from_logits:
        z = _as_2d(probs, "logits")
        y = _as_labels(labels, z.shape[0], z.shape[1])
        return float(F.cross_entropy(z, y))
    p, y = _probs(probs, labels, False)
    # A zero probability on the true class is an infinite loss; clamp so one such row does not
    # turn the mean into inf (it still dominates it).
    return float(-p.gather(1, y[:, None]).clamp_min(1e-300).log().mean())


def brier(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Multi-class Brier score ``mean_n sum_k (p_nk - onehot_nk)^2`` (range ``[0, 2]``)."""
    p, y = _probs(probs, labels, from_logits)
    onehot = F.one_hot(y, p.shape[1]).double()
    return float((p - onehot).pow(2).sum(1).mean())


def accuracy(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Top-1 accuracy."""
    p, y = _probs(probs, labels, from_logits)
    return float((p.argmax(1) == y).double().mean())


# ---------------------------------------------------------------------- temperature scaling
class TemperatureScaler(nn.Module):
    """Temperature scaling (Guo et al. 2017): ``softmax(logits / T)`` with one scalar ``T > 0``.

    ``fit(logits, labels)`` minimises the NLL over ``log T`` (so ``T`` stays positive) with
    L-BFGS on held-out logits; ``forward(logits)`` returns ``logits / T``. Temperature scaling
    never changes the predicted class, only the confidence.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be positive and finite, got {temperature!r}")
        self.log_temperature = nn.Parameter(
            torch.tensor(math.log(temperature), dtype=torch.float64), requires_grad=False
        )

    @property
    def temperature(self) -> float:
        """The fitted temperature ``T`` (logits are divided by it)."""
        return float(self.log_temperature.exp())

    def forward(self, logits: Tensor) -> Tensor:
        return logits / self.log_temperature.exp().to(logits.dtype)

    def fit(self, logits: Any, labels: Any, *, max_iter: int = 100) -> TemperatureScaler:
        """Fit ``T`` by minimising the NLL of held-out ``logits``/``labels`` (L-BFGS); returns self.

        Raises :class:`~jem_plugin.errors.InvalidScoresError` when every prediction is correct:
        the NLL then keeps falling as ``T -> 0`` and has no minimum, and the optimiser would stop
        at an arbitrary, ever sharper temperature.
        """
        z = _as_2d(logits, "logits")
        y = _as_labels(labels, z.shape[0], z.shape[1])
        if _all_correct(z, y):
            raise InvalidScoresError(_NO_MINIMUM)
        # float64 and a fresh leaf: the fit is tiny, so exactness beats speed, and it must work
        # inside no_grad/inference_mode evaluation code.
        with torch.inference_mode(False), torch.enable_grad():
            z = z.clone()
            log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
            opt = torch.optim.LBFGS(
                [log_t],
                lr=1.0,
                max_iter=max_iter,
                tolerance_grad=1e-10,
                tolerance_change=1e-12,
                line_search_fn="strong_wolfe",
            )

            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(z / log_t.exp(), y)
                loss.backward()
                return loss

            opt.step(closure)
        value = float(log_t.detach())
        if not math.isfinite(value):
            raise InvalidScoresError("temperature scaling diverged; check the logits and labels")
        with torch.no_grad():
            self.log_temperature.fill_(value)
        return self


_NO_MINIMUM = (
    "every prediction in the fit data is correct, so the NLL keeps falling as the temperature goes to 0 "
    "and no temperature minimises it; fit on held-out data on which the model makes mistakes"
)


def _all_correct(z: Tensor, y: Tensor) -> bool:
    """Whether the argmax of every row of ``z`` is its label: temperature scaling then has no optimum."""
    return bool((z.argmax(1) == y).all())


def fit_temperature(logits: Any, labels: Any, *, max_iter: int = 100) -> float:
    """The NLL-optimal temperature ``T`` for held-out ``logits`` (L-BFGS over ``log T``)."""
    return TemperatureScaler().fit(logits, labels, max_iter=max_iter).temperature


def _metrics(z: Tensor, y: Tensor, n_bins: int) -> dict[str, float]:
    return {
        "ece": ece(z, y, n_bins, from_logits=True),
        "mce": mce(z, y, n_bins, from_logits=True),
        "nll": nll(z, y, from_logits=True),
        "brier": brier(z, y, from_logits=True),
    }


def calibration_report(
    logits: Any, labels: Any, *, n_bins: int = 15, fit_logits: Any = None, fit_labels: Any = None
) -> dict[str, float]:
    """ECE, MCE, NLL and Brier before and after temperature scaling, and the temperature.

    Returns ``{"accuracy", "n", "temperature", "temperature_fitted", "ece_before", "ece_after",
    "mce_before", "mce_after", "nll_before", "nll_after", "brier_before", "brier_after"}``.
    ``temperature_fitted`` is ``False`` where the fitting data has no misclassified example: no
    temperature minimises its NLL (it falls without bound as ``T -> 0``), so none is applied:
    ``temperature`` is 1 and the "after" metrics are the "before" ones.

    The temperature is fitted on ``fit_logits``/``fit_labels`` (a held-out validation split, the
    standard protocol) and applied to ``logits``. Without them it is fitted on ``logits`` itself:
    an oracle temperature, i.e. the best that temperature scaling could do on this data, which
    is the strictest baseline for a calibration claim but optimistic as a deployable number.
    """
    z = _as_2d(logits, "logits")
    y = _as_labels(labels, z.shape[0], z.shape[1])
    if (fit_logits is None) != (fit_labels is None):
        raise ValueError("pass both fit_logits and fit_labels (a held-out split), or neither")
    fz, fy = (z, y) if fit_logits is None else (_as_2d(fit_logits, "fit_logits"), fit_labels)
    fy = _as_labels(fy, fz.shape[0], fz.shape[1])
    fitted = not _all_correct(fz, fy)
    t = fit_temperature(fz, fy) if fitted else 1.0
    return _before_after(z, y, z / t, n_bins, temperature=t, temperature_fitted=fitted)


def _before_after(z: Tensor, y: Tensor, scaled: Tensor, n_bins: int, **temperatures: float) -> dict[str, float]:
    """The report's dict: accuracy, ``n``, the temperatures, and each metric on ``z`` and ``scaled``."""
    before, after = _metrics(z, y, n_bins), _metrics(scaled, y, n_bins)
    out: dict[str, float] = {
        "accuracy": float((z.argmax(1) == y).double().mean()),
        "n": float(z.shape[0]),
        **temperatures,
    }
    for key in before:
        out[f"{key}_before"] = before[key]
        out[f"{key}_after"] = after[key]
    return out


def cross_fitted_report(logits: Any, labels: Any, *, n_bins: int = 15) -> dict[str, float]:
    """:func:`calibration_report` with no oracle and no split lost: each half of the data (even and
    odd indices) is scaled by a temperature fitted on the other half, and the "after" metrics are
    measured on all of it, every example under a temperature fitted without it.

    Use it when the only held-out data is the split being reported on. ``"temperature"`` is the
    geometric mean of the two fitted temperatures; ``"temperature_even"``/``"temperature_odd"``
    are the ones applied to each half. Where either half has no misclassified example no
    temperature is fitted (``"temperature_fitted"`` is ``False``, every temperature 1, as in
    :func:`calibration_report`).
    """
    z = _as_2d(logits, "logits")
    y = _as_labels(labels, z.shape[0], z.shape[1])
    if z.shape[0] < 4:
        raise InvalidScoresError(f"cross-fitting needs at least 4 examples, got {z.shape[0]}")
    even = torch.arange(z.shape[0]) % 2 == 0
    fitted = not (_all_correct(z[~even], y[~even]) or _all_correct(z[even], y[even]))
    t_even, t_odd = (fit_temperature(z[~even], y[~even]), fit_temperature(z[even], y[even])) if fitted else (1.0, 1.0)
    scaled = torch.where(even[:, None], z / t_even, z / t_odd)
    return _before_after(
        z,
        y,
        scaled,
        n_bins,
        temperature=math.sqrt(t_even * t_odd),
        temperature_fitted=fitted,
        temperature_even=t_even,
        temperature_odd=t_odd,
    )
