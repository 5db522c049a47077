"""Calibration metrics and temperature scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jem_plugin import calibration as cal
from jem_plugin.errors import InvalidLabelError, InvalidScoresError


def _numpy_ece_mce(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> tuple[float, float]:
    """Independent reference: Guo et al.'s loop over (lo, hi] bins, in numpy."""
    conf = probs.max(1)
    correct = probs.argmax(1) == labels
    edges = np.linspace(0, 1, n_bins + 1)
    ece, mce = 0.0, 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = (conf > lo) & (conf <= hi)
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - conf[in_bin].mean())
            ece += in_bin.mean() * gap
            mce = max(mce, gap)
    return ece, mce


def _synthetic_calibrated(n: int, k: int, seed: int):
    """Labels drawn from the predicted distribution itself: calibrated by construction."""
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, k, generator=g)
    probs = torch.softmax(logits, 1)
    labels = torch.multinomial(probs, 1, generator=g).squeeze(1)
    return logits, probs, labels


def test_calibrated_predictions_have_ece_near_zero():
    _, probs, labels = _synthetic_calibrated(200_000, 5, 0)
    assert cal.ece(probs, labels) < 0.01
    # and an overconfident version of the same predictor is clearly miscalibrated
    sharp = torch.softmax(torch.log(probs) * 3.0, 1)
    assert cal.ece(sharp, labels) > 0.05


def test_hand_computed_example():
    # confidences 0.85, 0.85, 0.55, 0.55 (no value on a bin edge, also in float32)
    probs = torch.tensor([[0.85, 0.15], [0.15, 0.85], [0.55, 0.45], [0.45, 0.55]])
    labels = torch.tensor([0, 0, 0, 0])  # correct, wrong, correct, wrong
    # n_bins=2: everything in (0.5, 1]: accuracy 0.5, mean confidence 0.7 -> ECE 0.2
    assert cal.ece(probs, labels, n_bins=2) == pytest.approx(0.2)
    # n_bins=10: bin (0.8, 0.9] holds the 0.85s (acc 0.5, gap 0.35), bin (0.5, 0.6] the 0.55s
    # (acc 0.5, gap 0.05): ECE = 0.5 * 0.35 + 0.5 * 0.05 = 0.2, MCE = 0.35
    assert cal.ece(probs, labels, n_bins=10) == pytest.approx(0.2)
    assert cal.mce(probs, labels, n_bins=10) == pytest.approx(0.35)
    p_true = np.array([0.85, 0.15, 0.55, 0.45])
    assert cal.nll(probs, labels) == pytest.approx(-np.mean(np.log(p_true)))
    assert cal.brier(probs, labels) == pytest.approx(np.mean(2 * (1 - p_true) ** 2))
    assert cal.accuracy(probs, labels) == 0.5
    b = cal.calibration_bins(probs, labels, n_bins=10)
    assert b["count"].tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 2, 0]
    np.testing.assert_allclose(b["accuracy"][[5, 8]], [0.5, 0.5])
    assert np.isnan(b["accuracy"][0])


@pytest.mark.parametrize("seed,n_bins", [(0, 15), (1, 10), (2, 7)])
def test_ece_matches_independent_implementations(seed, n_bins):
    logits, _, _ = _synthetic_calibrated(3000, 10, seed)
    labels = torch.randint(0, 10, (3000,), generator=torch.Generator().manual_seed(seed + 100))
    probs = torch.softmax(logits, 1)
    ref_ece, ref_mce = _numpy_ece_mce(probs.double().numpy(), labels.numpy(), n_bins)
    assert cal.ece(probs, labels, n_bins) == pytest.approx(ref_ece, abs=1e-12)
    assert cal.mce(probs, labels, n_bins) == pytest.approx(ref_mce, abs=1e-12)
    assert cal.ece(logits, labels, n_bins, from_logits=True) == pytest.approx(ref_ece, abs=1e-6)

    tm = pytest.importorskip("torchmetrics.functional.classification")
    ref = tm.multiclass_calibration_error(probs, labels, num_classes=10, n_bins=n_bins, norm="l1")
    assert cal.ece(probs, labels, n_bins) == pytest.approx(float(ref), abs=1e-5)
    ref_max = tm.multiclass_calibration_error(probs, labels, num_classes=10, n_bins=n_bins, norm="max")
    assert cal.mce(probs, labels, n_bins) == pytest.approx(float(ref_max), abs=1e-5)


def test_nll_and_brier_from_logits_match_torch():
    logits, probs, labels = _synthetic_calibrated(500, 4, 3)
    assert cal.nll(logits, labels, from_logits=True) == pytest.approx(float(F.cross_entropy(logits.double(), labels)))
    assert cal.nll(probs, labels) == pytest.approx(float(F.cross_entropy(logits.double(), labels)), abs=1e-5)
    onehot = F.one_hot(labels, 4).double()
    assert cal.brier(logits, labels, from_logits=True) == pytest.approx(
        float(((torch.softmax(logits.double(), 1) - onehot) ** 2).sum(1).mean())
    )


def test_temperature_scaling_recovers_known_temperature():
    # Labels drawn from softmax(z); the model reports 2.5 * z: overconfident with T* = 2.5.
    z, _, labels = _synthetic_calibrated(40_000, 10, 4)
    logits = 2.5 * z
    t = cal.fit_temperature(logits, labels)
    assert t == pytest.approx(2.5, rel=0.03)
    before = cal.nll(logits, labels, from_logits=True)
    after = cal.nll(logits / t, labels, from_logits=True)
    assert after < before - 0.1
    scaler = cal.TemperatureScaler().fit(logits, labels)
    assert scaler.temperature == pytest.approx(t)
    torch.testing.assert_close(scaler(logits), logits / t)
    # underconfident logits get T < 1
    assert cal.fit_temperature(0.5 * z, labels) == pytest.approx(0.5, rel=0.03)


