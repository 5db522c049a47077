"""JEMLoss and GenerativeLossMixin: the objective of the reference code, in one forward."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jem_plugin as jem
from jem_plugin import GenerativeLossMixin, plugins
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.errors import InvalidInputError, InvalidLabelError, UnknownNameError
from jem_plugin.losses import JEMLoss, LossBatch, LossOutput
from jem_plugin.sampling import SGLD

K = 10


def small_net(k: int = K) -> nn.Module:
    # No BatchNorm: separate forwards and one concatenated forward must then agree exactly.
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(4 * 64, k))


def buf(num_classes: int | None = None, shape=(1, 8, 8)) -> ReplayBuffer:
    """A small replay buffer for the batches below (class-conditional with ``num_classes``)."""
    return ReplayBuffer(64, shape, num_classes=num_classes)


def batch(n: int = 8, k: int = K):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, k, (n,), generator=g)


class FixedSampler:
    """Returns given samples and records how it was called (no SGLD: exact reference checks)."""

    def __init__(self, x_px, x_cond=None):
        self.x_px, self.x_cond, self.calls = x_px, x_cond, []

    def sample(self, jm, n=None, *, buffer=None, y=None, x_init=None):
        self.calls.append({"n": n, "y": None if y is None else y.clone(), "buffer": buffer})
        return (self.x_px if y is None else self.x_cond)[:n].clone()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_loss_equals_reference_objective_and_gradients():
    """CE + px + pxy + l2 match the reference code's separate forwards, value and gradient."""
    torch.manual_seed(0)
    net = small_net()
    jm = jem.wrap(net, num_classes=K)
    x, y = batch()
    x_q, x_qy = torch.rand(8, 1, 8, 8) * 2 - 1, torch.rand(8, 1, 8, 8) * 2 - 1
    sampler = FixedSampler(x_q, x_qy)
    loss_fn = JEMLoss(sampler, buf(K), ce_weight=0.7, px_weight=1.3, pxy_weight=0.5, l2_weight=0.2, data_noise=0.0)
    out = loss_fn(jm, x, y)
    assert isinstance(out, LossOutput)
    out.loss.backward()
    ours = grads(net)

    # reference (wgrathwohl/JEM train_wrn_ebm.py), three separate forwards
    net.zero_grad()
    lp, lq, lqy = net(x), net(x_q), net(x_qy)
    ce = F.cross_entropy(lp, y)
    fp, fq = lp.logsumexp(1), lq.logsumexp(1)
    l_px = -(fp.mean() - fq.mean())
    l_pxy = -(lp.gather(1, y[:, None]).mean() - lqy.gather(1, y[:, None]).mean())
    eq = torch.cat([fq, lqy.logsumexp(1)])
    l2 = (fp**2).mean() + (eq**2).mean()
    ref = 0.7 * ce + 1.3 * l_px + 0.5 * l_pxy + 0.2 * l2
    ref.backward()

    torch.testing.assert_close(out.loss, ref)
    for a, b in zip(ours, grads(net)):
        torch.testing.assert_close(a, b)
    m = out.metrics
    assert all(isinstance(v, float) for v in m.values())
    assert m["loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert m["ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert m["px"] == pytest.approx(l_px.item(), rel=1e-4, abs=1e-6)
    assert m["pxy"] == pytest.approx(l_pxy.item(), rel=1e-4, abs=1e-6)
    assert m["energy_data"] == pytest.approx(-fp.mean().item(), rel=1e-5)
    assert m["energy_sample"] == pytest.approx(-eq.mean().item(), rel=1e-5)
    assert m["energy_gap"] == pytest.approx(m["energy_sample"] - m["energy_data"], abs=1e-5)
    assert m["acc"] == pytest.approx((lp.argmax(1) == y).float().mean().item())
    # p(x|y) chains are drawn for the batch's own labels, as in the reference
    assert sampler.calls[0]["y"] is None and torch.equal(sampler.calls[1]["y"], y)
    torch.testing.assert_close(out.logits, lp)


def test_data_noise_is_gaussian_with_given_std_and_generator():
    jm = jem.wrap(small_net())
    x, y = batch()
    loss_fn = JEMLoss(FixedSampler(x), buf(), data_noise=0.03, generator=torch.Generator().manual_seed(5))
    seen = []
    jm.model.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().clone()))
    loss_fn(jm, x, y)
    expected = x + 0.03 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(seen[-1][:8], expected)


