"""The sampler contract (jem_plugin.chains): a sampler written only against it trains with JEMLoss;
the chain driver SGLD and PGDNegatives share checks each input once, draws at the size the model
trained on, and runs chains in the model's dtype."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import _checks, chains
from jem_plugin.builtins.pgd_negatives import PGDNegatives
from jem_plugin.chains import ChainSampler, Sampler

SHAPE = (1, 8, 8)
K = 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.LeakyReLU(0.2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, K),
    )


def _jm(model: nn.Module | None = None, **kw) -> jem.JEM:
    return jem.wrap(model if model is not None else _net(), data_range=(-1.0, 1.0), num_classes=K, **kw)


def _data(n: int = 8, shape=SHAPE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *shape, generator=g) * 2 - 1, torch.arange(n) % K


# ------------------------------------------------------------------ a sampler written only against the contract
class GradientWalk(ChainSampler):
    """Langevin dynamics without noise, ``x <- x + size * grad``: the one method a sampler writes.
    Written as pure tensor work (``grad * size``), so it also runs inside a CUDA graph."""

    step_size = 0.05

    def step(self, x, grad, size, state):
        x.add_(grad * size)


class RandomWalk(ChainSampler):
    """A random walk that ignores the gradient, with per-run state (its noise buffer)."""

    step_size = 0.1

    def prepare(self, jm, x):
        return torch.empty_like(x)

    def step(self, x, grad, size, state):
        x.add_(state.normal_(generator=self.generator), alpha=size)


def test_a_sampler_that_writes_one_step_trains_with_jemloss():
    jm = _jm()
    sampler = GradientWalk(steps=3, generator=torch.Generator().manual_seed(0))
    assert isinstance(sampler, Sampler)
    buffer = jem.ReplayBuffer(32, SHAPE, num_classes=K, reinit_freq=0.0)
    loss_fn = jem.JEMLoss(sampler, buffer, pxy_weight=1.0, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(jm.parameters(), lr=0.05)
    before = [p.detach().clone() for p in jm.parameters()]
    x, y = _data()
    for _ in range(3):
        out = loss_fn(jm, x, y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert torch.isfinite(out.loss) and {"px", "pxy", "energy_sample"} <= set(out.metrics)
    assert any(not torch.equal(a, b) for a, b in zip(before, jm.parameters()))
    stored = buffer.samples()
    assert stored.abs().max() <= 1.0  # the driver's clamp to the domain
    # What the driver gives: recording, the trained size, the model's dtype.
    x_s, diag = sampler.sample(jm, 5, return_diagnostics=True, record_energies=True, record_trajectory=True)
    assert x_s.shape == (5, *SHAPE) and diag.steps == 3 and diag.final_step_size == 0.05
    assert diag.energies.shape == (4, 5) and torch.equal(diag.trajectory[-1], x_s)
    assert (diag.energies[-1] <= diag.energies[0] + 1e-6).all()  # a noiseless gradient step lowers E


def test_a_samplers_state_and_generator_make_seeded_chains():
    jm = _jm()
    a = RandomWalk(steps=4, generator=torch.Generator().manual_seed(3)).sample(jm, 6, shape=SHAPE)
    b = RandomWalk(steps=4, generator=torch.Generator().manual_seed(3)).sample(jm, 6, shape=SHAPE)
    assert torch.equal(a, b)
    start = RandomWalk(steps=0, generator=torch.Generator().manual_seed(3)).sample(jm, 6, shape=SHAPE)
    assert not torch.equal(a, start)


def test_a_sampler_without_a_step_says_so():
    with pytest.raises(TypeError, match="abstract method.*step"):
        ChainSampler(steps=1)  # type: ignore[abstract]  # what the test checks


def test_a_third_party_step_runs_as_a_cuda_graph(monkeypatch):
    # The CPU stand-in for torch.cuda (tests/_fake_cuda.py): the captured step is the eager step.
    from _fake_cuda import install

    fake = install(monkeypatch)

    class Graphed(GradientWalk):
        cuda_graph = "require"

    jm = _jm()
    x, y = _data(6)
    graph = Graphed(steps=4).run(jm, x, y)
    eager = GradientWalk(steps=4).run(jm, x, y)
    assert fake.captures == 1 and torch.equal(graph, eager) and not torch.equal(graph, x)


# ------------------------------------------------------------------ each input checked once
def _count_calls(monkeypatch, name: str) -> list[int]:
    """Count calls of the _checks helper ``name`` from every jem_plugin module that imported it."""
    original = getattr(_checks, name)
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("jem_plugin") and getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("sampler", ["sgld", "pgd"])
def test_a_class_conditional_draw_checks_each_input_once(monkeypatch, sampler):
    jm = _jm()
    s = jem.SGLD(steps=2) if sampler == "sgld" else PGDNegatives(steps=2)
    buffer = jem.ReplayBuffer(16, SHAPE, num_classes=K)
    loss_fn = jem.JEMLoss(s, buffer, px_weight=0.0, pxy_weight=1.0)
    x, y = _data()
    labels, inputs, moves = (_count_calls(monkeypatch, n) for n in ("check_labels", "check_input", "follow"))
    loss_fn(jm, x, y)
    assert (len(labels), len(inputs), len(moves)) == (1, 1, 1)
    labels.clear(), inputs.clear(), moves.clear()
    s.sample(jm, y=y[:3], buffer=buffer)  # the sampler's own public edge
    assert (len(labels), len(inputs), len(moves)) == (1, 0, 1)


def test_labels_beyond_the_buffers_classes_are_refused_before_a_draw():
    jm = _jm()
    x, y = _data()
    with pytest.raises(jem.InvalidInputError, match=r"3 classes and the model has 4"):
        jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(16, SHAPE, num_classes=3), pxy_weight=1.0)(jm, x, y)
    with pytest.raises(jem.errors.InvalidLabelError, match=r"\[0, 3\)"):
        jem.SGLD(steps=1).sample(jm, buffer=jem.ReplayBuffer(16, SHAPE, num_classes=3), y=torch.tensor([0, 3]))


def test_a_loss_whose_model_does_not_know_its_classes_bounds_labels_by_the_buffer():
    jm = jem.wrap(_net(), data_range=(-1.0, 1.0))  # num_classes unknown until a forward
    x, y = _data()
    y[0] = 7
    loss_fn = jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(16, SHAPE, num_classes=K), pxy_weight=1.0)
    with pytest.raises(jem.errors.InvalidLabelError, match=r"\[0, 4\)"):
        loss_fn(jm, x, y)


# ------------------------------------------------------------------ the sample shape: the trained size first
def _train_one_batch(jm: jem.JEM, shape) -> None:
    jm.train()
    x, y = _data(4, shape)
    jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(8, shape), px_weight=0.0)(jm, x, y)


@pytest.mark.parametrize("sampler", [jem.SGLD, PGDNegatives])
def test_samples_come_at_the_size_the_model_trained_on(sampler):
    jm = _jm(input_size=(1, 12, 12))  # the declared size, as a pretrained config declares one
    _train_one_batch(jm, SHAPE)
    with pytest.warns(UserWarning, match=r"sampling at \(1, 8, 8\)") as caught:
        x = sampler(steps=1).sample(jm, 3)
    assert x.shape == (3, *SHAPE)
    assert caught[0].filename == __file__  # the conflict is said at the user's line


def test_pgd_negatives_of_a_timm_network_trained_smaller_come_at_the_trained_size():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet10t", pretrained=False, num_classes=K)
    jm = jem.wrap(model)
    assert jm.domain.input_size != (3, 16, 16)  # timm's pretrained size
    _train_one_batch(jm, (3, 16, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        x = PGDNegatives(steps=1).sample(jm, 2)
    assert x.shape == (2, 3, 16, 16)


# ------------------------------------------------------------------ dtypes: inputs cast to the model's
def test_a_float64_start_on_a_float32_model_is_cast():
    jm = _jm()
    x, y = _data(4)
    out = jem.SGLD(steps=2, generator=torch.Generator().manual_seed(0)).sample(jm, x_init=x.double(), y=y)
    ref = jem.SGLD(steps=2, generator=torch.Generator().manual_seed(0)).sample(jm, x_init=x, y=y)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert PGDNegatives(steps=2).run(jm, x.double()).dtype == torch.float32


def test_a_float64_model_trains_with_jemloss_and_samples_in_float64():
    jm = _jm(_net().double())
    x, y = _data()
    for s in (jem.SGLD(steps=2), PGDNegatives(steps=2)):
        loss_fn = jem.JEMLoss(s, jem.ReplayBuffer(16, SHAPE, num_classes=K), pxy_weight=1.0)
        out = loss_fn(jm, x, y)  # float32 data, float32 buffer
        out.loss.backward()
        assert torch.isfinite(out.loss) and out.loss.dtype == torch.float64
        assert s.sample(jm, 3, shape=SHAPE).dtype == torch.float64
        assert s.sample(jm, x_init=x[:2]).dtype == torch.float64


def test_chain_dtype_follows_the_model():
    assert chains.chain_dtype(_jm()) == torch.float32
    assert chains.chain_dtype(_jm(_net().double())) == torch.float64


# ------------------------------------------------------------------ one spelling of the BatchNorm modes
@pytest.mark.parametrize("old", ["eval", "batch"])
def test_sampling_mode_takes_the_samplers_batchnorm_names_only(old):
    from jem_plugin.model import BATCHNORM_MODES, sampling_mode

    model = _net().train()
    bn = model[1]
    assert BATCHNORM_MODES == jem.sampling.BATCHNORM_MODES == ("joint", "separate")
    with sampling_mode(model, "joint"):
        assert not bn.training  # the running statistics
    with sampling_mode(model, "separate"):
        assert bn.training and not bn.track_running_stats  # the batch's own, the running ones untouched
    with pytest.raises(ValueError, match=r"batchnorm must be one of \('joint', 'separate'\)"):
        with sampling_mode(model, old):
            pass
    with pytest.raises(ValueError, match="batchnorm must be one of"):
        PGDNegatives(batchnorm=old)


def test_a_read_only_view_bounds_labels_as_its_buffer_does():
    jm = jem.wrap(_net(), data_range=(-1.0, 1.0))  # the model's classes unknown: the buffer's bound the labels
    view = jem.ReplayBuffer(16, SHAPE, num_classes=K).read_only()
    assert view.num_classes == K
    with pytest.raises(jem.errors.InvalidLabelError, match=r"\[0, 4\)"):
        jem.SGLD(steps=1).sample(jm, buffer=view, y=torch.tensor([0, 9]))


def test_a_samplers_generator_travels_with_the_loss():
    src = RandomWalk(steps=2, generator=torch.Generator().manual_seed(5))
    loss_fn = jem.JEMLoss(src, jem.ReplayBuffer(8, SHAPE))
    src.sample(_jm(), 3, shape=SHAPE)  # the generator moves on
    dst = RandomWalk(steps=2, generator=torch.Generator().manual_seed(0))
    jem.JEMLoss(dst, jem.ReplayBuffer(8, SHAPE)).load_state_dict(loss_fn.state_dict())
    assert torch.equal(dst.generator.get_state(), src.generator.get_state())
    assert torch.equal(dst.sample(_jm(), 3, shape=SHAPE), src.sample(_jm(), 3, shape=SHAPE))


class ListBuffer:
    """A user's buffer, written against what a sampler asks of one: sample(n, domain=, y=,
    generator=) -> (x, idx) and update(idx, x); its chains live on the CPU."""

    def __init__(self, n: int) -> None:
        self.data = torch.zeros(n, *SHAPE)
        self.sample_shape = SHAPE

    def sample(self, n, *, domain, y=None, generator=None):
        idx = torch.randint(0, self.data.shape[0], (n,), generator=generator)
        return self.data[idx].clone(), idx

    def update(self, idx, x):
        self.data[idx] = x.detach().cpu()


def test_a_users_buffer_gives_starts_and_keeps_the_chains():
    jm = _jm()
    buffer = ListBuffer(6)
    x, y = _data()
    out = jem.JEMLoss(GradientWalk(steps=2), buffer, n_samples=6)(jm, x, y)
    assert torch.isfinite(out.loss) and buffer.data.abs().sum() > 0  # the chains were written back
    drawn = jem.SGLD(steps=1).sample(jm, 4, buffer=buffer)
    assert drawn.shape == (4, *SHAPE)
    with pytest.raises(ValueError, match="say how many samples"):
        jem.SGLD(steps=1).sample(jm)
