"""JEM on a GPU: devices, mixed precision, memory layout, compile, checkpoints and the CUDA-graph
SGLD path. The CUDA tests skip with a reason where no GPU is present; the CPU tests check the
dispatch logic and the device handling that runs everywhere. The graph path itself runs on the CPU
in test_cuda_graph_cpu.py, with a stand-in for torch.cuda (tests/_fake_cuda.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import cuda
from torch import nn

import jem_plugin as jem
from jem_plugin import _cuda_graph
from jem_plugin._checks import follow, generator_on, same_device
from jem_plugin.errors import CUDAGraphError
from jem_plugin.schedules import Poly


class SmallConvNet(nn.Module):
    """Hand-written: conv + BatchNorm + LeakyReLU, so BatchNorm statistics can be checked."""

    def __init__(self, k: int = 10, bn: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16) if bn else nn.Identity(),
            nn.LeakyReLU(0.2),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(32, k)

    def forward(self, x):
        return self.head(self.body(x))


def _jm(model: nn.Module, shape=(3, 16, 16)):
    return jem.wrap(model, data_range=(-1.0, 1.0), input_size=shape, num_classes=10)


def _x(n=8, shape=(3, 16, 16), device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, *shape, generator=g) * 2 - 1).to(device)


# --------------------------------------------------------------------------- CPU: dispatch
def test_cuda_graph_option_is_validated():
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        jem.SGLD(cuda_graph="on")


def test_require_on_cpu_raises_one_line_error_with_the_reason():
    jm = _jm(SmallConvNet())
    with pytest.raises(CUDAGraphError) as info:
        jem.SGLD(steps=2, cuda_graph="require").run(jm, _x())
    msg = str(info.value)
    assert "\n" not in msg and "not on a CUDA device" in msg and "cuda_graph='auto'" in msg


def test_cuda_graph_is_auto_by_default():
    assert jem.SGLD().cuda_graph == "auto"
    assert jem.SGLD.__init__.__kwdefaults__["cuda_graph"] == "auto"


def test_auto_on_cpu_is_eager_and_silent():
    jm = _jm(SmallConvNet())
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = jem.SGLD(steps=3, generator=torch.Generator().manual_seed(1), cuda_graph="auto").run(jm, x)
    off = jem.SGLD(steps=3, generator=torch.Generator().manual_seed(1), cuda_graph="off").run(jm, x)
    assert not torch.equal(auto, x)
    assert torch.equal(auto, off)


def test_require_with_zero_steps_needs_no_graph():
    x = _x()
    out = jem.SGLD(steps=0, cuda_graph="require").run(_jm(SmallConvNet()), x)
    assert torch.equal(out, x)


def test_a_generator_on_the_chains_device_is_kept():
    g = torch.Generator().manual_seed(0)
    assert generator_on("cpu", g, 1) is g and generator_on(torch.device("cpu"), g, 1) is g
    assert generator_on(None, g, 1) is g  # a model without parameters: its device is unknown


@cuda
def test_a_cpu_generator_gives_a_cuda_chain_one_of_its_own_seeded_alike():
    # What broke `jem train --device cuda` (its sample-quality check) and `jem sample --device cuda`:
    # one CPU generator for the data draws was handed to chains on the GPU, which SGLD refuses.
    g = generator_on("cuda", torch.Generator().manual_seed(0), 3)
    assert g.device.type == "cuda"
    assert torch.equal(torch.rand(4, device="cuda", generator=g), torch.rand(4, device="cuda", generator=_gen(3)))


def test_same_device_reads_cuda_as_the_current_device(monkeypatch):
    # What broke SGLD(generator=torch.Generator(device="cuda")): "cuda" vs the chain's "cuda:0".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device("cuda", torch.device("cuda", 1))
    assert same_device(torch.device("cuda"), "cuda:1")
    assert not same_device("cuda", "cuda:0")
    assert not same_device("cuda:1", "cpu")


class _Stop(Exception):
    pass


def test_sampler_moves_the_buffer_to_the_models_device(monkeypatch):
    # The model lives on `meta` (no data, so the chain itself cannot run): the buffer created on
    # the CPU must be on the model's device by the time it is drawn from.
    model = SmallConvNet().to("meta")
    buf = jem.ReplayBuffer(capacity=16, sample_shape=(3, 16, 16))
    seen = []

    def spy(self, n=None, **kw):
        seen.append(self.data.device)
        raise _Stop

    monkeypatch.setattr(jem.ReplayBuffer, "sample", spy)
    with pytest.raises(_Stop):
        jem.SGLD(steps=1).sample(_jm(model), 4, buffer=buf)
    assert seen == [torch.device("meta")]
    assert buf.data.device.type == "meta" and buf.labels.device.type == "meta"


class _SpySampler:
    clamp = True

    def __init__(self):
        self.devices = []

    def sample(self, jm, n, buffer=None, y=None):
        self.devices.append(buffer.data.device)
        raise _Stop


@pytest.mark.parametrize("how", ["given", "restored"])
def test_loss_moves_given_or_restored_buffer_to_the_models_device(how):
    spy = _SpySampler()
    if how == "given":
        loss = jem.JEMLoss(sampler=spy, buffer=jem.ReplayBuffer(capacity=16, sample_shape=(3, 16, 16)))
        loss.validate = False
    else:  # a buffer restored from a checkpoint: rebuilt on the CPU
        src = jem.JEMLoss(sampler=jem.SGLD(steps=1), buffer=jem.ReplayBuffer(capacity=16, sample_shape=(3, 16, 16)))
        src.validate = False
        model = SmallConvNet()
        src(_jm(model), _x(4), torch.arange(4))
        loss = jem.JEMLoss(sampler=spy)
        loss.validate = False
        loss.load_state_dict(src.state_dict())
        assert loss.buffer.data.device.type == "cpu"
    model = SmallConvNet().to("meta")
    with pytest.raises(_Stop):
        loss(_jm(model), _x(4).to("meta"), torch.arange(4, device="meta"))
    assert spy.devices == [torch.device("meta")]


def test_follow_leaves_a_buffer_on_the_right_device_alone():
    buf = jem.ReplayBuffer(capacity=4, sample_shape=(2,))
    data = buf.data
    follow(buf, "cpu")
    assert buf.data is data  # no copy when it is already there


# --------------------------------------------------------------------------- CUDA
def _cuda_jm(model=None, shape=(3, 16, 16)):
    model = (model or SmallConvNet()).cuda()
    return model, _jm(model, shape)


def _gen(seed=0):
    return torch.Generator(device="cuda").manual_seed(seed)


def _score_every_method(jm, x):
    """Every registered score on ``x``, on its device: the fitted detectors get in-distribution
    data of every class (fitting them is part of scoring with them)."""
    dev = x.device
    fit = (_x(60, device=dev, seed=5), torch.arange(60, device=dev) % 10)  # knn: k = 50
    for method in jem.ood.available_scores():
        if method in ("mcd", "rankfeat"):  # this net has no dropout and no feature maps: refused in one line
            with pytest.raises(TypeError, match="no dropout layer" if method == "mcd" else "feature maps"):
                jem.ood.score(jm, x, method)
            continue
        kw: dict = (
            {"generator": torch.Generator(device=dev).manual_seed(2), "steps": 2} if method.endswith("_sgld") else {}
        )
        if jem.ood.score_info(method)["needs_fit"]:
            kw["fit_data"] = fit
        if method in ("multi_mahalanobis", "gram"):  # a hand-written net: its layers named
            kw["layers"] = ["body.2", "body.4"]
        scores = jem.ood.score(jm, x, method, progress=False, **kw)
        assert scores.shape == (len(x),) and scores.device == dev and torch.isfinite(scores).all(), method
    # multi_mahalanobis's FGSM-learned weights: its kept images go back to the model's device
    layers = ["body.2", "body.4"]
    scores = jem.ood.score(jm, x, "multi_mahalanobis", fit_data=fit, layers=layers, weights="adversarial")
    assert scores.shape == (len(x),) and scores.device == dev and torch.isfinite(scores).all()


@pytest.mark.filterwarnings("ignore::jem_plugin.errors.UntrainedDensityWarning")  # an untrained net, on purpose
def test_every_score_runs_on_the_cuda_tests_network_on_the_cpu():
    # the same loop as on the GPU below, so what it asks of each score is checked where CI runs
    _score_every_method(_jm(SmallConvNet(), (3, 16, 16)), _x())


@cuda
def test_cuda_generator_everywhere():
    _, jm = _cuda_jm()
    x = _x(device="cuda")
    y = torch.arange(8, device="cuda") % 10
    s = jem.SGLD(steps=3, generator=_gen(), cuda_graph="auto")
    assert s.run(jm, x).is_cuda
    assert s.sample(jm, 4).is_cuda
    buf = jem.ReplayBuffer(capacity=32, sample_shape=(3, 16, 16), num_classes=10, init="gaussian")
    buf.fit(_x(20), torch.arange(20) % 10)  # the per-class Gaussian needs every class
    assert s.sample(jm, buffer=buf, y=y).is_cuda
    loss = jem.JEMLoss(sampler=s, buffer=buf, generator=_gen(1), class_conditional_px=True, pxy_weight=1.0)
    out = loss(jm, x, y)
    assert torch.isfinite(out.loss)
    _score_every_method(jm, x)
    adv = jem.robustness.pgd_attack(jm, x, y, eps=0.03, pgd=jem.robustness.PGD(steps=2), generator=_gen(3))
    assert adv.is_cuda
    defended = jem.robustness.SGLDDefense(jm, steps=2, n_chains=2, generator=_gen(4))
    assert defended.predict(x).shape == (8,)


@cuda
@pytest.mark.parametrize("how", ["given", "restored"])
def test_buffer_lives_on_the_chains_device_after_first_use(how):
    _, jm = _cuda_jm()
    x, y = _x(device="cuda"), torch.arange(8, device="cuda") % 10
    if how == "given":
        loss = jem.JEMLoss(sampler=jem.SGLD(steps=2), buffer=jem.ReplayBuffer(64, (3, 16, 16)))
    else:
        src = jem.JEMLoss(sampler=jem.SGLD(steps=2), buffer=jem.ReplayBuffer(64, (3, 16, 16), device="cuda"))
        src(jm, x, y)
        loss = jem.JEMLoss(sampler=jem.SGLD(steps=2))
        loss.load_state_dict({k: v.cpu() if torch.is_tensor(v) else v for k, v in src.state_dict().items()})
    loss(jm, x, y)
    data = loss.buffer.data
    assert data.is_cuda
    loss(jm, x, y)
    assert loss.buffer.data is data  # moved once, updated in place afterwards


@cuda
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_autocast_and_channels_last_training_steps(amp, channels_last):
    model, jm = _cuda_jm(SmallConvNet(bn=False))
    if channels_last:
        model.to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp == "fp16")
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    loss_fn = jem.JEMLoss(jem.SGLD(steps=3, generator=_gen(), cuda_graph="auto"), jem.ReplayBuffer(64, (3, 16, 16)))
    x, y = _x(device="cuda"), torch.arange(8, device="cuda") % 10
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        with torch.autocast("cuda", dtype=dtype):
            out = loss_fn(jm, x, y)
        opt.zero_grad()
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        assert all(torch.isfinite(torch.tensor(v)) for v in out.metrics.values())


@cuda
def test_compiled_model_samples():
    model, _ = _cuda_jm(SmallConvNet(bn=False))
    jm = _jm(torch.compile(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a capture failure may fall back to eager, with a warning
        out = jem.SGLD(steps=3, generator=_gen(), cuda_graph="auto").run(jm, _x(device="cuda"))
    assert torch.isfinite(out).all()


@cuda
@pytest.mark.parametrize("mode", ["off", "auto"])
def test_sampling_leaves_batchnorm_statistics_alone(mode):
    model, jm = _cuda_jm(SmallConvNet(bn=True))
    model.train()
    bn = model.body[1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
    jem.SGLD(steps=3, cuda_graph=mode).run(jm, _x(device="cuda"))
    assert model.training
    assert all(torch.equal(a, b) for a, b in zip(before, (bn.running_mean, bn.running_var, bn.num_batches_tracked)))


@cuda
def test_checkpoint_resume_is_exact_on_cuda(tmp_path, monkeypatch):
    # Exact means deterministic kernels: cuDNN weight gradients and index_copy_ with repeated
    # slots use atomics otherwise.
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _checkpoint_resume(tmp_path)
    finally:
        torch.use_deterministic_algorithms(False)


def _checkpoint_resume(tmp_path):
    def make():
        torch.manual_seed(0)
        model, jm = _cuda_jm(SmallConvNet(bn=False))
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        loss = jem.JEMLoss(
            jem.SGLD(steps=3, generator=_gen(5), cuda_graph="auto"),
            jem.ReplayBuffer(64, (3, 16, 16)),
            generator=_gen(6),
        )
        return model, jm, opt, loss

    x, y = _x(device="cuda"), torch.arange(8, device="cuda") % 10

    def step(jm, opt, loss):
        out = loss(jm, x, y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()

    model, jm, opt, loss = make()
    for _ in range(2):
        step(jm, opt, loss)
    jem.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, loss=loss)
    for _ in range(2):
        step(jm, opt, loss)
    model2, jm2, opt2, loss2 = make()
    jem.load_checkpoint(tmp_path / "c.pt", model=model2, optimizer=opt2, loss=loss2)
    for _ in range(2):
        step(jm2, opt2, loss2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(loss.buffer.data, loss2.buffer.data) and loss2.buffer.data.is_cuda


@pytest.fixture
def deterministic_cudnn(monkeypatch):
    """cuDNN's deterministic kernels: its default input-gradient kernels may add with atomics, and
    then two runs of one chain, eager or replayed, differ in their last bits (an H200 did so on
    2026-11-26)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


