"""GMM, MahalanobisODIN and OpenMax (jem_plugin.builtins.posthoc, issue 29): each equal to its
formula written out here, to pytorch-ood's detector (after the sign and scale its docstring
states), fitted by streaming (one batch = many batches), refusing to score before it is fitted,
and reachable by name through ``jem.ood.score`` and ``jem.ood.evaluate_all``."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.builtins import posthoc
from jem_plugin.builtins.posthoc import openmax as openmax_module
from jem_plugin.errors import InvalidInputError, NoFeaturesError, NotFittedError

NEW = ("gmm", "mahalanobis_odin", "openmax")
K, N_FIT = 4, 320
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _cnn() -> nn.Sequential:
    """A torchvision-style CNN: conv, pooling, a hidden layer (the 10-d features), a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 12, 3, padding=1),
        nn.Tanh(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(48, 10),
        nn.Tanh(),
        nn.Linear(10, K),
    )


def _images(n: int, g: torch.Generator) -> torch.Tensor:
    """Normalised images whose pixels are in [0, 1]."""
    return (torch.rand(n, 3, 8, 8, generator=g) - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(
        1, 3, 1, 1
    )


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = _cnn().eval()
    x_fit = _images(N_FIT, g)
    with torch.no_grad():  # the head: nearest of K k-means centres of the features (every class predicted)
        z = model[:-1](x_fit)
        centres = z[:K].clone()
        for _ in range(20):
            assign = torch.cdist(z, centres).argmin(1)
            centres = torch.stack([z[assign == c].mean(0) if (assign == c).any() else centres[c] for c in range(K)])
        scale = 12.0 / torch.cdist(centres, centres).max()  # logits spread over a few units, as a trained model's
        model[-1].weight.copy_(2 * scale * centres)
        model[-1].bias.copy_(-scale * centres.pow(2).sum(1))
        y_fit = model(x_fit).argmax(1)  # labels the model agrees with
    jm = jem.wrap(model, mean=MEAN, std=STD)
    assert torch.bincount(y_fit, minlength=K).min() >= 20
    x_test = _images(48, g)
    return jm, model, x_fit, y_fit, x_test


def _loader(x, y, batch_size=29):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def _feature_net(d: int) -> jem.JEM:
    """The features are the inputs: detectors on given feature vectors."""
    return jem.wrap(nn.Linear(d, K), features=lambda model, x: (x, model(x)), data_range=(-50.0, 50.0))


def _po():
    return pytest.importorskip("pytorch_ood.detector")


# ---------------------------------------------------------------------- registration and contract
def test_registered_by_name_with_what_they_need():
    for name in NEW:
        info = ood.score_info(name)
        assert info["needs_fit"] and info["description"], name
        assert info["needs_grad"] == (name == "mahalanobis_odin"), name
    assert isinstance(ood.detector("gmm"), posthoc.GMM)
    assert isinstance(ood.detector("mahalanobis_odin", eps=0.01), posthoc.MahalanobisODIN)
    assert isinstance(ood.detector("openmax", alpha=2), posthoc.OpenMax)
    assert "eps=0.01" in repr(ood.detector("mahalanobis_odin", eps=0.01))


@pytest.mark.parametrize("name", NEW)
def test_score_before_fit_raises_not_fitted(setup, name):
    jm, _, _, _, x_test = setup
    with pytest.raises(NotFittedError, match="fit"):
        ood.detector(name).score(jm, x_test)
    with pytest.raises(NotFittedError, match="fit_data="):
        ood.score(jm, x_test, name)


def test_options_are_checked():
    with pytest.raises(ValueError, match="reg"):
        posthoc.GMM(reg=-1.0)
    with pytest.raises(ValueError, match="eps"):
        posthoc.MahalanobisODIN(eps=float("nan"))
    with pytest.raises(ValueError, match="tailsize"):
        posthoc.OpenMax(tailsize=0)
    with pytest.raises(ValueError, match="euclid_weight"):
        posthoc.OpenMax(euclid_weight=1.5)
    with pytest.raises(ValueError, match="labels"):
        posthoc.GMM(labels="guess")


# ---------------------------------------------------------------------- streaming fit
@pytest.mark.parametrize("name", NEW)
def test_fit_streams_one_batch_equals_many(setup, name):
    jm, _, x_fit, y_fit, x_test = setup
    whole = ood.detector(name).fit(jm, (x_fit, y_fit), batch_size=N_FIT)
    streamed = ood.detector(name).fit(jm, _loader(x_fit, y_fit, batch_size=23))
    torch.testing.assert_close(streamed.score(jm, x_test), whole.score(jm, x_test), rtol=1e-4, atol=1e-5)


def test_fitted_state_does_not_grow_with_the_data():
    """GMM keeps K covariances (K x D x D), OpenMax K x K class means and its Weibull parameters:
    nothing per example (3000 of them, in 30 batches; GMM's from a generator)."""
    jm = _feature_net(6)
    n = 3000
    z, y = torch.randn(n, 6), torch.arange(n) % K

    def batches():
        for i in range(0, n, 100):
            yield z[i : i + 100], y[i : i + 100]

    gmm = ood.detector("gmm").fit(jm, batches())
    om = ood.detector("openmax").fit(jm, [(z[i : i + 100], y[i : i + 100]) for i in range(0, n, 100)])
    for det in (gmm, om):
        sizes = [t.shape[0] for t in vars(det).values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        assert sizes and max(sizes) <= max(K, 6), (det, sizes)
    assert gmm._whiten.shape == (K, 6, 6)


def test_openmax_needs_data_it_can_read_twice(setup):
    jm, _, x_fit, y_fit, _ = setup
    with pytest.raises(InvalidInputError, match="twice"):
        ood.detector("openmax").fit(jm, iter(_loader(x_fit, y_fit)))


# ---------------------------------------------------------------------- the formulas
def test_gmm_is_the_mixture_log_likelihood():
    """``log sum_c pi_c N(z | mu_c, Sigma_c + reg I)``, ``Sigma_c`` the class's squared deviations
    over ``N_c``, ``pi_c = N_c / N``: torch.distributions in float64."""
    g = torch.Generator().manual_seed(3)
    d, counts = 5, (30, 12, 50)  # unequal classes: the weights matter; class 3 absent
    z = torch.cat([torch.randn(c, d, generator=g) * (1 + i) + 3 * i for i, c in enumerate(counts)])
    y = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    q = torch.randn(20, d, generator=g) * 4
    jm = _feature_net(d)
    for reg in (1e-6, 0.1):
        det = posthoc.GMM(reg=reg).fit(jm, (z, y))
        assert det.classes.tolist() == [0, 1, 2]
        parts = []
        for c, n_c in enumerate(counts):
            zc = z[y == c].double()
            mu = zc.mean(0)
            cov = (zc - mu).T @ (zc - mu) / n_c + reg * torch.eye(d, dtype=torch.float64)
            mvn = torch.distributions.MultivariateNormal(mu, covariance_matrix=cov)
            parts.append(math.log(n_c / sum(counts)) + mvn.log_prob(q.double()))
        expected = torch.logsumexp(torch.stack(parts, 1), 1)
        torch.testing.assert_close(det.score(jm, q).double(), expected, rtol=1e-5, atol=1e-4)


def test_gmm_says_when_a_covariance_is_singular():
    jm = _feature_net(6)
    z = torch.randn(40, 6)
    z[:, 5] = 0.0  # a dead unit: singular covariances without the ridge
    y = torch.arange(40) % 2
    with pytest.raises(ValueError, match="increase reg"):
        posthoc.GMM(reg=0.0).fit(jm, (z, y))
    assert torch.isfinite(posthoc.GMM().fit(jm, (z, y)).score(jm, z)).all()


def test_mahalanobis_odin_is_lee_et_al_preprocessing(setup):
    """Lee et al.: class means and the shared covariance of the features (over N), the input moved
    by ``eps`` against the gradient sign of its squared distance to the closest mean (``eps / std``
    per channel in normalised units), then ``-min_c`` distance at the moved input; float64 here."""
    jm, model, x_fit, y_fit, x_test = setup
    body = copy.deepcopy(model[:-1]).double()
    with torch.no_grad():
        z = body(x_fit.double())
    mu = torch.stack([z[y_fit == c].mean(0) for c in range(K)])
    centred = z - mu[y_fit]
    precision = torch.linalg.pinv(centred.T @ centred / N_FIT)

    def dists(x):
        diff = body(x).unsqueeze(1) - mu.unsqueeze(0)
        return torch.einsum("bkd,de,bke->bk", diff, precision, diff)

    eps = 0.01
    x = x_test.double().requires_grad_(True)
    (g,) = torch.autograd.grad(dists(x).min(1).values.sum(), x)
    x_hat = x.detach() - eps * g.sign() / torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        expected = -dists(x_hat).min(1).values
    det = posthoc.MahalanobisODIN(eps=eps).fit(jm, (x_fit, y_fit))
    torch.testing.assert_close(det.score(jm, x_test).double(), expected, rtol=1e-4, atol=1e-4)
    # the step helps in-distribution inputs: closer to a class mean than before
    plain = posthoc.Mahalanobis().fit(jm, (x_fit, y_fit))
    assert (det.score(jm, x_test) >= plain.score(jm, x_test) - 1e-4).all()
    torch.testing.assert_close(
        posthoc.MahalanobisODIN(eps=0.0).fit(jm, (x_fit, y_fit)).score(jm, x_test), plain.score(jm, x_test)
    )


def test_mahalanobis_odin_under_no_grad_and_inference_mode(setup):
    jm, model, x_fit, y_fit, x_test = setup
    det = posthoc.MahalanobisODIN().fit(jm, (x_fit, y_fit))
    ref = ood.score(jm, x_test, det)
    with torch.no_grad():
        torch.testing.assert_close(ood.score(jm, x_test, det), ref)
    with torch.inference_mode():
        xi = x_test.clone()
        torch.testing.assert_close(ood.score(jm, xi, det), ref)
    assert all(p.grad is None for p in model.parameters())


def _weibull_mle(x: np.ndarray) -> tuple[float, float]:
    """Weibull maximum likelihood, location 0, written out: the shape solves the profile equation
    (scipy's root finder), the scale follows."""
    optimize = pytest.importorskip("scipy.optimize")
    lx = np.log(x)
    t = lx - lx.max()

    def eq(log_c: float) -> float:
        c = math.exp(log_c)
        w = np.exp(c * t)
        return 1.0 / c + lx.mean() - (w * lx).sum() / w.sum()

    c = math.exp(optimize.brentq(eq, math.log(1e-6), math.log(1e12), xtol=1e-14, rtol=1e-15))
    return c, float(np.exp(lx.max()) * np.mean(np.exp(c * t)) ** (1.0 / c))


def test_weibull_fit_is_maximum_likelihood_as_scipy():
    """Our Weibull fit against scipy's ``weibull_min.fit(floc=0)`` on Weibull samples, and at the
    likelihood maximum on shifted tails as OpenMax fits them (where scipy's generic optimiser is
    only close to it: never a better likelihood than ours)."""
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    rows = [stats.weibull_min.rvs(c, scale=s, size=60, random_state=rng) for c, s in ((1.5, 2.0), (3.0, 0.5))]
    shape, scale = openmax_module._weibull_fit(torch.tensor(np.stack(rows)), torch.ones(2, 60, dtype=torch.bool))
    for i, row in enumerate(rows):
        c, _, s = stats.weibull_min.fit(row, floc=0)
        assert shape[i].item() == pytest.approx(c, rel=1e-3) and scale[i].item() == pytest.approx(s, rel=1e-3)
    tails = [np.sort(rng.gamma(2.0, 1.0 + i, size=200))[-25:] for i in range(3)]
    shifted = np.stack([t + openmax_module._WEIBULL_SHIFT - t.min() for t in tails])
    valid = torch.ones(3, 25, dtype=torch.bool)
    valid[2, :5] = False  # a class with a shorter tail
    shape, scale = openmax_module._weibull_fit(torch.tensor(shifted), valid)
    for i in range(3):
        x = shifted[i][valid[i].numpy()]
        c, s = _weibull_mle(x)
        assert shape[i].item() == pytest.approx(c, rel=1e-7) and scale[i].item() == pytest.approx(s, rel=1e-9)
        c_sp, _, s_sp = stats.exponweib.fit(x, floc=0, f0=1)[1:]
        assert (
            stats.weibull_min.nnlf((shape[i].item(), 0, scale[i].item()), x)
            <= stats.weibull_min.nnlf((c_sp, 0, s_sp), x) + 1e-9
        )


def _openmax_reference(logits_fit, y_fit, logits, tailsize, alpha, euclid_weight):
    """Bendale & Boult's OpenMax as pytorch-ood runs it, written out per input in float64."""
    v_fit, v = logits_fit.double().numpy(), logits.double().numpy()
    k = v.shape[1]
    alpha = min(alpha, k)

    def dist(a, c):
        eu = np.linalg.norm(a - c, axis=-1)
        cos = 1 - (a * c).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(c))
        return euclid_weight * eu + (1 - euclid_weight) * cos

    centres, params = {}, {}
    for c in range(k):
        members = v_fit[y_fit.numpy() == c]
        centres[c] = members.mean(0)
        tail = np.sort(dist(members, centres[c]))[-tailsize:]
        params[c] = (tail.min(), *_weibull_mle(tail + 10_000.0 - tail.min()))
    out = []
    for row in v:
        top = np.argsort(-row)[:alpha]
        revised, unknown = row.copy(), 0.0
        for r, j in enumerate(top):
            lo, c, s = params[j]
            w = (alpha - r) / alpha * (1 - math.exp(-(((dist(row, centres[j]) + 10_000.0 - lo) / s) ** c)))
            revised[j] = row[j] * (1 - w)
            unknown += row[j] * w
        e = np.exp(np.concatenate([[unknown], revised]))
        out.append(-e[0] / e.sum())
    return torch.tensor(out)


@pytest.mark.parametrize("options", [{}, {"alpha": 2, "tailsize": 10}, {"euclid_weight": 0.5}])
def test_openmax_is_the_papers_revision(setup, options):
    jm, model, x_fit, y_fit, x_test = setup
    det = posthoc.OpenMax(**options).fit(jm, _loader(x_fit, y_fit))
    with torch.no_grad():
        logits_fit, logits = model(x_fit), model(x_test)
    full = {"tailsize": 25, "alpha": 10, "euclid_weight": 1.0, **options}
    expected = _openmax_reference(logits_fit, y_fit, logits, **full)
    scores = det.score(jm, x_test)
    assert ((scores <= 0) & (scores >= -1)).all()
    torch.testing.assert_close(scores.double(), expected, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------- against pytorch-ood
def test_gmm_equals_pytorch_ood(setup):
    """pytorch-ood's outlier score is minus the mixture log-likelihood: ours = -theirs."""
    jm, model, x_fit, y_fit, x_test = setup
    with torch.no_grad():
        z_fit, z_test = model[:-1](x_fit), model[:-1](x_test)
    ref = _po().GMM(None).fit_features(z_fit, y_fit).predict_features(z_test)
    ours = ood.score(jm, x_test, "gmm", fit_data=_loader(x_fit, y_fit))
    torch.testing.assert_close(ours.double(), -ref.double(), rtol=1e-4, atol=1e-4)


def test_mahalanobis_odin_equals_pytorch_ood_up_to_its_scale(setup):
    """pytorch-ood scores ``0.5 * min_c d_c`` with the inverse of the summed covariance at its
    preprocessed input (``eps`` in normalised units, ``norm_std``): ours = ``-2 N`` times theirs."""
    jm, model, x_fit, y_fit, x_test = setup
    po = _po()
    for eps in (0.002, 0.02):
        ref = po.MahalanobisODIN(model[:-1], eps=eps, norm_std=list(STD))
        ref.fit(_loader(x_fit, y_fit))
        theirs = ref.predict(x_test).detach()
        ours = ood.score(jm, x_test, "mahalanobis_odin", fit_data=_loader(x_fit, y_fit), eps=eps)
        torch.testing.assert_close(ours / (2 * N_FIT), -theirs, rtol=1e-4, atol=1e-4)


def test_openmax_equals_pytorch_ood(setup):
    """pytorch-ood's outlier score is the unknown class's probability: ours = -theirs. It takes
    the distance only to classes some input of the batch is predicted as (0 for the others), so
    the batch here has every class predicted; it gets float64 logits (its float32 shifted tails
    round at 1e-3)."""
    jm, model, x_fit, y_fit, x_test = setup
    with torch.no_grad():
        logits_fit = model(x_fit)
        batch = torch.cat([x_test, x_fit[:40]])
        logits = model(batch)
    assert len(logits.argmax(1).unique()) == K
    for options in ({}, {"alpha": 2, "tailsize": 10}, {"euclid_weight": 0.5}):
        ref = _po().OpenMax(None, **options).fit_logits(logits_fit.double(), y_fit)
        theirs = ref.predict_logits(logits.double())
        ours = ood.score(jm, batch, "openmax", fit_data=_loader(x_fit, y_fit), **options)
        torch.testing.assert_close(ours.double(), -theirs.double(), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- by name, end to end
def test_score_and_evaluate_all_by_name_on_a_cnn(setup):
    jm, _, x_fit, y_fit, x_test = setup
    g = torch.Generator().manual_seed(5)
    pixels = (torch.rand(40, 3, 8, 8, generator=g) > 0.5).float()  # saturated: every pixel 0 or 1
    far = (pixels - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    for name in NEW:
        s = ood.score(jm, x_test, name, fit_data=_loader(x_fit, y_fit))
        assert s.shape == (48,) and torch.isfinite(s).all(), name
    table = ood.evaluate_all(jm, x_test, {"far": far}, list(NEW), fit_data=_loader(x_fit, y_fit), progress=False)
    assert {r["score"] for r in table.records} == set(NEW)
    assert all(r["status"] == "ok" for r in table.records), table.records
    for name in ("gmm", "mahalanobis_odin"):  # feature-space densities: far inputs score lower
        assert table[name]["far"]["auroc"] > 0.5, (name, table[name]["far"])
    assert 0.0 <= table["openmax"]["far"]["auroc"] <= 1.0
    torch.testing.assert_close(table.scores["gmm"]["in"], ood.score(jm, x_test, "gmm", fit_data=_loader(x_fit, y_fit)))


def test_labels_predicted_fits_without_labels(setup):
    jm, model, x_fit, y_fit, x_test = setup
    for name in ("gmm", "openmax"):
        # y_fit are the model's predictions: the same fit
        a = ood.detector(name, labels="predicted").fit(jm, x_fit).score(jm, x_test)
        b = ood.detector(name).fit(jm, (x_fit, y_fit)).score(jm, x_test)
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------- one image, one score
@pytest.mark.filterwarnings("ignore::jem_plugin.errors.UntrainedDensityWarning")  # grad_norm on this CNN
@pytest.mark.parametrize(
    "name", [n for n in ood.available_scores() if not n.endswith("_sgld") and n not in ("mcd", "rankfeat")]
)
def test_an_images_score_does_not_depend_on_the_batch_it_is_scored_in(setup, name):
    """A deployed detector sees one image, or a batch of whatever arrived: every registered score
    gives an image the same value alone, in its own batch and beside other images.
    (pytorch-ood's OpenMax does not: benchmarks/check_openmax_batches.py.) The SGLD-refined scores
    and MCD are left out: their chains and dropout masks are drawn per batch; so is RankFeat, which
    needs feature maps this nn.Sequential does not give (tests/test_posthoc_field_detectors.py
    checks it on a CNN that does)."""
    jm, _, x_fit, y_fit, x_test = setup
    fit = _loader(x_fit, y_fit) if ood.score_info(name)["needs_fit"] else None
    options = {"layers": ["1", "5"]} if name in ("multi_mahalanobis", "gram") else {}  # an nn.Sequential's blocks
    det = ood.detector(name, **options).fit(jm, fit) if fit is not None else name
    together = ood.score(jm, x_test, det, batch_size=len(x_test))
    alone = ood.score(jm, x_test[:8], det, batch_size=1)
    others = _images(40, torch.Generator().manual_seed(5))
    beside_others = ood.score(jm, torch.cat([x_test[:8], others]), det, batch_size=48)[:8]
    tol = 1e-4 * max(1.0, float(together.abs().max()))
    torch.testing.assert_close(alone, together[:8], rtol=0, atol=tol)
    torch.testing.assert_close(beside_others, together[:8], rtol=0, atol=tol)


def _as_convolutions(model: nn.Sequential) -> nn.Sequential:
    """The same classifier with each ``nn.Linear`` a 1x1 convolution (a SqueezeNet-style head):
    the same logits, and no linear layer for the adapter to read features from."""
    layers: list[nn.Module] = [*model[:3]]  # conv, tanh, pooling to [B, 12, 2, 2]
    layers.append(nn.Flatten(2))  # [B, 12, 4]: the flattened maps as channels of one position
    layers.append(_Unflatten())
    for m in model[4:]:
        if isinstance(m, nn.Linear):
            conv = nn.Conv2d(m.in_features, m.out_features, 1)
            conv.weight.data.copy_(m.weight.data.view(*m.weight.shape, 1, 1))
            conv.bias.data.copy_(m.bias.data)
            layers.append(conv)
        else:
            layers.append(m)
    layers.append(nn.Flatten())
    return nn.Sequential(*layers).eval()


class _Unflatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, P] -> [B, C*P, 1, 1] in Flatten's order
        return x.reshape(x.shape[0], -1, 1, 1)


def test_openmax_reads_the_logits_alone_so_a_model_without_a_linear_head_can_use_it(setup):
    """OpenMax fits and scores the logits: on a classifier whose head is a convolution (the adapter
    finds no features) it must work, and give what it gives on the same logits of a linear head."""
    jm, model, x_fit, y_fit, x_test = setup
    conv = _as_convolutions(model)
    assert not any(isinstance(m, nn.Linear) for m in conv.modules())
    jm_conv = jem.wrap(conv, mean=MEAN, std=STD)
    torch.testing.assert_close(jm_conv(x_test), jm(x_test), atol=1e-5, rtol=0)
    with pytest.raises(NoFeaturesError):  # a feature detector still needs features
        ood.detector("mahalanobis").fit(jm_conv, _loader(x_fit, y_fit))
    ours = ood.detector("openmax").fit(jm_conv, _loader(x_fit, y_fit)).score(jm_conv, x_test)
    ref = ood.detector("openmax").fit(jm, _loader(x_fit, y_fit)).score(jm, x_test)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    table = ood.evaluate_all(
        jm_conv,
        x_test,
        {"other": _images(20, torch.Generator().manual_seed(5))},
        ["openmax"],
        fit_data=_loader(x_fit, y_fit),
    )
    assert table.rows()[0]["status"] == "ok"
