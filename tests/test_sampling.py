"""SGLD: the update rule, mode/BatchNorm safety, no graph kept, grad modes, precision, hooks, divergence."""

from __future__ import annotations

import gc
import io
import math
import weakref

import pytest
import timm
import torch
from conftest import TinyCNN
from torch import nn

import jem_plugin as jem
from jem_plugin.adapter import IMAGENET_MEAN, IMAGENET_STD
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.errors import DivergenceError, InvalidLabelError
from jem_plugin.model import sampling_mode
from jem_plugin.sampling import SGLD, SGLDStepState
from jem_plugin.schedules import Poly

SHAPE = (1, 8, 8)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def jm():
    return jem.wrap(TinyCNN())


def snapshot_flags(model: nn.Module):
    return ([m.training for m in model.modules()], [p.requires_grad for p in model.parameters()])


def logsumexp_grad(jm, x, y=None):
    xg = x.clone().requires_grad_(True)
    out = jm(xg)
    score = out.logsumexp(1) if y is None else out.gather(1, y.view(-1, 1))
    return torch.autograd.grad(score.sum(), xg)[0]


# ---------------------------------------------------------------- update rule
def test_one_step_is_the_paper_update(jm):
    jm.eval()
    x0 = torch.rand(4, *SHAPE) * 2 - 1
    out = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False).run(jm, x0)
    torch.testing.assert_close(out, x0 + 0.5 * logsumexp_grad(jm, x0))
    # noise: x + a*g + s*N(0, I) with the generator's normal draws
    out = SGLD(steps=1, step_size=0.5, noise=0.1, clamp=False, generator=gen(3)).run(jm, x0)
    torch.testing.assert_close(out, x0 + 0.5 * logsumexp_grad(jm, x0) + 0.1 * torch.randn(x0.shape, generator=gen(3)))


def test_proximal_sgld_clips_gradient_like_jempp(jm):
    jm.eval()
    x0 = torch.rand(8, *SHAPE) * 2 - 1
    g = logsumexp_grad(jm, x0)
    c = float(g.abs().median())  # half the entries saturate
    out = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False, grad_clamp=c).run(jm, x0)
    torch.testing.assert_close(out, x0 + 0.5 * g.clamp(-c, c))  # JEM++: x + clamp(eta, -eps, eps) * lr
    assert (out - x0).abs().max() <= 0.5 * c + 1e-7


def test_input_is_not_modified_and_result_is_detached_fp32(jm):
    x0 = torch.rand(4, *SHAPE, dtype=torch.float16).float() * 2 - 1
    before = x0.clone()
    out = SGLD(steps=3).run(jm, x0)
    assert torch.equal(x0, before)
    assert out.dtype == torch.float32 and not out.requires_grad and out.grad_fn is None


# ---------------------------------------------------------------- modes and BatchNorm
def test_batchnorm_stats_modes_and_flags_restored(jm):
    model = jm.model
    model.train()
    model.features[7].eval()  # a layer the user put in eval stays in eval
    model.head.bias.requires_grad_(False)  # a frozen parameter stays frozen
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = snapshot_flags(model)
    SGLD(steps=5).sample(jm, 16, buffer=ReplayBuffer(64, SHAPE))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed during sampling"  # running stats, num_batches_tracked
    assert snapshot_flags(model) == flags
    assert all(p.grad is None for p in model.parameters())


def test_existing_parameter_grads_are_untouched(jm):
    """Sampling between backward() and optimizer.step() (gradient accumulation) keeps .grad as is."""
    for p in jm.parameters():
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in jm.parameters()]
    SGLD(steps=3).sample(jm.train(), 8, shape=SHAPE, progress=True)
    assert all(torch.equal(p.grad, g) for p, g in zip(jm.parameters(), grads))


def test_inside_sampling_mode_everything_is_eval_and_frozen(jm):
    seen = []

    class Spy:
        @jem.hookimpl
        def jem_sgld_step(self, state):
            seen.append(
                (any(m.training for m in jm.model.modules()), any(p.requires_grad for p in jm.model.parameters()))
            )

    jem.register(Spy(), name="spy-modes")
    try:
        SGLD(steps=2).run(jm.train(), torch.zeros(2, *SHAPE))
    finally:
        jem.unregister(name="spy-modes")
    assert seen == [(False, False), (False, False)]
    assert jm.model.training


