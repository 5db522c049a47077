"""Issue 13: one input contract for every entry point, on models the rest of the suite does not name."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import ood

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")


def resnet18(channels: int = 3, k: int = 3) -> nn.Module:
    m = torchvision.models.resnet18(weights=None, num_classes=k)
    if channels != 3:
        m.conv1 = nn.Conv2d(channels, 64, 7, 2, 3, bias=False)
    return m.eval()


class MLP(nn.Module):
    """A hand-written tabular classifier."""

    def __init__(self, d: int = 5, k: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, k))

    def forward(self, x):
        return self.net(x)


def imagenet_batch(n: int = 4, c: int = 3, size: int = 32) -> torch.Tensor:
    return (torch.rand(n, c, size, size) - 0.45) / 0.226  # [0, 1] pixels, ImageNet-normalised


def ood_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, jem.OutOfDomainWarning)]


# ------------------------------------------------------------------ 1. wrappers
@pytest.mark.parametrize("wrapper", [pytest.param("compile", marks=pytest.mark.slow), "dataparallel"])
def test_adapter_detection_sees_through_wrappers(wrapper):
    m = resnet18()
    wrapped = torch.compile(m, backend="eager") if wrapper == "compile" else nn.DataParallel(m)
    jm = jem.wrap(wrapped)
    assert jm.adapter.name == "torchvision" and jm.domain.mean is not None
    assert jm.model is wrapped  # the wrapper is what runs
    assert jem.wrap(wrapped, adapter="torchvision").adapter.name == "torchvision"
    assert jm.log_px(imagenet_batch(2)).shape == (2,)


def test_adapter_detection_sees_through_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(resnet18())
        assert jem.wrap(ddp).adapter.name == "torchvision"
        assert jem.wrap(ddp, adapter="torchvision").num_classes == 3
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_compiled_jem_is_accepted_everywhere_a_jem_is():
    jm = jem.wrap(timm.create_model("test_convnext", num_classes=3).eval())
    cj = torch.compile(jm, backend="eager")
    assert jem.as_jem(cj) is jm and jem.as_jem(nn.DataParallel(jm)) is jm
    assert jem.wrap(jm) is jm
    with pytest.raises(TypeError, match="wrapped already"):  # never re-read with a guessed domain
        jem.wrap(cj)
    x, y = jm.domain.uniform(4, (3, 32, 32)), torch.tensor([0, 1, 2, 0])
    loss = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(16, (3, 32, 32)))
    assert torch.isfinite(loss(cj, x, y).loss)
    assert ood.score(cj, x, "max_logit").shape == (4,)
    assert jem.SGLD(steps=1).sample(cj, x_init=x).shape == x.shape


@pytest.mark.slow
def test_a_raw_model_is_refused_with_a_jem_error():
    m = resnet18()
    with pytest.raises(jem.JEMError, match="wrap"):
        ood.score(m, imagenet_batch(2))
    with pytest.raises(jem.NotWrappedError, match="wrap"):
        jem.JEMLoss()(m, imagenet_batch(2), torch.tensor([0, 1]))


# ------------------------------------------------------------------ 2. channels
@pytest.mark.slow
def test_one_channel_torchvision_model_gets_a_one_channel_domain():
    jm = jem.wrap(resnet18(channels=1))
    assert jm.domain.channels == 1 and jm.domain.input_size[0] == 1
    assert jem.SGLD(steps=1).sample(jm, n=2).shape[1] == 1
    with pytest.raises(jem.InvalidInputError, match="3 channel.*domain has 1"):
        jm.log_px(imagenet_batch(2, c=3))
    loss = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(8, (1, 32, 32)))
    assert torch.isfinite(loss(jm, imagenet_batch(2, c=1), torch.tensor([0, 1])).loss)


def test_timm_in_chans_sets_the_domain_channels_and_projected_grad_norm_is_not_inflated():
    jm = jem.wrap(timm.create_model("test_efficientnet", in_chans=1, num_classes=3).eval())
    assert jm.domain.channels == 1
    x = imagenet_batch(3, c=1).clamp(-1.0, 1.0)  # well inside the domain: nothing to project away
    g, gp = ood.score(jm, x, "grad_norm"), ood.score(jm, x, "grad_norm_projected")
    torch.testing.assert_close(gp, g)


def test_users_normalisation_with_the_wrong_channel_count_is_refused():
    with pytest.raises(jem.InvalidInputError, match="3 channel.*takes 1"):
        jem.wrap(resnet18(channels=1), mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))


# ------------------------------------------------------------------ 3. size
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "test_vit"])
def test_sampling_without_shape_uses_the_models_actual_image_size(name):
    jm = jem.wrap(timm.create_model(name, img_size=32, num_classes=3).eval())
    assert jm.domain.input_size == (3, 32, 32)
    x = jem.SGLD(steps=1).sample(jm, n=2)
    assert x.shape == (2, 3, 32, 32) and jm.log_px(x).shape == (2,)


def test_generic_model_learns_its_input_shape_from_the_first_batch():
    jm = jem.wrap(MLP(d=5))
    with pytest.raises(ValueError, match="shape"):
        jem.SGLD(steps=1).sample(jm, n=2)
    jm.log_px(torch.rand(3, 5))
    assert jem.SGLD(steps=1).sample(jm, n=2).shape == (2, 5)


# ------------------------------------------------------------------ 4. out-of-domain data
def test_pixels_0_255_warn_once_per_call_site_naming_range_domain_and_fix():
    jm = jem.wrap(resnet18())
    x255 = torch.rand(4, 3, 32, 32) * 255

    def twice():
        for _ in range(2):  # one site: one warning
            ood.score(jm, x255, "logpx")

    _, caught = ood_warnings(twice)
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "255" in msg and "mean=" in msg and "wrap(model" in msg
    assert caught[0].filename == __file__  # points at the user's line
    _, caught = ood_warnings(lambda: ood.score(jm, imagenet_batch(4), "logpx"))
    assert not caught


def test_raw_tabular_features_warn_in_the_loss_and_sgld_init():
    jm = jem.wrap(MLP())
    x, y = torch.randn(8, 5) * 30 + 100, torch.randint(0, 4, (8,))
    loss = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(16, (5,)))
    _, caught = ood_warnings(lambda: loss(jm, x, y))
    assert len(caught) == 1 and "[-1 .. 1]" in str(caught[0].message)
    _, caught = ood_warnings(lambda: jem.SGLD(steps=1).sample(jm, x_init=x))
    assert len(caught) == 1
    _, caught = ood_warnings(lambda: loss(jm, torch.rand(8, 5) * 2 - 1, y))
    assert not caught


def test_out_of_domain_warning_is_a_filterable_user_warning():
    assert issubclass(jem.OutOfDomainWarning, UserWarning)
    jm = jem.wrap(MLP())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=jem.OutOfDomainWarning)
        ood.score(jm, torch.randn(4, 5) * 50)


# ------------------------------------------------------------------ 5. dtypes
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_any_float_precision_is_cast_to_the_models_dtype(dtype):
    jm = jem.wrap(MLP())
    x, y = (torch.rand(6, 5) * 2 - 1).to(dtype), torch.randint(0, 4, (6,))
    assert jm.log_px(x).dtype == torch.float32
    assert ood.score(jm, x, "msp").dtype == torch.float32
    assert ood.score(jm, x, "grad_norm").shape == (6,)
    loss = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(16, (5,)))
    assert torch.isfinite(loss(jm, x, y).loss)


@pytest.mark.parametrize("method", ["grad_norm", "grad_norm_projected", "logpx", "msp"])
def test_integer_input_is_an_invalid_input_error_for_every_score(method):
    jm = jem.wrap(timm.create_model("test_convnext", num_classes=3).eval())
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with pytest.raises(jem.InvalidInputError, match="floating-point"):
        ood.score(jm, x, method)


def test_integer_input_is_refused_by_loss_sampler_and_robustness():
    jm = jem.wrap(MLP())
    x, y = torch.randint(0, 3, (4, 5)), torch.tensor([0, 1, 2, 3])
    with pytest.raises(jem.InvalidInputError):
        jem.JEMLoss(jem.SGLD(steps=1))(jm, x, y)
    with pytest.raises(jem.InvalidInputError):
        jem.SGLD(steps=1).sample(jm, x_init=x)
    with pytest.raises(jem.InvalidInputError):
        jem.robustness.pgd_attack(jm, x, y, eps=0.1)


def test_scores_under_autocast_are_fp32():
    jm = jem.wrap(MLP(k=10))
    x = torch.rand(300, 5) * 2 - 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = ood.score(jm, x, "msp")
        e = jm.energy(x)
    assert s.dtype == torch.float32 and e.dtype == torch.float32
    assert s.unique().numel() > 250  # bf16 would collapse these to a few dozen values


# ------------------------------------------------------------------ 6. wrap options
def test_wrap_refuses_unknown_options_and_lists_valid_ones():
    with pytest.raises(TypeError, match="data_rng.*valid options.*data_range"):
        jem.wrap(MLP(), data_rng=(0, 1))
    with pytest.raises(TypeError, match="'logit'"):
        jem.wrap(MLP(), logit=0)


def test_wrap_refuses_data_range_with_mean_std():
    with pytest.raises(ValueError, match="data_range together with mean"):
        jem.wrap(resnet18(), data_range=(0, 1), mean=(0.5,) * 3, std=(0.5,) * 3)


# ------------------------------------------------------------------ 7. checkpoints
def test_loss_state_with_explicit_buffer_loads_into_a_loss_without_one():
    jm = jem.wrap(MLP())
    x, y = torch.rand(8, 5) * 2 - 1, torch.randint(0, 4, (8,))
    src = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(32, (5,), num_classes=4), pxy_weight=1.0)
    src(jm, x, y)
    dst = jem.JEMLoss(jem.SGLD(steps=1), pxy_weight=1.0)
    dst.load_state_dict(src.state_dict())
    assert dst.buffer is not None and dst.buffer.num_classes == 4
    torch.testing.assert_close(dst.buffer.data, src.buffer.data)
    back = jem.JEMLoss(jem.SGLD(steps=1), buffer=jem.ReplayBuffer(32, (5,), num_classes=4), pxy_weight=1.0)
    back.load_state_dict(dst.state_dict())  # and the other way round
    torch.testing.assert_close(back.buffer.data, src.buffer.data)


def test_a_subclass_swapped_in_by_a_wrapper_keeps_its_adapter():
    # FSDP2's fully_shard replaces a module's class with a subclass defined in torch.distributed
    m = resnet18()
    m.__class__ = type("FSDPResNet", (type(m),), {"__module__": "torch.distributed.fsdp"})
    assert jem.wrap(m).adapter.name == "torchvision"


def test_lightning_load_from_checkpoint_restores_the_buffer(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from jem_plugin.integrations.lightning import JEMLightningModule

    module = JEMLightningModule(MLP(), sampler=jem.SGLD(steps=1), buffer=jem.ReplayBuffer(16, (5,)))
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        limit_val_batches=0,
    )
    data = torch.utils.data.TensorDataset(torch.rand(8, 5) * 2 - 1, torch.randint(0, 4, (8,)))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    trainer.save_checkpoint(tmp_path / "ck.ckpt")
    restored = JEMLightningModule.load_from_checkpoint(tmp_path / "ck.ckpt", model=MLP())
    src = [b for n, b in module.named_buffers() if n.endswith("buffer.data")]
    dst = [b for n, b in restored.named_buffers() if n.endswith("buffer.data")]
    assert len(src) == len(dst) == 1
    torch.testing.assert_close(dst[0], src[0])


# ------------------------------------------------------------------ 8. validation semantics
@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_validation_loss_does_not_touch_the_buffer_and_is_deterministic(mode):
    jm = jem.wrap(MLP())
    x, y = torch.rand(8, 5) * 2 - 1, torch.randint(0, 4, (8,))
    loss = jem.JEMLoss(
        jem.SGLD(steps=2, generator=torch.Generator()),
        buffer=jem.ReplayBuffer(32, (5,)),
        data_noise=0.5,
        generator=torch.Generator(),
    )
    loss(jm, x, y)  # training step: initialises the buffer
    before = loss.buffer.data.clone()

    def val() -> float:
        loss.generator.manual_seed(1)
        loss.sampler.generator.manual_seed(2)
        if mode == "eval":
            loss.eval()
            out = loss(jm, x, y)
            loss.train()
            return out.metrics["loss"]
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            return loss(jm, x, y).metrics["loss"]

    a, b = val(), val()
    assert a == b
    assert torch.equal(loss.buffer.data, before)
    with torch.no_grad():  # no data noise: the data term sees x itself
        out_logits = jm(x)
    loss.eval()
    torch.testing.assert_close(loss(jm, x, y).logits, out_logits)


# ------------------------------------------------------------------ 9. scoring
def test_progress_bar_off_for_tensors_and_non_tty_loaders_on_when_asked(capsys):
    jm = jem.wrap(MLP())
    x = torch.rand(8, 5) * 2 - 1
    ood.score(jm, x)
    ood.score(jm, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4))
    assert "ood score" not in capsys.readouterr().err
    ood.score(jm, x, progress=True)
    assert "ood score" in capsys.readouterr().err


def test_dict_batches_take_input_key():
    jm = jem.wrap(MLP())
    x = torch.rand(8, 5) * 2 - 1
    batches = [{"features": x[:4], "label": torch.zeros(4)}, {"features": x[4:], "label": torch.zeros(4)}]
    torch.testing.assert_close(ood.score(jm, batches, "logpx", input_key="features"), jm.log_px(x))
    with pytest.raises(jem.InvalidInputError, match="input_key"):
        ood.score(jm, batches, "logpx")


# ------------------------------------------------------------------ 10. Hugging Face
def _hf_resnet():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    return transformers.ResNetForImageClassification(cfg).eval(), transformers


def test_hf_processor_gives_the_normalisation_and_size():
    model, transformers = _hf_resnet()
    proc = transformers.ViTImageProcessor(
        size={"height": 48, "width": 48}, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
    )
    jm = jem.wrap(model, processor=proc)
    assert jm.domain.mean == pytest.approx(tuple(proc.image_mean))
    assert jm.domain.input_size == (3, 48, 48)
    assert jem.SGLD(steps=1).sample(jm, n=2).shape == (2, 3, 48, 48)
    x = imagenet_batch(2, size=48)  # what this processor yields
    assert jm.log_px(x).shape == (2,)
    _, caught = ood_warnings(lambda: ood.score(jm, x))
    assert not caught


def test_hf_default_is_the_documented_half_half_normalisation():
    model, _ = _hf_resnet()
    jm = jem.wrap(model)
    assert jm.domain.mean == (0.5,) * 3 and jm.domain.low == (-1.0,) * 3 and jm.domain.channels == 3


# ------------------------------------------------------------------ issue 12: adapters
def test_forced_adapter_is_resolved_centrally_for_a_plugin_that_never_reads_the_option():
    seen = []

    class Plugin:
        @jem.hookimpl
        def jem_adapter(self, model, options):
            seen.append(dict(options))
            return jem.Adapter("mine") if isinstance(model, MLP) else None

    name = jem.register(Plugin(), name="test-forced-adapter")
    try:
        assert jem.wrap(MLP(), adapter="generic").adapter.name == "generic"
        assert jem.wrap(nn.DataParallel(MLP()), adapter="mine").adapter.name == "mine"
        with pytest.raises(jem.NoLogitsError, match="no adapter accepted.*adapter='timm'.*generic"):
            jem.wrap(MLP(), adapter="timm")
        assert seen and all("adapter" not in o for o in seen)
    finally:
        jem.unregister(name=name)


def test_num_classes_is_settled_on_the_jem_and_the_adapter_is_never_mutated():
    jm = jem.wrap(lambda x: x[:, :3] * 2)
    assert jm.num_classes is None
    jm.log_px(torch.rand(2, 6))
    assert jm.num_classes == 3 and jm.adapter.num_classes is None


# ------------------------------------------------------------------ 11. docs
def test_every_public_member_has_a_docstring():
    missing = []
    spaces = [("jem_plugin", jem, jem.__all__)] + [
        (f"jem_plugin.{m}", getattr(jem, m), getattr(jem, m).__all__) for m in ("ood", "calibration", "robustness")
    ]
    for prefix, mod, names in spaces:
        for name in names:
            obj = getattr(mod, name)
            if not inspect.getdoc(obj):
                missing.append(f"{prefix}.{name}")
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                        continue
                    if not inspect.getdoc(member):
                        missing.append(f"{prefix}.{name}.{attr}")
    assert not missing, missing
