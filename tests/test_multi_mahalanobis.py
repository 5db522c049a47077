"""multi_mahalanobis (issue 29): Lee et al.'s feature ensemble, Mahalanobis summed over several
depths. Equal to the formula written out here and to pytorch-ood's MultiMahalanobis (up to the
scale its docstring states), fitted by streaming, with default layers read through the adapters
(timm's ``feature_info``, a ResNet's ``layer1``...; channels-last maps pooled as such), and one
line saying how to name the layers where jem-plugin knows none."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import train_by_cross_entropy
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.builtins import posthoc
from jem_plugin.errors import NoFeaturesError, NotFittedError

K, N_FIT = 3, 360


class SmallResNet(nn.Module):
    """A user's own network, named the way torchvision names a ResNet's stages."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.Tanh())
        self.layer1 = nn.Sequential(nn.Conv2d(6, 5, 3, padding=1), nn.Tanh())
        self.layer2 = nn.Sequential(nn.Conv2d(5, 8, 3, stride=2, padding=1), nn.Tanh())
        self.fc = nn.Linear(8, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(self.stem(x))).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    model = SmallResNet().eval()
    x_fit = torch.rand(N_FIT, 3, 8, 8, generator=g) * 2 - 1
    y_fit = torch.arange(N_FIT) % K
    x_fit = x_fit + 0.3 * y_fit.view(-1, 1, 1, 1)  # classes apart in brightness
    x_test = torch.rand(12, 3, 8, 8, generator=g) * 2 - 1
    jm = jem.wrap(model, data_range=(-1.0, 2.0))
    return jm, model, x_fit, y_fit, x_test