def test_flags_restored_when_the_chain_raises(jm):
    model = jm.model.train()
    model.head.weight.requires_grad_(False)
    flags = snapshot_flags(model)

    class Boom:
        @jem.hookimpl
        def jem_sgld_step(self, state):
            if state.step == 1:
                raise KeyboardInterrupt  # even a non-Exception interrupt restores the flags

    jem.register(Boom(), name="boom")
    try:
        with pytest.raises(KeyboardInterrupt):
            SGLD(steps=4).run(jm, torch.zeros(2, *SHAPE))
    finally:
        jem.unregister(name="boom")
    assert snapshot_flags(model) == flags
    with pytest.raises(ValueError):
        with sampling_mode(model):
            raise ValueError
    assert snapshot_flags(model) == flags


def test_timm_resnet_batchnorm_unchanged_and_per_channel_clamp():
    model = timm.create_model("test_resnet", pretrained=False, num_classes=10).train()
    jm = jem.wrap(model, mean=IMAGENET_MEAN, std=IMAGENET_STD)  # per-channel domain
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffer = ReplayBuffer(32, (3, 32, 32))
    out = SGLD(steps=2, step_size=50.0, noise=0.5).sample(jm, 4, buffer=buffer)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.training and all(p.grad is None for p in model.parameters())
    lo, hi = jm.domain.bounds(out)
    assert (out >= lo).all() and (out <= hi).all()
    for c in range(3):  # the big steps hit each channel's own bound
        assert torch.isclose(out[:, c].max(), hi.flatten()[c]) or torch.isclose(out[:, c].min(), lo.flatten()[c])
    assert (buffer.data >= lo).all() and (buffer.data <= hi).all()


def test_clamp_keeps_samples_in_domain_and_can_be_disabled(jm):
    x0 = torch.rand(16, *SHAPE) * 2 - 1
    out = SGLD(steps=3, step_size=100.0, noise=1.0).run(jm, x0)
    assert out.min() >= -1 and out.max() <= 1 and (out.abs() == 1).any()
    free = SGLD(steps=3, step_size=100.0, noise=1.0, clamp=False).run(jm, x0)
    assert free.abs().max() > 1


# ---------------------------------------------------------------- graph, grad modes, precision
@pytest.mark.slow
def test_no_graph_outlives_a_step(jm):
    """Every tensor autograd saves for backward is released within its own step."""
    packed = []

    class Saved:
        def __init__(self, t):
            self.t = t

    def pack(t):
        box = Saved(t)
        packed.append(weakref.ref(box))
        return box

    alive_at_step = []

    class Probe:
        @jem.hookimpl
        def jem_sgld_step(self, state):
            alive_at_step.append(sum(r() is not None for r in packed))

    jem.register(Probe(), name="probe-graph")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            out = SGLD(steps=5).sample(jm.train(), 8, buffer=ReplayBuffer(32, SHAPE))
    finally:
        jem.unregister(name="probe-graph")
    gc.collect()
    assert packed, "the probe saw no saved tensors"
    assert alive_at_step == [0] * 5
    assert all(r() is None for r in packed)
    assert out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_works_under_no_grad_and_inference_mode(jm, context):
    ref = SGLD(steps=4, generator=gen(1)).sample(jm, 8, shape=SHAPE)
    with context():
        out = SGLD(steps=4, generator=gen(1)).sample(jm, 8, shape=SHAPE)
        # a class-conditional chain from a buffer, too
        buf = ReplayBuffer(40, SHAPE, num_classes=10)
        cond = SGLD(steps=2).sample(jm, buffer=buf, y=torch.arange(8) % 10)
    assert torch.equal(out, ref)  # identical to the chain run outside the context
    assert cond.shape == (8, *SHAPE) and torch.isfinite(cond).all()


