"""JEMLoss only computes: the buffer, the init's fit, the sampler's settings and SAM's replay are
explicit calls."""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin._train_state import History, TrainState
from jem_plugin.buffer import ReadOnlyBuffer, ReplayBuffer
from jem_plugin.builtins.init_distributions import GaussianInit
from jem_plugin.covariance import LowRank
from jem_plugin.errors import InvalidInputError
from jem_plugin.extensions import FitInitFromBatches
from jem_plugin.inits import Gaussian
from jem_plugin.losses import JEMLoss
from jem_plugin.sampling import SGLD

K = 3
SHAPE = (1, 4, 4)


def _net(seed: int = 0, bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(16, 16)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    return nn.Sequential(*layers, nn.SiLU(), nn.Linear(16, K))


def _jm(seed: int = 0, bn: bool = False):
    return jem.wrap(_net(seed, bn), data_range=(-1, 1), input_size=SHAPE, num_classes=K)


def _batches(n: int = 6, size: int = 8, seed: int = 0):
    """``n`` batches of ``size`` examples; the first holds only classes 0 and 1 (class 2 missing)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        y = torch.arange(size) % (2 if i == 0 else K)
        x = (y.view(-1, 1, 1, 1) - 1) * 0.4 + 0.2 * torch.randn(size, *SHAPE, generator=g)
        out.append((x.clamp(-1, 1), y))
    return out


def _through_checkpoint(state: dict) -> dict:
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


class _NoWarnings(warnings.catch_warnings):
    """Every warning raised in the block is an error (not only the ones pytest shows)."""

    def __enter__(self):
        out = super().__enter__()
        warnings.simplefilter("error")
        return out


# ---------------------------------------------------------------- the explicit path
def test_forward_with_an_explicit_buffer_and_a_fitted_init_warns_nothing_and_builds_nothing(monkeypatch):
    jm = _jm()
    x_fit, y_fit = torch.cat([b[0] for b in _batches()]), torch.cat([b[1] for b in _batches()])
    buffer = ReplayBuffer(30, SHAPE, init=Gaussian(), num_classes=K).fit(x_fit, y_fit)
    sampler = SGLD(steps=2, generator=torch.Generator().manual_seed(1))
    loss_fn = JEMLoss(sampler, buffer, pxy_weight=1.0, l2_weight=0.1)
    fits, init_mean = buffer.fit_count, buffer.init_dist.mean.clone()

    def refuse(*args, **kwargs):
        raise AssertionError("JEMLoss.forward built or fitted something")

    monkeypatch.setattr(ReplayBuffer, "__init__", refuse)  # no buffer is built
    monkeypatch.setattr(ReplayBuffer, "fit", refuse)  # nor fitted
    monkeypatch.setattr(GaussianInit, "fit", refuse)
    x, y = _batches()[1]
    with _NoWarnings():
        loss_fn(jm, x, y).loss.backward()
        loss_fn(jm, x, y)
        loss_fn.eval()
        loss_fn(jm, x, y)
    assert loss_fn.buffer is buffer and loss_fn.sampler is sampler
    assert buffer.fit_count == fits and torch.equal(buffer.init_dist.mean, init_mean)
    assert sampler.colour_projection is None  # the loss set nothing on its sampler


def test_a_loss_that_draws_samples_without_a_buffer_names_the_explicit_call():
    jm = _jm()
    x, y = _batches()[1]
    with pytest.raises(InvalidInputError, match=re.escape("ReplayBuffer.for_model(jm, class_conditional=True)")):
        JEMLoss(SGLD(steps=1), pxy_weight=1.0)(jm, x, y)
    with pytest.raises(InvalidInputError, match=re.escape("ReplayBuffer.for_model(jm))")):
        JEMLoss(SGLD(steps=1))(jm, x, y)
    assert JEMLoss(SGLD(steps=1), px_weight=0.0)(jm, x, y).metrics["ce"] > 0  # cross-entropy alone draws nothing
    with _NoWarnings():
        explicit = ReplayBuffer.for_model(jm, class_conditional=True)
    assert explicit.config() == ReplayBuffer(10000, SHAPE, 0.05, num_classes=K).config()
    assert ReplayBuffer.for_model(jm, (1, 4, 4)).num_classes is None
    with pytest.raises(InvalidInputError, match="sample_shape"):
        ReplayBuffer.for_model(jem.wrap(_net(), data_range=(-1, 1)))
    with pytest.raises(InvalidInputError, match="num_classes=K"):
        ReplayBuffer.for_model(jem.wrap(_net(), data_range=(-1, 1)), SHAPE, class_conditional=True)


# ---------------------------------------------------------------- fitting the init from batches
def _doubling_fit_means(batches, examples: int) -> list[torch.Tensor | None]:
    """A fit from the first batches, by hand: keep the batches, fit (missing classes pooled) at
    the first batch and each time the examples double, until ``examples`` are held.
    The fitted mean after each batch (``None`` before the first fit)."""
    init, held, next_fit, done, means = GaussianInit(), [], 0, False, []
    for x, y in batches:
        if not done:
            held.append((x.clone(), y.clone()))
            n = sum(b.shape[0] for b, _ in held)
            if n >= next_fit:
                init.fit(torch.cat([b for b, _ in held]), torch.cat([c for _, c in held]), K, pool_missing=True)
                done, next_fit = n >= examples, 2 * n
        means.append(init.mean.clone() if init.fitted else None)
    return means


def test_fit_init_from_batches_refits_as_the_examples_double_bit_for_bit():
    batches = _batches()
    reference = _doubling_fit_means(batches, examples=32)
    assert [m is not None for m in reference] == [True] * 6
    assert sum(not torch.equal(a, b) for a, b in zip(reference, reference[1:])) == 2  # refits at 16 and 32

    jm = _jm()
    buffer = ReplayBuffer(30, SHAPE, init=Gaussian(), num_classes=K)
    loss_fn = JEMLoss(SGLD(steps=1), buffer, data_noise=0.0)
    ext = FitInitFromBatches(buffer, examples=32)
    with _NoWarnings():
        for i, (x, y) in enumerate(batches):
            fits = buffer.fit_count
            ext.on_batch(None, x, y)  # what a hand-written loop calls before its step
            if buffer.fit_count != fits:
                assert not buffer.has_samples, "the chains are redrawn from the new fit"
            loss_fn(jm, x, y)
            assert torch.equal(buffer.init_dist.mean, reference[i])
    assert buffer.fit_count == 3
    ext2, buffer2 = FitInitFromBatches(examples=32), ReplayBuffer(30, SHAPE, init=Gaussian(), num_classes=K)
    assert [ext2.observe(buffer2, x, y) for x, y in batches] == [True, True, False, True, False, False]


def test_fit_init_from_batches_in_fit_reads_the_loss_buffer_and_yields_to_a_users_fit():
    jm = _jm()
    buffer = ReplayBuffer(30, SHAPE, init=Gaussian(), num_classes=K)
    loss_fn = JEMLoss(SGLD(steps=1), buffer)
    state = TrainState(jm, torch.optim.SGD(jm.parameters(), lr=0.1), None, loss_fn, History())
    ext = FitInitFromBatches()
    batches = _batches()
    ext.on_batch(state, *batches[0])
    assert buffer.init_dist.fitted and buffer.fit_count == 1
    x_user, y_user = torch.full((6, *SHAPE), 0.5), torch.tensor([0, 1, 2, 0, 1, 2])
    buffer.fit(x_user, y_user)  # the user fits: the batches collected so far are dropped
    for x, y in batches[1:]:
        assert not ext.observe(buffer, x, y)
    assert float(buffer.init_dist.mean.min()) == 0.5
    with pytest.raises(TypeError, match=r"FitInitFromBatches\(buffer\)"):
        FitInitFromBatches().on_batch(None, *batches[0])
    with pytest.raises(ValueError, match="examples"):
        FitInitFromBatches(examples=-1)


# ---------------------------------------------------------------- the sampler's settings
@pytest.mark.parametrize("mode", ["joint", "separate"])
def test_batchnorm_is_the_samplers_one_knob(mode):
    """The loss reads SGLD(batchnorm=): "separate" leaves the data's logits and running
    statistics to the data alone, "joint" mixes the samples in."""
    x, y = _batches()[1]
    far = torch.full((8, *SHAPE), 0.99)

    class Far(SGLD):  # SGLD's settings, fixed samples far from the data
        def sample(self, jm, n=None, **kwargs):
            return far[:n].clone()

    jm = _jm(bn=True)
    with _NoWarnings():
        loss_fn = JEMLoss(Far(batchnorm=mode), ReplayBuffer(8, SHAPE), data_noise=0.0)
        out = loss_fn(jm, x, y)
    assert loss_fn.batchnorm == mode
    ref = _net(bn=True)
    alone = ref(x).detach()
    assert torch.allclose(out.logits.detach(), alone) is (mode == "separate")


def test_a_users_sampler_says_how_its_samples_pass_batchnorm_or_is_joint():
    class Plain:  # a user's sampler that says nothing about BatchNorm
        def sample(self, jm, n=None, **kwargs):
            return torch.zeros(n, *SHAPE)

    assert JEMLoss(Plain()).batchnorm == "joint"
    separate = Plain()
    separate.batchnorm = "separate"  # a user's sampler may say
    assert JEMLoss(separate).batchnorm == "separate"
    separate.batchnorm = "eval"  # the names are joint/separate only
    with pytest.raises(InvalidInputError, match="joint"):
        JEMLoss(separate).batchnorm  # noqa: B018  (the property raises)


@pytest.mark.parametrize("sampler_clamp", [True, False])
def test_the_data_noise_stays_in_the_domain_exactly_when_the_sampler_clamps(sampler_clamp):
    jm = jem.wrap(_net(), data_range=(-1, 1), input_size=SHAPE, num_classes=K)
    x, y = torch.ones(8, *SHAPE), torch.arange(8) % K  # saturated: noise leaves the domain unless clamped
    loss_fn = JEMLoss(SGLD(steps=1, clamp=sampler_clamp), ReplayBuffer(8, SHAPE), data_noise=0.3)
    assert loss_fn.clamps_data() is sampler_clamp
    seen = []
    jm.model.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().clone()))
    with _NoWarnings():
        loss_fn(jm, x, y)
    assert bool((seen[-1][:8] <= 1).all()) is sampler_clamp


# ---------------------------------------------------------------- validation reads the buffer
@pytest.mark.parametrize("colours", ["data", "all"])
def test_validation_starts_from_a_read_only_view_in_the_datas_colours(colours):
    """Eval mode: the chains start from the buffer, drawn with the loss's generator, and with
    SGLD(colours="data") move in the colour axes of the data it was fitted on (grey data: grey
    steps); the buffer is not written."""
    shape = (3, 4, 4)
    g = torch.Generator().manual_seed(0)
    grey = (torch.rand(30, 1, 4, 4, generator=g) - 0.5).expand(30, 3, 4, 4).contiguous()
    y = torch.arange(30) % K
    buffer = ReplayBuffer(30, shape, init=Gaussian(scale=0.1), num_classes=K).fit(grey, y)
    twin = copy.deepcopy(buffer)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, K))
    jm = jem.wrap(model, data_range=(-1, 1), input_size=shape, num_classes=K)
    sampler = SGLD(steps=3, step_size=0.01, noise=0.05, colours=colours, generator=torch.Generator().manual_seed(1))
    loss_fn = JEMLoss(sampler, buffer, generator=torch.Generator().manual_seed(2)).eval()
    seen = []
    jm.model.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().clone()))
    with _NoWarnings():
        loss_fn(jm, grey[:6], y[:6])
    data = buffer.data.clone()
    x0, _ = twin.sample(6, domain=jm.domain, generator=torch.Generator().manual_seed(2))  # the same starts
    steps = seen[-1][6:] - x0
    off_grey = float((steps - steps.mean(1, keepdim=True)).abs().max())
    assert (off_grey < 1e-5) is (colours == "data"), off_grey
    with _NoWarnings():
        loss_fn(jm, grey[:6], y[:6])
    assert torch.equal(buffer.data, data), "validation never writes the buffer"
    view = buffer.read_only(torch.Generator().manual_seed(2))
    assert isinstance(view, ReadOnlyBuffer)
    x1, _ = view.sample(6, domain=jm.domain, generator=torch.Generator().manual_seed(99))  # its own generator
    x2, _ = buffer.sample(6, domain=jm.domain, generator=torch.Generator().manual_seed(2))
    assert torch.equal(x1, x2)
    view.update(torch.arange(6), torch.zeros(6, *shape))
    assert torch.equal(buffer.data, data)


# ---------------------------------------------------------------- checkpoints
def test_typed_covariance_round_trips_through_a_weights_only_jem_loss_checkpoint():
    x, y = torch.cat([b[0] for b in _batches()]), torch.cat([b[1] for b in _batches()])
    spec = Gaussian(covariance=LowRank(rank=4, residual=0.5), jitter=1e-3)
    src = JEMLoss(SGLD(steps=1), ReplayBuffer(30, SHAPE, init=spec, num_classes=K).fit(x, y))
    src(_jm(), x[:8], y[:8])
    state = _through_checkpoint(src.state_dict())
    with _NoWarnings():
        dst = JEMLoss()
        dst.load_state_dict(state)
    assert dst.buffer.init_spec == spec and dst.buffer.init_dist.covariance == LowRank(rank=4, residual=0.5)
    assert torch.equal(dst.buffer.init_dist.factor, src.buffer.init_dist.factor)
    assert torch.equal(dst.buffer.data, src.buffer.data)