@pytest.mark.parametrize("sampler_clamp", [True, False])
def test_noisy_data_stays_in_the_domain_the_chains_are_clamped_to(sampler_clamp):
    """Clamped chains + unclamped data noise put positive-phase mass where no sample can go
    (saturated pixels + noise); the noisy batch is clamped exactly when the chains are."""
    jm = jem.wrap(small_net(), data_range=(-1.0, 1.0))
    x, y = batch()
    x[:, :, :4] = -1.0  # saturated background, like the digits
    x[:, :, 4:] = 1.0
    loss_fn = JEMLoss(
        SGLD(steps=1, clamp=sampler_clamp), buf(), data_noise=0.3, generator=torch.Generator().manual_seed(0)
    )
    assert loss_fn.clamps_data() is sampler_clamp
    seen = []
    jm.model.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().clone()))
    loss_fn(jm, x, y)
    noisy = seen[-1][:8]
    assert bool(((noisy >= -1) & (noisy <= 1)).all()) is sampler_clamp
    assert not torch.equal(noisy, x)  # the noise itself is still there


def test_noise_clamp_never_clips_the_data_itself():
    """Data outside the domain (a mis-set domain) is not silently clipped into it: only the
    noise's excursion beyond the clean value is cut."""
    jm = jem.wrap(small_net(), data_range=(-1.0, 1.0))
    x, y = batch()
    x[:4] = 3.0  # outside [-1, 1]
    loss_fn = JEMLoss(SGLD(steps=1), buf(), data_noise=0.3, generator=torch.Generator().manual_seed(0))
    seen = []
    jm.model.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].detach().clone()))
    loss_fn(jm, x, y)
    noisy = seen[-1][:8]
    assert float(noisy[:4].max()) == 3.0 and float(noisy[:4].min()) < 2.5  # inward noise kept
    assert bool(((noisy[4:] >= -1) & (noisy[4:] <= 1)).all())


def test_one_forward_on_concatenated_batch_with_real_sampler():
    net = small_net()
    jm = jem.wrap(net, num_classes=K)
    calls = []
    net.register_forward_hook(lambda m, inp, out: calls.append((inp[0].shape[0], torch.is_grad_enabled())))
    loss_fn = JEMLoss(SGLD(steps=3), buf(K), pxy_weight=1.0, n_samples=6)
    x, y = batch(8)
    loss_fn(jm, x, y).loss.backward()
    # 3 SGLD steps for p(x), 3 for p(x|y), then exactly one forward of 8 + 6 + 6 inputs.
    assert [c[0] for c in calls] == [6, 6, 6, 6, 6, 6, 20]
    assert all(p.grad is not None for p in net.parameters())


def test_wrapped_module_forward_goes_through_wrapper_sampling_does_not():
    jm = jem.wrap(small_net())
    wrapper = nn.DataParallel(jm)  # on CPU it just calls the module: stands in for DDP
    n_calls = []
    wrapper.register_forward_hook(lambda m, i, o: n_calls.append(i[0].shape[0]))
    x, y = batch(8)
    JEMLoss(SGLD(steps=2), buf())(wrapper, x, y)
    assert n_calls == [16]


