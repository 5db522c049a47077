"""Replay buffer: lazy init, reinit frequency, class segments, init distributions, state, grid PNG."""

from __future__ import annotations

import io
import math
import re
import warnings

import numpy as np
import pytest
import torch

import jem_plugin as jem
from jem_plugin.adapter import IMAGENET_MEAN, IMAGENET_STD, InputDomain
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.builtins.init_distributions import GaussianInit
from jem_plugin.covariance import Diagonal, Full, LowRank, Stationary
from jem_plugin.errors import CheckpointError, InvalidInputError, InvalidLabelError, JEMError, UnknownNameError
from jem_plugin.inits import Gaussian, Normal

SHAPE = (1, 8, 8)
DOMAIN = InputDomain()  # [-1, 1]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def roundtrip(state: dict) -> dict:
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)  # loading never executes code from the file


# ---------------------------------------------------------------- drawing
def test_lazy_init_from_the_domain_and_registered_buffers():
    domain = InputDomain.from_normalization(IMAGENET_MEAN, IMAGENET_STD)
    buf = ReplayBuffer(50, (3, 4, 4))
    assert not buf.initialized and {"data", "labels", "initialized"} <= set(buf.state_dict())
    assert buf.data.dtype == torch.float32 and buf.data.shape == (50, 3, 4, 4)
    x, idx = buf.sample(10, domain=domain, generator=gen())
    assert buf.initialized and x.shape == (10, 3, 4, 4) and idx.shape == (10,)
    lo, hi = domain.bounds(buf.data)
    assert (buf.data >= lo).all() and (buf.data <= hi).all()
    # per channel: each channel spans its own range
    for c in range(3):
        assert buf.data[:, c].min() < lo.flatten()[c] + 0.1 and buf.data[:, c].max() > hi.flatten()[c] - 0.1


@pytest.mark.parametrize("rho", [0.0, 0.2, 1.0])
def test_reinit_frequency(rho):
    buf = ReplayBuffer(100, SHAPE, reinit_freq=rho)
    buf.initialize(DOMAIN)
    buf.data.fill_(5.0)  # outside the domain: restarted chains are recognisable
    n, draws = 500, 8
    fresh = 0
    g = gen(1)
    for _ in range(draws):
        x, _ = buf.sample(n, domain=DOMAIN, generator=g)
        fresh += int((x.flatten(1)[:, 0] != 5.0).sum())
    total = n * draws
    sd = math.sqrt(total * rho * (1 - rho))
    assert abs(fresh - rho * total) <= 4 * sd + 1e-9  # binomial, 4 standard deviations


def test_update_writes_chains_back():
    buf = ReplayBuffer(30, SHAPE, reinit_freq=0.0)
    x, idx = buf.sample(5, domain=DOMAIN, generator=gen())
    assert torch.equal(x, buf.data[idx])  # drawn from the stored slots
    buf.update(idx, torch.full_like(x, 0.5))
    assert (buf.data[idx] == 0.5).all()
    assert int((buf.data == 0.5).all(dim=(1, 2, 3)).sum()) == len(set(idx.tolist()))
    with pytest.raises(InvalidInputError, match="shape"):
        buf.update(idx, torch.zeros(5, 2, 8, 8))


def test_class_segments():
    buf = ReplayBuffer(100, SHAPE, num_classes=10)
    assert torch.equal(buf.labels, torch.arange(10).repeat_interleave(10))  # contiguous, even
    y = torch.arange(10).repeat(30)
    _, idx = buf.sample(domain=DOMAIN, y=y, generator=gen())
    assert torch.equal(buf.labels[idx], y)
    assert len(set(idx[y == 3].tolist())) == 10  # the whole segment is reachable
    # capacity not divisible by the classes: contiguous segments differing by at most one
    odd = ReplayBuffer(105, SHAPE, num_classes=10)
    sizes = torch.bincount(odd.labels)
    assert sizes.sum() == 105 and sizes.max() - sizes.min() <= 1
    assert (odd.labels.diff() >= 0).all()
    _, idx = odd.sample(domain=DOMAIN, y=torch.full((200,), 9), generator=gen())
    assert (odd.labels[idx] == 9).all()


