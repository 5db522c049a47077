"""The sample-quality measure: Fréchet distance (closed form) and the independent judge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jem_plugin.app.data import digits_tensors, uniform_noise
from jem_plugin.errors import InvalidInputError
from jem_plugin.sample_quality import (
    JudgeArch,
    frechet_distance,
    frechet_from_moments,
    reference_points,
    sample_quality,
    train_judge,
)


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
        4.25 + 2 - 2 * (2.0 + 0.5), rel=1e-9
    )


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
    return train_judge(x, y, epochs=8, test=(xt, yt)), (x, y, xt, yt)


def test_judge_tells_data_from_noise(digits_judge):
    judge, (x, y, xt, yt) = digits_judge
    assert judge.test_accuracy > 0.9
    noise = uniform_noise(len(xt), seed=3)
    q_real = sample_quality(judge, x[: len(xt)], xt, y_samples=y[: len(xt)])
    q_noise = sample_quality(judge, noise, xt, y_samples=yt)
    assert q_real["judge_acc"] > 0.9
    assert q_noise["judge_acc"] < 0.3  # about chance (0.1): noise carries no class
    assert q_noise["fd"] > 20 * q_real["fd"]
    ref = reference_points(judge, xt, train=x, init=noise)
    assert ref["heldout_halves"] < ref["init"] / 10
    assert ref["train"] < ref["init"] / 10


def test_train_judge_takes_its_size_as_an_arch_and_the_held_out_pair_as_test():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 8, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    xt, yt = x[:16], y[:16]
    judge = train_judge(x, y, epochs=1, arch=JudgeArch(width=4, feature_dim=8), test=(xt, yt))
    assert judge.test_accuracy is not None
    assert judge.net.head.in_features == 8 and judge.net.body[0].out_channels == 4
    for old in ("x_test", "y_test", "width", "feature_dim"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            train_judge(x, y, epochs=0, **{old: None})
    with pytest.raises(TypeError, match="held-out pair"):
        train_judge(x, y, epochs=0, test=xt)
    with pytest.raises(ValueError, match="width"):
        JudgeArch(width=0)


def test_judge_refuses_inputs_of_another_shape(digits_judge):
    judge, _ = digits_judge
    with pytest.raises(InvalidInputError, match="shape"):
        judge.features(torch.zeros(4, 3, 32, 32))


# ---------------------------------------------------------------- chain_trace
class _Wells(torch.nn.Module):
    """logits_k = -|x - mu_k|^2 / 2: an energy whose gradient leads to the class means."""

    def __init__(self, means):
        super().__init__()
        self.register_buffer("means", means.flatten(1))

    def forward(self, x):
        return -0.5 * torch.cdist(x.flatten(1), self.means).square()


class _Tilt(torch.nn.Module):
    """logits = x . w for one fixed direction: low energy at a corner of the domain, nowhere near data."""

    def __init__(self, dim):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(dim, 10, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return x.flatten(1) @ self.w


def _jem(model):
    import jem_plugin as jem

    return jem.wrap(model, data_range=(-1.0, 1.0), input_size=(1, 8, 8), num_classes=10)


def test_chain_trace_follows_a_landscape_that_leads_to_the_data(digits_judge):
    import jem_plugin as jem
    from jem_plugin.sample_quality import chain_trace

    judge, (x, y, xt, yt) = digits_judge
    means = torch.stack([x[y == k].mean(0) for k in range(10)])
    sampler = jem.SGLD(steps=5, step_size=0.1, noise=0.0)
    before = sampler.state_dict()
    x0 = uniform_noise(100, seed=4)
    out = chain_trace(_jem(_Wells(means)), judge, x0, xt, sampler=sampler, rounds=(0, 2, 10), batch_size=32)
    e = [row["energy"] for row in out["trace"]]
    fd = [row["fd"] for row in out["trace"]]
    assert [row["steps"] for row in out["trace"]] == [0, 10, 50]
    assert e[0] > e[1] > e[2] and fd[0] > fd[1] > fd[2], out
    assert fd[2] < 0.5 * fd[0] and e[2] < out["heldout_energy"]
    assert sampler.state_dict() == before, "the caller's sampler is left as it was"


def test_chain_trace_shows_chains_that_fool_the_model(digits_judge):
    """Energy below the data's while the judge's distance grows: the signature the README quotes."""
    import jem_plugin as jem
    from jem_plugin.sample_quality import chain_trace

    judge, (x, y, xt, yt) = digits_judge
    start = xt[:100].clone()
    out = chain_trace(
        _jem(_Tilt(64)), judge, start, xt, sampler=jem.SGLD(steps=5, step_size=0.05, noise=0.0), rounds=(0, 10)
    )
    first, last = out["trace"]
    assert last["energy"] < out["heldout_energy"] and last["energy"] < first["energy"]
    assert last["fd"] > 3 * first["fd"], out


def test_chain_trace_rejects_bad_rounds(digits_judge):
    import jem_plugin as jem
    from jem_plugin.sample_quality import chain_trace

    judge, (x, y, xt, yt) = digits_judge
    with pytest.raises(ValueError, match="increasing"):
        chain_trace(_jem(_Tilt(64)), judge, xt[:8], xt, sampler=jem.SGLD(steps=1), rounds=(4, 2))


def test_a_process_trains_one_judge_per_data_set_and_seed(monkeypatch):
    """jem train, jem sample and the demo each train a judge at the end (seconds): the same data and
    seed give the same judge, so a process that runs them again on one data set trains it once, and
    any other data or seed gets its own."""
    from torch.utils.data import TensorDataset

    from jem_plugin.app import sample_checks

    calls = []
    real = sample_checks.train_judge

    def counted(*args, **kwargs):
        calls.append(kwargs["seed"])
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_checks, "train_judge", counted)
    monkeypatch.setattr(sample_checks, "_JUDGES", type(sample_checks._JUDGES)())
    x, y = digits_tensors("train")
    train, held = TensorDataset(x[:200], y[:200]), TensorDataset(x[200:260], y[200:260])
    ask = lambda seed, ds=train: sample_checks._judge_for(ds, held, 10, torch.Generator().manual_seed(0), seed, 200, 60)
    first, xh, _ = ask(0)
    again, xh2, _ = ask(0)
    assert again is first and torch.equal(xh, xh2) and calls == [0]
    assert ask(1)[0] is not first and calls == [0, 1]  # another seed
    other = TensorDataset(x[:200].flip(-1), y[:200])
    assert ask(0, other)[0] is not first and calls == [0, 1, 0]  # other images
    sample_checks._JUDGES.clear()
    fresh, _, _ = ask(0)  # trained anew: the kept judge is the one training gives
    assert fresh is not first and calls == [0, 1, 0, 0]
    assert torch.equal(fresh.features(xh), first.features(xh)) and fresh.test_accuracy == first.test_accuracy
