"""Adapters: timm families, torchvision, Hugging Face outputs, tuples and dicts."""

from __future__ import annotations

import dataclasses

import pytest
import timm
import torch
import torchvision

import jem_plugin as jem
from jem_plugin.adapter import IMAGENET_MEAN, IMAGENET_STD


@pytest.mark.parametrize("name", ["test_resnet", "test_vit", "test_convnext", "test_efficientnet"])
def test_timm_families(name):
    model = timm.create_model(name, pretrained=False, num_classes=7).eval()
    jm = jem.wrap(model)
    assert jm.adapter.name == "timm"
    assert jm.num_classes == 7
    cfg = model.pretrained_cfg
    assert jm.domain.mean == tuple(cfg["mean"]) and jm.domain.std == tuple(cfg["std"])
    assert jm.domain.input_size == tuple(cfg["input_size"])
    # the domain is [0, 1] pixels after the model's normalisation, per channel
    expected_low = tuple((0 - m) / s for m, s in zip(cfg["mean"], cfg["std"]))
    assert jm.domain.low == pytest.approx(expected_low)
    size = 32 if name != "test_vit" else cfg["input_size"][-1]
    x = torch.randn(2, 3, size, size)
    assert torch.equal(jm(x), model(x))
    assert jm.energy(x).shape == (2,)


def test_timm_family_never_named_in_tests_works():
    # any timm architecture goes through the same contract
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3).eval()
    jm = jem.wrap(model)
    assert jm.adapter.name == "timm" and jm.num_classes == 3
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(jm.energy(x), -torch.logsumexp(model(x), 1))


def test_torchvision_model():
    model = torchvision.models.mobilenet_v3_small(num_classes=5).eval()
    jm = jem.wrap(model)
    assert jm.adapter.name == "torchvision"
    assert jm.num_classes == 5
    assert jm.domain.mean == IMAGENET_MEAN and jm.domain.std == IMAGENET_STD
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(jm(x), model(x))


def _without_head(kind: str) -> torch.nn.Module:
    """A classifier whose head a user removed the usual way, to get features out of it."""
    if kind == "timm num_classes=0":
        return timm.create_model("lcnet_050", pretrained=False, num_classes=0)
    if kind == "torchvision fc = Identity":
        model = torchvision.models.shufflenet_v2_x0_5(num_classes=4)
        model.fc = torch.nn.Identity()
        return model
    if kind == "torchvision classifier[-1] = Identity":
        model = torchvision.models.mnasnet0_5(num_classes=4)
        model.classifier[-1] = torch.nn.Identity()
        return model
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=0)
    return transformers.ConvNextForImageClassification(config)


@pytest.mark.parametrize(
    "kind",
    [
        "timm num_classes=0",
        "torchvision fc = Identity",
        "torchvision classifier[-1] = Identity",
        "huggingface num_labels=0",
    ],
)
def test_a_model_whose_classifier_was_removed_is_refused_not_read_as_logits(kind):
    """Its output is the pooled features: read as logits they would give one "class" per feature
    and every score, loss and sample would be silently wrong."""
    model = _without_head(kind).eval()
    with pytest.raises(jem.NoLogitsError, match=r"has no classifier .*nn.Identity.*returns features, not logits: "):
        jem.wrap(model)
    jm = jem.wrap(model, logits=lambda out: getattr(out, "logits", out)[:, :3])  # the user says where: accepted
    assert jm(torch.rand(2, 3, 32, 32) * 2 - 1).shape == (2, 3)


def test_user_options_override_domain():
    model = timm.create_model("test_resnet", pretrained=False, num_classes=2)
    jm = jem.wrap(model, data_range=(-1, 1))
    assert jm.domain.low == (-1.0,) and jm.domain.high == (1.0,)
    jm2 = jem.wrap(torch.nn.Linear(3, 2), mean=(0.5,), std=(0.25,))
    assert jm2.domain.low == (-2.0,) and jm2.domain.high == (2.0,)


def test_generic_defaults_to_paper_domain():
    jm = jem.wrap(torch.nn.Linear(4, 3))
    assert jm.adapter.name == "generic"
    assert jm.domain.low == (-1.0,) and jm.domain.high == (1.0,)


class DictNet(torch.nn.Module):
    def __init__(self, key="logits"):
        super().__init__()
        self.key = key
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return {self.key: self.fc(x), "features": x}


def test_dict_outputs():
    x = torch.randn(2, 4)
    net = DictNet()
    torch.testing.assert_close(jem.wrap(net).energy(x), -torch.logsumexp(net.fc(x), 1))
    net2 = DictNet("scores")
    with pytest.raises(jem.NoLogitsError, match="logits='name'"):
        jem.wrap(net2).energy(x)
    torch.testing.assert_close(jem.wrap(net2, logits="scores").energy(x), -torch.logsumexp(net2.fc(x), 1))


def test_callable_logits_selector():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return [(self.fc(x),)]

    net = Net()
    jm = jem.wrap(net, logits=lambda out: out[0][0])
    x = torch.randn(2, 4)
    assert torch.equal(jm(x), net.fc(x))


# --- Hugging Face -----------------------------------------------------------------------
def _hf_model():
    """A real tiny transformers image classifier when installed, else a stand-in of the same shape."""
    try:
        from transformers import ViTConfig, ViTForImageClassification
    except ImportError:
        ViTForImageClassification = None
    if ViTForImageClassification is not None:
        cfg = ViTConfig(
            image_size=16,
            patch_size=8,
            num_channels=3,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=4,
        )
        return ViTForImageClassification(cfg).eval(), True

    @dataclasses.dataclass
    class ImageClassifierOutput:  # the fields transformers' output type carries
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        hidden_states: tuple | None = None

    class Config:
        num_labels = 4
        id2label = {i: str(i) for i in range(4)}

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()
            self.fc = torch.nn.Linear(3 * 16 * 16, 4)

        def forward(self, pixel_values):
            return ImageClassifierOutput(logits=self.fc(pixel_values.flatten(1)))

    return StandIn().eval(), False


@pytest.mark.slow
def test_huggingface_image_classifier():
    model, real = _hf_model()
    jm = jem.wrap(model)
    assert jm.adapter.name == "huggingface"
    assert jm.num_classes == 4
    # the documented default without processor=: mean = std = 0.5 on each of config.num_channels
    assert set(jm.domain.low) == {-1.0} and set(jm.domain.high) == {1.0}
    x = torch.randn(2, 3, 16, 16).clamp(-1, 1)
    logits = model(x).logits
    assert torch.equal(jm(x), logits)
    torch.testing.assert_close(jm.energy(x), -torch.logsumexp(logits, 1))
