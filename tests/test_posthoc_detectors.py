"""The field's post-hoc detectors (jem_plugin.builtins.posthoc): registered through the OOD-score
hook, higher = in-distribution, fitted by streaming, and equal to pytorch-ood's detectors on the
same model and data (after the sign flip, and the scale noted where the definitions differ) or
to the paper's formula written out here."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.builtins import posthoc
from jem_plugin.errors import InvalidLabelError, NotFittedError, UnknownNameError

FITTED = ("mahalanobis", "relative_mahalanobis", "vim", "knn", "react")
FUNCTIONS = ("odin", "gen", "ash", "scale")
K, D, N_FIT = 4, 24, 400


class MLP(nn.Module):
    """Penultimate features are non-negative (ReLU), as ASH, SCALE and ReAct assume."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, D), nn.ReLU())
        self.fc = nn.Linear(D, K)

    def forward(self, x):
        return self.fc(self.body(x))


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    model = MLP()
    with torch.no_grad():  # biased first layer: every ReLU unit active on part of the data (full-rank covariance)
        model.body[2].bias.add_(0.3)
    jm = jem.wrap(model.eval())
    x_fit = torch.rand(N_FIT, 10, generator=g) * 2 - 1
    y_fit = torch.arange(N_FIT) % K
    x_test = torch.rand(60, 10, generator=g) * 2 - 1
    with torch.no_grad():
        z_fit, z_test = model.body(x_fit), model.body(x_test)
    return jm, model, x_fit, y_fit, x_test, z_fit, z_test


def _loader(x, y, batch_size=37):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _po():
    return pytest.importorskip("pytorch_ood.detector")