def test_label_validation():
    buf = ReplayBuffer(20, SHAPE, num_classes=4)
    with pytest.raises(InvalidLabelError, match=r"\[0, 4\)"):
        buf.sample(domain=DOMAIN, y=torch.tensor([0, 4]))
    with pytest.raises(InvalidLabelError, match="integer"):
        buf.sample(domain=DOMAIN, y=torch.tensor([0.5]))
    with pytest.raises(InvalidLabelError, match="num_classes"):
        ReplayBuffer(20, SHAPE).sample(domain=DOMAIN, y=torch.tensor([0]))
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(3, SHAPE, num_classes=4)
    with pytest.raises(ValueError, match="reinit_freq"):
        ReplayBuffer(10, SHAPE, reinit_freq=1.5)


# ---------------------------------------------------------------- init distributions
def class_data(n_per=200, k=3, seed=0):
    g = gen(seed)
    means = torch.tensor([-0.5, 0.0, 0.5])[:k]
    x = torch.cat([m + 0.1 * torch.randn(n_per, *SHAPE, generator=g) for m in means])
    y = torch.arange(k).repeat_interleave(n_per)
    return x, y, means


def test_gaussian_init_fit_reproduces_class_means():
    x, y, means = class_data()
    buf = ReplayBuffer(300, SHAPE, num_classes=3, init=Gaussian()).fit(x, y)
    fitted = buf.init_dist.mean.view(3, -1).mean(1)
    torch.testing.assert_close(fitted, means, atol=0.01, rtol=0)
    draws = buf.init_dist.sample(3000, SHAPE, DOMAIN, gen(2), "cpu", y=torch.arange(3).repeat(1000))
    per_class = draws.view(1000, 3, -1).mean(dim=(0, 2))
    torch.testing.assert_close(per_class, means, atol=0.01, rtol=0)
    assert abs(draws.view(1000, 3, -1).std(dim=(0, 2)).mean() - 0.1) < 0.01
    # the buffer's segments start from their own class's Gaussian
    buf.initialize(DOMAIN, gen(3))
    seg_means = buf.data.view(3, 100, -1).mean(dim=(1, 2))
    torch.testing.assert_close(seg_means, means, atol=0.02, rtol=0)
    # unconditional draws mix the classes
    mixed = buf.init_dist.sample(3000, SHAPE, DOMAIN, gen(4), "cpu").flatten(1).mean(1)
    for m in means:
        assert ((mixed - m).abs() < 0.05).float().mean() > 0.2


def test_gaussian_full_covariance_keeps_pixel_correlations():
    g = gen(0)
    base = 0.3 * torch.randn(400, 1, generator=g)
    x = (base + 0.01 * torch.randn(400, 64, generator=g)).view(400, *SHAPE)  # all pixels move together
    y = torch.zeros(400, dtype=torch.long)
    full = GaussianInit(covariance=Full()).fit(x, y)
    diag = GaussianInit().fit(x, y)
    corr = lambda s: torch.corrcoef(s.flatten(1)[:, :2].T)[0, 1]
    assert corr(full.sample(2000, SHAPE, DOMAIN, gen(1), "cpu")) > 0.95
    assert abs(corr(diag.sample(2000, SHAPE, DOMAIN, gen(1), "cpu"))) < 0.1


