"""Paths CI did not take and degenerate features (issue 60, item 5): knn's default search takes
faiss (installed by the test extra), NCI on features constant across inputs, ViM's cut among the
directions dead units leave without variance."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.builtins.posthoc.knn import _faiss

D, K = 24, 5


class Net(nn.Module):
    """Its input is the feature vector; a linear head."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(D, K, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _jm(bias: bool = True):
    torch.manual_seed(0)
    return jem.wrap(Net(bias), features="fc", data_range=(-50.0, 50.0))


def _data(n: int = 600, dead: int = 0):
    """Labelled features; the last ``dead`` units exactly 0 for every input."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, K, (n,), generator=g)
    x = torch.randn(n, D, generator=g) + 3.0 * torch.nn.functional.one_hot(y, D).float()
    x[:, D - dead :] = 0.0
    return x, y


def test_knn_default_search_takes_faiss_and_finds_the_same_neighbours():
    assert _faiss() is not None, "faiss-cpu is in the test extra: pip install -e '.[test]'"
    jm, (x, y) = _jm(), _data()
    auto = jem.ood.detector("knn", k=7).fit(jm, (x, y))
    exact = jem.ood.detector("knn", k=7, search="torch").fit(jm, (x, y))
    z = torch.cat([x[:50], x[:50] + 2.0])
    got = auto.score(jm, z)
    assert auto.search == "auto" and auto.__dict__.get("_index") is not None  # searched by faiss's index
    assert exact.__dict__.get("_index") is None
    torch.testing.assert_close(got, exact.score(jm, z), rtol=1e-5, atol=1e-5)


def test_nci_is_finite_on_features_constant_across_inputs():
    """Features equal for every input sit at the training mean: no direction, alignment 0 (before:
    0 / 0, NaN for every input)."""
    jm = _jm()
    x = torch.full((40, D), 0.25)
    det = jem.ood.detector("nci").fit(jm, (x, torch.zeros(40, dtype=torch.long)))
    scores = det.score(jm, x[:8])
    assert torch.isfinite(scores).all() and torch.equal(scores, torch.zeros(8))
    moved = det.score(jm, x[:8] + torch.randn(8, D))
    assert torch.isfinite(moved).all() and moved.abs().max() > 0  # away from the mean: the alignment as before
    with_norm = jem.ood.detector("nci", alpha=0.5).fit(jm, (x, torch.zeros(40, dtype=torch.long)))
    torch.testing.assert_close(with_norm.score(jm, x[:8]), torch.full((8,), 0.5 * 0.25 * D))


def test_vim_warns_in_one_line_when_its_cut_falls_among_dead_units():
    """Half the units exactly 0 (and a head without bias, so its origin adds no direction): the
    features vary in 12 of 24 directions, and the default dim=12 leaves a residual of none."""
    jm, data = _jm(bias=False), _data(dead=D // 2)
    with pytest.warns(RuntimeWarning) as caught:
        jem.ood.detector("vim").fit(jm, data)
    lines = [str(w.message) for w in caught if "vim:" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "vary in 12 of 24 directions" in lines[0] and "dim=12" in lines[0] and "pass dim=6" in lines[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dim it names fits: no warning
        det = jem.ood.detector("vim", dim=6).fit(jm, data)
    assert torch.isfinite(det.score(jm, data[0][:20])).all() and det.principal_dim == 6


def test_vim_says_nothing_where_every_unit_varies():
    jm, data = _jm(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jem.ood.detector("vim").fit(jm, data)
