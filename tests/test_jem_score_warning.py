"""The scores that read log p(x) as a trained density (grad_norm, grad_norm_projected,
logpx_sgld, msp_sgld) warn once on a model whose log p(x) was not trained as a JEM."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.errors import UntrainedDensityWarning

ASSUMING = ("grad_norm", "grad_norm_projected", "logpx_sgld", "msp_sgld")
OPTIONS = {"logpx_sgld": {"steps": 1}, "msp_sgld": {"steps": 1}}


def _jm():
    return jem.wrap(nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 3)))


def _x(n=8):
    return torch.rand(n, 6) * 2 - 1


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, UntrainedDensityWarning)]


@pytest.mark.parametrize("name", ASSUMING)
def test_each_jem_score_warns_on_an_untrained_model_naming_the_scores_that_do_not_assume_it(name):
    jm = _jm()
    assert jm.trained_px is None
    found = _caught(lambda: ood.score(jm, _x(), name, **OPTIONS.get(name, {})))
    assert len(found) == 1
    text = str(found[0].message)
    assert f"{name!r} assumes a JEM-trained model" in text and "jm.trained_px" in text
    others = text.split("Scores that do not assume it:")[1]
    for ok in ("logpx", "msp", "max_logit", "odin", "mahalanobis", "knn"):
        assert ok in others
    for needs in ASSUMING:
        assert needs not in others
    assert found[0].filename == __file__  # points at the user's line, not inside the library
    assert issubclass(UntrainedDensityWarning, UserWarning)


def test_warns_once_per_model_across_scores_and_batches():
    jm = _jm()

    def run():
        ood.score(jm, _x(20), "grad_norm", batch_size=4)
        ood.score(jm, _x(), "grad_norm_projected")
        ood.score(jm, _x(), "logpx_sgld", steps=1)

    assert len(_caught(run)) == 1
    assert _caught(lambda: ood.score(jm, _x(), "msp_sgld", steps=1)) == []
    assert len(_caught(lambda: ood.score(_jm(), _x(), "grad_norm"))) == 1  # another model warns again


def test_scores_that_do_not_assume_it_never_warn():
    jm = _jm()
    assert [ood.score_info(n)["assumes_jem"] for n in ASSUMING] == [True] * 4
    for name in ("logpx", "msp", "max_logit", "odin", "gen"):
        assert not ood.score_info(name)["assumes_jem"]
        assert _caught(lambda n=name: ood.score(jm, _x(), n)) == []


def test_no_warning_after_a_jem_loss_training_step():
    jm = _jm()
    loss_fn = jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(100, (6,)), data_noise=0.0)
    with torch.no_grad():  # validation does not train p(x)
        loss_fn(jm, _x(), torch.randint(0, 3, (8,)))
    assert jm.trained_px is None
    loss_fn(jm, _x(), torch.randint(0, 3, (8,))).loss.backward()
    assert jm.trained_px is True
    assert _caught(lambda: [ood.score(jm, _x(), n, **OPTIONS.get(n, {})) for n in ASSUMING]) == []


@pytest.mark.parametrize(
    "weights, trained", [({"px_weight": 0.0}, None), ({"px_weight": 0.0, "pxy_weight": 1.0}, True)]
)
def test_only_a_density_term_marks_the_model(weights, trained):
    jm = _jm()
    buffer = jem.ReplayBuffer(100, (6,), num_classes=3)
    jem.JEMLoss(jem.SGLD(steps=1), buffer, data_noise=0.0, **weights)(jm, _x(), torch.randint(0, 3, (8,)))
    assert jm.trained_px is trained


def test_the_user_silences_it_by_setting_the_flag():
    jm = _jm()
    jm.trained_px = True
    assert _caught(lambda: ood.score(jm, _x(), "grad_norm")) == []
    jm2 = _jm()
    jm2.trained_px = False  # known not trained: still warned, the score is still misleading
    assert len(_caught(lambda: ood.score(jm2, _x(), "grad_norm"))) == 1
