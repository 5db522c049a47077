"""Penultimate features through the adapters: ``jm.features(x) -> (features, logits)`` in one
forward, for timm, torchvision, Hugging Face and user modules (models the rest of the suite does
not use), with the head mapping the features to exactly the logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.adapter import Adapter, InputDomain
from jem_plugin.errors import NoFeaturesError


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    return calls


def _check(jm, model_out, x, stem: nn.Module):
    calls = _count_calls(stem)
    feats, logits = jm.features(x)
    assert calls[0] == 1, "features must take exactly one forward"
    assert feats.dim() == 2 and feats.shape[0] == x.shape[0] and feats.dtype == torch.float32
    head = jm.head()
    assert isinstance(head, nn.Linear) and head.in_features == feats.shape[1]
    torch.testing.assert_close(head(feats), logits, rtol=0, atol=1e-6)  # head(features) == logits
    torch.testing.assert_close(logits, model_out, rtol=0, atol=1e-6)  # the model's own logits
    return feats, logits


def _first_conv(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


@pytest.mark.parametrize("name", ["lcnet_050", "convnext_atto"])
def test_timm_features_are_forward_head_pre_logits(name):
    timm = pytest.importorskip("timm")
    model = timm.create_model(name, pretrained=False, num_classes=5).eval()
    with torch.no_grad():
        model.get_classifier().weight.normal_()  # timm zero-initialises some heads: make the check bite
    jm = jem.wrap(model)
    assert jm.adapter.name == "timm"
    x = torch.randn(3, 3, 32, 32).clamp(-2, 2)
    with torch.no_grad():
        ref = model.forward_head(model.forward_features(x), pre_logits=True)
        feats, _ = _check(jm, model(x), x, _first_conv(model))
    torch.testing.assert_close(feats, ref.flatten(1), rtol=0, atol=0)
    assert jm.head() is model.get_classifier()


def test_torchvision_features_are_the_input_of_the_last_linear():
    tvm = pytest.importorskip("torchvision.models")
    model = tvm.mobilenet_v3_small(weights=None, num_classes=6).eval()
    jm = jem.wrap(model)
    assert jm.adapter.name == "torchvision"
    x = torch.randn(2, 3, 32, 32).clamp(-2, 2)
    with torch.no_grad():
        feats, _ = _check(jm, model(x), x, _first_conv(model))
    assert jm.head() is model.classifier[-1] and feats.shape == (2, model.classifier[-1].in_features)


def test_huggingface_features_are_the_pooled_output():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    model = transformers.ResNetForImageClassification(cfg).eval()
    jm = jem.wrap(model)
    assert jm.adapter.name == "huggingface"
    x = torch.randn(2, 3, 32, 32).clamp(-1, 1)
    with torch.no_grad():
        out = model(x, output_hidden_states=False)
        pooled = model.resnet(x).pooler_output.flatten(1)
        feats, _ = _check(jm, out.logits, x, _first_conv(model))
    torch.testing.assert_close(feats, pooled, rtol=0, atol=0)
    assert jm.head() is model.classifier[-1]


class UserNet(nn.Module):
    """The last nn.Linear is the classifier; BatchNorm and Dropout to check the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.proj = nn.Linear(24, 12)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)
        return self.fc(self.drop(torch.relu(self.proj(h))))


def test_user_module_features_by_a_hook_on_the_last_linear():
    model = UserNet().eval()
    jm = jem.wrap(model)
    x = torch.rand(4, 1, 8, 8) * 2 - 1
    with torch.no_grad():
        feats, _ = _check(jm, model(x), x, model.conv)
    assert feats.shape == (4, 12) and jm.head() is model.fc
    assert not model.fc._forward_hooks, "the hook is removed after the forward"


def test_features_respect_the_models_mode_like_forward():
    model = UserNet().train()
    jm = jem.wrap(model)
    x = torch.rand(8, 1, 8, 8) * 2 - 1
    torch.manual_seed(1)
    ref = jm(x)
    torch.manual_seed(1)
    stats = model.bn.running_mean.clone()
    feats, logits = jm.features(x)
    assert model.training  # not switched to eval
    assert not torch.equal(model.bn.running_mean, stats)  # train-mode BatchNorm updated its statistics, as forward
    torch.testing.assert_close(logits, ref)  # same dropout mask as forward with the same seed
    assert (feats == 0).float().mean() > 0.3  # dropout applied to the features the head saw
    torch.testing.assert_close(model.fc(feats), logits)


def test_wrappers_are_seen_through():
    model = UserNet().eval()
    x = torch.rand(2, 1, 8, 8) * 2 - 1
    jm = jem.wrap(nn.DataParallel(model))
    feats, logits = jm.features(x)
    assert jm.head() is model.fc
    torch.testing.assert_close(model.fc(feats), logits)


def test_features_option_names_the_classifier_or_reads_them_itself():
    class Tail(nn.Module):  # the last registered Linear is not the classifier
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(8, 3)
            self.embed = nn.Linear(5, 8)

        def forward(self, x):
            return self.classifier(torch.tanh(self.embed(x)))

    model = Tail()
    x = torch.randn(4, 5).clamp(-1, 1)
    with pytest.raises(NoFeaturesError, match=r"'embed'.*not the logits.*features='name.of.classifier'"):
        jem.wrap(model).features(x)
    jm = jem.wrap(model, features="classifier")
    feats, logits = jm.features(x)
    torch.testing.assert_close(model.classifier(feats), logits)
    assert jm.head() is model.classifier
    with pytest.raises(NoFeaturesError, match="names no submodule"):
        jem.wrap(model, features="nope").features(x)

    calls = []

    def read(m, inp):
        calls.append(1)
        h = torch.tanh(m.embed(inp))
        return h, m.classifier(h)

    jm = jem.wrap(model, features=read)
    feats2, logits2 = jm.features(x)
    assert len(calls) == 1 and jm.head() is None
    torch.testing.assert_close(feats2, feats)
    torch.testing.assert_close(logits2, logits)


def test_no_linear_layer_says_how_to_point_at_the_features():
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(NoFeaturesError, match="no nn.Linear.*features="):
        jem.wrap(model).features(torch.rand(2, 1, 5, 5))


def test_half_precision_features_come_back_fp32():
    model = UserNet().eval()
    jm = jem.wrap(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats, logits = jm.features(torch.rand(2, 1, 8, 8))
    assert feats.dtype == torch.float32 and logits.dtype == torch.float32


def test_a_third_party_adapter_provides_features_through_the_hook():
    class Pair(nn.Module):  # returns (embedding, logits): no hookable classifier layer
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return x, x @ self.w

    class PairAdapter(Adapter):
        def features(self, model, x):
            emb, logits = model(x)
            return emb, logits

    class Plugin:
        @jem.hookimpl
        def jem_adapter(self, model, options):
            if isinstance(model, Pair):
                return PairAdapter("pair", domain=InputDomain(), logits=1)
            return None

    name = jem.register(Plugin())
    try:
        model = Pair()
        jm = jem.wrap(model)
        assert jm.adapter.name == "pair"
        x = torch.rand(5, 3)
        feats, logits = jm.features(x)
        torch.testing.assert_close(feats, x)
        torch.testing.assert_close(logits, x @ model.w)
    finally:
        jem.unregister(name=name)