def test_a_loss_built_without_a_buffer_resumes_the_saved_one_exactly():
    """The buffer travels as the arguments that rebuild it: a loss built without one (Lightning's
    ``load_from_checkpoint(ck, model=...)``) resumes from the state."""
    torch.manual_seed(0)
    jm = jem.wrap(small_net(), num_classes=K)
    x, y = batch(8)
    make = lambda buffer=None: JEMLoss(
        SGLD(steps=2, generator=torch.Generator().manual_seed(3)),
        buffer,
        pxy_weight=1.0,
        generator=torch.Generator().manual_seed(4),
    )
    loss_fn = make(ReplayBuffer.for_model(jm, (1, 8, 8), class_conditional=True))
    loss_fn(jm, x, y)
    buf = loss_fn.buffer
    assert (buf.capacity, buf.sample_shape, buf.reinit_freq, buf.num_classes) == (10000, (1, 8, 8), 0.05, K)
    state = loss_fn.state_dict()
    assert "buffer.data" in state

    resumed = make()
    resumed.load_state_dict(state)  # builds the buffer from its saved arguments
    assert torch.equal(resumed.buffer.data, buf.data)
    a, b = loss_fn(jm, x, y), resumed(jm, x, y)
    assert a.loss.item() == b.loss.item()
    assert torch.equal(resumed.buffer.data, loss_fn.buffer.data)


def test_given_buffer_is_a_submodule_and_used():
    jm = jem.wrap(small_net())
    buf = ReplayBuffer(100, (1, 8, 8))
    loss_fn = JEMLoss(SGLD(steps=1), buffer=buf)
    assert loss_fn.buffer is buf and "buffer.data" in loss_fn.state_dict()
    loss_fn(jm, *batch(8))
    assert bool(buf.initialized)


def test_ce_only_needs_no_samples():
    net = small_net()
    jm = jem.wrap(net)
    calls = []
    net.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    loss_fn = JEMLoss(SGLD(steps=5), px_weight=0.0, data_noise=0.0)  # no buffer: none needed
    x, y = batch(8)
    out = loss_fn(jm, x, y)
    assert calls == [8] and loss_fn.buffer is None
    assert out.loss.item() == pytest.approx(F.cross_entropy(net(x), y).item())


def test_energy_l2_has_one_knob_l2_weight():
    torch.manual_seed(0)
    jm = jem.wrap(small_net())
    x, y = batch()
    x_q = torch.rand(8, 1, 8, 8)
    a = JEMLoss(FixedSampler(x_q), buf(), l2_weight=0.3, data_noise=0.0)(jm, x, y)
    with torch.no_grad():
        e_data, e_q = -torch.logsumexp(jm(x), 1), -torch.logsumexp(jm(x_q), 1)
    expected = e_data.pow(2).mean() + e_q.pow(2).mean()
    assert a.metrics["l2"] == pytest.approx(expected.item(), rel=1e-5)
    assert a.loss.item() == pytest.approx(a.metrics["ce"] + a.metrics["px"] + 0.3 * expected.item(), rel=1e-5)
    with pytest.raises(UnknownNameError, match="energy_l2"):  # no second way to ask for it
        JEMLoss(SGLD()).add_term("energy_l2", weight=0.3)


def test_sampler_is_a_plain_attribute_unless_it_is_a_module():
    loss_fn = JEMLoss(SGLD(steps=1))
    other = SGLD(steps=3)
    loss_fn.sampler = other  # swapping samplers keeps it out of the module tree
    assert loss_fn.sampler is other and "sampler" not in dict(loss_fn.named_children())
    assert loss_fn.state_dict()["_extra_state"]["sampler"]["steps"] == 3

    class ModuleSampler(nn.Module):  # a sampler with its own parameters is an ordinary submodule
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    ms = ModuleSampler()
    loss_fn.sampler = ms
    assert loss_fn.sampler is ms and "sampler.scale" in loss_fn.state_dict()
    del loss_fn.sampler  # torch's rule for a child module: delete it before assigning a non-module
    loss_fn.sampler = other
    assert loss_fn.sampler is other and "sampler.scale" not in loss_fn.state_dict()