def test_lowrank_covariance_equals_full_when_fitted_on_few_examples():
    """Fitted on fewer examples per class than its rank (JEMLoss's fit on one batch), the low-rank
    Gaussian is the full one: the same covariance, hence the same distribution."""
    g = gen(0)
    x, y = torch.randn(14, *SHAPE, generator=g), torch.tensor([0] * 6 + [1] * 8)
    full = GaussianInit(covariance=Full()).fit(x, y)
    low = GaussianInit(covariance=LowRank(rank=16)).fit(x, y)
    eye = torch.eye(64)
    for c in range(2):
        implied = low.factor[c] @ low.factor[c].T + low.std[c] ** 2 * eye
        torch.testing.assert_close(implied, full.scale_tril[c] @ full.scale_tril[c].T, atol=1e-5, rtol=1e-4)


def test_lowrank_covariance_keeps_leading_directions_and_total_variance():
    """Rank 2 on data spread along two directions plus pixel noise: draws keep those directions'
    variances; the rest comes back as isotropic noise (total variance unchanged), a share of it
    (residual=0.25), or none (residual=0)."""
    g = gen(0)
    dirs = torch.linalg.qr(torch.randn(64, 2, generator=g))[0]  # orthonormal [64, 2]
    x = (torch.randn(3000, 2, generator=g) * torch.tensor([0.3, 0.2])) @ dirs.T
    x = (x + 0.05 * torch.randn(3000, 64, generator=g)).view(3000, *SHAPE)
    y = torch.zeros(3000, dtype=torch.long)
    outside = lambda s: s - s.mean(0) - (s - s.mean(0)) @ dirs @ dirs.T  # off the two directions
    low = GaussianInit(covariance=LowRank(rank=2)).fit(x, y)
    draws = low.sample(20000, SHAPE, DOMAIN, gen(1), "cpu").flatten(1)
    torch.testing.assert_close(
        ((draws - low.mean[0]) @ dirs).std(0), ((x.flatten(1) - low.mean[0]) @ dirs).std(0), atol=0.01, rtol=0
    )
    torch.testing.assert_close(draws.var(0).sum(), x.flatten(1).var(0).sum(), atol=0.01, rtol=0.02)
    assert abs(outside(draws).std() - 0.05) < 0.005
    span = GaussianInit(covariance=LowRank(rank=2, residual=0.0)).fit(x, y)
    assert outside(span.sample(2000, SHAPE, DOMAIN, gen(1), "cpu").flatten(1)).std() < 0.011
    quarter = GaussianInit(covariance=LowRank(rank=2, residual=0.25)).fit(x, y)
    assert abs(outside(quarter.sample(2000, SHAPE, DOMAIN, gen(1), "cpu").flatten(1)).std() - 0.027) < 0.003
    diag = GaussianInit().fit(x, y).sample(20000, SHAPE, DOMAIN, gen(1), "cpu").flatten(1)
    along = lambda s: ((s - s.mean(0)) @ dirs[:, 0]).std()
    assert along(diag) < 0.1 < along(draws), "a diagonal covariance loses the direction"


def test_lowrank_covariance_fits_where_full_is_refused_and_round_trips():
    """At 3x224x224 the full covariance is refused; the low-rank one fits, draws and saves."""
    x, y = torch.rand(6, 3, 224, 224, generator=gen(0)) * 2 - 1, torch.tensor([0, 1, 2, 0, 1, 2])
    buf = ReplayBuffer(6, (3, 224, 224), init=Gaussian(covariance=LowRank(rank=8)), num_classes=3).fit(x, y)
    # two examples per class give two directions: the factor stores two columns, not eight
    assert buf.init_dist.factor.shape == (3, 3 * 224 * 224, 2) and "rank=8" in repr(buf.init_dist)
    new = ReplayBuffer(6, (3, 224, 224), init=Gaussian(covariance=LowRank(rank=8)), num_classes=3)
    new.load_state_dict(roundtrip(buf.state_dict()))
    a = buf.init_dist.sample(4, (3, 224, 224), DOMAIN, gen(5), "cpu", y=torch.tensor([2, 0, 1, 2]))
    b = new.init_dist.sample(4, (3, 224, 224), DOMAIN, gen(5), "cpu", y=torch.tensor([2, 0, 1, 2]))
    assert torch.equal(a, b) and a.min() >= -1 and a.max() <= 1
    with pytest.raises(ValueError, match="rank"):
        LowRank(rank=0)
    with pytest.raises(ValueError, match="residual"):
        LowRank(residual=2.0)