def _max_abs(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


# ---------------------------------------------------------------------- registration and contract
def test_registered_through_the_ood_score_hook_with_what_they_need():
    names = set(ood.available_scores())
    assert set(FITTED) | set(FUNCTIONS) <= names
    for name in FITTED:
        info = ood.score_info(name)
        assert info["needs_fit"] and not info["needs_grad"] and info["description"]
    assert ood.score_info("odin")["needs_grad"] and not ood.score_info("odin")["needs_fit"]
    for name in ("gen", "ash", "scale", "logpx"):
        assert ood.score_info(name) == {**ood.score_info(name), "needs_fit": False, "needs_grad": False}
    with pytest.raises(UnknownNameError, match="available"):
        ood.score_info("nope")
    assert "jem_plugin.builtins.posthoc" in jem.plugins.BUILTIN_PLUGINS


def test_each_detector_is_registered_from_what_its_class_or_function_says_of_it():
    """Issue 47: the name, needs_grad, needs_fit, description and paper live on the detector
    (its class, or a function score itself), and registration reads them there."""
    entries = jem.plugins.collect("jem_register_ood_scores")
    assert len(posthoc.DETECTORS) == 29
    for d in posthoc.DETECTORS:
        entry = entries[d.name]
        assert entry["item"] is d
        assert bool(entry["needs_grad"]) == d.needs_grad and bool(entry["needs_fit"]) == d.needs_fit
        assert entry["description"] == d.description and d.description
        assert entry["paper"] == d.paper and d.paper
        assert d.needs_fit == isinstance(d, type)  # the fitted ones are classes


def test_detector_builds_unfitted_objects_and_checks_options(setup):
    jm, *_ = setup
    det = ood.detector("knn", k=7)
    assert isinstance(det, posthoc.KNN) and det.k == 7 and "k=7" in repr(det)
    with pytest.raises(NotFittedError, match="fit"):
        det.score(jm, torch.zeros(2, 10))
    with pytest.raises(TypeError, match="does not take option.*kk.*accepts: k"):
        ood.detector("knn", kk=3)
    with pytest.raises(ValueError, match="needs no fitting"):
        ood.detector("msp")


def test_score_requires_fit_data_for_fitted_methods_and_takes_fitted_detectors(setup):
    jm, _, x_fit, y_fit, x_test, *_ = setup
    with pytest.raises(NotFittedError, match="fit_data="):
        ood.score(jm, x_test, "knn")
    s = ood.score(jm, x_test, "knn", fit_data=(x_fit, y_fit), k=5)
    det = ood.detector("knn", k=5).fit(jm, _loader(x_fit, y_fit))
    assert det.fitted
    torch.testing.assert_close(ood.score(jm, x_test, det), s)
    torch.testing.assert_close(det.score(jm, x_test), s)
    with pytest.raises(TypeError, match="build the detector"):
        ood.score(jm, x_test, det, k=3)
    # fit_data is ignored by scores that need no fitting (one call can pass it to every method)
    torch.testing.assert_close(ood.score(jm, x_test, "msp", fit_data=x_fit), ood.score(jm, x_test, "msp"))
    # a detector object given with fit_data is fitted on it
    fresh = posthoc.KNN(k=5)
    torch.testing.assert_close(ood.score(jm, x_test, fresh, fit_data=(x_fit, y_fit)), s)


def test_a_third_party_fitted_detector_comes_through_the_same_hook(setup):
    jm, _, x_fit, y_fit, x_test, *_ = setup

    class MeanDistance:
        name = "mean_distance"

        def fit(self, jm, data, *, batch_size=256, progress=None):
            self.mu = jm.features(data)[0].mean(0)
            return self

        def score(self, jm, x):
            return -(jm.features(x)[0] - self.mu).norm(dim=1)

    class Plugin:
        @jem.hookimpl
        def jem_register_ood_scores(self, register):
            register("mean_distance", MeanDistance, needs_grad=False, needs_fit=True, description="test")

    name = jem.register(Plugin())
    try:
        assert ood.score_info("mean_distance")["needs_fit"]
        s = ood.score(jm, x_test, "mean_distance", fit_data=x_fit)
        assert s.shape == (60,) and (s <= 0).all()
    finally:
        jem.unregister(name=name)


# ---------------------------------------------------------------------- streaming fit
@pytest.mark.parametrize("name", FITTED)
def test_fit_streams_a_loader_and_equals_the_fit_on_the_whole_set(setup, name):
    jm, _, x_fit, y_fit, x_test, *_ = setup
    whole = ood.detector(name).fit(jm, (x_fit, y_fit), batch_size=N_FIT)
    streamed = ood.detector(name).fit(jm, _loader(x_fit, y_fit, batch_size=23))
    torch.testing.assert_close(streamed.score(jm, x_test), whole.score(jm, x_test), rtol=1e-4, atol=1e-4)


def test_streaming_detectors_keep_no_per_example_state():
    """Mahalanobis, its relative variant and ViM hold sums (size independent of N) after fit."""
    model = MLP().eval()
    jm = jem.wrap(model)
    n = 3000
    x, y = torch.rand(n, 10) * 2 - 1, torch.arange(n) % K

    def batches():  # a generator: no len(), never materialised
        for i in range(0, n, 100):
            yield x[i : i + 100], y[i : i + 100]

    for name in ("mahalanobis", "relative_mahalanobis", "vim"):
        det = ood.detector(name, **({"max_alpha": 200} if name == "vim" else {})).fit(jm, batches())
        sizes = [t.shape[0] for t in vars(det).values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        assert sizes and max(sizes) <= 200, (name, sizes)


def test_subsamples_are_bounded_uniform_and_seeded(setup):
    jm, _, x_fit, y_fit, *_ = setup
    knn = ood.detector("knn", k=3, max_fit=50).fit(jm, _loader(x_fit, y_fit, batch_size=16))
    assert knn.bank.shape == (50, D)
    again = ood.detector("knn", k=3, max_fit=50).fit(jm, _loader(x_fit, y_fit, batch_size=16))
    assert torch.equal(knn.bank, again.bank)
    react = ood.detector("react", max_values=500).fit(jm, x_fit)
    assert react.activations.numel() == 500
    exact = ood.detector("react").fit(jm, x_fit)
    assert abs(react.threshold - exact.threshold) < 0.1 * (exact.activations.max() - exact.activations.min())


def test_mahalanobis_needs_labels_or_predicted_ones(setup):
    jm, model, x_fit, *_ = setup
    with pytest.raises(InvalidLabelError, match="labels='predicted'"):
        ood.detector("mahalanobis").fit(jm, x_fit)
    det = ood.detector("mahalanobis", labels="predicted").fit(jm, x_fit)
    assert det.score(jm, x_fit[:5]).shape == (5,)
    with pytest.raises(InvalidLabelError):
        ood.detector("mahalanobis").fit(jm, (x_fit, torch.full((N_FIT,), K)))


def test_react_percentile_changes_without_refitting(setup):
    jm, _, x_fit, y_fit, x_test, *_ = setup
    det = ood.detector("react", percentile=90).fit(jm, x_fit)
    t90 = det.threshold
    np.testing.assert_allclose(t90, np.percentile(det.activations.numpy(), 90), rtol=1e-6)
    det.percentile = 50
    assert det.threshold < t90
    np.testing.assert_allclose(det.threshold, np.percentile(det.activations.numpy(), 50), rtol=1e-6)


# ---------------------------------------------------------------------- against pytorch-ood
def test_mahalanobis_equals_pytorch_ood_up_to_its_scale(setup):
    """pytorch-ood's outlier score is ``0.5 * min_c d_c`` with the precision of the *sum* of squared
    deviations (plus ``1e-6 I``), Lee et al.'s ``-min_c d_c`` uses the covariance (that sum over
    ``N``): ours = ``-2 N`` times theirs."""
    jm, _, x_fit, y_fit, x_test, z_fit, z_test = setup
    ref = _po().Mahalanobis(None).fit_features(z_fit, y_fit).predict_features(z_test)
    ours = ood.score(jm, x_test, "mahalanobis", fit_data=_loader(x_fit, y_fit))
    torch.testing.assert_close(ours / (2 * N_FIT), -ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, -2 * N_FIT * ref, rtol=1e-4, atol=1e-4)


def test_mahalanobis_is_lee_et_al_formula():
    """Lee et al.'s code: class means, ``EmpiricalCovariance`` of the class-centred features
    (``/ N``), its (pseudo-)inverse, and ``-min_c (z - mu_c)^T P (z - mu_c)``; in float64 here."""
    z = torch.tensor([[0.0, 1.0], [2.0, 1.0], [1.0, 3.0], [5.0, 4.0], [7.0, 4.0], [6.0, 7.0]])
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    jm = jem.wrap(nn.Linear(2, 2), features=lambda model, x: (x, model(x)), data_range=(-10.0, 10.0))
    det = posthoc.Mahalanobis().fit(jm, (z, y))
    mu = torch.stack([z[:3].mean(0), z[3:].mean(0)]).double()
    centred = z.double() - mu[y]
    precision = torch.linalg.inv(centred.T @ centred / 6)
    q = torch.tensor([[1.0, 1.0], [6.0, 5.0], [3.0, 3.0]]).double()
    expected = -torch.stack([((q - m) @ precision * (q - m)).sum(1) for m in mu], 1).min(1).values
    torch.testing.assert_close(det.score(jm, q.float()).double(), expected, rtol=1e-5, atol=1e-5)


class LinearBottleneck(nn.Module):
    """A user's CNN whose 1x1 convolution widens 6 channels to 24 with no activation after it (as
    MobileNetV2's projections do): its 24 pooled features span 6 directions, and the other 18 hold
    nothing but float32 rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU())
        self.widen = nn.Conv2d(6, 24, 1)
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.widen(self.stem(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("name", ["mahalanobis", "relative_mahalanobis", "multi_mahalanobis"])
def test_gaussian_scores_ignore_directions_that_hold_only_rounding(name):
    """Found on the first GPU run: directions of the covariance with float32 rounding in them and
    nothing else were inverted as if they were spread, so the scores moved by 10% between the CPU
    and the GPU. Here the network in float32 must score as its float64 copy does (before the fix:
    differing by more than
    the scores' own size)."""
    torch.manual_seed(0)
    net = LinearBottleneck().eval()
    g = torch.Generator().manual_seed(1)
    x_fit, y_fit = torch.rand(200, 3, 8, 8, generator=g), torch.arange(200) % 4
    x = torch.rand(16, 3, 8, 8, generator=g)
    scores = []
    for dtype in (torch.float32, torch.float64):
        layers = {"layers": ["stem", "widen"]} if name == "multi_mahalanobis" else {}
        jm = jem.wrap(copy.deepcopy(net).to(dtype), input_size=(3, 8, 8))
        det = ood.detector(name, **layers).fit(jm, (x_fit.to(dtype), y_fit), progress=False)
        scores.append(det.score(jm, x.to(dtype)).double())
    single, double = scores
    assert (single - double).abs().max() < 1e-3 * double.abs().max(), (single, double)


@pytest.mark.parametrize("name", ["mahalanobis", "relative_mahalanobis", "multi_mahalanobis"])
def test_a_fit_without_spread_within_classes_warns_once_at_the_users_line(name):
    """One image per class: no direction varies within a class, every class distance is 0; said
    once, pointing at the fit call, not silently."""
    jm = jem.wrap(LinearBottleneck().eval(), input_size=(3, 8, 8))
    layers = {"layers": ["stem", "widen"]} if name == "multi_mahalanobis" else {}
    det = ood.detector(name, **layers)
    with pytest.warns(RuntimeWarning, match="do not vary within their classes") as caught:
        det.fit(jm, (torch.rand(4, 3, 8, 8), torch.arange(4)), progress=False)
    flat = [w for w in caught if "do not vary" in str(w.message)]
    assert len(flat) == 1 and flat[0].filename == __file__, [(w.filename, str(w.message)) for w in flat]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # two images per class: spread, no warning
        ood.detector(name, **layers).fit(jm, (torch.rand(40, 3, 8, 8), torch.arange(40) % 4), progress=False)


@pytest.mark.parametrize("name", ["mahalanobis", "relative_mahalanobis", "multi_mahalanobis"])
def test_a_fit_on_fewer_images_than_features_says_what_the_distances_ignore(name):
    """20 images in 4 classes for 24 features: the within-class covariance spans at most 16
    directions and inputs can differ unseen in the others; said once, at the fit call (for
    ``multi_mahalanobis``, naming the layer that is too wide, not the 6-channel one)."""
    jm = jem.wrap(LinearBottleneck().eval(), input_size=(3, 8, 8))
    layers = {"layers": ["stem", "widen"]} if name == "multi_mahalanobis" else {}
    g = torch.Generator().manual_seed(0)
    with pytest.warns(RuntimeWarning, match="spans at most 16 directions") as caught:
        ood.detector(name, **layers).fit(jm, (torch.rand(20, 3, 8, 8, generator=g), torch.arange(20) % 4))
    few = [w for w in caught if "spans at most" in str(w.message)]
    assert len(few) == 1 and few[0].filename == __file__
    message = str(few[0].message)
    assert "fit on at least 28 images" in message
    assert ("widen (24 features)" in message and "stem" not in message) if layers else "24 features" in message


def test_relative_mahalanobis_equals_pytorch_ood_up_to_its_scale(setup):
    """pytorch-ood's ``RMD`` uses sums of squared deviations, not covariances: ours = ``-N`` times theirs."""
    jm, _, x_fit, y_fit, x_test, z_fit, z_test = setup
    ref = _po().RMD(None).fit_features(z_fit, y_fit).predict_features(z_test)
    ours = ood.score(jm, x_test, "relative_mahalanobis", fit_data=_loader(x_fit, y_fit))
    torch.testing.assert_close(ours / N_FIT, -ref, rtol=1e-4, atol=1e-4)


def test_vim_equals_pytorch_ood(setup):
    jm, model, x_fit, y_fit, x_test, z_fit, z_test = setup
    ref = _po().ViM(None, d=8, w=model.fc.weight, b=model.fc.bias).fit_features(z_fit, y_fit)
    det = ood.detector("vim", dim=8).fit(jm, _loader(x_fit, y_fit))
    assert det.alpha == pytest.approx(ref.alpha, rel=1e-4)
    torch.testing.assert_close(ood.score(jm, x_test, det), -ref.predict_features(z_test), rtol=1e-4, atol=1e-4)


def test_knn_equals_pytorch_ood(setup):
    jm, _, x_fit, y_fit, x_test, z_fit, z_test = setup
    ref = _po().KNN(None, k=5).fit_features(z_fit, y_fit).predict_features(z_test)
    # chunk=64: the neighbour search runs over several chunks of the bank
    ours = ood.score(jm, x_test, posthoc.KNN(k=5, chunk=64), fit_data=(x_fit, y_fit))
    torch.testing.assert_close(ours, -ref.float(), rtol=1e-4, atol=1e-4)


def test_react_equals_pytorch_ood(setup):
    jm, model, x_fit, y_fit, x_test, z_fit, z_test = setup
    ref = _po().ReAct(backbone=model.body, head=model.fc, percentile=0.9)
    ref.fit_feature_maps(z_fit, y_fit)
    det = ood.detector("react", percentile=90).fit(jm, _loader(x_fit, y_fit))
    assert det.threshold == pytest.approx(ref.threshold, rel=1e-6)
    torch.testing.assert_close(ood.score(jm, x_test, det), -ref.predict(x_test), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, cls", [("ash", "ASH"), ("scale", "SCALE")])
def test_ash_and_scale_equal_pytorch_ood_on_penultimate_features(setup, name, cls):
    """pytorch-ood shapes 4-d feature maps; the penultimate features are ``[B, D, 1, 1]`` maps
    (as the ASH code reshapes them); its percentile is ours / 100."""
    jm, model, _, _, x_test, *_ = setup
    for p in (65, 90):
        ref = getattr(_po(), cls)(
            backbone=lambda x: model.body(x)[:, :, None, None],
            head=lambda h: model.fc(h.flatten(1)),
            percentile=p / 100,
        )
        torch.testing.assert_close(
            ood.score(jm, x_test, name, percentile=p), -ref.predict(x_test), rtol=1e-4, atol=1e-4
        )


def test_odin_equals_pytorch_ood_with_the_normalisation_std():
    """Our ``eps`` is in [0, 1]-pixel units and the step is ``eps * (high - low)`` of the domain,
    i.e. ``eps / std`` for normalised images: pytorch-ood's ``norm_std``."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    jm = jem.wrap(model, mean=mean, std=std)
    x = (torch.rand(12, 3, 8, 8) - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    for t, eps in ((1000.0, 0.0014), (1.0, 0.05)):
        ref = _po().ODIN(model, eps=eps, temperature=t, norm_std=list(std)).predict(x)
        torch.testing.assert_close(ood.score(jm, x, "odin", temperature=t, eps=eps), -ref, rtol=1e-4, atol=1e-5)


def test_odin_runs_in_eval_mode_under_no_grad_and_inference_mode(setup):
    jm, model, _, _, x_test, *_ = setup
    model.train()
    try:
        ref = ood.score(jm, x_test, "odin")
        with torch.inference_mode():
            xi = x_test.clone()
            torch.testing.assert_close(ood.score(jm, xi, "odin"), ref)
        assert model.training and all(p.grad is None for p in model.parameters())
    finally:
        model.eval()


def test_gen_equals_pytorch_ood_up_to_its_mean(setup):
    """pytorch-ood averages over the top M (ours sums, as the authors' code); both clamp ``p`` to
    ``[1e-7, 1 - 1e-7]``: ours = ``-M`` theirs, also for saturated and tiny probabilities."""
    jm, _, _, _, x_test, *_ = setup
    for logits in (jm.logits(x_test).detach(), torch.linspace(0, 60, 10).repeat(4, 1) * torch.rand(4, 1)):
        net = jem.wrap(lambda x: x, num_classes=logits.shape[1], data_range=(-100.0, 100.0))
        for m in (2, logits.shape[1]):
            ref = _po().GEN(None, gamma=0.1, M=m).predict_logits(logits)
            torch.testing.assert_close(ood.score(net, logits, "gen", M=m) / m, -ref, rtol=1e-4, atol=1e-5)


def test_gen_is_the_papers_formula():
    """Liu et al. 2023, eq. 6: ``G(p) = sum_{j=1}^{M} p_j^g (1 - p_j)^g`` over the M largest
    probabilities; the score is ``-G``. M defaults to min(K, 100)."""
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]))
    jm = jem.wrap(lambda x: x, num_classes=3, data_range=(-10.0, 10.0))
    g = 0.1
    expected = [-sum(p**g * (1 - p) ** g for p in row) for row in ([0.7, 0.2, 0.1], [0.4, 0.35, 0.25])]
    torch.testing.assert_close(ood.score(jm, logits, "gen").double(), torch.tensor(expected).double())
    top2 = [-sum(p**g * (1 - p) ** g for p in row) for row in ([0.7, 0.2], [0.4, 0.35])]
    torch.testing.assert_close(ood.score(jm, logits, "gen", M=2).double(), torch.tensor(top2).double())
    with pytest.raises(ValueError, match="clamp"):
        ood.score(jm, logits, "gen", clamp=0.5)


def test_gen_keeps_confident_inputs_apart_where_float32_saturates():
    """A confident model's top probability rounds to exactly 1 in float32: the top class's term
    ``p^g (1 - p)^g`` is then 0 for all of them. GEN is computed from the logits in log space, so
    ``1 - p`` is the others' probability mass: the term matches a float64 reference and orders the
    inputs by how confident they are."""
    logits = torch.zeros(5, 10)
    logits[:, 0] = torch.tensor([40.0, 45.0, 50.0, 60.0, 80.0])  # the top probability: 1.0 in float32
    assert (logits.softmax(1)[:, 0] == 1.0).all()
    jm = jem.wrap(lambda x: x, num_classes=10, data_range=(-100.0, 100.0))
    g = 0.1
    p = logits.double().softmax(1)
    rest = p[:, 1:].sum(1)  # 1 - p_top, exactly: the nine others' (tiny) probabilities
    expected = -(p[:, 0] ** g * rest**g + (p[:, 1:] ** g * (1 - p[:, 1:]) ** g).sum(1))
    scores = ood.score(jm, logits, "gen", clamp=0.0)  # the formula exactly
    torch.testing.assert_close(scores.double(), expected, rtol=1e-6, atol=0.0)
    naive_top = logits.softmax(1)[:, 0] ** g * (1 - logits.softmax(1)[:, 0]) ** g
    assert (naive_top == 0).all()  # what float32 gives the top class
    assert torch.all(scores[1:] > scores[:-1])  # more confident, more in-distribution


def test_scores_separate_far_inputs_from_the_fit_data(setup):
    """Higher = in-distribution: far-away inputs score lower on average (the distance-based
    detectors; ReAct is an energy, which an untrained network does not order this way)."""
    jm, _, x_fit, y_fit, x_test, *_ = setup
    far = 30.0 * torch.randn(60, 10)
    for name in ("mahalanobis", "relative_mahalanobis", "vim", "knn"):
        det = ood.detector(name).fit(jm, (x_fit, y_fit))
        assert det.score(jm, x_test).mean() > det.score(jm, far).mean(), name


def test_ash_and_scale_leave_an_all_zero_row_finite():
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every unit dead: the features are all zero
    jm = jem.wrap(model)
    for name in ("ash", "scale"):
        s = ood.score(jm, torch.rand(4, 3), name)
        assert torch.isfinite(s).all()
        torch.testing.assert_close(s, torch.logsumexp(model[2].bias, 0).expand(4))


@pytest.mark.parametrize("name", ["mahalanobis", "knn", "openmax"])
def test_a_detector_scoring_another_network_than_it_was_fitted_on_warns_once(name, recwarn):
    """Fitted statistics belong to one network: a detector fitted on one model and handed another
    (one detector object reused across models, as in a loop over checkpoints) says so once.
    Another wrapper of the same network is the same network; a pickled detector keeps its
    statistics and scores as before."""
    import pickle
    import warnings

    torch.manual_seed(0)
    a, b = MLP().eval(), MLP().eval()
    x, y = torch.randn(80, 10), torch.arange(80) % K
    det = ood.detector(name).fit(jem.wrap(a, data_range=(-5, 5)), (x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = det.score(jem.wrap(a, data_range=(-5, 5)), x[:6])  # a new wrapper, the same network
    jm_b = jem.wrap(b, data_range=(-5, 5))
    with pytest.warns(UserWarning, match=rf"this {name} detector was fitted on another network \(MLP\)"):
        det.score(jm_b, x[:6])
    det.score(jm_b, x[:6])
    assert not [w for w in recwarn if "fitted on another network" in str(w.message)]  # once
    det.fit(jm_b, (x, y))  # refitted on b: no warning on b
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        det.score(jm_b, x[:6])
    again = pickle.loads(pickle.dumps(ood.detector(name).fit(jem.wrap(a, data_range=(-5, 5)), (x, y))))
    torch.testing.assert_close(again.score(jem.wrap(a, data_range=(-5, 5)), x[:6]), expected)
