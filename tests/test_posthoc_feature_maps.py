"""ASH and SCALE shape a CNN's last feature maps, as their papers and pytorch-ood do, wherever the
adapter can give them (:meth:`jem_plugin.JEM.feature_maps`): timm CNNs through ``forward_features``
and ``forward_head``, models with an ``avgpool`` layer and an ``fc``/``classifier`` head (torchvision's
ResNets, MobileNets and EfficientNets, hand-written CNNs) through a forward hook. Elsewhere (ViTs,
heads the adapter cannot rebuild) they shape the penultimate features, as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.adapter import Adapter
from jem_plugin.builtins.posthoc import shaping
from jem_plugin.errors import NoFeaturesError

timm = pytest.importorskip("timm")


def _po():
    return pytest.importorskip("pytorch_ood.detector")


def _images(jm, n: int = 6, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Random pixels in the model's own input domain (normalised as it expects)."""
    return jm.domain.uniform(n, (3, size, size), generator=torch.Generator().manual_seed(seed))


def _penultimate(jm, x, shape) -> torch.Tensor:
    """The energy from the shaped penultimate features: what ash/scale computed before maps."""
    h, _ = jm.features(x)
    return torch.logsumexp(jm.head()(shape(h)), dim=1)


@pytest.mark.parametrize("name, cls, p", [("ash", "ASH", 90), ("scale", "SCALE", 85), ("ash", "ASH", 65)])
def test_on_a_timm_cnn_ash_and_scale_equal_pytorch_oods_feature_map_detectors(name, cls, p):
    """pytorch-ood's ASH and SCALE take a CNN's backbone and head: timm's ``forward_features`` and
    ``forward_head``. Ours give the same scores at the same percentile (ours / 100 there)."""
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", num_classes=7).eval()
    with torch.no_grad():  # logits far apart, as a trained model's: the two scores then differ clearly
        model.get_classifier().weight.mul_(30.0)
    jm = jem.wrap(model)
    x = _images(jm)
    maps, to_logits = jm.feature_maps(x)
    assert maps.shape[:2] == (6, model.num_features) and maps.dim() == 4
    torch.testing.assert_close(to_logits(maps), model(x))
    ref = getattr(_po(), cls)(backbone=model.forward_features, head=model.forward_head, percentile=p / 100)
    with torch.no_grad():
        theirs = -ref.predict(x)
    torch.testing.assert_close(ood.score(jm, x, name, percentile=p), theirs, rtol=1e-4, atol=1e-4)
    flat = _penultimate(jm, x, lambda h: shaping._ash_s(h, p) if name == "ash" else shaping._scale_rows(h, p))
    assert (flat - theirs).abs().max() > 1e-3  # the penultimate-feature version is a different score


def test_a_torchvision_efficientnet_gives_its_avgpool_input_as_its_feature_maps():
    """torchvision names the pool ``avgpool`` and the head ``classifier`` (dropout, then the linear
    layer): the maps are the pool's input and ``classifier(flatten(avgpool(maps)))`` its logits."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(num_classes=5).eval()
    jm = jem.wrap(model, input_size=(3, 32, 32))
    x = _images(jm)
    maps, to_logits = jm.feature_maps(x)
    assert maps.shape == (6, 1280, 1, 1)
    torch.testing.assert_close(to_logits(maps), model(x))
    ref = _po().ASH(
        backbone=lambda t: model.features(t), head=lambda m: model.classifier(torch.flatten(model.avgpool(m), 1))
    )
    with torch.no_grad():
        theirs = -ref.predict(x)
    torch.testing.assert_close(ood.score(jm, x, "ash", percentile=65), theirs, rtol=1e-4, atol=1e-4)


class _PoolThenScaled(nn.Module):
    """A hand-written CNN whose forward does more between its pool and its head than flatten."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, k)

    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(self.body(x)), 1) * 2.0)


class _Plain(_PoolThenScaled):
    def forward(self, x):
        return self.fc(torch.flatten(self.avgpool(self.body(x)), 1))


def test_a_user_cnn_gets_maps_only_where_its_head_is_rebuilt_exactly():
    """``fc(flatten(avgpool(maps)))`` is offered only where it gives back the model's own logits: a
    forward that scales the pooled features falls back to the penultimate features (the fc's input)."""
    torch.manual_seed(0)
    x = torch.rand(5, 3, 10, 10)
    plain = jem.wrap(_Plain().eval(), data_range=(0.0, 1.0))
    maps, to_logits = plain.feature_maps(x)
    assert maps.shape == (5, 8, 8, 8)
    by_hand = torch.logsumexp(
        plain.model.fc(plain.model.avgpool(shaping._ash_s(maps.flatten(1), 90).view_as(maps)).flatten(1)), 1
    )
    torch.testing.assert_close(ood.score(plain, x, "ash"), by_hand)

    scaled = jem.wrap(_PoolThenScaled().eval(), data_range=(0.0, 1.0))
    assert scaled.feature_maps(x) is None
    torch.testing.assert_close(
        ood.score(scaled, x, "scale"), _penultimate(scaled, x, lambda h: shaping._scale_rows(h, 85))
    )