@cuda
@pytest.mark.parametrize("conditional", [False, True])
def test_graph_matches_eager_and_repeats_bitwise(conditional, deterministic_cudnn):
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    y = torch.arange(8, device="cuda") % 10 if conditional else None
    eager = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="off").run(jm, x, y)
    g1 = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="require").run(jm, x, y)
    g2 = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="require").run(jm, x, y)
    assert not torch.equal(g1, x)
    assert torch.equal(g1, g2)
    torch.testing.assert_close(g1, eager, rtol=1e-4, atol=1e-4)


@cuda
def test_graph_with_batch_statistics_matches_eager_and_leaves_running_statistics():
    """SGLD(batchnorm="separate") captured as a graph: the chains normalise with their own batch
    statistics as eagerly, and the running statistics stay as they were."""
    model, jm = _cuda_jm(SmallConvNet(bn=True))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _x(device="cuda")
    eager = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="off", batchnorm="separate").run(jm, x)
    graph = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="require", batchnorm="separate").run(jm, x)
    running = jem.SGLD(steps=10, generator=_gen(7), cuda_graph="require").run(jm, x)
    torch.testing.assert_close(graph, eager, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(graph, running)  # a separate capture, not the running-statistics graph
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training


@cuda
def test_graph_leaves_the_generator_where_eager_does():
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    ga, gb = _gen(8), _gen(8)
    jem.SGLD(steps=4, generator=ga, cuda_graph="off").run(jm, x)
    jem.SGLD(steps=4, generator=gb, cuda_graph="require").run(jm, x)
    assert torch.equal(ga.get_state(), gb.get_state())


@cuda
def test_graph_sees_parameters_updated_by_the_optimizer():
    model, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    sampler = jem.SGLD(steps=5, noise=0.0, cuda_graph="require")
    before = sampler.run(jm, x)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).logsumexp(1).sum().backward()
    opt.step()
    after = sampler.run(jm, x)
    eager = jem.SGLD(steps=5, noise=0.0, cuda_graph="off").run(jm, x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, eager, rtol=1e-4, atol=1e-4)
    model.half().float()  # replaces every parameter tensor: the graph must be captured again
    torch.testing.assert_close(
        sampler.run(jm, x), jem.SGLD(steps=5, noise=0.0, cuda_graph="off").run(jm, x), rtol=1e-4, atol=1e-4
    )