def test_stationary_covariance_keeps_each_class_mean_and_the_data_power_spectrum():
    """covariance=Stationary(): draws have the class's mean and its power spectrum
    (smooth data give smooth draws, unlike the diagonal init's white noise), and grey data give
    grey draws (one colour rotation for all classes)."""
    g = gen(0)
    grey = torch.nn.functional.avg_pool2d(torch.randn(300, 1, 20, 20, generator=g), 5, 1)  # smooth, 16x16
    y = torch.arange(300) % 2
    x = grey.expand(300, 3, 16, 16) + 2.0 * y.view(-1, 1, 1, 1) * torch.tensor([1.0, 0.5, 0.0]).view(1, 3, 1, 1)
    wide = InputDomain((-9.0,), (9.0,))
    yy = torch.ones(2000, dtype=torch.long)
    draws = {
        name: GaussianInit(covariance=cov).fit(x, y).sample(2000, (3, 16, 16), wide, g, "cpu", y=yy)
        for name, cov in (("stationary", Stationary()), ("diagonal", Diagonal()))
    }
    d, data = draws["stationary"], x[y == 1]
    assert torch.allclose(d.mean(0), data.mean(0), atol=0.05)  # the class mean
    centred = d - d.mean(0)
    assert (centred[:, 0] - centred[:, 1]).abs().max() < 1e-4  # grey stays grey
    power = lambda t: torch.fft.fft2(t[:, 0] - t[:, 0].mean(0)).abs().square().mean(0)
    ratio = power(d) / power(data)
    low, high = ratio[:2, :2].mean(), ratio[6:10, 6:10].mean()
    assert 0.8 < low < 1.25 and 0.5 < high < 2.0  # the same spectrum
    jumps = lambda t: float((t[..., 1:] - t[..., :-1]).abs().mean() / (t - t.mean(0)).abs().mean())
    assert jumps(d) < 0.6 * jumps(draws["diagonal"])  # as smooth as the data


def test_stationary_covariance_round_trips_at_any_size_and_refuses_non_images():
    """D numbers per class at 3x224x224 (where full is refused); saved and loaded with the buffer;
    one-line errors for inputs that are not images and for samples of another image shape."""
    x, y = torch.rand(6, 3, 224, 224, generator=gen(0)) * 2 - 1, torch.tensor([0, 1, 2, 0, 1, 2])
    init = Gaussian(covariance=Stationary())
    buf = ReplayBuffer(6, (3, 224, 224), init=init, num_classes=3).fit(x, y)
    assert buf.init_dist.std.shape == (3, 3, 224, 224) and buf.init_dist.colour.shape == (3, 3)
    new = ReplayBuffer(6, (3, 224, 224), init=init, num_classes=3)
    new.load_state_dict(roundtrip(buf.state_dict()))
    a = buf.init_dist.sample(4, (3, 224, 224), DOMAIN, gen(5), "cpu", y=torch.tensor([2, 0, 1, 2]))
    b = new.init_dist.sample(4, (3, 224, 224), DOMAIN, gen(5), "cpu", y=torch.tensor([2, 0, 1, 2]))
    assert torch.equal(a, b) and a.min() >= -1 and a.max() <= 1
    with pytest.raises(InvalidInputError, match=r"needs images \[N, C, H, W\]"):
        GaussianInit(covariance=Stationary()).fit(torch.randn(10, 5), torch.arange(10) % 2)
    with pytest.raises(InvalidInputError, match=r"fitted on images of shape \(3, 224, 224\)"):
        buf.init_dist.sample(2, (3, 112, 448), DOMAIN)
    with pytest.raises(ValueError, match=r"Stationary\(\)"):
        GaussianInit(covariance="circulant")