def test_unknown_term_lists_choices():
    with pytest.raises(UnknownNameError, match="available: .*energy_bounded"):
        JEMLoss(SGLD()).add_term("no_such_term")


class ConstTermPlugin:
    @plugins.hookimpl
    def jem_register_loss_terms(self, register):
        def factory(value=1.0):
            def term(jm, b: LossBatch):
                assert b.logits_sample is not None and b.logits_data.shape[0] == b.x.shape[0]
                return b.logits_data.new_tensor(value), {"seen": float(b.x_sample.shape[0])}

            term.needs_samples = True
            return term

        register("const", factory)


def test_third_party_term_through_the_hook():
    plugin = ConstTermPlugin()
    name = plugins.register(plugin, name="const-term-test")
    try:
        jm = jem.wrap(small_net())
        x, y = batch()
        loss_fn = JEMLoss(FixedSampler(torch.rand(8, 1, 8, 8)), buf(), px_weight=0.0, data_noise=0.0)
        loss_fn.add_term("const", value=2.5)
        out = loss_fn(jm, x, y)
        assert out.metrics["const"] == 2.5 and out.metrics["const/seen"] == 8.0
        assert out.loss.item() == pytest.approx(out.metrics["ce"] + 2.5, rel=1e-6)
    finally:
        plugins.unregister(name=name)


@pytest.mark.parametrize(
    "bad_y, match",
    [
        (torch.tensor([0, 1, 2, 10, 3, 4, 5, 6]), r"\[0, 10\).*from 0 to 10"),
        (torch.tensor([0, 1, 2, -1, 3, 4, 5, 6]), r"from -1 to 6"),
        (torch.zeros(8), "integer class indices"),
        (torch.zeros(7, dtype=torch.long), r"shape \[8\]"),
    ],
)
def test_bad_labels_are_clear_errors(bad_y, match):
    jm = jem.wrap(small_net(), num_classes=K)
    x, _ = batch(8)
    with pytest.raises(InvalidLabelError, match=match):
        JEMLoss(SGLD(steps=1), buf())(jm, x, bad_y)


def test_label_range_checked_even_when_num_classes_unknown_before_first_forward():
    jm = jem.wrap(small_net())
    x, _ = batch(8)
    y = torch.full((8,), 12)
    with pytest.raises(InvalidLabelError, match=r"\[0, 10\)"):
        JEMLoss(SGLD(steps=1), px_weight=0.0)(jm, x, y)


def test_loss_never_mutates_the_adapter_and_learns_num_classes_once_on_the_jem():
    # A hand-written adapter that does not know the class count: the JEM learns it from the first
    # forward (once); the adapter is never written.
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 6))
    jm = jem.JEM(net, jem.Adapter("plain"))
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 5, 2, 3])
    JEMLoss(SGLD(steps=1), px_weight=0.0)(jm, x, y)  # CE only: the class count is not needed
    assert jm.adapter.num_classes is None
    with pytest.raises(InvalidLabelError, match=r"\[0, 6\)"):  # the range is still checked
        JEMLoss(SGLD(steps=1), px_weight=0.0)(jm, x, torch.tensor([0, 6, 1, 1]))
    assert jm.num_classes == 6
    for kwargs in ({"pxy_weight": 1.0}, {"class_conditional_px": True}):
        fresh = jem.JEM(nn.Sequential(nn.Flatten(), nn.Linear(64, 6)), jem.Adapter("plain"))
        out = JEMLoss(SGLD(steps=1), buf(6), **kwargs)(fresh, x, y)  # class-conditional sampling needs K
        assert torch.isfinite(out.loss) and fresh.num_classes == 6
        assert fresh.adapter.num_classes is None
    assert jm.adapter.num_classes is None


