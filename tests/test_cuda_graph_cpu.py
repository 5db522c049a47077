"""The CUDA-graph SGLD path (jem_plugin._cuda_graph) on CPU chains, with the stand-in for torch.cuda of
tests/_fake_cuda.py: its graphs record the captured step's aten ops and replay them, with the
addresses, the generator and the memory rules of a real CUDA graph. So a graphed chain is compared
with the eager chain exactly as on a GPU, and every line of the module runs in CI."""

from __future__ import annotations

import gc
import warnings
from types import SimpleNamespace

import pytest
import torch
from _fake_cuda import NOT_PERMITTED, FakeCuda, install
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import jem_plugin as jem
from jem_plugin import _cuda_graph
from jem_plugin.errors import CUDAGraphError, DivergenceError, InvalidLabelError
from jem_plugin.schedules import Poly

SHAPE = (3, 8, 8)


class Net(nn.Module):
    """Conv + BatchNorm + LeakyReLU + linear head. The input is cast to the parameters' dtype, so
    a float64 model also runs float32 chains."""

    def __init__(self, k: int = 10, bn: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8) if bn else nn.Identity(),
            nn.LeakyReLU(0.2),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(8, k)
        self.fail: str | None = None  # a ValueError forward raises: the model's own error
        self.sync = False  # forward reads a value on the host (a sync, refused by a capture)
        for m in self.modules():  # running statistics that differ from batch statistics
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        if self.fail is not None:
            raise ValueError(self.fail)
        h = self.body(x.to(self.head.weight.dtype))
        if self.sync and h.abs().sum().item() < 0:  # never true: the read is what counts
            h = -h
        return self.head(h)


def _jm(model=None, **kw):
    model = model if model is not None else Net()
    opts = {"data_range": (-1.0, 1.0), "input_size": SHAPE, "num_classes": 10, **kw}
    return jem.wrap(model, **{k: v for k, v in opts.items() if v is not None})


def _x(n=6, shape=SHAPE, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *shape, generator=g) * 2 - 1


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _both(jm, x, y=None, *, gen=None, seed=3, **opts):
    """``(graph, eager)``: the chain run as a graph, drawing from ``gen`` (``None``: the default
    generator), and eagerly from a generator seeded alike; both leave their generator alike."""
    opts = {"steps": 5, **opts}

    def run(mode, g):
        if g is None:
            torch.manual_seed(seed)
        else:
            g.manual_seed(seed)
        out = jem.SGLD(**opts, generator=g, cuda_graph=mode).run(jm, x, y)
        return out, (g or torch.default_generator).get_state()

    graph, after_graph = run("require", gen)
    eager, after_eager = run("off", None if gen is None else _gen())
    assert torch.equal(after_graph, after_eager)  # the warm-up's draws are undone
    return graph, eager


def _entries(jm):
    return _cuda_graph._graphs.get(jm.model, {})


@pytest.fixture
def fake(monkeypatch) -> FakeCuda:
    return install(monkeypatch)


# --------------------------------------------------------------------------- the stand-in itself
def test_the_fake_graph_keeps_the_rules_of_a_cuda_graph():
    fake = FakeCuda()
    w, x = torch.ones(3), torch.zeros(3)
    g = fake.CUDAGraph()
    with pytest.raises(RuntimeError, match="not captured"):
        g.replay()
    with fake.graph(g, pool=fake.graph_pool_handle(), stream=fake.Stream("cpu"), capture_error_mode="thread_local"):
        assert fake.is_current_stream_capturing()
        y = x * 2 + w
        x.add_(1)
    assert not fake.is_current_stream_capturing()
    assert torch.equal(x, torch.zeros(3)) and y.isnan().all()  # a capture computes nothing
    g.replay()
    assert torch.equal(x, torch.ones(3)) and torch.equal(y, torch.ones(3))  # the same tensors, computed
    w.mul_(10)
    g.replay()
    assert torch.equal(x, torch.full((3,), 2.0)) and torch.equal(y, torch.full((3,), 12.0))  # live inputs
    del w
    with pytest.raises(RuntimeError, match="freed since capture"):
        g.replay()  # a graph holds addresses, not tensors
    with pytest.raises(RuntimeError, match="already been captured"), fake.graph(g):
        pass
    for body, error in (
        (lambda: x.sum().item(), NOT_PERMITTED),
        (lambda: x.normal_(generator=_gen()), "not in capture mode"),
    ):
        with pytest.raises(RuntimeError, match=error), fake.graph(fake.CUDAGraph()):
            body()
    with pytest.raises(RuntimeError, match="capture error mode"), fake.graph(fake.CUDAGraph(), capture_error_mode="x"):
        pass
    assert fake.captures == 1