def _pooled(model: SmallResNet, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        h1 = model.layer1(model.stem(x))
        h2 = model.layer2(h1)
    return [h1.mean(dim=(2, 3)).double(), h2.mean(dim=(2, 3)).double()]


def _lee_distances(z_fit: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``min_c (z - mu_c)^T pinv(Sigma) (z - mu_c)``, Sigma the within-class covariance over N."""
    mu = torch.stack([z_fit[y == c].mean(0) for c in range(K)])
    centred = z_fit - mu[y]
    precision = torch.linalg.pinv(centred.T @ centred / len(y))
    return torch.stack([((z - m) @ precision * (z - m)).sum(1) for m in mu], 1).min(1).values


@pytest.mark.parametrize("weights", ["dof", "uniform", [0.5, 2.0]])
def test_is_the_weighted_sum_of_each_layers_mahalanobis_distance(setup, weights):
    jm, model, x_fit, y_fit, x_test = setup
    det = ood.detector("multi_mahalanobis", weights=weights).fit(jm, (x_fit, y_fit))
    assert det.layer_names == ["layer1", "layer2"]  # the ResNet convention, read by the adapter
    assert det.ranks == [5, 8]
    d = [_lee_distances(zf, y_fit, zt) for zf, zt in zip(_pooled(model, x_fit), _pooled(model, x_test))]
    named = {"dof": [1 / math.sqrt(10), 1 / math.sqrt(16)], "uniform": [1.0, 1.0]}
    w = named[weights] if isinstance(weights, str) else weights
    expected = -(w[0] * d[0] + w[1] * d[1])
    torch.testing.assert_close(det.score(jm, x_test).double(), expected, rtol=1e-4, atol=1e-4)
    per_layer = det.layer_scores(jm, x_test).double()
    torch.testing.assert_close(per_layer, -torch.stack(d, 1), rtol=1e-4, atol=1e-4)


def test_equals_pytorch_ood_multi_mahalanobis_up_to_its_scale(setup):
    """pytorch-ood sums ``0.5 * min_c d_c`` per layer with the precision of the *sum* of squared
    deviations: ours with ``weights="uniform"`` is ``-2 N`` times its outlier score."""
    po = pytest.importorskip("pytorch_ood.detector")
    jm, model, x_fit, y_fit, x_test = setup
    theirs = po.MultiMahalanobis([nn.Identity(), nn.Identity()])
    theirs.fit_structured([z.float() for z in _pooled(model, x_fit)], y_fit)
    ref = theirs.predict_structured([z.float() for z in _pooled(model, x_test)])
    ours = ood.score(jm, x_test, "multi_mahalanobis", fit_data=(x_fit, y_fit), weights="uniform")
    torch.testing.assert_close(ours / (2 * N_FIT), -ref, rtol=1e-3, atol=1e-4)


def test_fit_streams_one_batch_equals_many(setup):
    jm, _, x_fit, y_fit, x_test = setup
    whole = posthoc.MultiMahalanobis().fit(jm, (x_fit, y_fit), batch_size=N_FIT)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_fit, y_fit), batch_size=37)
    streamed = posthoc.MultiMahalanobis().fit(jm, loader)
    torch.testing.assert_close(streamed.score(jm, x_test), whole.score(jm, x_test), rtol=1e-4, atol=1e-4)


def test_options_and_unfitted_use_are_refused_in_one_line(setup):
    jm, _, x_fit, y_fit, x_test = setup
    with pytest.raises(NotFittedError, match="fit"):
        posthoc.MultiMahalanobis().score(jm, x_test)
    with pytest.raises(ValueError, match="weights"):
        posthoc.MultiMahalanobis(weights="equal")
    with pytest.raises(ValueError, match="weights"):
        posthoc.MultiMahalanobis(weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="layers"):
        posthoc.MultiMahalanobis(layers="layer1")  # a string, not a list of names
    with pytest.raises(ValueError, match=r"3 number\(s\) for 2 layers"):
        posthoc.MultiMahalanobis(weights=[1.0, 1.0, 1.0]).fit(jm, (x_fit, y_fit))
    with pytest.raises(NoFeaturesError, match=r"no submodule 'layer9'.*top-level children: stem, layer1, layer2, fc"):
        posthoc.MultiMahalanobis(layers=["layer1", "layer9"]).fit(jm, (x_fit, y_fit))


def test_a_model_without_known_layers_is_told_how_to_name_them():
    """An ``nn.Sequential`` has no ``feature_info`` and no ``layer1``: the error says what to pass,
    and the named layers then work, ``[B, D]`` outputs included."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 6), nn.ReLU(), nn.Linear(6, 2)
    )
    jm = jem.wrap(model, data_range=(-5.0, 5.0)).eval()
    x, y = torch.randn(60, 1, 8, 8), torch.arange(60) % 2
    assert jm.feature_layers() is None
    with pytest.raises(NoFeaturesError, match=r"layers=\['name.of.block1'"):
        ood.detector("multi_mahalanobis").fit(jm, (x, y))
    det = ood.detector("multi_mahalanobis", layers=["1", "4"]).fit(jm, (x, y))
    assert det.score(jm, x[:5]).shape == (5,)
    table = ood.evaluate_all(jm, x, {"noise": torch.randn(20, 1, 8, 8) * 3}, ["multi_mahalanobis"], fit_data=(x, y))
    (row,) = table.rows()
    assert row["status"] == "failed" and "layers=" in row["reason"]  # in its row; the comparison goes on


@pytest.mark.parametrize(
    ("name", "size", "layers"),
    [
        ("test_byobnet", 32, ["stem", "stages.0", "stages.1", "stages.2", "final_conv"]),
        ("test_mambaout", 64, ["stages.0", "stages.1", "stages.2", "stages.3"]),  # channels-last maps
    ],
)
def test_timm_models_default_to_their_feature_info_stages(name, size, layers):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, num_classes=K).eval()
    jm = jem.wrap(model)
    assert jm.feature_layers() == layers
    x = torch.rand(2, 3, size, size)
    feats, logits = jm.layer_features(x)
    assert [f.shape[1] for f in feats] == [f["num_chs"] for f in model.feature_info]
    torch.testing.assert_close(logits, model(x))
    caught = []
    hook = model.get_submodule(layers[0]).register_forward_hook(lambda _m, _a, out: caught.append(out))
    model(x)
    hook.remove()
    maps = caught[0]
    spatial = (1, 2) if getattr(model, "output_fmt", None) == "NHWC" else (2, 3)
    torch.testing.assert_close(feats[0], maps.mean(dim=spatial))


@pytest.mark.parametrize(
    ("name", "layers", "widths"),
    [
        ("mobilenet_v3_small", ["features.0", "features.1", "features.3", "features.8", "features.12"], None),
        ("densenet121", ["features.pool0", "features.denseblock1", "features.denseblock2"], [64, 256, 512]),
    ],
)
def test_torchvision_cnns_default_to_the_end_of_each_resolution_of_their_features(name, layers, widths):
    """Blocks named by index or by name; the end of a resolution is the block before a strided
    one, or the pooling layer itself."""
    tv = pytest.importorskip("torchvision")
    jm = jem.wrap(getattr(tv.models, name)(num_classes=K).eval())
    assert jm.feature_layers()[: len(layers)] == layers
    with torch.no_grad():
        feats, _ = jm.layer_features(torch.rand(2, 3, 64, 64))
    assert widths is None or [f.shape[1] for f in feats[: len(widths)]] == widths


