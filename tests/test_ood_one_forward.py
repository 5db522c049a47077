"""One forward for every detector (issue 46): the detectors fit from and score outputs already
computed (:class:`jem_plugin.ood.Outputs`), and ``evaluate_all`` runs the network once per batch
for all the scores without an input gradient, with the same scores as each detector alone."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import _ood_compare, ood
from jem_plugin.errors import InvalidInputError, NoFeaturesError, NotFittedError

K, N_FIT, N_SET, BATCH = 4, 120, 40, 32
WARM_UP = 1  # evaluate_all's one batch before timing anything (one-off costs out of the times)


class SmallCNN(nn.Module):
    """Read by the generic adapter: ``layer1``/``layer2`` (multi-layer detectors), an ``avgpool``
    and ``fc`` (feature maps), the input of ``fc`` (features): all by hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, K)

    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(self.layer2(self.layer1(self.stem(x)))), 1))


def _network(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "cnn":
        return SmallCNN().eval()
    timm = pytest.importorskip("timm")
    if kind == "resnet10t":
        return timm.create_model("resnet10t", num_classes=K).eval()
    return timm.create_model("test_vit", img_size=16, patch_size=4, num_classes=K).eval()


def _data(size: int = 16) -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "fit": (torch.rand(N_FIT, 3, size, size, generator=g), torch.arange(N_FIT) % K),
        "in": torch.rand(N_SET, 3, size, size, generator=g),
        "sets": {
            "noise": torch.randn(N_SET, 3, size, size, generator=g).clamp(0, 1),
            "flat": torch.full((N_SET, 3, size, size), 0.5) + 0.01 * torch.rand(N_SET, 3, size, size, generator=g),
        },
    }


def _gradient_free() -> list[str]:
    """The scores that share the forward: every one without an input gradient but mcd (its own
    dropout passes)."""
    return [m for m in ood.available_scores() if ood.score_info(m)["reads"] is not None]