# --------------------------------------------------------------------------- graph == eager
@pytest.mark.parametrize("batchnorm", ["joint", "separate"])
@pytest.mark.parametrize("noise", [0.0, 0.05])
@pytest.mark.parametrize("conditional", [False, True])
def test_graph_is_the_eager_chain(fake, conditional, noise, batchnorm):
    model = Net()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    jm = _jm(model)
    x = _x()
    y = torch.tensor([0, 3, 9, 1, 1, 5]) if conditional else None
    opts = {
        "steps": 6,
        "step_size": Poly(300.0, end=50.0),
        "grad_clamp": 3e-4,
        "noise": noise,
        "batchnorm": batchnorm,
    }
    gen = _gen()
    graph, eager = _both(jm, x, y, gen=gen, **opts)
    assert torch.equal(graph, eager)
    assert not torch.equal(graph, x)
    assert graph.dtype == torch.float32 and graph.shape == x.shape
    assert fake.captures == 1 and fake.graphs[-1].replays == 6
    # the gradient clamp bites (an unclamped chain goes elsewhere); the clamp holds the chain in the domain
    unclipped = jem.SGLD(**{**opts, "grad_clamp": None}, generator=gen.manual_seed(3), cuda_graph="require").run(
        jm, x, y
    )
    assert not torch.equal(unclipped, graph)
    assert graph.min() >= -1 and graph.max() <= 1 and ((graph == 1) | (graph == -1)).any()
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # running statistics untouched


def test_batch_statistics_are_a_separate_graph(fake):
    model = Net()
    jm = _jm(model)
    x = _x()
    running = jem.SGLD(steps=4, noise=0.0, cuda_graph="require").run(jm, x)
    batch = jem.SGLD(steps=4, noise=0.0, cuda_graph="require", batchnorm="separate").run(jm, x)
    assert fake.captures == 2 and not torch.allclose(running, batch)


@pytest.mark.parametrize("clamp", [True, False])
def test_per_channel_clamp_and_no_clamp(fake, clamp):
    # A normalised domain clamps each channel to its own bounds (views of the chain).
    jm = _jm(data_range=None, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    x = _x() * 0.5
    graph, eager = _both(jm, x, step_size=2000.0, noise=0.1, clamp=clamp)
    assert torch.equal(graph, eager)
    high = torch.tensor([(1 - m) / s for m, s in zip((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))]).view(1, 3, 1, 1)
    assert bool((graph <= high + 1e-6).all()) is clamp


def test_channels_last_chain(fake):
    jm = _jm()
    x = _x().contiguous(memory_format=torch.channels_last)
    graph, eager = _both(jm, x, noise=0.02)
    assert torch.equal(graph, eager)
    assert graph.is_contiguous(memory_format=torch.channels_last) and not graph.is_contiguous()
    graph, eager = _both(jm, x.contiguous(), noise=0.02)
    assert torch.equal(graph, eager) and graph.is_contiguous()
    assert fake.captures == 2  # contiguous and channels_last chains are two graphs


def test_autocast_chain(fake):
    jm = _jm(Net(bn=False))
    x = _x()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph, eager = _both(jm, x, noise=0.02)
    assert graph.dtype == torch.float32
    assert torch.equal(graph, eager)
    _both(jm, x, noise=0.02)
    assert fake.captures == 2  # autocast on and off: two graphs


def test_a_gradient_in_another_dtype_is_cast_to_the_chain(fake, monkeypatch):
    # autograd returns the input's dtype; the step's guard (as the eager loop's) casts any other back
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: tuple(g.bfloat16() for g in grad(*a, **k)))
    graph, eager = _both(_jm(), _x(), noise=0.0, step_size=300.0, grad_clamp=3e-4)  # a bf16 clamp would differ
    assert torch.equal(graph, eager) and graph.dtype == torch.float32