def test_a_vit_is_shaped_on_its_penultimate_features_in_one_forward():
    """A ViT has no spatial maps: its pre-logits features are its 1x1 maps, read in the same
    forward (ASH and SCALE on test_vit cost two forwards, half pytorch-ood's throughput, when the
    maps were looked for first and the features read after)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=4).eval()
    jm = jem.wrap(model)
    x = _images(jm, 3)
    maps, to_logits = jm.feature_maps(x)
    assert maps.shape == (3, model.num_features, 1, 1)
    torch.testing.assert_close(to_logits(maps), model(x))
    calls = []
    handle = model.patch_embed.register_forward_hook(lambda *_: calls.append(1))
    try:
        for name, shape in (("ash", lambda h: shaping._ash_s(h, 90)), ("scale", lambda h: shaping._scale_rows(h, 85))):
            calls.clear()
            score = ood.score(jm, x, name)
            assert len(calls) == 1, f"{name} ran the model {len(calls)} times"
            torch.testing.assert_close(score, _penultimate(jm, x, shape))
    finally:
        handle.remove()


class _MapsAdapter(Adapter):
    """A third party's adapter: the maps of its model's ``trunk`` and the rest of the forward."""

    def feature_maps(self, model, x):
        return model.trunk(x), lambda m: model.fc(m.mean(dim=(2, 3)))


class _Trunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU())
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(self.trunk(x).mean(dim=(2, 3)))


def test_an_adapter_from_the_plugin_hook_can_provide_the_feature_maps():
    from jem_plugin.plugins import get_plugin_manager, hookimpl

    class Plugin:
        @hookimpl(tryfirst=True)
        def jem_adapter(self, model, options):
            return _MapsAdapter("trunked", num_classes=2) if isinstance(model, _Trunked) else None

    pm = get_plugin_manager()
    plugin = Plugin()
    pm.register(plugin)
    try:
        model = _Trunked().eval()
        jm = jem.wrap(model, data_range=(0.0, 1.0))
        assert jm.adapter.name == "trunked"
        x = torch.rand(4, 3, 9, 9)
        m = model.trunk(x)
        s2 = torch.topk(m.flatten(1), shaping._kept(m[0].numel(), 85), dim=1).values.sum(1)
        by_hand = torch.logsumexp(model.fc((m * torch.exp(m.flatten(1).sum(1) / s2).view(-1, 1, 1, 1)).mean((2, 3))), 1)
        torch.testing.assert_close(ood.score(jm, x, "scale"), by_hand)
    finally:
        pm.unregister(plugin)


def test_maps_of_the_wrong_shape_from_an_adapter_end_in_one_clear_error():
    class Flat(_MapsAdapter):
        def feature_maps(self, model, x):
            return model.trunk(x).flatten(1), lambda m: m

    jm = jem.wrap(_Trunked().eval(), adapter=Flat("flat", num_classes=2), data_range=(0.0, 1.0))
    with pytest.raises(NoFeaturesError, match=r"feature maps of shape \[B=4, C, H, W\]"):
        ood.score(jm, torch.rand(4, 3, 9, 9), "ash")


def test_a_hugging_face_resnet_gives_its_poolers_input_as_its_feature_maps():
    """transformers' ResNet pools in ``resnet.pooler`` and classifies with ``classifier`` (Flatten,
    Linear): its maps are the pooler's input, and ASH equals pytorch-ood's on them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    model = transformers.ResNetForImageClassification(cfg).eval()
    jm = jem.wrap(model, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    x = _images(jm, 4)
    maps, to_logits = jm.feature_maps(x)
    assert maps.shape[:2] == (4, 16) and maps.dim() == 4
    torch.testing.assert_close(to_logits(maps), model(x).logits)

    def trunk(t):
        return model.resnet.encoder(model.resnet.embedder(t)).last_hidden_state

    ref = _po().ASH(backbone=trunk, head=lambda m: model.classifier(model.resnet.pooler(m)), percentile=0.9)
    with torch.no_grad():
        theirs = -ref.predict(x)
    torch.testing.assert_close(ood.score(jm, x, "ash"), theirs, rtol=1e-4, atol=1e-4)
