"""The detector contract (issue 60, item 3): a detector written against ``jem.ood.Detector``
alone, as a plugin would, declares its metadata, its memory and how its fit combines across ranks
on its class, and gets the fit, the scoring, the streaming fit, the shared forward of
``evaluate_all`` and the memory refusal of the built-in ones."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import Tensor, nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.errors import MemoryLimitError


class CentreDistance(ood.Detector):
    """Minus the distance of the logits to their mean over the fit data."""

    name = "centre_distance"
    description = "test: minus the distance of the logits to their fit mean"
    paper = "none"
    reads = frozenset({"logits"})
    across_ranks = "reduce"
    _rank_stats = (("_sum", "sum"), ("_n", "sum"))

    def memory_estimate(self, shape: ood.FitShape) -> ood.Estimate | None:
        if shape.classes is None:
            return None
        k, b = shape.classes, shape.batch or 0
        return ood.Estimate(k * 8 * 2 + b * k * 8, f"the mean of {k} logits (float64)", "use fewer classes")

    def _begin(self, jm) -> None:
        self._sum: Tensor | None = None
        self._n = 0

    def _add_outputs(self, outputs: ood.Outputs, y: Tensor | None) -> None:
        z = outputs.logits.double()
        self._sum = z.sum(0) if self._sum is None else self._sum + z.sum(0)
        self._n += z.shape[0]

    def _finish(self, jm) -> None:
        assert self._sum is not None
        self.centre = (self._sum / self._n).float()
        del self._sum, self._n

    def _score_outputs(self, jm, outputs: ood.Outputs) -> Tensor:
        return -(outputs.logits.float() - self.centre.to(outputs.logits.device)).norm(dim=1)


class Plugin:
    @jem.hookimpl
    def jem_register_ood_scores(self, register):
        c = CentreDistance
        register(c.name, c, needs_grad=c.needs_grad, needs_fit=c.needs_fit, description=c.description)


@pytest.fixture
def setup():
    torch.manual_seed(0)
    jm = jem.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), data_range=(-20.0, 20.0)).eval()
    g = torch.Generator().manual_seed(1)
    x_fit, x_in = torch.randn(300, 8, generator=g), torch.randn(50, 8, generator=g)
    x_out = torch.randn(50, 8, generator=g) * 3.0
    return jm, x_fit, x_in, x_out


def _expected(jm, x_fit, x):
    with torch.no_grad():
        centre = jm.logits(x_fit).double().mean(0).float()
        return -(jm.logits(x) - centre).norm(dim=1)


def test_a_detector_written_against_the_base_class_fits_scores_and_streams(setup):
    jm, x_fit, x_in, _ = setup
    det = CentreDistance().fit(jm, x_fit, batch_size=64)
    assert det.fitted and "fitted" in repr(det)
    torch.testing.assert_close(det.score(jm, x_in), _expected(jm, x_fit, x_in))
    torch.testing.assert_close(ood.score(jm, x_in, det), _expected(jm, x_fit, x_in))
    # streaming, from outputs computed by the caller
    streamed = CentreDistance()
    streamed.begin_fit(jm, rows=300)
    for x in x_fit.split(70):
        streamed.add_outputs(ood.outputs(jm, x, reads=streamed.reads))
    assert streamed.end_fit(jm) is True
    out = ood.outputs(jm, x_in, reads=streamed.reads)
    torch.testing.assert_close(ood.score_outputs(jm, out, streamed), det.score(jm, x_in))
    torch.testing.assert_close(
        CentreDistance().fit_outputs(jm, ood.outputs(jm, x_fit)).score(jm, x_in), det.score(jm, x_in)
    )
    # the fitted state pickles without the link to the network
    again = pickle.loads(pickle.dumps(det))
    torch.testing.assert_close(again.score(jm, x_in), det.score(jm, x_in))
    with pytest.raises(jem.errors.NotFittedError, match="centre_distance detector is not fitted"):
        CentreDistance().score(jm, x_in)


def test_a_plugin_detector_is_registered_compared_and_refused_on_memory(setup):
    jm, x_fit, x_in, x_out = setup
    name = jem.register(Plugin())
    try:
        info = ood.score_info("centre_distance")
        assert info["needs_fit"] and info["reads"] == {"logits"} and info["across_ranks"] == "reduce"
        s = ood.score(jm, x_in, "centre_distance", fit_data=x_fit)
        torch.testing.assert_close(s, _expected(jm, x_fit, x_in))
        table = ood.evaluate_all(jm, x_in, {"far": x_out}, ["centre_distance", "msp"], fit_data=x_fit, progress=False)
        assert table.rows()[0]["status"] == "ok"
        torch.testing.assert_close(table.scores["centre_distance"]["in"], _expected(jm, x_fit, x_in))
        # its own estimate, checked before it allocates: refused in one line naming its setting
        small = ood.detector("centre_distance", memory_limit=100)
        with pytest.raises(
            MemoryLimitError, match=r"centre_distance: this fit would need about .* for the mean of 4 logits"
        ):
            small.fit(jm, x_fit, batch_size=64)
        assert not small.fitted and vars(small).get("_sum") is None  # refused on the first batch, before adding it
        assert ood.detector("centre_distance", memory_limit=1 << 20).fit(jm, x_fit).fitted
    finally:
        jem.unregister(name=name)
