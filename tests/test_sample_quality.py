"""The sample-quality measure: Fréchet distance (closed form) and the independent judge."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jem_plugin.app.data import digits_tensors, uniform_noise
from jem_plugin.errors import InvalidInputError
from jem_plugin.sample_quality import (frechet_distance, frechet_from_moments, reference_points,
                                       sample_quality, train_judge)


def _closed_form_diag(mu_a, var_a, mu_b, var_b):
    # For commuting (diagonal) covariances the matrix square root is elementwise.
    return float(((mu_a - mu_b) ** 2).sum() + (var_a + var_b - 2 * np.sqrt(var_a * var_b)).sum())


def test_frechet_from_moments_matches_the_closed_form():
    mu_a, mu_b = np.array([0.0, 1.0, -2.0]), np.array([1.0, 1.0, 0.5])
    var_a, var_b = np.array([1.0, 4.0, 0.25]), np.array([2.0, 1.0, 1.0])
    got = frechet_from_moments(mu_a, np.diag(var_a), mu_b, np.diag(var_b))
    assert got == pytest.approx(_closed_form_diag(mu_a, var_a, mu_b, var_b), rel=1e-9)
    # non-commuting case: W2^2 between N(0, A) and N(0, I) is tr(A) + d - 2 tr(A^1/2)
    rot = np.array([[np.cos(0.3), -np.sin(0.3)], [np.sin(0.3), np.cos(0.3)]])
    a = rot @ np.diag([4.0, 0.25]) @ rot.T
    assert frechet_from_moments(np.zeros(2), a, np.zeros(2), np.eye(2)) == pytest.approx(
        4.25 + 2 - 2 * (2.0 + 0.5), rel=1e-9)


def test_frechet_distance_of_samples_estimates_the_gaussians_distance():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5])
    b = torch.randn(40000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.5, 1.0, 0.5]) + 1.0
    want = _closed_form_diag(np.zeros(3), np.array([1.0, 4.0, 0.25]), np.ones(3), np.array([2.25, 1.0, 0.25]))
    assert frechet_distance(a, b) == pytest.approx(want, rel=0.03)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)


def test_frechet_distance_rejects_mismatched_features():
    with pytest.raises(InvalidInputError, match="widths"):
        frechet_distance(np.zeros((5, 3)), np.zeros((5, 4)))
    with pytest.raises(InvalidInputError, match="NaN"):
        frechet_distance(np.full((5, 3), np.nan), np.zeros((5, 3)))


@pytest.fixture(scope="module")
def digits_judge():
    torch.set_num_threads(1)
    x, y = digits_tensors("train")
    xt, yt = digits_tensors("test")
    return train_judge(x, y, epochs=8, x_test=xt, y_test=yt), (x, y, xt, yt)


def test_judge_tells_data_from_noise(digits_judge):
    judge, (x, y, xt, yt) = digits_judge
    assert judge.test_accuracy > 0.9
    noise = uniform_noise(len(xt), seed=3)
    q_real = sample_quality(judge, x[: len(xt)], xt, y_samples=y[: len(xt)])
    q_noise = sample_quality(judge, noise, xt, y_samples=yt)
    assert q_real["judge_acc"] > 0.9
    assert q_noise["judge_acc"] < 0.3          # about chance (0.1): noise carries no class
    assert q_noise["fd"] > 20 * q_real["fd"]
    ref = reference_points(judge, xt, train=x, init=noise)
    assert ref["heldout_halves"] < ref["init"] / 10
    assert ref["train"] < ref["init"] / 10


def test_judge_refuses_inputs_of_another_shape(digits_judge):
    judge, _ = digits_judge
    with pytest.raises(InvalidInputError, match="shape"):
        judge.features(torch.zeros(4, 3, 32, 32))
