"""OOD scores and metrics: equal to the reference libraries, plugin-extensible, robust to bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyCNN
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.errors import InvalidInputError, InvalidScoresError, UnknownNameError

pytest.importorskip("pytorch_ood")
from pytorch_ood.detector import EnergyBased, MaxLogit, MaxSoftmax  # noqa: E402 (after the importorskip above)
from pytorch_ood.metrics import OODMetrics  # noqa: E402 (after the importorskip above)
from sklearn.metrics import average_precision_score, roc_auc_score  # noqa: E402 (kept with the imports above)


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = TinyCNN()
    # Spread the logits out so softmax/logsumexp are not all near log(10).
    with torch.no_grad():
        m.head.weight.mul_(20.0)
    return m


@pytest.fixture
def jm(model):
    return jem.wrap(model, data_range=(0.0, 1.0), input_size=(1, 8, 8))


@pytest.fixture
def x():
    return torch.rand(64, 1, 8, 8)


# ---------------------------------------------------------------- equality with pytorch-ood
@pytest.mark.parametrize("t", [1.0, 2.5, 1000.0])
def test_logpx_equals_pytorch_ood_energy(model, jm, x, t):
    model.eval()
    ours = ood.score(jm, x, "logpx", temperature=t, progress=False)
    theirs = -EnergyBased(model, t=t)(x)  # pytorch-ood: energy = outlier score
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("t", [1.0, 1000.0])
def test_msp_equals_pytorch_ood_maxsoftmax(model, jm, x, t):
    model.eval()
    ours = ood.score(jm, x, "msp", temperature=t, progress=False)
    theirs = -MaxSoftmax(model, t=t)(x)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_max_logit_equals_pytorch_ood(model, jm, x):
    model.eval()
    torch.testing.assert_close(ood.score(jm, x, "max_logit", progress=False), -MaxLogit(model)(x), atol=1e-6, rtol=0)


def test_score_runs_in_eval_mode_and_restores_train_mode(model, jm, x):
    model.train()
    bn = model.features[1]
    before = bn.running_mean.clone()
    a = ood.score(jm, x, "logpx", progress=False)
    b = ood.score(jm, x, "logpx", progress=False)
    assert model.training and bn.training  # restored
    torch.testing.assert_close(bn.running_mean, before)  # BatchNorm statistics untouched
    torch.testing.assert_close(a, b)  # deterministic: Dropout was off


# ---------------------------------------------------------------- metrics
def _random_scores(seed: int, n_in: int, n_out: int, ties: bool):
    g = np.random.default_rng(seed)
    s_in = g.normal(1.0, 1.0, n_in)
    s_out = g.normal(0.0, 1.0, n_out)
    if ties:  # coarse rounding creates many ties within and across the sets
        s_in, s_out = np.round(s_in, 1), np.round(s_out, 1)
    return torch.tensor(s_in, dtype=torch.float32), torch.tensor(s_out, dtype=torch.float32)


def _pytorch_ood_metrics(outlier_scores: torch.Tensor, is_ood: torch.Tensor) -> dict:
    m = OODMetrics()
    m.update(outlier_scores, torch.where(is_ood, -1, 0))  # pytorch-ood: label < 0 marks OOD
    return m.compute()


@pytest.mark.parametrize(
    "seed,n_in,n_out,ties", [(0, 200, 150, False), (1, 37, 500, True), (2, 1000, 20, True), (3, 20, 19, False)]
)
def test_evaluate_matches_pytorch_ood_and_sklearn(seed, n_in, n_out, ties):
    s_in, s_out = _random_scores(seed, n_in, n_out, ties)
    s = torch.cat([s_in, s_out])
    is_out = torch.cat([torch.zeros(n_in, dtype=torch.bool), torch.ones(n_out, dtype=torch.bool)])

    # positive="out": pytorch-ood's own convention (OOD positive, outlier score = -ours).
    ours = ood.evaluate(s_in, s_out, positive="out", aupr="trapezoid")
    ref = _pytorch_ood_metrics(-s, is_out)
    assert ours["auroc"] == pytest.approx(ref["AUROC"], abs=1e-12)
    assert ours["fpr95"] == pytest.approx(ref["FPR95TPR"], abs=1e-12)
    assert ours["aupr_in"] == pytest.approx(ref["AUPR-IN"], abs=1e-12)
    assert ours["aupr_out"] == pytest.approx(ref["AUPR-OUT"], abs=1e-12)

    # positive="in" (Liu et al.): the same library with the roles swapped, i.e. in-distribution
    # samples labelled as pytorch-ood's positives and our score as its outlier score.
    ours_in = ood.evaluate(s_in, s_out, aupr="trapezoid")
    ref_in = _pytorch_ood_metrics(s, ~is_out)
    assert ours_in["fpr95"] == pytest.approx(ref_in["FPR95TPR"], abs=1e-12)
    assert ours_in["auroc"] == pytest.approx(ref_in["AUROC"], abs=1e-12)

    # default AUPR is scikit-learn's average precision; AUROC is scikit-learn's too.
    default = ood.evaluate(s_in, s_out)
    y_in = (~is_out).numpy().astype(int)
    assert default["auroc"] == pytest.approx(roc_auc_score(y_in, s.numpy()), abs=1e-12)
    assert default["aupr_in"] == pytest.approx(average_precision_score(y_in, s.numpy()), abs=1e-12)
    assert default["aupr_out"] == pytest.approx(average_precision_score(1 - y_in, -s.numpy()), abs=1e-12)


def test_fpr95_by_hand():
    # 20 in-distribution scores 1..20; keeping 95% of them (19) needs threshold 2.
    s_in = torch.arange(1, 21, dtype=torch.float32)
    # OOD scores: 4 of 10 are >= 2, so 40% of OOD inputs are still accepted.
    s_out = torch.tensor([0.0, 0.5, 1.0, 1.5, 1.9, 1.95, 2.0, 3.0, 10.0, 25.0])
    assert ood.evaluate(s_in, s_out)["fpr95"] == pytest.approx(0.4)
    # OOD positive: catching 95% of OOD (10 of 10) needs threshold -25 on -score, which
    # rejects every in-distribution input.
    assert ood.evaluate(s_in, s_out, positive="out")["fpr95"] == pytest.approx(1.0)
    perfect = ood.evaluate(torch.tensor([5.0, 6.0]), torch.tensor([1.0, 2.0]))
    assert perfect == {"auroc": 1.0, "aupr_in": 1.0, "aupr_out": 1.0, "fpr95": 0.0}


@pytest.mark.parametrize(
    "bad_in,bad_out,match",
    [
        ([], [1.0], "scores_in is empty"),
        ([1.0], torch.tensor([]), "scores_out is empty"),
        (torch.ones(3, 2), [1.0], "1-D"),
        ([1.0, float("nan")], [0.0], "non-finite"),
        ([1.0], [0.0, float("inf")], "non-finite"),
        (["a"], [0.0], "1-D array of numbers"),
    ],
)
def test_evaluate_rejects_bad_scores(bad_in, bad_out, match):
    with pytest.raises(InvalidScoresError, match=match) as info:
        ood.evaluate(bad_in, bad_out)
    assert isinstance(info.value, ValueError)


def test_evaluate_rejects_bad_options():
    with pytest.raises(ValueError, match="positive"):
        ood.evaluate([1.0], [0.0], positive="ood")


# ---------------------------------------------------------------- gradient score
def test_grad_norm_matches_per_example_gradient(model, jm, x):
    model.eval()
    expected = []
    for xi in x[:8]:
        xi = xi.unsqueeze(0).requires_grad_(True)
        (g,) = torch.autograd.grad(torch.logsumexp(model(xi), 1).sum(), xi)
        expected.append(-g.norm())
    got = ood.score(jm, x[:8], "grad_norm", progress=False)
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_grad_norm_under_no_grad_and_inference_mode(model, jm, x, context):
    model.train()
    reference = ood.score(jm, x, "grad_norm", progress=False)
    with context():
        xi = x.clone()  # created inside the context, as in a Lightning eval step
        got = ood.score(jm, xi, "grad_norm", progress=False)
    torch.testing.assert_close(got, reference)
    assert all(p.grad is None for p in model.parameters())  # no parameter gradient touched
    assert all(p.requires_grad for p in model.parameters())  # frozen only while scoring
    assert model.training  # mode restored
    assert (got < 0).all()


def test_grad_norm_separates_far_inputs_from_data(jm, x):
    # Far outside the data the logits are much steeper: -||grad|| is much lower there.
    s_in = ood.score(jm, x, "grad_norm", progress=False)
    s_far = ood.score(jm, 50.0 * torch.randn_like(x), "grad_norm", progress=False)
    assert ood.evaluate(s_in, s_far)["auroc"] > 0.9


def test_grad_norm_projected_drops_only_components_leaving_the_domain():
    """A linear energy: d log p/dx = w everywhere. At a pixel on the lower bound with w < 0 (or
    on the upper bound with w > 0) the density rises out of the domain: projected, that
    component is dropped; inside the domain, or pointing inwards, it is kept."""
    w = torch.tensor([[-3.0, 4.0, 2.0, -1.0]])
    lin = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    jm = jem.wrap(lin, data_range=(-1.0, 1.0), num_classes=1)
    x = torch.tensor(
        [
            [-1.0, 1.0, 0.2, -0.3],  # pixels 0 and 1 saturated, pointing outwards
            [-1.0, -1.0, 1.0, 1.0],  # all saturated: 0 and 2 point out, 1 and 3 in
            [0.1, 0.2, 0.3, 0.4],
        ]
    )  # strictly inside
    plain = ood.score(jm, x, "grad_norm", progress=False)
    projected = ood.score(jm, x, "grad_norm_projected", progress=False)
    torch.testing.assert_close(plain, torch.full((3,), -(30.0**0.5)))
    torch.testing.assert_close(projected, torch.tensor([-(5.0**0.5), -(17.0**0.5), -(30.0**0.5)]))
    torch.testing.assert_close(ood.score(jm, x, "grad_norm", project=True, progress=False), projected)


def test_grad_norm_projected_uses_per_channel_domain():
    """timm-style normalised inputs: the bounds are per channel, in the loader's space."""
    lin = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 1, bias=False))
    with torch.no_grad():
        lin[1].weight.copy_(torch.tensor([[-1.0, -1.0]]))
    jm = jem.wrap(lin, mean=(0.5, 0.0), std=(0.5, 1.0), num_classes=1)  # channel lows: -1 and 0
    x = torch.tensor([[-1.0, 0.0]]).reshape(1, 2, 1, 1)  # both channels at their own lower bound
    assert float(ood.score(jm, x, "grad_norm_projected", progress=False)) == 0.0
    x = torch.tensor([[-1.0, 0.5]]).reshape(1, 2, 1, 1)  # channel 1 inside
    assert float(ood.score(jm, x, "grad_norm_projected", progress=False)) == -1.0


