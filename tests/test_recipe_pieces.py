"""JEM-family recipe pieces on their own: px_data, noise-free clamped steps, the auto-fitted
Gaussian init, and the jempp/sadajem presets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.builtins.init_distributions import GaussianInit
from jem_plugin.covariance import Diagonal, Full, LowRank, Stationary
from jem_plugin.extensions import FitInitFromBatches
from jem_plugin.inits import Gaussian
from jem_plugin.recipes import RECIPES, get_recipe


class FixedSampler:
    """A user's sampler: hands back the same chains; says how its samples pass BatchNorm."""

    clamp = False

    def __init__(self, x, batchnorm="joint"):
        self.x, self.batchnorm = x, batchnorm

    def sample(self, jm, n=None, **kw):
        return self.x[:n]


def _net(seed=0, in_ch=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(in_ch * 16, 16), nn.SiLU(), nn.Linear(16, 3))


def test_px_data_feeds_the_px_term_and_ce_keeps_the_augmented_batch():
    model = _net()
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    xs = torch.rand(4, 1, 4, 4) * 2 - 1
    loss_fn = jem.JEMLoss(FixedSampler(xs), jem.ReplayBuffer(8, (1, 4, 4)), data_noise=0.0, l2_weight=0.5)
    x_aug, x_clean = torch.rand(4, 1, 4, 4) * 2 - 1, torch.rand(4, 1, 4, 4) * 2 - 1
    y = torch.tensor([0, 1, 2, 0])
    out = loss_fn(jm, x_aug, y, px_data=x_clean)
    e = lambda t: -torch.logsumexp(model(t), 1)
    with torch.no_grad():
        assert out.metrics["px"] == pytest.approx(float(e(x_clean).mean() - e(xs).mean()), abs=1e-5)
        assert out.metrics["l2"] == pytest.approx(float(e(x_clean).pow(2).mean() + e(xs).pow(2).mean()), abs=1e-5)
        assert out.metrics["ce"] == pytest.approx(float(nn.functional.cross_entropy(model(x_aug), y)), abs=1e-5)
    plain = loss_fn(jm, x_aug, y)
    assert plain.metrics["px"] != pytest.approx(out.metrics["px"], abs=1e-4)


def test_noise_free_clamped_steps_are_deterministic_and_bounded():
    # SGLD(noise=0, grad_clamp=c) is JEM++/SADA-JEM's noise-free proximal step: each coordinate
    # moves by at most step_size * c, and two runs from the same start agree exactly.
    model = _net(1)
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    x0 = torch.zeros(5, 1, 4, 4)
    s = jem.SGLD(steps=1, step_size=1.0, noise=0.0, grad_clamp=0.01)
    a, b = s.sample(jm, x_init=x0), s.sample(jm, x_init=x0)
    assert torch.equal(a, b)
    assert (a - x0).abs().max() <= 0.01 + 1e-7
    assert (a - x0).abs().max() > 0.009  # the raw gradient is larger than the clip: it binds
    free = jem.SGLD(steps=1, step_size=1.0, noise=0.0).sample(jm, x_init=x0)
    assert (free - x0).abs().max() > 0.011


def test_unfitted_gaussian_init_is_fitted_from_the_first_batch():
    torch.manual_seed(0)
    model = _net(2)
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    buffer = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    fit_init = FitInitFromBatches(buffer)
    loss_fn = jem.JEMLoss(jem.SGLD(steps=0), buffer, data_noise=0.0)
    # classes 0 and 1 only, at distinct levels: class 2 falls back to the batch's Gaussian
    x = torch.cat([torch.full((4, 1, 4, 4), -0.5), torch.full((4, 1, 4, 4), 0.5)]) + 0.01 * torch.randn(8, 1, 4, 4)
    y = torch.tensor([0] * 4 + [1] * 4)
    fit_init.on_batch(None, x, y)
    loss_fn(jm, x, y)
    init = buffer.init_dist
    assert init.fitted
    torch.testing.assert_close(init.mean[0], torch.full((16,), -0.5), atol=0.02, rtol=0)
    torch.testing.assert_close(init.mean[1], torch.full((16,), 0.5), atol=0.02, rtol=0)
    torch.testing.assert_close(init.mean[2], torch.zeros(16), atol=0.02, rtol=0)
    seg0 = buffer.samples(y=0)
    assert seg0.mean() == pytest.approx(-0.5, abs=0.05), "the chains start from the fitted Gaussian"


