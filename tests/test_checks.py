"""The shared helpers of jem_plugin._checks, and the public entry points that rely on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import _checks, calibration, ood
from jem_plugin.builtins.energy_bounded import EnergyBoundedTerm
from jem_plugin.errors import InvalidInputError, InvalidLabelError
from jem_plugin.losses import LossBatch


class TwoLayer(nn.Module):
    """Hand-written classifier (not one the rest of the suite names)."""

    def __init__(self, d: int = 5, k: int = 4) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 16), nn.Linear(16, k)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class BufferOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1, dtype=torch.float64))


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.tensor([0.0, 1.0]), "integer class indices"),
        (torch.tensor([True, False]), "integer class indices"),
        (torch.tensor([[0, 1]]), r"shape \[2\]"),
        (torch.tensor([0, 4]), r"\[0, 4\) for 4 classes; got values from 0 to 4"),
        (torch.tensor([-1, 0]), r"from -1 to 0"),
        (["a", "b"], "integer class indices"),
    ],
)
def test_every_entry_point_rejects_bad_labels_with_the_same_message(bad, match):
    with pytest.raises(InvalidLabelError, match=match):
        _checks.check_labels(bad, 2, num_classes=4)
    if isinstance(bad, torch.Tensor):  # the metrics, the sampler and the attacks give the same answer
        with pytest.raises(InvalidLabelError, match=match):
            calibration.ece(torch.randn(2, 4), bad, from_logits=True)
        jm = jem.wrap(TwoLayer(), num_classes=4, data_range=(-1.0, 1.0), input_size=(5,))
        with pytest.raises(InvalidLabelError, match=match):
            jem.SGLD(steps=1).run(jm, torch.zeros(2, 5), y=bad)


def test_labels_from_lists_and_numpy_become_long_tensors_on_the_device():
    y = _checks.check_labels(np.array([3, 0, 1], dtype=np.int32), 3, num_classes=4, device="cpu")
    assert y.dtype == torch.long and y.tolist() == [3, 0, 1]
    assert _checks.check_labels([1, 2]).tolist() == [1, 2]


def test_free_energy_is_minus_temperature_logsumexp():
    logits = torch.tensor([[0.0, 0.0], [1.0, -2.0]], dtype=torch.float64)
    ref = -torch.log(torch.exp(logits).sum(1))
    torch.testing.assert_close(_checks.free_energy(logits), ref)
    ref_t = -3.0 * torch.log(torch.exp(logits / 3.0).sum(1))
    torch.testing.assert_close(_checks.free_energy(logits, 3.0), ref_t)


def test_unpack_batch_reads_tensors_tuples_and_dicts_with_settable_keys():
    x, y = torch.zeros(2, 3), torch.tensor([0, 1])
    assert _checks.unpack_batch(x) == (x, None)
    assert _checks.unpack_batch((x, y, "extra")) == (x, y)
    got = _checks.unpack_batch({"pixel_values": x, "labels": y})
    assert got[0] is x and got[1] is y
    got = _checks.unpack_batch({"img": x, "target": y}, input_key="img", label_key=("cls", "target"))
    assert got[0] is x and got[1] is y
    with pytest.raises(InvalidInputError, match="'img'"):
        _checks.unpack_batch({"x": x}, input_key="img")
    with pytest.raises(InvalidLabelError, match="holds no labels"):
        _checks.unpack_batch({"x": x}, need_labels=True)


def test_model_device_reads_parameters_then_buffers_then_the_default():
    assert _checks.model_device(TwoLayer()) == torch.device("cpu")
    assert _checks.model_device(BufferOnly()) == torch.device("cpu")
    assert _checks.model_device(nn.ReLU()) is None
    assert _checks.model_device(nn.ReLU(), "cpu") == torch.device("cpu")


def test_ood_scores_and_outlier_loaders_read_dict_batches():
    jm = jem.wrap(TwoLayer(), data_range=(-3.0, 3.0), input_size=(5,))
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    expected = ood.score(jm, x, "logpx", progress=False)
    dicts = [{"pixel_values": x[i : i + 4], "labels": torch.zeros(4)} for i in range(0, 12, 4)]
    torch.testing.assert_close(ood.score(jm, dicts, "logpx", progress=False), expected)
    # energy_bounded's outlier loader goes through the same batch helper (no private ood import)
    term = EnergyBoundedTerm(m_in=-5.0, m_out=-1.0, outliers=dicts)
    logits = jm(x[:4])
    batch = LossBatch(
        x=x[:4],
        y=torch.zeros(4, dtype=torch.long),
        x_data=x[:4],
        logits_data=logits,
        energy_data=_checks.free_energy(logits),
    )
    _, metrics = term(jm, batch)
    torch.testing.assert_close(metrics["e_out"], _checks.free_energy(jm(x[:4])).mean())