def test_bad_inputs_are_clear_errors():
    jm = jem.wrap(small_net())
    _, y = batch(8)
    with pytest.raises(InvalidInputError, match="floating-point"):
        JEMLoss(SGLD(steps=1))(jm, torch.zeros(8, 1, 8, 8, dtype=torch.long), y)
    with pytest.raises(TypeError, match="wrap"):
        JEMLoss(SGLD(steps=1))(small_net(), torch.zeros(8, 1, 8, 8), y)
    loss_fn = JEMLoss(SGLD(steps=1), buffer=ReplayBuffer(10, (1, 4, 4)))
    with pytest.raises(InvalidInputError, match="sample_shape"):
        loss_fn(jm, torch.zeros(8, 1, 8, 8), y)
    with pytest.raises(ValueError, match="px_weight"):
        JEMLoss(SGLD(), px_weight=-1)


def test_class_conditional_px_draws_random_labels():
    jm = jem.wrap(small_net(), num_classes=K)
    sampler = FixedSampler(None, torch.rand(8, 1, 8, 8))
    JEMLoss(sampler, buf(K), class_conditional_px=True, generator=torch.Generator().manual_seed(0))(jm, *batch(8))
    y = sampler.calls[0]["y"]
    assert y is not None and y.shape == (8,) and 0 <= int(y.min()) and int(y.max()) < K


class Classifier(GenerativeLossMixin, nn.Module):
    def __init__(self):
        super().__init__()
        self.net = small_net()
        self.configure_jem("net", sampler=SGLD(steps=2), buffer=buf(), pxy_weight=0.0, l2_weight=0.1)

    def forward(self, x):
        return self.net(x)


def test_mixin_owns_the_buffer_in_its_state_dict_and_trains():
    torch.manual_seed(0)
    model = Classifier()
    assert model.jem.model is model.net
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in model.net.parameters())
    x, y = batch(16)
    losses = []
    for _ in range(15):
        out = model.generative_loss(x, y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.metrics["ce"])
    assert losses[-1] < losses[0]
    state = model.state_dict()
    assert "jem_loss.buffer.data" in state
    assert not any(k.startswith("jem.") for k in state)  # classifier weights are not duplicated
    fresh = Classifier()
    fresh.load_state_dict(state)
    assert torch.equal(fresh.jem_loss.buffer.data, model.jem_loss.buffer.data)
    assert torch.equal(fresh.net[0].weight, model.net[0].weight)


def test_mixin_misuse_is_explained():
    class NoSetup(GenerativeLossMixin, nn.Module):
        pass

    with pytest.raises(AttributeError, match="configure_jem"):
        NoSetup().generative_loss(*batch(2))

    class Early(GenerativeLossMixin, nn.Module):
        def __init__(self):
            self.configure_jem("net")

    with pytest.raises(TypeError, match="super"):
        Early()

    class Missing(GenerativeLossMixin, nn.Module):
        def __init__(self):
            super().__init__()
            self.configure_jem("backbone")

    with pytest.raises(AttributeError, match="backbone"):
        Missing()


def test_terms_are_added_by_name_and_validate_is_an_attribute():
    loss_fn = JEMLoss(SGLD())
    term = loss_fn.add_term("energy_bounded", outliers="uniform", weight=0.3)
    assert dict(loss_fn._all_terms())["energy_bounded"] is term and term.weight == 0.3
    assert loss_fn.state_dict()["_extra_state"]["term_kwargs"] == {
        "energy_bounded": {"outliers": "uniform", "weight": 0.3}
    }
    assert JEMLoss(SGLD()).validate is True
    params = inspect.signature(JEMLoss.__init__).parameters
    assert len([n for n in params if n != "self"]) <= 10
    assert not [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]  # one spelling per setting
    for old in ("terms", "validate", "batchnorm", "clamp_data"):
        with pytest.raises(TypeError, match=old):
            JEMLoss(SGLD(), **{old: None})
