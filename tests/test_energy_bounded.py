"""Energy-bounded fine-tuning (Liu et al. 2020) as a loss-term plugin."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin import ood, plugins
from jem_plugin.builtins.energy_bounded import EnergyBoundedTerm, calibrate_margins, energy_bounded_loss, free_energy
from jem_plugin.errors import InvalidInputError
from jem_plugin.losses import JEMLoss

CENTERS = torch.tensor([[1.0, 0.0], [-0.5, 0.87], [-0.5, -0.87]])


def _blobs(n: int, g: torch.Generator):
    y = torch.randint(0, 3, (n,), generator=g)
    return CENTERS[y] + 0.25 * torch.randn(n, 2, generator=g), y


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 3))


def _wrap(model):
    return jem.wrap(model, data_range=(-4.0, 4.0), input_size=(2,))


def test_loss_by_hand():
    e_in, e_out = torch.tensor([-3.0, -1.0]), torch.tensor([-10.0, -4.0])
    # in: relu([-1, 1])^2 -> mean 0.5; out: relu([5, -1])^2 -> mean 12.5
    assert float(energy_bounded_loss(e_in, e_out, m_in=-2.0, m_out=-5.0)) == pytest.approx(13.0)
    assert float(energy_bounded_loss(e_in, e_out, m_in=0.0, m_out=-20.0)) == 0.0


def test_free_energy_matches_pytorch_ood():
    detector = pytest.importorskip("pytorch_ood.detector")
    logits = 5 * torch.randn(32, 7)
    for t in (1.0, 2.0):
        torch.testing.assert_close(free_energy(logits, t), detector.EnergyBased.score(logits, t=t), atol=1e-6, rtol=0)


def test_calibrate_margins_rule():
    e_in = torch.tensor([-12.0, -10.0, -8.0, -6.0, -4.0])
    e_out = torch.tensor([-5.0, -3.0, -1.0])
    assert calibrate_margins(e_in, e_out) == (-8.0, -3.0)  # medians, already >= min_gap apart
    assert calibrate_margins(e_in, e_out, q_in=0.25, q_out=0.75) == (-10.0, -2.0)
    # outliers currently LOWER in energy than the data: margins straddle the midpoint
    m_in, m_out = calibrate_margins(e_out - 10, e_in, min_gap=2.0)  # medians -13 and -8 -> fine
    assert (m_in, m_out) == (-13.0, -8.0)
    m_in, m_out = calibrate_margins(e_in, e_out - 10, min_gap=2.0)  # medians -8 and -13
    assert (m_in, m_out) == pytest.approx((-11.5, -9.5))
    with pytest.raises(ValueError, match="q_in"):
        calibrate_margins(e_in, e_out, q_in=1.5)
    with pytest.raises(InvalidInputError, match="non-finite"):
        calibrate_margins(torch.tensor([float("nan")]), e_out)


def test_registered_through_the_hook():
    entry = plugins.lookup("jem_register_loss_terms", "energy_bounded", "loss term")
    assert entry["item"] is EnergyBoundedTerm
    term = JEMLoss(px_weight=0.0).add_term("energy_bounded", m_in=-5.0, m_out=-1.0)
    assert isinstance(term, EnergyBoundedTerm) and (term.m_in, term.m_out) == (-5.0, -1.0)


def test_default_margins_come_from_the_models_own_energies():
    model = _mlp()
    jm = _wrap(model)
    g = torch.Generator().manual_seed(0)
    x, y = _blobs(64, g)
    x_out = 3.0 * torch.randn(64, 2, generator=g)
    loss_fn = JEMLoss(px_weight=0.0, data_noise=0.0)
    term = loss_fn.add_term("energy_bounded", outliers=lambda x: x_out, calibration_size=128)
    out1 = loss_fn(jm, x, y)  # 64 of 128 calibration energies: no loss yet
    assert not term.calibrated and out1.metrics["energy_bounded"] == 0.0
    out2 = loss_fn(jm, x, y)  # 128 collected: margins fixed, loss on
    with torch.no_grad():
        e_in, e_out = free_energy(model(x)), free_energy(model(x_out))
    expected = calibrate_margins(torch.cat([e_in, e_in]), torch.cat([e_out, e_out]))
    assert (term.m_in, term.m_out) == pytest.approx(expected, abs=1e-5)
    assert out2.metrics["energy_bounded/m_in"] == pytest.approx(expected[0], abs=1e-5)
    assert out2.metrics["energy_bounded"] == pytest.approx(
        0.1 * float(energy_bounded_loss(e_in, e_out, *expected)), rel=1e-4
    )
    # a resumed run keeps the measured margins
    fresh = JEMLoss(px_weight=0.0, data_noise=0.0)
    fresh.add_term("energy_bounded", outliers="uniform")
    fresh.load_state_dict(loss_fn.state_dict())
    assert (fresh._all_terms()[0][1].m_in, fresh._all_terms()[0][1].m_out) == (term.m_in, term.m_out)


def test_outliers_from_a_loader_cycle_and_from_the_batch():
    jm = _wrap(_mlp())
    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(3 * torch.randn(20, 2, generator=g), torch.zeros(20)), batch_size=8)
    term = EnergyBoundedTerm(m_in=-5.0, m_out=-1.0, outliers=loader)
    x, y = _blobs(16, g)
    from jem_plugin.losses import LossBatch

    logits = jm(x)
    batch = LossBatch(x=x, y=y, x_data=x, logits_data=logits, energy_data=free_energy(logits))
    for _ in range(5):  # 3 loader batches per epoch: cycles into a second epoch
        loss, metrics = term(jm, batch)
        assert loss.dim() == 0 and torch.isfinite(loss)
    # outliers=None reads batch.extra["x_outlier"], and says what to do when it is missing
    term_none = EnergyBoundedTerm(m_in=-5.0, m_out=-1.0)
    batch.extra["x_outlier"] = 3 * torch.randn(5, 2)
    assert torch.isfinite(term_none(jm, batch)[0])
    del batch.extra["x_outlier"]
    with pytest.raises(InvalidInputError, match="outliers=<DataLoader"):
        term_none(jm, batch)
    with pytest.raises(InvalidInputError, match="outlier inputs must be a tensor"):
        EnergyBoundedTerm(m_in=-5.0, m_out=-1.0, outliers=lambda x: torch.zeros(3, 5))(jm, batch)


def test_bad_options():
    with pytest.raises(ValueError, match="both"):
        EnergyBoundedTerm(m_in=-5.0)
    with pytest.raises(ValueError, match="below"):
        EnergyBoundedTerm(m_in=-1.0, m_out=-5.0)
    with pytest.raises(ValueError, match="outliers"):
        EnergyBoundedTerm(outliers="gaussian")
    with pytest.raises(ValueError, match="weight"):
        EnergyBoundedTerm(weight=-1.0)


def test_outliers_from_sgld_samples():
    jm = _wrap(_mlp())
    from jem_plugin.sampling import SGLD

    loss_fn = JEMLoss(
        sampler=SGLD(steps=2, step_size=0.1, noise=0.01),
        buffer=jem.ReplayBuffer(256, (2,)),
        px_weight=1.0,
        data_noise=0.0,
    )
    loss_fn.add_term("energy_bounded", outliers="samples", calibration_size=1)
    x, y = _blobs(32, torch.Generator().manual_seed(2))
    out = loss_fn(jm, x, y)
    assert "energy_bounded/m_out" in out.metrics
    assert out.metrics["energy_bounded/e_out"] == pytest.approx(out.metrics["energy_sample"], abs=1e-4)


@pytest.mark.slow
def test_fine_tuning_separates_energies_and_keeps_accuracy():
    """A classifier extrapolates with confident logits far from the data (AUROC < 0.5); fine-tuning
    with measured margins and uniform outliers fixes that without hurting accuracy."""
    model = _mlp()
    jm = _wrap(model)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    ce = JEMLoss(px_weight=0.0, data_noise=0.0)
    for _ in range(200):
        x, y = _blobs(128, g)
        opt.zero_grad()
        ce(jm, x, y).loss.backward()
        opt.step()
    x_test, y_test = _blobs(1000, g)
    far = torch.rand(2000, 2, generator=g) * 8 - 4
    far = far[far.norm(dim=1) > 2]  # away from the three blobs

    def evaluate():
        with torch.no_grad():
            acc = float((jm(x_test).argmax(1) == y_test).float().mean())
        r = ood.evaluate(ood.score(jm, x_test, progress=False), ood.score(jm, far, progress=False))
        return acc, r["auroc"]

    acc0, auroc0 = evaluate()
    assert acc0 > 0.97 and auroc0 < 0.6
    eb = JEMLoss(px_weight=0.0, data_noise=0.0)
    eb.add_term("energy_bounded", outliers="uniform", generator=torch.Generator().manual_seed(1))
    for _ in range(200):
        x, y = _blobs(128, g)
        opt.zero_grad()
        eb(jm, x, y).loss.backward()
        opt.step()
    acc1, auroc1 = evaluate()
    assert auroc1 > 0.95
    assert acc1 >= acc0 - 0.01