@cuda
def test_a_graph_run_leaves_earlier_results_alone():
    # A graph holds addresses, not tensors: the noise buffer each replay refills must live as long
    # as the graph, or its memory goes to the next tensor of its size (often the returned chain),
    # which later replays then overwrite with noise.
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    sampler = jem.SGLD(steps=3, generator=_gen(), cuda_graph="require")
    first = sampler.run(jm, x)
    kept = first.clone()
    for _ in range(3):
        sampler.run(jm, x)
    torch.cuda.synchronize()
    assert torch.equal(first, kept)


@cuda
def test_graph_memory_is_flat_in_steps():
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    jem.SGLD(steps=2, cuda_graph="require").run(jm, x)  # capture
    peaks = []
    for steps in (5, 50):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        jem.SGLD(steps=steps, cuda_graph="require").run(jm, x)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[0] == peaks[1]


def _host_syncs(run, *args) -> list[str]:
    """Where ``run(*args)`` made the host wait for the GPU, as CUDA's sync debug mode reports it."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]


@cuda
def test_no_host_sync_per_step():
    # A chain of 12 steps makes no more host syncs than one of 3 (the divergence check at the end
    # is one). Each count is the second of two: on an H200 (2026-11-26) the first counted 3-step
    # chain of the process made 3 syncs and the 12-step chain after it 2, an extra one taken for
    # one-time setup.
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")
    where = {}
    for mode in ("off", "require"):
        for steps in (3, 12):
            jem.SGLD(steps=steps, cuda_graph=mode).run(jm, x)  # capture / warm up outside the count
            _host_syncs(jem.SGLD(steps=steps, cuda_graph=mode).run, jm, x)
            where[mode, steps] = _host_syncs(jem.SGLD(steps=steps, cuda_graph=mode).run, jm, x)
    for mode in ("off", "require"):
        assert len(where[mode, 12]) <= len(where[mode, 3]), where


@cuda
def test_hook_falls_back_with_one_warning_and_require_refuses():
    _, jm = _cuda_jm(SmallConvNet(bn=False))
    x = _x(device="cuda")

    class Hook:
        @jem.hookimpl
        def jem_sgld_step(self, state):
            pass

    plugin = Hook()
    jem.register(plugin)
    try:
        _cuda_graph._warned.clear()
        with pytest.warns(RuntimeWarning, match="jem_sgld_step"):
            jem.SGLD(steps=2, cuda_graph="auto").run(jm, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jem.SGLD(steps=2, cuda_graph="auto").run(jm, x)  # once only
            jem.SGLD(steps=2).run(jm, x)  # off by default: eager, silent
        with pytest.raises(CUDAGraphError, match="jem_sgld_step"):
            jem.SGLD(steps=2, cuda_graph="require").run(jm, x)
    finally:
        jem.unregister(plugin)


@cuda
def test_graph_under_bf16_autocast_and_channels_last_matches_eager():
    model, jm = _cuda_jm(SmallConvNet(bn=False))
    model.to(memory_format=torch.channels_last)
    x = _x(device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        g = jem.SGLD(steps=5, generator=_gen(9), cuda_graph="require").run(jm, x)
        e = jem.SGLD(steps=5, generator=_gen(9), cuda_graph="off").run(jm, x)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)


@cuda
def test_wrn_on_cuda_samples_with_the_graph():
    from jem_plugin.app.nets import WideResNet

    _, jm = _cuda_jm(WideResNet(10, 1, 10), shape=(3, 32, 32))
    out = jem.SGLD(steps=3, generator=_gen(), cuda_graph="require").run(jm, _x(4, (3, 32, 32), "cuda"))
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- the paper's network
def test_wrn_spec_builds_the_papers_network_and_runs_a_forward():
    from jem_plugin.nets import WideResNet, build_model

    model = build_model("wrn-10-1", num_classes=10, in_chans=3)
    assert isinstance(model, WideResNet) and (model.depth, model.widen_factor) == (10, 1)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())  # as in the paper
    assert next(m.negative_slope for m in model.modules() if isinstance(m, nn.LeakyReLU)) == 0.2
    x = _x(2, (3, 32, 32))
    assert model(x).shape == (2, 10)
    out = jem.SGLD(steps=2).run(_jm(model, (3, 32, 32)), x)  # input gradients flow
    assert not torch.equal(out, x)
    wide = build_model("wrn28-10", num_classes=10, in_chans=3)
    assert (wide.depth, wide.widen_factor) == (28, 10)
    assert 36_000_000 < sum(p.numel() for p in wide.parameters()) < 37_000_000  # WRN-28-10: 36.5M
    bn = build_model("wrn-16-2", num_classes=5, in_chans=1, options={"norm": "batch"})
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn.modules()) and bn(_x(2, (1, 32, 32))).shape == (2, 5)


def test_wrn_spec_with_an_impossible_depth_is_an_error_naming_the_rule():
    from jem_plugin.errors import UnknownNameError
    from jem_plugin.nets import build_model

    with pytest.raises(UnknownNameError, match="6n \\+ 4"):
        build_model("wrn-12-2", num_classes=10, in_chans=3)


@pytest.mark.parametrize("conditional", [False, True])
def test_the_captured_step_is_the_eager_step(conditional):
    # The body the graph captures, run eagerly on the CPU: the same chain as the eager loop for
    # the same generator (decaying step size, gradient clamp, per-channel clamp, labels).
    from jem_plugin.model import sampling_mode

    model = SmallConvNet(bn=False)
    jm = jem.wrap(model, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), input_size=(3, 16, 16), num_classes=10)
    x = _x()
    y = torch.arange(8) % 10 if conditional else None
    opts = {"steps": 6, "step_size": Poly(2.0, end=0.5), "noise": 0.05, "grad_clamp": 0.3}
    eager = jem.SGLD(**opts, generator=torch.Generator().manual_seed(3), cuda_graph="off").run(jm, x, y)
    sampler = jem.SGLD(**opts, generator=torch.Generator().manual_seed(3))
    xs = x.clone().requires_grad_(True)
    a = torch.zeros(())
    ys = y.view(-1, 1) if conditional else None
    step = _cuda_graph.make_step(jm, xs, a, ys, sampler.prepare(jm, xs.detach()), sampler)
    with sampling_mode(model):
        for size in sampler.step_sizes():
            a.fill_(size)
            step()
    assert not torch.equal(eager, x)
    torch.testing.assert_close(xs.detach(), eager, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- benchmarks/bench_gpu.py
@pytest.mark.slow
def test_bench_gpu_prints_one_note_and_exits_0_without_a_gpu():
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]


def test_bench_gpu_counts_the_iterations_flops():
    # The FLOP floor's count: a chain step is a forward plus an input gradient (~2 forwards per
    # chain), the training step a forward and full backward (~3 forwards per image).
    from benchmarks.bench_gpu import iteration_flops
    from jem_plugin.app.nets import WideResNet

    f = iteration_flops(lambda: WideResNet(10, 2, 10), batch=4, chains=4, steps=5)
    fwd = f["forward_gflop_per_image"] * 1e9
    assert 1.9 < f["chain_step_tflop"] * 1e12 / (4 * fwd) < 2.1
    assert 2.9 < f["train_step_tflop"] * 1e12 / (8 * fwd) < 3.1
    assert f["iteration_tflop"] == pytest.approx(5 * f["chain_step_tflop"] + f["train_step_tflop"])


# --------------------------------------------------------------------------- autocast
def test_chain_under_autocast_sees_its_current_state_not_a_cached_cast():
    # Autocast caches the bf16 copy of a leaf that requires grad; the chain is such a leaf,
    # updated in place. With the cache on, every step reused the cast of the start, so the
    # chain extrapolated its first gradient instead of following the energy.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 16, 5))
    jm = jem.wrap(model, data_range=(-1.0, 1.0))
    x = torch.rand(4, 3, 6, 6) * 2 - 1
    chain = jem.SGLD(steps=20, step_size=5.0, noise=0.0, clamp=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chain.run(jm, x)
        extrapolated = jem.SGLD(steps=1, step_size=100.0, noise=0.0, clamp=False).run(jm, x)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        uncached = chain.run(jm, x)
    assert torch.equal(ours, uncached)
    assert (ours - extrapolated).abs().max() > 0.1


@cuda
def test_ddp_and_fsdp2_over_nccl_on_one_rank():
    """The distributed paths over NCCL, the backend GPU users have (the other distributed tests run
    gloo on the CPU): one rank, in this process. DDP trains a BatchNorm JEM; an FSDP2-sharded
    model trains too, and its chains run eagerly with the reason (a capture would gather the
    shards with collectives), or refuse under ``cuda_graph="require"``."""
    import socket

    import torch.distributed as dist

    from jem_plugin import distributed as jdist

    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("this PyTorch build has no NCCL")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this PyTorch has no FSDP2 (fully_shard)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        info = jdist.init_distributed()
        assert (info.backend, info.world_size, info.device.type) == ("nccl", 1, "cuda")
        x, y = _x(16, device="cuda"), torch.arange(16, device="cuda") % 10
        for kind in ("ddp", "fsdp2"):
            torch.manual_seed(0)
            jm = _jm(SmallConvNet(bn=kind == "ddp")).cuda()
            model = jdist.wrap_ddp(jm) if kind == "ddp" else jdist.fully_shard_jem(jm)
            loss_fn = jem.JEMLoss(jem.SGLD(steps=3), jem.ReplayBuffer(64, (3, 16, 16), num_classes=10))
            opt = torch.optim.SGD(jm.parameters(), lr=0.05)
            start = [p.detach().clone() for p in jm.parameters()]
            for _ in range(3):
                out = loss_fn(model, x, y)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
            assert torch.isfinite(out.loss), kind
            assert any(not torch.equal(a, b) for a, b in zip(start, jm.parameters())), kind
            assert jdist.params_in_sync(jm), kind
        assert all(hasattr(p, "full_tensor") for p in jm.parameters())  # the last one is sharded
        _cuda_graph._warned.clear()
        with pytest.warns(RuntimeWarning, match=r"sharded \(FSDP\)"):
            chains = jem.SGLD(steps=2, cuda_graph="auto").run(jm, x)
        assert chains.is_cuda and torch.isfinite(chains).all()
        with pytest.raises(CUDAGraphError, match=r"sharded \(FSDP\)"):
            jem.SGLD(steps=2, cuda_graph="require").run(jm, x)
    finally:
        jdist.cleanup()