class Counter:
    """Counts passes through the network: a pre-hook on its first layer with parameters."""

    def __init__(self, model: nn.Module) -> None:
        first = next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
        self.calls = 0
        first.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def _batches(n: int) -> int:
    return -(-n // BATCH)


@pytest.fixture(
    scope="module",
    params=["cnn", pytest.param("resnet10t", marks=pytest.mark.slow), pytest.param("test_vit", marks=pytest.mark.slow)],
)
def run(request):
    model = _network(request.param)
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    counter = Counter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few fit images for wide features: the Gaussian detectors warn
        table = ood.evaluate_all(
            jm, D["in"], D["sets"], _gradient_free(), fit_data=D["fit"], batch_size=BATCH, progress=False
        )
    return jm, D, table, counter.calls


def test_evaluate_all_runs_the_network_once_per_batch_for_every_gradient_free_score(run):
    """Per-detector loops ran it once per detector, set and batch, and once more per batch of
    each fit: 15 scores over 3 sets and a fit. Now one forward per batch of each set and of the
    fit data (openmax's second pass, for the distances to its class means, reads the logits kept
    from the first)."""
    _, _, table, calls = run
    # rankfeat reads feature maps, which a ViT has none of: refused in its row
    assert all(m == "rankfeat" and "feature maps" in r for m, r in table.failures().items()), table.failures()
    assert calls == 3 * _batches(N_SET) + _batches(N_FIT) + WARM_UP, calls


@pytest.mark.slow
def test_the_shared_forward_gives_each_detector_its_own_scores(run):
    """Every score from the shared outputs equals the score of that detector fitted and scored
    on its own, batch for batch."""
    jm, D, table, _ = run
    for m in [m for m in _gradient_free() if m not in table.failures()]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ood.score_info(m)["needs_fit"]:
                det = ood.detector(m).fit(jm, D["fit"], batch_size=BATCH)
                alone = {s: ood.score(jm, x, det, batch_size=BATCH) for s, x in [("in", D["in"]), *D["sets"].items()]}
            else:
                alone = {s: ood.score(jm, x, m, batch_size=BATCH) for s, x in [("in", D["in"]), *D["sets"].items()]}
        for s, expected in alone.items():
            torch.testing.assert_close(table.scores[m][s], expected, rtol=1e-5, atol=1e-6, msg=f"{m} on {s}")


def test_the_gradient_scores_keep_their_own_passes_beside_the_shared_one():
    model = _network("cnn")
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    counter = Counter(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = ood.evaluate_all(
            jm, D["in"], D["sets"], ["msp", "knn", "odin"], fit_data=D["fit"], batch_size=BATCH, progress=False
        )
    assert not table.failures()
    per_set = 3 * _batches(N_SET)
    # one shared pass (knn's fit, then msp and knn scored), and odin's two forwards (and a backward) per batch
    assert counter.calls == WARM_UP + _batches(N_FIT) + per_set + 2 * per_set


def test_detectors_fit_from_and_score_outputs_computed_once():
    """The feature level, as pytorch-ood's fit_features/predict_features: outputs computed once
    (one forward) serve every detector; the scores equal those of the inputs."""
    model = _network("cnn")
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    x_fit, y_fit = D["fit"]
    names = ["mahalanobis", "knn", "vim", "react", "gmm", "openmax", "multi_mahalanobis", "gram"]
    dets = [ood.detector(m) for m in names]
    reads = frozenset().union(*(d.reads for d in dets))
    counter = Counter(model)
    fit_out = ood.outputs(jm, x_fit, reads)  # default layers: the ones the detectors read by default
    test_out = ood.outputs(jm, D["in"], reads)
    assert counter.calls == 2 and len(test_out) == N_SET and set(test_out.layers) == {"layer1", "layer2"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m, det in zip(names, dets):
            det.fit_outputs(jm, (fit_out, y_fit))
            alone = ood.detector(m).fit(jm, D["fit"], batch_size=N_FIT)
            torch.testing.assert_close(
                ood.score_outputs(jm, test_out, det), alone.score(jm, D["in"]), rtol=1e-5, atol=1e-6, msg=m
            )
    # the fit_outputs and score_outputs above ran nothing: the forwards since are the checks' own
    assert counter.calls == 2 + (len(names) + 1) + len(names)  # a fit each (openmax: two passes), a score each
    for m in ("msp", "logpx", "max_logit", "gen", "ash", "scale"):
        out = ood.outputs(jm, D["in"], ood.score_info(m)["reads"])
        torch.testing.assert_close(ood.score_outputs(jm, out, m), ood.score(jm, D["in"], m), msg=m)
    # options as for the inputs
    torch.testing.assert_close(
        ood.score_outputs(jm, test_out, "msp", temperature=10.0), ood.score(jm, D["in"], "msp", temperature=10.0)
    )


def test_score_info_says_what_each_score_reads():
    assert ood.score_info("msp")["reads"] == {"logits"}
    assert ood.score_info("ash")["reads"] == {"logits", "feature_maps", "features"}
    assert ood.score_info("knn")["reads"] == {"logits", "features"}
    assert ood.score_info("gram")["reads"] == {"logits", "layers"}
    assert ood.score_info("openmax")["reads"] == {"logits"}
    for m in ("odin", "mahalanobis_odin", "grad_norm", "logpx_sgld"):
        assert ood.score_info(m)["reads"] is None  # they read the inputs themselves


def test_outputs_computed_elsewhere_are_scored_as_the_network_would_be():
    """A user's own features and logits, no forward of ours."""
    model = _network("cnn")
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    x_fit, y_fit = D["fit"]
    with torch.no_grad():
        feats_fit, logits_fit = jm.features(x_fit)
        feats, logits = jm.features(D["in"])
    det = ood.detector("mahalanobis").fit_outputs(jm, (ood.Outputs(logits_fit, features=feats_fit), y_fit))
    batches = [
        (ood.Outputs(lg, features=f), y) for lg, f, y in zip(logits_fit.split(50), feats_fit.split(50), y_fit.split(50))
    ]
    streamed = ood.detector("mahalanobis").fit_outputs(jm, batches)
    out = ood.Outputs(logits, features=feats)
    expected = ood.detector("mahalanobis").fit(jm, D["fit"]).score(jm, D["in"])
    torch.testing.assert_close(det.score_outputs(jm, out), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(streamed.score_outputs(jm, out), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ood.score_outputs(jm, ood.Outputs(logits), "max_logit"), logits.max(1).values)


def test_what_outputs_cannot_serve_says_so_in_one_line():
    model = _network("cnn")
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    x_fit, y_fit = D["fit"]
    logits_only = ood.outputs(jm, x_fit)
    with pytest.raises(NoFeaturesError, match="penultimate features.*jem.ood.outputs"):
        ood.detector("mahalanobis").fit_outputs(jm, (logits_only, y_fit))
    with pytest.raises(ValueError, match="inputs themselves"):
        ood.score_outputs(jm, logits_only, "odin")
    with pytest.raises(NotFittedError, match="fit_outputs"):
        ood.score_outputs(jm, logits_only, "knn")
    with pytest.raises(ValueError, match="input gradient"):
        ood.detector("mahalanobis_odin").fit_outputs(jm, (logits_only, y_fit))
    with pytest.raises(ValueError, match="inputs along their gradient"):
        ood.detector("mahalanobis_odin").score_outputs(jm, logits_only)
    with pytest.raises(InvalidInputError, match="twice"):
        ood.detector("openmax").fit_outputs(jm, iter([(logits_only, y_fit)]))
    with pytest.raises(ValueError, match="unknown output kind.*'featurs'"):
        ood.outputs(jm, x_fit, reads=["featurs"])
    with pytest.raises(TypeError, match="msp.*temp"):
        ood.score_outputs(jm, logits_only, "msp", temp=2.0)


def test_a_kind_the_network_lacks_fails_only_the_detectors_that_read_it():
    """A network whose classifier is a convolution has no penultimate features: the feature
    detectors fail in their rows, the logit scores share the forward as before."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, K, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    jm = jem.wrap(model.eval(), data_range=(0, 1), num_classes=K)
    D = _data()
    counter = Counter(model)
    table = ood.evaluate_all(
        jm,
        D["in"],
        D["sets"],
        ["msp", "openmax", "mahalanobis", "knn"],
        fit_data=D["fit"],
        batch_size=BATCH,
        progress=False,
    )
    assert set(table.failures()) == {"mahalanobis", "knn"}
    assert "NoFeaturesError" in table.failures()["knn"]
    assert {"msp", "openmax"} <= set(table)
    assert counter.calls == WARM_UP + _batches(N_FIT) + 3 * _batches(N_SET)


def test_openmax_streams_its_second_pass_from_the_kept_logits_or_runs_again_past_the_budget(monkeypatch):
    model = _network("cnn")
    jm = jem.wrap(model, data_range=(0, 1), num_classes=K)
    D = _data()
    counter = Counter(model)
    scored = 3 * _batches(N_SET)

    def table(fit):
        before = counter.calls
        t = ood.evaluate_all(jm, D["in"], D["sets"], ["openmax"], fit_data=fit, batch_size=BATCH, progress=False)
        return t, counter.calls - before

    kept, calls = table(D["fit"])
    assert calls == WARM_UP + _batches(N_FIT) + scored
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*D["fit"]), batch_size=BATCH)
    one_shot, _ = table(iter(loader))  # read once: the second pass needs no second read
    monkeypatch.setattr(_ood_compare, "_REPLAY_BYTES", 0)  # logits too large to keep: a second forward pass
    again, calls = table(D["fit"])
    assert calls == WARM_UP + 2 * _batches(N_FIT) + scored
    for t in (one_shot, again):
        assert not t.failures()
        torch.testing.assert_close(t.scores["openmax"]["noise"], kept.scores["openmax"]["noise"], rtol=0, atol=0)
    failed, _ = table(iter(loader))
    assert "one-shot iterator" in failed.failures()["openmax"]