def test_bf16_autocast_keeps_chain_fp32(jm):
    dtypes = []
    jm.model.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    sampler = SGLD(steps=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, diag = sampler.sample(
            jm, 8, buffer=ReplayBuffer(32, SHAPE), return_diagnostics=True, record_trajectory=True, record_energies=True
        )
    assert torch.bfloat16 in dtypes  # the forward did run in autocast
    assert out.dtype == torch.float32
    assert all(x.dtype == torch.float32 for x in diag.trajectory)
    assert diag.energies.dtype == torch.float32 and diag.energies.shape == (4, 8)


# ---------------------------------------------------------------- reproducibility
def test_same_generator_seed_gives_bitwise_identical_samples(jm):
    def draw(seed):
        buf = ReplayBuffer(64, SHAPE, reinit_freq=0.3)
        sampler = SGLD(steps=5, generator=gen(seed))
        first = sampler.sample(jm, 16, buffer=buf)
        return torch.cat([first, sampler.sample(jm, 16, buffer=buf)]), buf.data.clone()

    (a, da), (b, db), (c, _) = draw(7), draw(7), draw(8)
    assert torch.equal(a, b) and torch.equal(da, db)
    assert not torch.equal(a, c)


def test_state_dict_round_trip_resumes_the_generator(jm):
    sampler = SGLD(steps=3, step_size=Poly(0.5, end=0.1), noise=0.02, grad_clamp=0.05, generator=gen(5))
    sampler.sample(jm, 4, shape=SHAPE)  # advance the generator
    blob = io.BytesIO()
    torch.save(sampler.state_dict(), blob)
    blob.seek(0)
    restored = SGLD()
    restored.load_state_dict(torch.load(blob, weights_only=True))
    assert restored.step_sizes() == sampler.step_sizes() and restored.grad_clamp == 0.05
    assert torch.equal(restored.sample(jm, 4, shape=SHAPE), sampler.sample(jm, 4, shape=SHAPE))


# ---------------------------------------------------------------- what the chain does
def test_no_noise_sgld_increases_log_px_monotonically(jm):
    jm.eval()
    sampler = SGLD(steps=15, step_size=0.2, noise=0.0)
    _, diag = sampler.run(jm, torch.rand(32, *SHAPE) * 2 - 1, return_diagnostics=True, record_energies=True)
    log_px = -diag.energies.mean(1)  # [steps + 1]
    assert log_px.shape == (16,)
    assert (log_px.diff() >= -1e-6).all() and log_px[-1] > log_px[0]


def test_class_conditional_sampling_increases_target_logit(jm):
    jm.eval()
    x0 = torch.rand(32, *SHAPE) * 2 - 1
    y = torch.full((32,), 3)
    out = SGLD(steps=10, step_size=1.0, noise=0.0).run(jm, x0, y)
    with torch.no_grad():
        gain = jm(out)[:, 3] - jm(x0)[:, 3]
        other = jm(out)[:, 5] - jm(x0)[:, 5]
    assert (gain > 0).float().mean() > 0.9 and gain.mean() > other.mean()


def test_trajectory_and_energies_are_returned_not_kept_on_the_sampler(jm):
    sampler = SGLD(steps=4, step_size=Poly(0.5, end=0.1))
    record = dict(return_diagnostics=True, record_trajectory=True, record_energies=True)
    out, diag = sampler.sample(jm, 6, shape=SHAPE, **record)
    assert isinstance(diag, jem.SGLDDiagnostics) and diag.steps == 4
    assert diag.final_step_size == pytest.approx(0.1)
    assert len(diag.trajectory) == 5 and torch.equal(diag.trajectory[-1], out)
    with torch.no_grad():  # the chain's energies are those of the model in eval mode
        torch.testing.assert_close(diag.energies[-1], jm.eval().energy(out))
    # a second call through the same (shared) sampler does not touch the first call's diagnostics
    out2, diag2 = sampler.sample(jm, 3, shape=SHAPE, **record)
    assert len(diag.trajectory) == 5 and diag.trajectory[-1].shape[0] == 6 and diag2.energies.shape == (5, 3)
    assert not hasattr(sampler, "last_trajectory") and not hasattr(sampler, "last_energies")
    # the default call returns the samples alone; unrecorded diagnostics are None
    plain = SGLD(steps=2)
    assert isinstance(plain.sample(jm, 2, shape=SHAPE), torch.Tensor)
    x, d = plain.run(jm, torch.rand(2, *SHAPE), return_diagnostics=True)
    assert d == jem.SGLDDiagnostics(steps=2, final_step_size=1.0) and d.trajectory is None and d.energies is None
    buf = ReplayBuffer(16, SHAPE)
    xb, db = plain.sample(jm, 4, buffer=buf, return_diagnostics=True)
    assert db.steps == 2 and xb.shape == (4, *SHAPE)


def test_schedules():
    poly = SGLD(steps=10, step_size=Poly(1.0, power=0.55, end=0.1))
    sizes = poly.step_sizes()
    assert sizes[0] == 1.0 and abs(sizes[-1] - 0.1) < 1e-9 and all(a > b for a, b in zip(sizes, sizes[1:]))
    assert SGLD(steps=3, step_size=Poly(2.0)).step_sizes() == [2.0 * (1 + t) ** -0.55 for t in range(3)]
    assert SGLD(steps=3, step_size=lambda t: 0.1 * (t + 1)).step_sizes() == [0.1, 0.2, 0.1 * 3]
    assert SGLD(steps=3, step_size=lambda t, steps: 0.1 * (steps - t)).step_sizes() == [0.1 * 3, 0.2, 0.1]
    with pytest.raises(ValueError, match="step_size callable"):
        SGLD(steps=2, step_size=lambda t: -1.0).step_sizes()


# ---------------------------------------------------------------- plugin hook
class Recorder:
    def __init__(self):
        self.steps = []

    @jem.hookimpl
    def jem_sgld_step(self, state: SGLDStepState):
        assert state.x.dtype == torch.float32 and state.grad.shape == state.x.shape
        self.steps.append((state.step, state.step_size, state.noise))
        if state.step == 2:
            state.x = torch.full_like(state.x, 0.25)  # replace the chain


@pytest.fixture
def recorder():
    plugin = Recorder()
    jem.register(plugin, name="sgld-recorder")
    yield plugin
    jem.unregister(name="sgld-recorder")


def test_hook_called_once_per_step_and_can_alter_x(jm, recorder):
    out = SGLD(steps=3, step_size=0.5, noise=0.0).run(jm, torch.zeros(2, *SHAPE))
    assert recorder.steps == [(0, 0.5, 0.0), (1, 0.5, 0.0), (2, 0.5, 0.0)]
    assert torch.equal(out, torch.full_like(out, 0.25))  # the last step's replacement is the result


# ---------------------------------------------------------------- divergence and validation
class Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 3)

    def forward(self, x):
        return self.lin(x.flatten(1)) * 1e30