def test_channels_last_maps_of_torchvisions_swin_are_pooled_over_positions():
    """torchvision's Swin stages return [B, H, W, C]: the layer's own width (its last norm) says
    so. Its stages end before each patch merging, which halves the resolution with no stride."""
    tv = pytest.importorskip("torchvision")
    model = tv.models.swin_t(num_classes=K).eval()
    jm = jem.wrap(model)
    assert jm.feature_layers() == ["features.1", "features.3", "features.5", "features.7"]
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        feats, _ = jm.layer_features(x)
        maps = model.features[:2](x)
    assert [f.shape[1] for f in feats] == [96, 192, 384, 768]
    torch.testing.assert_close(feats[0], maps.mean(dim=(1, 2)))


def _small_torchvision(name: str) -> nn.Module:
    tv = pytest.importorskip("torchvision")
    if name == "vit":  # a user's own small ViT: the class torchvision's vit_b_16 is built from
        return tv.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=K
        )
    if name == "googlenet":
        return tv.models.googlenet(num_classes=K, aux_logits=False, init_weights=False)
    return getattr(tv.models, name)(num_classes=K)


@pytest.mark.parametrize(
    ("name", "layers", "widths"),
    [
        (
            "vit",
            ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1", "encoder.layers.encoder_layer_2"],
            [16] * 3,
        ),
        ("regnet_x_400mf", [f"trunk_output.block{i}" for i in range(1, 5)], [32, 64, 160, 400]),
        ("shufflenet_v2_x0_5", ["maxpool", "stage2", "stage3", "conv5"], [24, 48, 96, 1024]),
        ("mnasnet0_5", ["layers.7", "layers.8", "layers.9", "layers.11", "layers.16"], [8, 16, 24, 48, 1280]),
        ("googlenet", ["maxpool1", "maxpool2", "maxpool3", "maxpool4", "inception5b"], [64, 192, 480, 832, 1024]),
    ],
)
def test_other_torchvision_classifiers_have_default_layers(name, layers, widths):
    """A transformer's encoder blocks, a RegNet's trunk stages, and the resolution ends of a model
    whose stages are its own children (ShuffleNet, GoogLeNet) or a ``layers`` sequence (MNASNet)."""
    jm = jem.wrap(_small_torchvision(name).eval())
    assert jm.feature_layers() == layers
    with torch.no_grad():
        feats, logits = jm.layer_features(torch.rand(2, 3, 32, 32))
    assert [f.shape[1] for f in feats] == widths and logits.shape == (2, K)