def test_user_and_default_generators(fake):
    jm = _jm()
    x = _x()
    for gen in (None, _gen()):  # the default generator, and one of the user's, registered with the graph
        graph, eager = _both(jm, x, gen=gen, noise=0.05)
        assert torch.equal(graph, eager)
    assert fake.captures == 2


def test_step_size_is_not_baked_in(fake):
    jm = _jm()
    x = _x()
    for size in (1.0, 0.25):
        graph, eager = _both(jm, x, step_size=size, noise=0.0)
        assert torch.equal(graph, eager)
    sizes = [2.0, 2.0, 0.5, 1.0]
    graph, eager = _both(jm, x, step_size=lambda t: sizes[t], steps=4, noise=0.0)
    assert torch.equal(graph, eager)
    assert fake.captures == 1


def test_graph_score_feeds_the_divergence_check(fake):
    jm = _jm()
    with pytest.raises(DivergenceError, match="max_energy"):
        jem.SGLD(steps=2, max_energy=1e-6, cuda_graph="require").run(jm, _x())
    out, diag = jem.SGLD(steps=3, cuda_graph="require").run(jm, _x(), return_diagnostics=True)
    assert diag.steps == 3 and torch.isfinite(out).all()


def test_streams_and_pool(fake):
    jm = _jm()
    jem.SGLD(steps=2, cuda_graph="require").run(jm, _x())
    jem.SGLD(steps=2, cuda_graph="require").run(jm, _x(3))
    side = fake.streams[0]
    assert len(fake.streams) == 1 and len(fake.pools) == 1  # one side stream and one pool per device
    assert side.waited == [fake.current_stream(), fake.current_stream()]  # warm-up after the current stream's work
    assert fake.current_stream().waited == [side, side]  # and the current stream after the warm-up


# --------------------------------------------------------------------------- labels
def test_conditional_chain_with_unknown_num_classes(fake):
    # wrap() without num_classes: the graph path checks the labels against the captured logits
    # (this called the removed SGLD._check_y_range, an AttributeError on every such CUDA run).
    jm = _jm(num_classes=None)
    assert jm.num_classes is None
    x = _x()
    y = torch.tensor([0, 1, 2, 3, 4, 9])
    graph, eager = _both(jm, x, y, noise=0.02)
    assert torch.equal(graph, eager)
    sampler = jem.SGLD(steps=3, noise=0.02, generator=_gen(), cuda_graph="require")
    first = sampler.run(jm, x, y)
    sampler.generator.manual_seed(0)
    assert torch.equal(sampler.run(jm, x, y), first)  # replayed
    assert fake.captures == 2
    with pytest.raises(InvalidLabelError, match=r"y \(one class per chain\) must lie in \[0, 10\)"):
        sampler.run(jm, x, y + 1)  # checked before the replay
    assert fake.captures == 2 and fake.graphs[-1].replays == 6


def test_labels_are_copied_in_at_every_run(fake):
    jm = _jm()
    x = _x()
    for y in (torch.arange(6), torch.tensor([9, 9, 0, 0, 5, 5])):
        graph, eager = _both(jm, x, y, noise=0.02)
        assert torch.equal(graph, eager)
    assert fake.captures == 1