def test_lowrank_covariance_too_large_for_memory_is_refused_with_the_rank_that_fits(monkeypatch):
    """rank 8 for 1000 classes at 3x224x224 takes 4.5 GiB: refused with the largest rank that fits
    (here the cap is lowered so that 3 classes of 64 values at rank 4 pass it)."""
    import jem_plugin.builtins.init_distributions as init_module

    monkeypatch.setattr(init_module, "COVARIANCE_MAX_BYTES", 3 * 64 * 4 * 3)
    x, y, _ = class_data()
    with pytest.raises(InvalidInputError, match=r"rank-8 covariance for 3 classes of 64 values.*use rank <= 3"):
        GaussianInit(covariance=LowRank(rank=8)).fit(x, y)
    assert GaussianInit(covariance=LowRank(rank=3)).fit(x, y).factor.shape == (3, 64, 3)


def test_full_covariance_too_large_for_memory_is_refused_in_one_line():
    """jempp's full covariance at 224x224 would ask for 844 GiB: a clear error, not an OOM kill."""
    x = torch.zeros(4, 3, 224, 224)
    with pytest.raises(InvalidInputError, match=r"needs \d+\.\d GiB.*covariance=LowRank\(\) or Diagonal\(\)"):
        GaussianInit(covariance=Full()).fit(x, torch.tensor([0, 1, 0, 1]))
    buf = ReplayBuffer(4, (3, 224, 224), init=Gaussian(), num_classes=2).fit(x, torch.tensor([0, 1, 0, 1]))
    assert buf.init_dist.fitted, "the diagonal covariance fits at that size"


def test_gaussian_samples_are_clamped_and_errors_are_clear():
    x, y, _ = class_data()
    wide = GaussianInit(scale=50.0).fit(x, y)
    s = wide.sample(100, SHAPE, DOMAIN, gen(), "cpu")
    assert s.min() >= -1 and s.max() <= 1 and (s.abs() == 1).any()
    with pytest.raises(JEMError, match="fit"):
        ReplayBuffer(10, SHAPE, init=Gaussian()).sample(2, domain=DOMAIN)
    with pytest.raises(InvalidLabelError, match="classes"):
        GaussianInit().fit(x, y, num_classes=5)  # classes 3 and 4 have no examples
    with pytest.raises(InvalidInputError, match="sample_shape"):
        ReplayBuffer(10, SHAPE, init=Gaussian()).fit(x.view(-1, 64), y)
    with pytest.raises(JEMError, match="nothing to fit"):
        ReplayBuffer(10, SHAPE).fit(x, y)


def test_unknown_init_lists_available_ones():
    with pytest.raises(UnknownNameError) as err:
        ReplayBuffer(10, SHAPE, init="perlin")
    assert all(name in str(err.value) for name in ("uniform", "gaussian", "normal"))


def test_normal_init_and_user_callable():
    buf = ReplayBuffer(400, SHAPE, init=Normal(std=0.2))
    buf.initialize(DOMAIN, gen())
    assert abs(buf.data.std() - 0.2) < 0.01
    calls = []

    def ramp(n, shape, domain, generator, device, y=None):
        calls.append(None if y is None else y.clone())
        return torch.linspace(-1, 1, n).view(n, *[1] * len(shape)).expand(n, *shape).clone()

    cond = ReplayBuffer(20, SHAPE, num_classes=2, init=ramp)
    cond.sample(domain=DOMAIN, y=torch.tensor([0, 1]))
    assert torch.equal(cond.data[:, 0, 0, 0], torch.linspace(-1, 1, 20))
    assert torch.equal(calls[0], cond.labels)  # the init draw knows each slot's class


class ZerosPlugin:
    """A third-party init distribution, registered through the hook."""

    class Zeros:
        def sample(self, n, shape, domain, generator=None, device=None, y=None):
            return torch.zeros(n, *shape, device=device)

    @jem.hookimpl
    def jem_register_init_distributions(self, register):
        register("zeros", lambda **kw: self.Zeros())