def test_sgld_refined_scores(jm, x):
    pytest.importorskip("jem_plugin.sampling")
    s = ood.score(jm, x, "logpx_sgld", steps=3, progress=False)
    assert s.shape == (x.shape[0],) and torch.isfinite(s).all()
    with torch.inference_mode():
        s2 = ood.score(jm, x, "msp_sgld", steps=2, progress=False)
    assert ((s2 > 0) & (s2 <= 1)).all()
    # options reach the sampler: a seeded generator makes the refined score reproducible
    a, b = (
        ood.score(jm, x, "logpx_sgld", steps=3, noise=0.1, progress=False, generator=torch.Generator().manual_seed(7))
        for _ in range(2)
    )
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, s)


# ---------------------------------------------------------------- registry and plugins
def test_available_scores_lists_builtins():
    names = ood.available_scores()
    for n in ("logpx", "msp", "max_logit", "grad_norm", "grad_norm_projected", "logpx_sgld", "msp_sgld"):
        assert n in names and names[n]


def test_unknown_score_name_lists_available(jm, x):
    with pytest.raises(UnknownNameError) as info:
        ood.score(jm, x, "energyy", progress=False)
    msg = str(info.value)
    assert "energyy" in msg and "logpx" in msg and "grad_norm" in msg and "max_logit" in msg
    assert isinstance(info.value, KeyError)