class _Gathers(TorchDispatchMode):
    """Every aten.gather index that runs, with its bound."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.gather.default:
            self.seen.append((int(args[2].max()), args[0].shape[args[1]]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["require", "auto"])
def test_out_of_range_labels_never_reach_a_kernel(fake, mode):
    # On CUDA an out-of-range gather index is a device-side assert that kills the process: the
    # labels of a new capture are checked before its first (warm-up) gather, as eagerly.
    jm = _jm(num_classes=None)
    with _Gathers() as spy, pytest.raises(InvalidLabelError, match=r"must lie in \[0, 10\)"):
        jem.SGLD(steps=2, cuda_graph=mode).run(jm, _x(), torch.tensor([0, 1, 2, 3, 4, 10]))
    assert all(i < k for i, k in spy.seen)
    assert fake.captures == 0


# --------------------------------------------------------------------------- the cache
def test_graph_is_reused_and_sees_in_place_updates(fake):
    model = Net(bn=False)
    jm = _jm(model)
    x = _x()
    opts = {"steps": 4, "noise": 0.02}
    sampler = jem.SGLD(**opts, generator=_gen(4), cuda_graph="require")
    first = sampler.run(jm, x)
    sampler.generator.manual_seed(4)
    assert torch.equal(sampler.run(jm, x), first)
    jem.SGLD(**opts, generator=sampler.generator, cuda_graph="require").run(jm, x)  # another sampler, same settings
    assert fake.captures == 1
    for opt in (
        torch.optim.Adam(model.parameters(), lr=0.05),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True),
    ):
        model(x).logsumexp(1).mean().backward()
        opt.step()  # optimizers update in place: the graph reads the live tensors
        opt.zero_grad()
        sampler.generator.manual_seed(4)
        seen = sampler.run(jm, x)
        assert torch.equal(seen, jem.SGLD(**opts, generator=_gen(4), cuda_graph="off").run(jm, x))
        assert not torch.equal(seen, first)
    assert fake.captures == 1


_CHANGES = {
    "noise": lambda o, x, y: ({**o, "noise": 0.05}, x, y),
    "no noise": lambda o, x, y: ({**o, "noise": 0.0}, x, y),
    "grad_clamp": lambda o, x, y: ({**o, "grad_clamp": 0.01}, x, y),
    "clamp": lambda o, x, y: ({**o, "clamp": False}, x, y),
    "batchnorm": lambda o, x, y: ({**o, "batchnorm": "separate"}, x, y),
    "shape": lambda o, x, y: (o, x[:4], y),
    "dtype": lambda o, x, y: (o, x, y),  # the model made float64 below: its chains are float64
    "labels": lambda o, x, y: (o, x, torch.arange(6)),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_changed_setting_is_a_new_graph(fake, change):
    model = Net()
    jm = _jm(model)
    opts = {"steps": 3, "noise": 0.02}
    x = _x()
    g, e = _both(jm, x, None, **opts)
    assert torch.equal(g, e)
    _both(jm, x, None, **opts)
    assert fake.captures == 1  # the same settings: replayed
    opts2, x2, y2 = _CHANGES[change](opts, x, None)
    if change == "dtype":
        model.double()
    g, e = _both(jm, x2, y2, **opts2)
    assert fake.captures == 2 and torch.equal(g, e)
    assert g.dtype == (torch.float64 if change == "dtype" else torch.float32)


def test_backend_flags_are_part_of_the_key(fake, monkeypatch):
    jm = _jm()
    _both(jm, _x())
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", not torch.backends.cudnn.deterministic)
    _both(jm, _x())
    assert fake.captures == 2


@pytest.mark.parametrize("how", ["load_state_dict(assign=True)", "p.data = ...", "model.double().float()"])
def test_replaced_parameters_are_captured_again(fake, how):
    # A replaced tensor has a new address: the old graph would read freed memory (the fake raises).
    model = Net()
    jm = _jm(model)
    x = _x()
    _both(jm, x)
    new = Net()
    if how == "load_state_dict(assign=True)":
        model.load_state_dict({k: v.clone() for k, v in new.state_dict().items()}, assign=True)
    elif how == "p.data = ...":
        for p, q in zip(model.parameters(), new.parameters()):
            p.data = q.detach().clone()
    else:
        model.double().float()
    graph, eager = _both(jm, x)
    assert torch.equal(graph, eager)
    assert fake.captures == 2 and len(_entries(jm)) == 1  # the stale graph is dropped


def test_a_new_generator_is_a_new_graph(fake):
    jm = _jm()
    x = _x()
    _both(jm, x, noise=0.02)
    _both(jm, x, noise=0.02)
    assert fake.captures == 1  # the default generator
    _both(jm, x, gen=_gen(), noise=0.02)
    _both(jm, x, gen=_gen(), noise=0.02)
    assert fake.captures == 3  # each graph draws from the generator registered with it
    gen = _gen()
    _both(jm, x, gen=gen, noise=0.02)
    _both(jm, x, gen=gen, noise=0.02)
    assert fake.captures == 4
    # The key holds the generator's id and the graph its object: another object under the same
    # key (id reuse) is never replayed.
    (key, entry), *_ = reversed(_entries(jm).items())
    entry.owners = (_gen(), entry.owners[1])
    graph, eager = _both(jm, x, gen=gen, noise=0.02)
    assert fake.captures == 5 and torch.equal(graph, eager)
    assert _entries(jm)[key].owners[0] is gen


def test_a_new_adapter_is_a_new_graph(fake):
    model = Net()
    _both(_jm(model), _x())
    _both(_jm(model), _x())  # another wrap: another adapter
    assert fake.captures == 2 and len(_entries(_jm(model))) == 2


def test_graph_cache_keeps_a_few_graphs_per_model(fake):
    jm = _jm(Net(bn=False))
    for n in range(1, _cuda_graph.MAX_GRAPHS + 3):
        jem.SGLD(steps=1, cuda_graph="require").run(jm, _x(n))
    assert len(_entries(jm)) == _cuda_graph.MAX_GRAPHS
    assert [k[0][0] for k in _entries(jm)] == list(range(3, _cuda_graph.MAX_GRAPHS + 3))
    jem.SGLD(steps=1, cuda_graph="require").run(jm, _x(3))  # the least recently used is dropped next
    jem.SGLD(steps=1, cuda_graph="require").run(jm, _x(1))  # dropped earlier: captured again
    assert fake.captures == _cuda_graph.MAX_GRAPHS + 3
    assert [k[0][0] for k in _entries(jm)] == [5, 6, 3, 1]


@pytest.mark.slow
def test_graphs_do_not_keep_the_model_alive(fake):
    model = Net()
    jem.SGLD(steps=2, cuda_graph="require").run(_jm(model), _x())
    assert len(_cuda_graph._graphs) == 1
    del model
    gc.collect()
    assert len(_cuda_graph._graphs) == 0


def test_clear_drops_graphs_and_pools(fake):
    jm = _jm()
    _both(jm, _x())
    assert _cuda_graph._graphs and _cuda_graph._pools
    _cuda_graph.clear()
    assert not _cuda_graph._graphs and not _cuda_graph._pools
    graph, eager = _both(jm, _x())
    assert torch.equal(graph, eager) and fake.captures == 2 and len(fake.pools) == 2


# --------------------------------------------------------------------------- fallbacks
class _Hook:
    @jem.hookimpl
    def jem_sgld_step(self, state):
        pass


def _blocked(how, jm, fake):
    """Options of the run call, a JEM and an undo for each reason the chain cannot be a graph."""
    undo = lambda: None
    opts: dict = {}
    if how in ("record_trajectory", "record_energies"):
        opts = {how: True, "return_diagnostics": True}
    elif how == "hook":
        plugin = _Hook()
        jem.register(plugin)
        undo = lambda: jem.unregister(plugin)
    elif how == "callable":
        model = jm.model
        jm = jem.wrap(lambda x: model(x), data_range=(-1.0, 1.0), input_size=SHAPE, num_classes=10)
    elif how == "sharded":  # what FSDP2 leaves: parameters that are DTensors (full_tensor() gathers them)
        weight = jm.model.head.weight
        weight.full_tensor = lambda: weight
        undo = lambda: delattr(weight, "full_tensor")
    elif how == "capturing":
        fake.capturing = True
    elif how == "unavailable":
        fake.is_available = lambda: False
    return opts, jm, undo


_REASONS = {
    "record_trajectory": "trajectory/energy recording",
    "record_energies": "trajectory/energy recording",
    "hook": "jem_sgld_step plugin hook",
    "colours": "colour projection",
    "callable": "plain callable",
    "sharded": "sharded \\(FSDP\\)",
    "capturing": "already being captured",
    "unavailable": "not on a CUDA device",
}


@pytest.mark.parametrize("how", list(_REASONS))
def test_blockers_fall_back_with_one_warning_and_require_refuses(fake, how):
    opts, jm, undo = _blocked(how, _jm(Net(bn=False)), fake)
    x = _x()
    colour = torch.full((3, 3), 1 / 3) if how == "colours" else None  # grey steps
    try:

        def run(mode):
            s = jem.SGLD(steps=3, noise=0.02, generator=_gen(2), cuda_graph=mode)
            s.colour_projection = colour
            out = s.run(jm, x, **opts)
            return out[0] if isinstance(out, tuple) else out

        with pytest.raises(CUDAGraphError, match=_REASONS[how]) as info:
            run("require")
        assert "\n" not in str(info.value) and "cuda_graph='auto'" in str(info.value)
        with pytest.warns(RuntimeWarning, match=f"SGLD runs eagerly, not as a CUDA graph: .*{_REASONS[how]}"):
            auto = run("auto")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = run("auto")  # warned once only
        assert torch.equal(auto, again) and torch.equal(auto, run("off"))
    finally:
        undo()
    assert fake.captures == 0 and not fake.graphs


def test_chains_off_the_graph_device_fall_back_silently(fake, monkeypatch):
    monkeypatch.setattr(_cuda_graph, "_DEVICE_TYPE", "cuda")  # CPU chains, CUDA graphs
    jm = _jm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = jem.SGLD(steps=2, generator=_gen(), cuda_graph="auto").run(jm, _x())
    assert torch.equal(auto, jem.SGLD(steps=2, generator=_gen(), cuda_graph="off").run(jm, _x()))
    with pytest.raises(CUDAGraphError, match="not on a CUDA device"):
        jem.SGLD(steps=2, cuda_graph="require").run(jm, _x())
    assert not fake.graphs


@pytest.mark.parametrize("message", ["operation failed in capture\nsecond line", ""])
def test_a_failed_capture_is_remembered_and_reported(fake, message):
    fake.fail_capture = RuntimeError(message)
    jm = _jm()
    x = _x()
    gen = _gen()
    first = "operation failed in capture" if message else ""
    with pytest.raises(CUDAGraphError) as info:
        jem.SGLD(steps=2, generator=gen, cuda_graph="require").run(jm, x)
    assert f"capture failed (RuntimeError: {first or 'RuntimeError'})" in str(info.value)
    assert "\n" not in str(info.value)
    assert len(fake.graphs) == 1 and fake.captures == 0
    fake.fail_capture = None  # would capture now, but the failure is remembered: not tried again
    with pytest.warns(RuntimeWarning, match="capture failed"):
        auto = jem.SGLD(steps=2, generator=gen.manual_seed(0), cuda_graph="auto").run(jm, x)
    assert len(fake.graphs) == 1
    assert torch.equal(auto, jem.SGLD(steps=2, generator=_gen(), cuda_graph="off").run(jm, x))
    with pytest.raises(CUDAGraphError, match="capture failed"):
        jem.SGLD(steps=2, generator=gen, cuda_graph="require").run(jm, x)
    assert len(fake.graphs) == 1


def test_a_model_that_syncs_with_the_host_runs_eagerly(fake):
    model = Net()
    model.sync = True
    jm = _jm(model)
    with pytest.warns(RuntimeWarning, match=NOT_PERMITTED):
        auto = jem.SGLD(steps=3, generator=_gen(), cuda_graph="auto").run(jm, _x())
    assert torch.equal(auto, jem.SGLD(steps=3, generator=_gen(), cuda_graph="off").run(jm, _x()))
    assert fake.captures == 0


@pytest.mark.parametrize("mode", ["auto", "require"])
def test_the_models_own_error_comes_from_the_eager_loop(fake, mode):
    model = Net()
    model.fail = "the model's own error"
    jm = _jm(model)
    gen = _gen()
    state = gen.get_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: this is not about graphs
        with pytest.raises(ValueError, match="the model's own error") as info:
            jem.SGLD(steps=2, generator=gen, cuda_graph=mode).run(jm, _x())
    assert not any(entry.path.name == "_cuda_graph.py" for entry in info.traceback)  # raised by the eager loop
    assert not fake.graphs and not _entries(jm)  # not remembered: nothing to do with capture
    assert torch.equal(gen.get_state(), state)
    model.fail = None
    graph, eager = _both(jm, _x())
    assert torch.equal(graph, eager) and fake.captures == 1


def test_a_torch_without_generator_registration(fake):
    fake.register_generator_state = False
    jm = _jm()
    x = _x()
    with pytest.raises(CUDAGraphError, match="register_generator_state"):
        jem.SGLD(steps=2, noise=0.02, generator=_gen(), cuda_graph="require").run(jm, x)
    with pytest.warns(RuntimeWarning, match="cannot register a generator"):
        auto = jem.SGLD(steps=2, noise=0.02, generator=_gen(), cuda_graph="auto").run(jm, x)
    assert torch.equal(auto, jem.SGLD(steps=2, noise=0.02, generator=_gen(), cuda_graph="off").run(jm, x))
    assert fake.captures == 0
    # no generator of its own (the default one is always registered), or no noise: captured
    torch.manual_seed(1)
    graph = jem.SGLD(steps=2, noise=0.02, cuda_graph="require").run(jm, x)
    torch.manual_seed(1)
    assert torch.equal(graph, jem.SGLD(steps=2, noise=0.02, cuda_graph="off").run(jm, x))
    graph, eager = _both(jm, x, noise=0.0)
    assert torch.equal(graph, eager) and fake.captures == 2


def test_an_unregistered_generator_cannot_be_captured(fake, monkeypatch):
    # What the registration is for: the fake refuses a capture that draws from an unregistered
    # generator, as CUDA's Philox generators do.
    from _fake_cuda import NOT_REGISTERED, FakeCUDAGraphWithGenerators

    monkeypatch.setattr(FakeCUDAGraphWithGenerators, "register_generator_state", lambda self, g: None)
    with pytest.raises(CUDAGraphError, match=NOT_REGISTERED.rstrip(".")):
        jem.SGLD(steps=2, noise=0.02, generator=_gen(), cuda_graph="require").run(_jm(), _x())


# --------------------------------------------------------------------------- small paths
def test_progress_bar(fake, monkeypatch):
    bars = []

    def spy(it, **kw):
        bars.append(kw["desc"])
        return it

    monkeypatch.setattr(_cuda_graph, "tqdm", spy)
    jm = _jm()
    with_bar = jem.SGLD(steps=3, generator=_gen(), cuda_graph="require").run(jm, _x(), progress=True)
    without = jem.SGLD(steps=3, generator=_gen(), cuda_graph="require").run(jm, _x())
    assert bars == ["SGLD (CUDA graph)"] and torch.equal(with_bar, without)


def test_zero_steps_and_off_need_no_graph(fake):
    jm = _jm()
    x = _x()
    assert torch.equal(jem.SGLD(steps=0, cuda_graph="require").run(jm, x), x)
    assert _cuda_graph.run(jem.SGLD(steps=0, cuda_graph="require"), jm, x, None) is None
    assert _cuda_graph.run(jem.SGLD(steps=3, cuda_graph="off"), jm, x, None) is None
    assert not fake.graphs


def test_default_is_auto_and_graphs_chains_on_the_graph_device(fake):
    jm = _jm()
    assert jem.SGLD().cuda_graph == "auto"
    graph = jem.SGLD(steps=2, generator=_gen()).run(jm, _x())
    assert fake.captures == 1 and fake.graphs[-1].replays == 2
    assert torch.equal(graph, jem.SGLD(steps=2, generator=_gen(), cuda_graph="off").run(jm, _x()))


def test_default_runs_cpu_chains_eagerly_without_a_word():
    # The real torch.cuda, chains on the CPU: no graph is attempted, nothing is said.
    jm = _jm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = jem.SGLD(steps=2, generator=_gen()).run(jm, _x())
        conditional = jem.SGLD(steps=2, generator=_gen()).sample(jm, y=torch.tensor([0, 3]), shape=SHAPE)
    assert torch.equal(default, jem.SGLD(steps=2, generator=_gen(), cuda_graph="off").run(jm, _x()))
    assert conditional.shape == (2, *SHAPE) and jm.model not in _cuda_graph._graphs


def test_a_generator_on_another_device_is_left_to_the_eager_loop(fake):
    # The eager loop raises its clear device-mismatch error; a generator elsewhere is never captured.
    sampler = jem.SGLD(steps=2, noise=0.02, cuda_graph="require")
    sampler.generator = SimpleNamespace(device=torch.device("cuda", 0))  # type: ignore[assignment]  # only its device is read
    assert _cuda_graph.run(sampler, _jm(), _x(), None) is None
    assert not fake.graphs


def test_check_mode():
    assert [_cuda_graph.check_mode(m) for m in _cuda_graph.MODES] == list(_cuda_graph.MODES)
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        _cuda_graph.check_mode("on")