def test_init_distribution_from_a_plugin():
    jem.register(ZerosPlugin(), name="zeros-init")
    try:
        buf = ReplayBuffer(10, SHAPE, init="zeros")
        buf.sample(3, domain=DOMAIN)
        assert (buf.data == 0).all()
    finally:
        jem.unregister(name="zeros-init")
    with pytest.raises(UnknownNameError):
        ReplayBuffer(10, SHAPE, init="zeros")


# ---------------------------------------------------------------- state
def test_state_dict_round_trip_is_bitwise():
    x, y, _ = class_data()
    buf = ReplayBuffer(60, SHAPE, num_classes=3, init=Gaussian(), reinit_freq=0.3).fit(x, y)
    buf.sample(domain=DOMAIN, y=torch.tensor([0, 1, 2]), generator=gen())
    buf.update(torch.tensor([0, 1]), torch.full((2, *SHAPE), 0.123))
    new = ReplayBuffer(60, SHAPE, num_classes=3, init=Gaussian(), reinit_freq=0.3)
    new.load_state_dict(roundtrip(buf.state_dict()))
    for key, value in buf.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, new.state_dict()[key]), key
    assert new.initialized and "initialized=True" in repr(new)
    a = buf.sample(domain=DOMAIN, y=torch.tensor([2, 0]), generator=gen(9))
    b = new.sample(domain=DOMAIN, y=torch.tensor([2, 0]), generator=gen(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_mismatched_checkpoints_raise_checkpoint_error():
    state = roundtrip(ReplayBuffer(20, SHAPE).state_dict())
    with pytest.raises(CheckpointError, match="sample_shape"):
        ReplayBuffer(20, (3, 8, 8)).load_state_dict(state)
    with pytest.raises(CheckpointError, match="capacity=20"):
        ReplayBuffer(40, SHAPE).load_state_dict(state)
    with pytest.raises(CheckpointError, match="num_classes"):
        ReplayBuffer(20, SHAPE, num_classes=2).load_state_dict(state)
    with pytest.raises(CheckpointError, match="init"):
        ReplayBuffer(20, SHAPE, init=Normal()).load_state_dict(state)
    # also when the buffer is nested inside another module's checkpoint
    outer = torch.nn.Module()
    outer.buffer = ReplayBuffer(20, (3, 8, 8))
    with pytest.raises(CheckpointError):
        outer.load_state_dict({"buffer." + k: v for k, v in state.items()})


# ---------------------------------------------------------------- looking at it
def test_a_grid_of_the_buffers_chains_is_a_nontrivial_png(tmp_path):
    import matplotlib.image as mpimg

    from jem_plugin.viz import save_samples

    buf = ReplayBuffer(100, SHAPE, num_classes=10)
    buf.sample(domain=DOMAIN, y=torch.arange(10), generator=gen())
    # stripes whose brightness is the class index: a visibly structured grid
    buf.data.copy_(torch.linspace(-1, 1, 10).repeat_interleave(10).view(100, 1, 1, 1).expand_as(buf.data))
    buf.data[:, :, ::2] *= -1
    path = save_samples(buf.samples(64), tmp_path / "grid" / "buffer.png", domain=DOMAIN, nrow=8)
    img = mpimg.imread(path)
    assert img.shape[:2] == (8 * 10 + 2, 8 * 10 + 2)  # 8x8 tiles of 8 px plus 2 px padding
    assert np.std(img) > 0.1 and len(np.unique(img)) >= 8
    assert buf.samples(5, y=3).shape == (5, *SHAPE) and (buf.samples(y=3) == buf.data[30:40]).all()
    with pytest.raises(JEMError, match="no samples yet"):
        ReplayBuffer(10, SHAPE).samples()


def test_repr_names_the_configuration():
    r = repr(ReplayBuffer(64, SHAPE, reinit_freq=0.1, num_classes=4))
    for part in ("capacity=64", "sample_shape=(1, 8, 8)", "reinit_freq=0.1", "init=Uniform()", "num_classes=4"):
        assert part in r


# ---------------------------------------------------------------- typed covariance and init specs
def test_the_covariance_is_typed_and_the_init_a_spec():
    for old in ("full", "lowrank"):  # the strings before the typed values
        with pytest.raises(ValueError, match=r"Stationary\(\) from jem_plugin.covariance"):
            GaussianInit(covariance=old)
    for old in ("rank", "residual"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            GaussianInit(**{old: 1})
    for old in ("init_kwargs", "auto_fit_examples"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            ReplayBuffer(12, SHAPE, init="gaussian", **{old: None})
    assert not hasattr(ReplayBuffer(12, SHAPE), "fit_if_unfitted")  # FitInitFromBatches does it


def test_a_registered_name_alone_is_silent_and_means_the_default_spec():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf = ReplayBuffer(12, SHAPE, init="gaussian", num_classes=3)
    assert buf.init_spec == Gaussian() and buf.init_dist.covariance == Diagonal()


def _is_plain(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _is_plain(v) for k, v in value.items())


@pytest.mark.parametrize("covariance", [Diagonal(), Full(), LowRank(rank=3, residual=0.5), Stationary()])
def test_typed_covariance_round_trips_through_config_and_a_weights_only_checkpoint(covariance):
    x, y, _ = class_data(n_per=20)
    spec = Gaussian(covariance=covariance, jitter=1e-3)
    buf = ReplayBuffer(12, SHAPE, init=spec, num_classes=3).fit(x, y)
    config = buf.config()
    assert _is_plain(config) and config["init"]["covariance"]["kind"] == covariance.kind
    assert buf.init_spec == spec
    saved = roundtrip({"config": config, "buffer": buf.state_dict()})  # weights_only=True
    rebuilt = ReplayBuffer(**saved["config"])
    rebuilt.load_state_dict(saved["buffer"])
    assert rebuilt.init_spec == spec and rebuilt.init_dist.covariance == covariance
    assert rebuilt.config() == config
    ys = torch.tensor([2, 0, 1])
    a = buf.init_dist.sample(3, SHAPE, DOMAIN, gen(5), "cpu", y=ys)
    assert torch.equal(a, rebuilt.init_dist.sample(3, SHAPE, DOMAIN, gen(5), "cpu", y=ys))
    other = Gaussian(covariance=LowRank(rank=2) if covariance != LowRank(rank=2) else Full())
    with pytest.raises(CheckpointError, match=re.escape(f"create it with init={spec!r}")) as err:
        ReplayBuffer(12, SHAPE, init=other, num_classes=3).load_state_dict(saved["buffer"])
    assert "\n" not in str(err.value)


def test_fit_pools_missing_classes_by_copies_for_an_init_that_does_not_pool_itself():
    seen = {}

    class Means:  # a third party's init: fits per-class means, knows nothing of pooling
        def fit(self, x, y):
            seen["y"] = y.clone()
            self.means = torch.stack([x[y == c].mean(0) for c in range(int(y.max()) + 1)])

        def sample(self, n, shape, domain, generator=None, device=None, y=None):
            return self.means[y]

    buf = ReplayBuffer(12, SHAPE, init=Means(), num_classes=3)
    x = torch.stack([torch.full(SHAPE, 0.1), torch.full(SHAPE, 0.3)])
    with pytest.raises(IndexError):  # class 2 has no examples: the init's own rule
        buf.fit(x, torch.tensor([0, 1])).init_dist.sample(1, SHAPE, DOMAIN, y=torch.tensor([2]))
    buf.fit(x, torch.tensor([0, 1]), missing_classes="pool")
    assert torch.equal(seen["y"], torch.tensor([0, 1, 2, 2]))  # one copy of every example, labelled 2
    assert float(buf.init_dist.means[2].mean()) == pytest.approx(0.2)