def _auto_fitting_loss(examples):
    """A JEMLoss over an unfitted Gaussian init, and the extension that fits it from the batches."""
    jm = jem.wrap(_net(2), data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    buffer = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    loss_fn = jem.JEMLoss(jem.SGLD(steps=0), buffer, data_noise=0.0)
    return jm, buffer, loss_fn, FitInitFromBatches(buffer, examples=examples), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def test_auto_fit_pools_the_first_batches_refitting_at_doublings_then_stops():
    # One batch of 64 gives about six examples per class: too few for a per-class Gaussian's
    # chains to move. The fit keeps the first batches and refits at 8, 16 and 32 examples.
    jm, buffer, loss_fn, fit_init, y = _auto_fitting_loss(examples=32)
    levels, refits = [], []
    for i in range(6):  # batch i sits at level i / 10: the fitted mean is the held batches' mean
        levels.append(i / 10)
        before = buffer.init_dist.mean.clone() if buffer.init_dist.fitted else None
        x = torch.full((8, 1, 4, 4), i / 10)
        fit_init.on_batch(None, x, y)
        loss_fn(jm, x, y)
        mean = buffer.init_dist.mean
        refits.append(before is None or not torch.equal(before, mean))
        if refits[-1]:
            torch.testing.assert_close(mean, torch.full_like(mean, sum(levels) / len(levels)))
            assert buffer.samples().mean() == pytest.approx(sum(levels) / len(levels), abs=0.005), (
                "the chains are redrawn from the new fit"
            )
    assert refits == [True, True, False, True, False, False]  # 8, 16, 32 examples, then done


def test_auto_fit_counts_a_sam_iteration_once():
    # SAM's second pass calls the loss again on the same batch; the extension sees the batch once.
    jm, buffer, loss_fn, fit_init, y = _auto_fitting_loss(examples=16)
    for level in (0.0, 0.4):
        x = torch.full((8, 1, 4, 4), level)
        fit_init.on_batch(None, x, y)
        with loss_fn.reusing_samples():
            loss_fn(jm, x, y)
            loss_fn(jm, x, y)
    torch.testing.assert_close(buffer.init_dist.mean, torch.full_like(buffer.init_dist.mean, 0.2))


def test_auto_fit_zero_fits_once_and_a_users_fit_stops_it():
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    once = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    fit_once = FitInitFromBatches(once, examples=0)
    assert fit_once.observe(once, torch.zeros(6, 1, 4, 4), y)
    assert not fit_once.observe(once, torch.ones(6, 1, 4, 4), y)
    assert float(once.init_dist.mean.abs().max()) == 0.0
    pooled = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    fit_pooled = FitInitFromBatches(pooled)
    assert fit_pooled.observe(pooled, torch.zeros(6, 1, 4, 4), y)
    pooled.fit(torch.full((6, 1, 4, 4), 0.5), y)  # the user fits: the first batches are dropped
    for _ in range(3):
        assert not fit_pooled.observe(pooled, torch.ones(6, 1, 4, 4), y)
    assert float(pooled.init_dist.mean.min()) == 0.5
    # A checkpoint taken while it collects resumes with the fit so far (the examples are not saved).
    collecting = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    assert FitInitFromBatches(collecting).observe(collecting, torch.zeros(6, 1, 4, 4), y)
    resumed = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    resumed.load_state_dict(collecting.state_dict())
    assert not FitInitFromBatches(resumed).observe(resumed, torch.ones(6, 1, 4, 4), y)
    torch.testing.assert_close(resumed.init_dist.mean, collecting.init_dist.mean)
    with pytest.raises(ValueError, match="examples"):
        FitInitFromBatches(collecting, examples=-1)


@pytest.mark.parametrize("covariance", ["diagonal", "full", "lowrank", "stationary"])
def test_gaussian_fit_pools_missing_classes_only_when_asked(covariance):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 4, 4, generator=g)
    y = torch.tensor([0, 2] * 6)  # class 1 and 3 have no examples
    cov = {"diagonal": Diagonal(), "full": Full(), "lowrank": LowRank(rank=3), "stationary": Stationary()}[covariance]
    init = GaussianInit(covariance=cov)
    with pytest.raises(jem.InvalidLabelError, match=r"classes \[1, 3\]"):
        init.fit(x, y, num_classes=4)
    init.fit(x, y, num_classes=4, pool_missing=True)
    whole = GaussianInit(covariance=cov)
    whole.fit(x, torch.zeros_like(y), num_classes=1)
    alone = GaussianInit(covariance=cov).fit(x, y // 2, num_classes=2)
    assert init.num_classes == 4
    # The stationary init's colour axes are shared by the classes (and see the pooled copy): its
    # power summed over the axes does not depend on them.
    same = (lambda t: t.square().sum(0)) if covariance == "stationary" else (lambda t: t)
    for name in ("mean", "std", "scale_tril", "factor"):
        t = getattr(init, name)
        if t.numel():
            for c in (1, 3):  # the missing classes: the Gaussian of all examples
                torch.testing.assert_close(same(t[c]), same(getattr(whole, name)[0]), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(same(t[2]), same(getattr(alone, name)[1]), atol=1e-5, rtol=1e-4)


def test_user_fitted_init_is_left_alone():
    buffer = jem.ReplayBuffer(30, (1, 4, 4), init=Gaussian(), num_classes=3)
    buffer.fit(torch.zeros(6, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    assert not FitInitFromBatches(buffer).observe(buffer, torch.ones(6, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    assert float(buffer.init_dist.mean.abs().max()) == 0.0


@pytest.mark.parametrize("name", ["jempp", "sadajem", "generative"])
def test_family_presets_build_a_working_loss(name):
    r = get_recipe(name)
    assert name in RECIPES and r.name == name and name in str(r)
    model = _net(3, in_ch=3)
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(3, 4, 4), num_classes=3)
    x, y = torch.rand(6, 3, 4, 4) * 2 - 1, torch.tensor([0, 1, 2, 0, 1, 2])
    setup = r.replace(buffer_capacity=30).build(jm, (x, y), total_iters=100, batch_size=6)
    loss_fn = setup.loss
    assert loss_fn.buffer.init_dist.fitted, "build() fits the Gaussian init on the data it is given"
    out = loss_fn(jm, x, y, px_data=x if r.loss.px_clean_data else None)
    out.loss.backward()
    assert loss_fn.sampler.noise == 0.0 and loss_fn.sampler.grad_clamp is not None


def test_generative_preset_fits_a_stationary_init_on_the_data_it_is_built_on():
    """generative: the per-class stationary Gaussian, fitted on the (clean) training data by build(),
    and samples in the data's BatchNorm pass."""
    r = get_recipe("generative").replace(buffer_capacity=30, buffer_visits=None)
    assert isinstance(r.buffer.init.covariance, Stationary) and r.loss.px_clean_data and r.sampler.batchnorm == "joint"
    jm = jem.wrap(_net(3, in_ch=3), data_range=(-1, 1), input_size=(3, 4, 4), num_classes=3)
    clean, y = torch.rand(6, 3, 4, 4) * 0.5, torch.tensor([0, 1, 2, 0, 1, 2])
    setup = r.build(jm, (clean, y))
    init = setup.buffer.init_dist
    assert init.std.shape == (3, 3, 4, 4)
    torch.testing.assert_close(init.mean[0], (clean[0] + clean[3]).flatten() / 2)
    augmented = clean.roll(1, dims=-1) - 0.5
    setup.loss(jm, augmented, y, px_data=clean).loss.backward()
    torch.testing.assert_close(init.mean[0], (clean[0] + clean[3]).flatten() / 2)  # the loss fits nothing


# ---------------------------------------------------------------- how samples meet BatchNorm
def _bn_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.SiLU(), nn.Linear(8, 3))


def test_separate_batchnorm_keeps_samples_out_of_the_data_statistics():
    """batchnorm="separate": the data logits and the running statistics are those of the data
    alone, whatever the samples look like; "joint" mixes both."""
    x = torch.rand(8, 1, 4, 4) * 2 - 1
    y = torch.arange(8) % 3
    far = torch.full((8, 1, 4, 4), 0.99)  # samples far from the data
    runs = {}
    for mode in ("joint", "separate"):
        model = _bn_net()
        jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
        loss_fn = jem.JEMLoss(FixedSampler(far, batchnorm=mode), jem.ReplayBuffer(8, (1, 4, 4)), data_noise=0.0)
        out = loss_fn(jm, x, y)
        out.loss.backward()
        runs[mode] = (out.logits.detach(), model[2].running_mean.clone(), model[2].num_batches_tracked.item())
    ref = _bn_net()
    ref_logits = ref(x).detach()  # the data alone through train-mode BatchNorm
    logits, running_mean, tracked = runs["separate"]
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(running_mean, ref[2].running_mean)
    assert tracked == 1
    assert not torch.allclose(runs["joint"][0], ref_logits)  # the check can tell the difference
    assert not torch.allclose(runs["joint"][1], ref[2].running_mean)


def test_batch_statistics_chains_leave_running_statistics_and_modes_alone():
    model = _bn_net()
    model[2].eval()  # a user who froze this layer gets it back frozen
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x0 = torch.rand(6, 1, 4, 4) * 2 - 1
    out = {m: jem.SGLD(steps=3, noise=0.0, batchnorm=m).sample(jm, x_init=x0) for m in ("joint", "separate")}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert model.training and not model[2].training and model[2].track_running_stats
    # batch statistics make a chain depend on the others in its batch; running ones do not
    alone = {m: jem.SGLD(steps=3, noise=0.0, batchnorm=m).sample(jm, x_init=x0[:3]) for m in ("joint", "separate")}
    torch.testing.assert_close(alone["joint"], out["joint"][:3])
    assert not torch.allclose(alone["separate"], out["separate"][:3])


def test_batchnorm_is_one_knob_on_the_sampler_and_rejects_unknown_modes():
    with pytest.raises(ValueError, match="batchnorm must be one of"):
        jem.SGLD(batchnorm="both")
    assert jem.JEMLoss(jem.SGLD(batchnorm="separate"), jem.ReplayBuffer(8, (1, 4, 4))).batchnorm == "separate"
    with pytest.raises(TypeError, match="batchnorm"):  # the sampler's only
        jem.JEMLoss(jem.SGLD(batchnorm="joint"), jem.ReplayBuffer(8, (1, 4, 4)), batchnorm="separate")


def test_recipe_batchnorm_and_conditional_fields_reach_the_loss_and_sampler():
    r = get_recipe("fast").replace(class_conditional_px=True, buffer_capacity=30)
    jm = jem.wrap(_bn_net(), data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    x, y = torch.rand(6, 1, 4, 4) * 2 - 1, torch.tensor([0, 1, 2, 0, 1, 2])
    setup = r.build(jm, (x, y))
    assert setup.sampler.batchnorm == "separate"  # one knob: the loss reads its sampler's
    assert setup.loss.class_conditional_px and setup.buffer.num_classes == 3  # one class per slot
    out = setup.loss(jm, x, y)
    out.loss.backward()
    assert "sgld_batchnorm" in str(r) and "class_conditional_px" in str(r)


def test_recipe_init_covariance_and_rank_reach_the_fitted_init():
    r = get_recipe("jempp").replace(init_covariance="lowrank", init_rank=3, buffer_capacity=30)
    x, y = torch.rand(30, 1, 4, 4) * 2 - 1, torch.arange(30) % 3
    jm = jem.wrap(_net(), data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    init = r.build(jm, (x, y)).buffer.init_dist
    assert init.factor.shape == (3, 16, 3)
    assert "init_rank" in str(r)


def test_separate_batchnorm_keeps_one_forward_without_batch_statistics():
    calls = []
    model = _net()  # no BatchNorm
    model.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3)
    xs = torch.rand(4, 1, 4, 4) * 2 - 1
    loss_fn = jem.JEMLoss(FixedSampler(xs, batchnorm="separate"), jem.ReplayBuffer(8, (1, 4, 4)))
    loss_fn(jm, torch.rand(4, 1, 4, 4) * 2 - 1, torch.tensor([0, 1, 2, 0]))
    assert calls == [8]  # data and samples in one forward: the result is the same, the cost lower
    bn = _bn_net()
    bn.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    loss_fn(
        jem.wrap(bn, data_range=(-1, 1), input_size=(1, 4, 4), num_classes=3),
        torch.rand(4, 1, 4, 4) * 2 - 1,
        torch.tensor([0, 1, 2, 0]),
    )
    assert calls[1:] == [4, 4]


def _grey_rgb(n, g, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
    """Grey images in ImageNet-normalised RGB (the same pixel value in every channel before the
    normalisation), as grey digits fed to an RGB model."""
    grey = torch.rand(n, 1, 6, 6, generator=g).expand(n, 3, 6, 6)
    return (grey - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


def _is_grey(x, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
    pixels = x * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    return float((pixels - pixels.mean(1, keepdim=True)).abs().max())


def test_colour_steps_keep_grey_chains_grey_and_colour_data_unchanged():
    # Grey data in an RGB model: per-channel steps add colour the data never have (issue 16, e68).
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(144, 3))
    jm = jem.wrap(model, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), input_size=(3, 6, 6), num_classes=3)
    x, y = _grey_rgb(30, g), torch.arange(30) % 3
    buffer = jem.ReplayBuffer(30, (3, 6, 6), init="gaussian", num_classes=3, reinit_freq=0.0).fit(x, y)
    proj = buffer.colour_projection
    assert torch.linalg.matrix_rank(proj) == 1, "grey data vary along one colour axis"
    torch.testing.assert_close(proj @ proj, proj, atol=1e-5, rtol=0)
    start = {}
    for colours in ("all", "data"):
        buffer.data.copy_(x)
        buffer.initialized.fill_(True)
        buffer._is_init = True
        sampler = jem.SGLD(
            steps=5, step_size=1.0, noise=0.01, colours=colours, generator=torch.Generator().manual_seed(1)
        )
        start[colours] = sampler.sample(jm, 30, buffer=buffer)
    assert _is_grey(start["all"]) > 1e-3, "the model's gradient is not grey: free steps add colour"
    assert _is_grey(start["data"]) < 1e-4, "confined steps (gradient and noise) keep the chains grey"
    assert (start["data"] - x).abs().max() > 1e-3, "and still move them"
    # Colour data use every axis: the projection is the identity and the steps are unchanged.
    colour = jem.ReplayBuffer(30, (3, 6, 6), init="gaussian", num_classes=3).fit(torch.randn(30, 3, 6, 6), y)
    assert torch.equal(colour.colour_projection, torch.eye(3))
    free = jem.SGLD(steps=1, colours="data")
    free.use_colours_of(colour)
    assert free.colour_projection is None, "no projection at all: colour images keep their CUDA graphs"
    free.use_colours_of(buffer)
    assert torch.equal(free.colour_projection, proj)


def test_colour_steps_errors_and_checkpoint():
    g = torch.Generator().manual_seed(0)
    jm = jem.wrap(
        nn.Sequential(nn.Flatten(), nn.Linear(108, 3)), data_range=(-3, 3), input_size=(3, 6, 6), num_classes=3
    )
    sampler = jem.SGLD(steps=2, colours="data")
    unfitted = jem.ReplayBuffer(30, (3, 6, 6))  # uniform init: nothing fitted, no colour axes
    assert unfitted.colour_projection is None
    with pytest.raises(jem.JEMError, match="colours='data'.*fit its init"):
        sampler.sample(jm, 4, buffer=unfitted)
    with pytest.raises(jem.JEMError, match="no colour axes yet"):
        sampler.sample(jm, x_init=torch.zeros(4, 3, 6, 6))
    sampler.colour_projection = torch.eye(2)
    with pytest.raises(jem.InvalidInputError, match=r"\[C, C\] with C = 3"):
        sampler.sample(jm, x_init=torch.zeros(4, 3, 6, 6))
    with pytest.raises(ValueError, match="colours must be one of"):
        jem.SGLD(colours="grey")
    # The colour axes travel with the buffer's state.
    y = torch.arange(30) % 3
    fitted = jem.ReplayBuffer(30, (3, 6, 6), init="gaussian", num_classes=3).fit(_grey_rgb(30, g), y)
    restored = jem.ReplayBuffer(30, (3, 6, 6), init="gaussian", num_classes=3)
    restored.load_state_dict(fitted.state_dict())
    torch.testing.assert_close(restored.colour_projection, fitted.colour_projection)


def test_generative_keeps_every_chain_it_has_started():
    """A buffer that restarts 5% of its draws holds chains about 20 draws old on average however long
    the run: on resnet18 that kept it at 0.81 of its init's distance (e81, FD 137), and never
    restarting brought it to 0.39 (e87, FD 67). `generative` draws keep every slot's chain."""
    r = get_recipe("generative")
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(60, 3, 8, 8, generator=g), torch.arange(60) % 3
    jm = jem.wrap(
        nn.Sequential(nn.Conv2d(3, 3, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()), input_size=(3, 8, 8), num_classes=3
    )
    buf = r.build(jm, (x, y), total_iters=10).buffer
    domain = jm.domain
    start, _ = buf.sample(buf.capacity, domain=domain, generator=g)
    buf.update(torch.arange(buf.capacity), torch.full_like(start, 0.25))  # every chain "advanced"
    for _ in range(20):
        drawn, _ = buf.sample(32, domain=domain, generator=g)
        assert (drawn == 0.25).all(), "a generative draw restarted a chain from the init"