def test_divergence_raises_with_remedies():
    jm = jem.wrap(Exploding())
    with pytest.raises(DivergenceError) as err:
        SGLD(steps=5, step_size=1e30, clamp=False).run(jm, torch.rand(4, *SHAPE))
    msg = str(err.value)
    assert "step size" in msg and "l2_weight" in msg and "checkpoint" in msg
    # the error carries its parts as fields: nothing to parse out of the message
    e = err.value
    assert e.reason.startswith("SGLD diverged") and "Known remedies" not in e.reason
    assert any("grad_clamp" in r for r in e.remedies) and e.iteration is None
    assert e.energy is not None and not math.isfinite(e.energy)
    jm_ok = jem.wrap(TinyCNN())
    with pytest.raises(DivergenceError, match="max_energy"):
        SGLD(steps=1, max_energy=1e-9).run(jm_ok, torch.rand(2, *SHAPE))


def test_argument_validation(jm):
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="steps"):
            SGLD(steps=bad)
    with pytest.raises(ValueError, match="step_size"):
        SGLD(step_size=0)
    with pytest.raises(ValueError, match="noise"):
        SGLD(noise=-0.1)
    with pytest.raises(ValueError, match="exceed"):
        SGLD(step_size=Poly(0.1, end=1.0))
    with pytest.raises(ValueError, match="batchnorm"):
        SGLD(batchnorm="running")
    with pytest.raises(TypeError, match="unexpected keyword argument 'stpes'"):
        SGLD(stpes=3)
    sampler = SGLD(steps=1)
    buf = ReplayBuffer(20, SHAPE, num_classes=10)
    with pytest.raises(ValueError, match="not both"):
        sampler.sample(jm, 2, buffer=buf, x_init=torch.zeros(2, *SHAPE))
    with pytest.raises(ValueError, match="conflicts"):
        sampler.sample(jm, 3, y=torch.arange(2), buffer=buf)
    with pytest.raises(ValueError, match="conflicts"):
        sampler.sample(jm, 3, x_init=torch.zeros(2, *SHAPE))
    with pytest.raises(ValueError, match="shape="):
        sampler.sample(jm, 2)  # no buffer, no x_init, unknown input size
    with pytest.raises(InvalidLabelError, match=r"\[0, 10\)"):
        sampler.run(jm, torch.zeros(2, *SHAPE), torch.tensor([0, 10]))
    with pytest.raises(InvalidLabelError, match="integer"):
        sampler.run(jm, torch.zeros(2, *SHAPE), torch.tensor([0.0, 1.0]))
    with pytest.raises(InvalidLabelError, match="shape"):
        sampler.run(jm, torch.zeros(2, *SHAPE), torch.tensor([0, 1, 2]))
    with pytest.raises(InvalidLabelError, match="num_classes"):
        sampler.sample(jm, buffer=ReplayBuffer(20, SHAPE), y=torch.tensor([1, 2]))
    rgb = jem.wrap(TinyCNN(), mean=IMAGENET_MEAN, std=IMAGENET_STD)  # a 3-channel domain
    with pytest.raises(jem.InvalidInputError, match="3 channels"):
        sampler.run(rgb, torch.zeros(2, *SHAPE))