def test_temperature_fit_works_inside_inference_mode():
    z, _, labels = _synthetic_calibrated(5000, 10, 5)
    with torch.inference_mode():
        t = cal.fit_temperature(2.0 * z, labels)
    assert t == pytest.approx(2.0, rel=0.06)


def test_calibration_report_before_after():
    z, _, labels = _synthetic_calibrated(20_000, 10, 6)
    r = cal.calibration_report(3.0 * z, labels)
    assert set(r) == {
        "accuracy",
        "n",
        "temperature",
        "temperature_fitted",
        "ece_before",
        "ece_after",
        "mce_before",
        "mce_after",
        "nll_before",
        "nll_after",
        "brier_before",
        "brier_after",
    }
    assert r["temperature"] == pytest.approx(3.0, rel=0.05)
    assert r["ece_after"] < 0.02 < r["ece_before"]
    assert r["nll_after"] < r["nll_before"] and r["brier_after"] < r["brier_before"]
    # held-out protocol: the temperature comes from the fit split only
    z2, _, labels2 = _synthetic_calibrated(20_000, 10, 7)
    r2 = cal.calibration_report(3.0 * z, labels, fit_logits=2.0 * z2, fit_labels=labels2)
    assert r2["temperature"] == pytest.approx(2.0, rel=0.05)
    with pytest.raises(ValueError, match="both"):
        cal.calibration_report(z, labels, fit_logits=z)


def test_cross_fitted_report_scales_each_half_by_the_other_halfs_temperature():
    """No example is scaled by a temperature fitted on it: a model 3x overconfident everywhere gets
    its calibration back, but halves that need different temperatures do not (an oracle would)."""
    z, _, labels = _synthetic_calibrated(20_000, 10, 8)
    r = cal.cross_fitted_report(3.0 * z, labels)
    assert r["n"] == 20_000 and r["temperature"] == pytest.approx(3.0, rel=0.05)
    assert r["ece_after"] < 0.02 < r["ece_before"]
    mixed = z.clone()
    mixed[::2] *= 10.0  # even half far too confident, odd half calibrated
    r = cal.cross_fitted_report(mixed, labels)
    assert r["temperature_even"] == pytest.approx(1.0, rel=0.1)  # fitted on the odd half
    assert r["temperature_odd"] > 5.0  # fitted on the even half
    assert r["ece_after"] > 0.1 > cal.calibration_report(mixed[::2], labels[::2])["ece_after"]
    with pytest.raises(InvalidScoresError, match="at least 4"):
        cal.cross_fitted_report(z[:3], labels[:3])


def test_no_temperature_is_fitted_where_every_prediction_is_right():
    """With no misclassified example the NLL keeps falling as T -> 0: L-BFGS stopped at an
    arbitrary T (0.04 on a perfect 80-image held-out split), and jem train kept those sharpened
    logits. Fitting now refuses, and the reports apply no temperature and say so."""
    z, _, labels = _synthetic_calibrated(400, 5, 9)
    right = z.argmax(1)  # labels the logits always get right
    with pytest.raises(InvalidScoresError, match="every prediction in the fit data is correct"):
        cal.TemperatureScaler().fit(z, right)
    r = cal.calibration_report(z, right)
    assert r["temperature_fitted"] is False and r["temperature"] == 1.0
    assert r["ece_after"] == r["ece_before"] and r["nll_after"] == r["nll_before"]
    held = cal.calibration_report(z, labels, fit_logits=z, fit_labels=right)  # the fit split decides
    assert held["temperature_fitted"] is False and held["ece_after"] == held["ece_before"]
    half = right.clone()
    half[1::2] = labels[1::2]  # the odd half has errors, the even half none
    c = cal.cross_fitted_report(z, half)
    assert c["temperature_fitted"] is False and c["temperature_even"] == c["temperature_odd"] == 1.0
    one_wrong = right.clone()
    one_wrong[0] = (right[0] + 1) % 5  # a single error gives the NLL a minimum again
    assert cal.calibration_report(z, one_wrong)["temperature_fitted"] is True


@pytest.mark.parametrize(
    "probs,labels,exc,match",
    [
        (torch.empty(0, 3), torch.empty(0, dtype=torch.long), InvalidScoresError, "empty"),
        (torch.ones(4), torch.zeros(4, dtype=torch.long), InvalidScoresError, r"\[N, K\]"),
        (torch.tensor([[0.5, 0.5], [0.5, float("nan")]]), torch.tensor([0, 1]), InvalidScoresError, "non-finite"),
        (torch.tensor([[2.0, -1.0]]), torch.tensor([0]), InvalidScoresError, "from_logits=True"),
        (torch.tensor([[0.3, 0.3]]), torch.tensor([0]), InvalidScoresError, "sum to 1"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1]), InvalidLabelError, "one per prediction"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([2]), InvalidLabelError, r"\[0, 2\)"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0.0]), InvalidLabelError, "integer"),
    ],
)
def test_bad_inputs(probs, labels, exc, match):
    with pytest.raises(exc, match=match) as info:
        cal.ece(probs, labels)
    assert isinstance(info.value, ValueError)


def test_bad_bins():
    with pytest.raises(ValueError, match="n_bins"):
        cal.ece(torch.tensor([[0.5, 0.5]]), torch.tensor([0]), n_bins=0)


def test_accepts_numpy_and_lists():
    assert cal.ece(np.array([[0.9, 0.1]]), [0]) == pytest.approx(0.1)
    assert cal.ece([[0.9, 0.1]], np.array([1])) == pytest.approx(0.9)