def test_an_nn_sequential_cnn_defaults_to_its_pooling_layers_and_is_scored_without_naming_them():
    """Rule 4: the resolution ends along a plain ``nn.Sequential`` CNN up to its head, so
    ``multi_mahalanobis`` runs on it as it comes; maps far from the fitted ones score lower."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 2 * 2, 2),
    )  # fmt: skip
    jm = jem.wrap(model, data_range=(-5.0, 5.0)).eval()
    assert jm.feature_layers() == ["2", "5"]
    x, y = torch.randn(80, 1, 8, 8), torch.arange(80) % 2
    det = ood.detector("multi_mahalanobis").fit(jm, (x, y))
    far = torch.randn(20, 1, 8, 8) * 4 + 3
    assert det.score(jm, x[:20]).mean() > det.score(jm, far).mean()


def test_torchvision_resnet_and_the_cli_networks_have_default_layers():
    tv = pytest.importorskip("torchvision")
    from jem_plugin.app.nets import DigitsCNN, WideResNet

    assert jem.wrap(tv.models.resnet18(num_classes=K)).feature_layers() == ["layer1", "layer2", "layer3", "layer4"]
    assert jem.wrap(DigitsCNN(), data_range=(-1, 1)).feature_layers() == ["features.4", "features.9"]
    wrn = jem.wrap(WideResNet(16, 1), data_range=(-1, 1)).eval()
    assert wrn.feature_layers() == ["blocks.1", "blocks.3", "blocks.5"]
    feats, _ = wrn.layer_features(torch.rand(2, 3, 32, 32))
    assert [f.shape[1] for f in feats] == [16, 32, 64]


def test_hugging_face_models_default_to_their_encoders_blocks():
    transformers = pytest.importorskip("transformers")
    resnet = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=K)
    )
    swin = transformers.SwinForImageClassification(
        transformers.SwinConfig(
            image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 1], window_size=2, num_labels=K
        )
    )
    for model, width in ((resnet, [8, 16]), (swin, [16, 16])):  # Swin's blocks return (tokens, ...) tuples
        jm = jem.wrap(model.eval())
        layers = jm.feature_layers()
        assert layers is not None and len(layers) == 2 and layers[0].endswith(("stages.0", "layers.0")), layers
        feats, logits = jm.layer_features(torch.rand(2, 3, 32, 32))
        assert [f.shape[1] for f in feats] == width and logits.shape == (2, K)


def test_catches_low_level_shifts_that_the_penultimate_features_map_onto_the_classes():
    """What the ensemble is for: a digits classifier maps blurred or half-contrast digits onto its
    classes, so the penultimate Mahalanobis distance ranks many of them among the test digits
    (AUROC 0.80 and 0.86 here); the early layer sees the lost edges and contrast."""
    from jem_plugin.app.data import digits_tensors
    from jem_plugin.app.nets import DigitsCNN

    torch.manual_seed(0)
    x, y = digits_tensors("train")
    x_test, _ = digits_tensors("test")
    model = train_by_cross_entropy(DigitsCNN(width=8), x, y, epochs=3)
    jm = jem.wrap(model, data_range=(-1, 1))
    shifted = {"blurred": nn.functional.avg_pool2d(x_test, 3, 1, 1), "half contrast": 0.5 * x_test}
    adversarial = ood.detector("multi_mahalanobis", weights="adversarial")
    adversarial.name = "adversarial"
    methods = ["mahalanobis", "multi_mahalanobis", adversarial]
    table = ood.evaluate_all(jm, x_test, shifted, methods, fit_data=(x, y))
    auroc = {(r["score"], r["set"]): r["auroc"] for r in table.rows()}
    for name in shifted:
        assert auroc["multi_mahalanobis", name] > max(0.95, auroc["mahalanobis", name] + 0.05), auroc
    # Lee et al.'s FGSM-learned weights give the first layer a negative coefficient here: kept, it
    # ranked blurred digits above the test digits (AUROC 0.20); left out, the scores stay above chance
    assert adversarial.layer_weights[0] == 0.0 < adversarial.layer_weights[1]
    assert min(auroc["adversarial", name] for name in shifted) > 0.85, auroc


def test_adversarial_weights_are_lee_et_als_logistic_regression_on_fgsm_images(setup):
    """``weights="adversarial"``: the coefficients of a logistic regression (standardised
    per-layer scores, scaled back) telling the first ``adversarial_images`` fit images from their
    FGSM versions, a step of ``eps`` pixels up the cross-entropy's gradient sign, recomputed here
    with scikit-learn; the images are not kept past the fit, and batches stream as before."""
    from sklearn.linear_model import LogisticRegression

    jm, model, x_fit, y_fit, x_test = setup
    n, eps = 100, 0.05
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_fit, y_fit), batch_size=40)
    det = ood.detector("multi_mahalanobis", weights="adversarial", adversarial_images=n, adversarial_eps=eps)
    det.fit(jm, loader)
    assert det._kept is None and repr(det).count("adversarial_eps=0.05") == 1

    x, y = x_fit[:n].clone().requires_grad_(True), y_fit[:n]
    (g,) = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), x)
    x_adv = x.detach() + eps * g.sign() * 3.0  # the domain (-1, 2) is 3 pixel ranges wide
    feats = torch.cat([det.layer_scores(jm, x.detach()), det.layer_scores(jm, x_adv)]).double().numpy()
    standard, spread = (feats - feats.mean(0)) / feats.std(0), feats.std(0)
    target = [1] * n + [0] * n
    expected, kept = [0.0, 0.0], [0, 1]
    while kept:  # the layers with a negative coefficient are left out, the rest refitted
        coef = LogisticRegression(max_iter=2000).fit(standard[:, kept], target).coef_[0]
        if (coef >= 0).all():
            for i, c in zip(kept, coef):
                expected[i] = c / spread[i]
            break
        kept = [i for i, c in zip(kept, coef) if c >= 0]
    assert det.layer_weights == pytest.approx(expected, rel=1e-3, abs=1e-12)
    by_hand = (det.layer_scores(jm, x_test).double() * torch.tensor(expected, dtype=torch.float64)).sum(1)
    torch.testing.assert_close(det.score(jm, x_test).double(), by_hand, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="adversarial_eps"):
        posthoc.MultiMahalanobis(weights="adversarial", adversarial_eps=0)
    with pytest.raises(ValueError, match="adversarial_images"):
        posthoc.MultiMahalanobis(weights="adversarial", adversarial_images=1)


def test_adversarial_weights_score_noise_below_the_fit_images(setup):
    """With labels read off the model (``labels="predicted"``, unlabelled fit data) the learned
    weights are finite and score uniform noise over the domain below the in-distribution images."""
    jm, _, x_fit, _, _ = setup
    det = ood.detector("multi_mahalanobis", weights="adversarial", labels="predicted").fit(jm, x_fit)
    assert len(det.layer_weights) == 2 and all(math.isfinite(w) for w in det.layer_weights)
    noise = torch.rand(60, 3, 8, 8) * 3 - 1
    assert det.score(jm, x_fit[:60]).mean() > det.score(jm, noise).mean()