def test_unknown_score_option_is_named(jm, x):
    with pytest.raises(TypeError, match="tempreature.*accepts: temperature"):
        ood.score(jm, x, "logpx", tempreature=2.0, progress=False)


def test_third_party_score_through_the_hook(jm, x):
    class MyPlugin:
        @jem.hookimpl
        def jem_register_ood_scores(self, register):
            register(
                "neg_l1",
                lambda jm, x, scale=1.0: -scale * x.abs().flatten(1).sum(1),
                needs_grad=False,
                description="-scale * ||x||_1",
            )

    plugin = MyPlugin()
    name = jem.register(plugin, name="test-ood-plugin")
    try:
        assert "neg_l1" in ood.available_scores()
        got = ood.score(jm, x, "neg_l1", scale=2.0, batch_size=10, progress=False)
        torch.testing.assert_close(got, -2.0 * x.abs().flatten(1).sum(1))
    finally:
        jem.unregister(name=name)
    assert "neg_l1" not in ood.available_scores()


def test_score_fn_with_wrong_output_shape_is_caught(jm, x):
    class BadPlugin:
        @jem.hookimpl
        def jem_register_ood_scores(self, register):
            register("bad", lambda jm, x: jm(x), needs_grad=False)

    name = jem.register(BadPlugin(), name="test-bad-ood-plugin")
    try:
        with pytest.raises(InvalidScoresError, match="must return a \\[B\\] tensor"):
            ood.score(jm, x, "bad", progress=False)
    finally:
        jem.unregister(name=name)


# ---------------------------------------------------------------- data forms
def test_dataloader_tuple_and_dict_inputs_match_tensor(jm, x):
    y = torch.randint(0, 10, (x.shape[0],))
    expected = ood.score(jm, x, "logpx", progress=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    torch.testing.assert_close(ood.score(jm, loader, "logpx", progress=True), expected)
    dicts = [{"image": xb, "label": yb} for xb, yb in loader]
    torch.testing.assert_close(ood.score(jm, dicts, "logpx", progress=False), expected)
    gen = (xb for xb in x.split(7))  # a generator has no len(): the bar has no total
    torch.testing.assert_close(ood.score(jm, gen, "logpx", progress=False), expected)
    torch.testing.assert_close(ood.score(jm, x.numpy(), "logpx", progress=False), expected)


def test_bad_data_is_rejected(jm, x):
    with pytest.raises(InvalidInputError, match="empty"):
        ood.score(jm, [], "logpx", progress=False)
    with pytest.raises(InvalidInputError, match="input tensor"):
        ood.score(jm, [("not", "tensors")], "logpx", progress=False)
    with pytest.raises(InvalidInputError, match="iterable"):
        ood.score(jm, 3.0, "logpx", progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        ood.score(jm, x, "logpx", batch_size=0, progress=False)
    with pytest.raises(ValueError, match="temperature"):
        ood.score(jm, x, "logpx", temperature=0.0, progress=False)


def test_evaluate_all_every_method_against_every_set(jm, x):
    far = 5.0 * torch.rand_like(x) + 1.0
    noise = torch.rand(40, 1, 8, 8)
    res = ood.evaluate_all(
        jm,
        x,
        {"far": far, "noise": DataLoader(TensorDataset(noise), batch_size=16)},
        methods=("logpx", "msp"),
        method_kwargs={"msp": {"temperature": 2.0}},
        progress=False,
    )
    scores = res.scores
    assert set(res) == {"logpx", "msp"} and set(res["logpx"]) == {"far", "noise"}
    assert res["logpx"]["far"] == ood.evaluate(ood.score(jm, x, progress=False), ood.score(jm, far, progress=False))
    torch.testing.assert_close(scores["msp"]["noise"], ood.score(jm, noise, "msp", temperature=2.0, progress=False))
    assert set(scores["msp"]) == {"in", "far", "noise"}
    with pytest.raises(ValueError, match="grad_norm"):
        ood.evaluate_all(jm, x, {"far": far}, methods=("logpx",), method_kwargs={"grad_norm": {}})
    with pytest.raises(InvalidInputError, match="non-empty dict"):
        ood.evaluate_all(jm, x, far)
