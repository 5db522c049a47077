"""PGD-made negatives and the logistic contrast term (after DAT): what a user of them relies on."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import plugins
from jem_plugin.builtins.pgd_negatives import (
    TERM_NAME,
    LogisticContrastTerm,
    PGDNegatives,
    dat_setup,
    logistic_contrast,
)
from jem_plugin.extensions import RecomputeBatchNorm
from jem_plugin.losses import LOSS_TERMS_HOOK, LossBatch

SHAPE = (1, 8, 8)


def _jm(model: nn.Module | None = None):
    from conftest import TinyCNN  # BatchNorm + Dropout: the layers that break naive code

    return jem.wrap(model if model is not None else TinyCNN(), data_range=(-1, 1), input_size=SHAPE)


def _energy(jm, x, y=None):
    with torch.no_grad(), jem.model.sampling_mode(jm):
        logits = jm(x)
    return -torch.logsumexp(logits, 1) if y is None else -logits.gather(1, y.view(-1, 1)).squeeze(1)


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8 - 1
    return x, torch.tensor(digits.target)


# ---------------------------------------------------------------------------- the negatives
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_negatives_have_lower_energy_than_their_starts(norm):
    jm = _jm()
    x0 = jm.domain.uniform(32, SHAPE, generator=torch.Generator().manual_seed(1))
    x = PGDNegatives(steps=10, step_size=0.2 if norm == "l2" else 0.02, norm=norm).run(jm, x0)
    assert (_energy(jm, x) < _energy(jm, x0)).all()
    y = torch.arange(32) % 10  # class-conditional chains descend E(x, y) = -f(x)[y]
    xy = PGDNegatives(steps=10, norm=norm).run(jm, x0, y)
    assert (_energy(jm, xy, y) < _energy(jm, x0, y)).all()
    assert x.shape == x0.shape and not x.requires_grad and x0.abs().max() <= 1


def test_steps_have_the_asked_length_and_stay_in_the_ball_and_domain():
    jm = _jm()
    x0 = torch.zeros(8, *SHAPE)  # mid-domain: one step cannot reach the bounds
    one = PGDNegatives(steps=1, step_size=0.3).run(jm, x0)
    assert torch.allclose((one - x0).flatten(1).norm(dim=1), torch.full((8,), 0.3), atol=1e-5)
    far = PGDNegatives(steps=30, step_size=0.5, eps=1.0).run(jm, x0)
    assert (far - x0).flatten(1).norm(dim=1).max() <= 1.0 + 1e-5
    box = PGDNegatives(steps=5, step_size=0.1, eps=0.15, norm="linf").run(jm, x0)
    assert (box - x0).abs().max() <= 0.15 + 1e-6
    edge = PGDNegatives(steps=30, step_size=3.0).run(jm, jm.domain.uniform(8, SHAPE))
    assert edge.min() >= -1 and edge.max() <= 1
    assert PGDNegatives(steps=0).run(jm, x0).equal(x0)
    # The default step is DAT's 0.1 of [0, 1] pixels: 0.2 on a [-1, 1] domain.
    assert PGDNegatives().step_length(jm) == pytest.approx(0.2)


@pytest.mark.parametrize("batchnorm", ["joint", "separate"])
def test_generating_leaves_the_model_as_it_was(batchnorm):
    jm = _jm()
    model = jm.model
    model.train()
    model.head.weight.requires_grad_(False)  # the user's own frozen layer stays frozen
    model.head.bias.grad = torch.ones_like(model.head.bias)  # and a gradient they hold stays theirs
    bn = model.features[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    sampler = PGDNegatives(steps=5, batchnorm=batchnorm)
    buffer = jem.ReplayBuffer(64, SHAPE, reinit_freq=1.0)
    sampler.sample(jm, 16, buffer=buffer)
    sampler.sample(jm, y=torch.arange(10))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm running statistics and batch counters included
    assert int(bn.num_batches_tracked) == int(before["features.1.num_batches_tracked"])
    assert all(m.training == was for m, was in flags)
    assert all(p.requires_grad == was for p, was in grads)
    assert model.head.bias.grad.equal(torch.ones_like(model.head.bias))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "head.bias")


def test_works_under_no_grad_and_inference_mode_and_repeats_with_a_generator():
    jm = _jm()
    with torch.no_grad():
        a = PGDNegatives(steps=3, generator=torch.Generator().manual_seed(0)).sample(jm, 8)
    with torch.inference_mode():
        b = PGDNegatives(steps=3, generator=torch.Generator().manual_seed(0)).sample(jm, 8)
    assert torch.equal(a, b)


def test_diagnostics_are_sglds():
    jm = _jm()
    x, diag = PGDNegatives(steps=4).sample(jm, 6, return_diagnostics=True, record_energies=True, record_trajectory=True)
    assert isinstance(diag, jem.SGLDDiagnostics)
    assert diag.steps == 4 and diag.final_step_size == pytest.approx(0.2)
    assert diag.energies.shape == (5, 6) and len(diag.trajectory) == 5
    assert torch.equal(diag.trajectory[-1], x)
    assert (diag.energies[-1] < diag.energies[0]).all()
    with pytest.raises(ValueError, match="return_diagnostics"):
        PGDNegatives().sample(jm, 2, record_energies=True)


def test_the_buffer_gives_starts_and_keeps_the_negatives():
    jm = _jm()
    buffer = jem.ReplayBuffer(4, SHAPE, reinit_freq=1.0)
    x = PGDNegatives(steps=2).sample(jm, 64, buffer=buffer)  # every slot drawn (with replacement)
    # Each slot holds a negative of this draw (the last one made from it): the buffer shows them.
    assert all(any(torch.equal(s, xi) for xi in x) for s in buffer.samples())


def test_bad_settings_are_refused():
    for kwargs in (
        {"steps": -1},
        {"step_size": 0},
        {"eps": 0},
        {"norm": "l1"},
        {"batchnorm": "eval"},
        {"start_steps": 30},
        {"auc_threshold": 0.2},
        {"auc_window": 0},
    ):
        with pytest.raises((ValueError, TypeError)):
            PGDNegatives(**kwargs)


def test_the_curriculum_adds_a_step_when_the_auc_holds():
    sampler = PGDNegatives(steps=2, start_steps=0, auc_threshold=0.8, auc_window=3)
    assert sampler.current_steps == 0
    assert not sampler.observe_auc(0.9) and not sampler.observe_auc(0.9)
    assert sampler.observe_auc(0.9) and sampler.current_steps == 1  # a full window at the threshold
    for auc in (0.7, 0.8, 0.8):
        assert not sampler.observe_auc(auc)  # mean 0.77: not yet
    assert sampler.observe_auc(0.95) and sampler.current_steps == 2
    for _ in range(5):
        assert not sampler.observe_auc(1.0)  # at steps: no further
    assert PGDNegatives(steps=3).current_steps == 3 and not PGDNegatives(steps=3).observe_auc(1.0)


# ---------------------------------------------------------------------------- the loss term
def test_registered_through_the_loss_term_hook():
    entry = plugins.lookup(LOSS_TERMS_HOOK, TERM_NAME, "loss term")
    assert entry["item"] is LogisticContrastTerm
    assert "jem_plugin.builtins.pgd_negatives" in plugins.BUILTIN_PLUGINS


def test_term_value_and_gradient_by_hand_on_a_linear_model():
    torch.manual_seed(3)
    linear = nn.Linear(3, 4).double()
    jm = jem.wrap(linear, data_range=(-1, 1))
    x_data, x_neg = torch.rand(5, 3).double() * 2 - 1, torch.rand(7, 3).double() * 2 - 1
    logits_d, logits_n = jm(x_data), jm(x_neg)
    batch = LossBatch(
        x=x_data,
        y=torch.zeros(5, dtype=torch.long),
        x_data=x_data,
        logits_data=logits_d,
        energy_data=-torch.logsumexp(logits_d, 1),
        x_sample=x_neg,
        logits_sample=logits_n,
        energy_sample=-torch.logsumexp(logits_n, 1),
    )
    weight, offset = 0.7, 0.4
    loss, metrics = LogisticContrastTerm(weight, offset)(jm, batch)
    loss.backward()

    # By hand: E(x) = -log sum_k exp(W x + b)_k, sigma the logistic function.
    W, b = linear.weight.detach(), linear.bias.detach()

    def parts(x):
        z = x @ W.T + b
        p = torch.exp(z - z.max(1, keepdim=True).values)
        p = p / p.sum(1, keepdim=True)  # softmax: dE/dz = -p
        return -(z.max(1).values + torch.log(torch.exp(z - z.max(1, keepdim=True).values).sum(1))), p

    e_d, p_d = parts(x_data)
    e_n, p_n = parts(x_neg)
    sig = lambda t: 1 / (1 + torch.exp(-t))  # noqa: E731  (a one-line helper: the logistic function)
    expected = (
        weight * 0.5 * (torch.log1p(torch.exp(e_d - offset)).mean() + torch.log1p(torch.exp(offset - e_n)).mean())
    )
    # d softplus(E - c)/dE = sigma(E - c); d softplus(c - E)/dE = -sigma(c - E); dE/dW = -p x^T, dE/db = -p
    a_d = sig(e_d - offset) / len(e_d)
    a_n = -sig(offset - e_n) / len(e_n)
    grad_w = weight * 0.5 * (-(a_d[:, None] * p_d).T @ x_data - (a_n[:, None] * p_n).T @ x_neg)
    grad_b = weight * 0.5 * (-(a_d[:, None] * p_d).sum(0) - (a_n[:, None] * p_n).sum(0))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(linear.weight.grad, grad_w, rtol=1e-10, atol=1e-12)
    assert torch.allclose(linear.bias.grad, grad_b, rtol=1e-10, atol=1e-12)
    assert logistic_contrast(batch.energy_data, batch.energy_sample, offset).item() == pytest.approx(
        expected.item() / weight, rel=1e-12
    )
    auc = ((e_d[:, None] < e_n[None, :]).double().mean()).item()
    assert float(metrics["auc"]) == pytest.approx(auc)


def test_term_refuses_a_batch_without_negatives_and_bad_settings():
    jm = _jm()
    logits = jm(torch.zeros(2, *SHAPE))
    batch = LossBatch(
        x=torch.zeros(2, *SHAPE),
        y=torch.zeros(2, dtype=torch.long),
        x_data=torch.zeros(2, *SHAPE),
        logits_data=logits,
        energy_data=-torch.logsumexp(logits, 1),
    )
    with pytest.raises(jem.errors.InvalidInputError, match="negatives"):
        LogisticContrastTerm()(jm, batch)
    for kwargs in ({"weight": -1.0}, {"offset": math.inf}, {"curriculum": object()}):
        with pytest.raises((ValueError, TypeError)):
            LogisticContrastTerm(**kwargs)


# ---------------------------------------------------------------------------- through JEMLoss
def test_through_jem_loss_end_to_end():
    jm = _jm()
    g = torch.Generator().manual_seed(0)
    sampler = PGDNegatives(steps=3, start_steps=1, auc_window=1, auc_threshold=0.5, generator=g)
    buffer = jem.ReplayBuffer(64, SHAPE, reinit_freq=1.0)
    loss_fn = jem.JEMLoss(sampler, buffer, px_weight=0.0, data_noise=0.0, n_samples=8, generator=g)
    loss_fn.add_term(TERM_NAME, weight=0.5, curriculum=sampler)
    assert loss_fn.samples_needed and loss_fn.clamps_data() and loss_fn.batchnorm == "joint"
    x, y = jm.domain.uniform(16, SHAPE), torch.arange(16) % 10
    jm.trained_px = None
    with loss_fn.reusing_samples() as replay:
        out = loss_fn(jm, x, y)
    out.loss.backward()
    ((x_neg, _),) = replay.draws
    assert x_neg.shape == (8, *SHAPE) and buffer.has_samples
    assert out.metrics["loss"] == pytest.approx(out.metrics["ce"] + out.metrics[TERM_NAME], rel=1e-5)
    assert f"{TERM_NAME}/auc" in out.metrics and out.metrics[f"{TERM_NAME}/steps"] >= 1
    assert "px" in out.metrics and jm.trained_px is True  # the term trains log p(x) and says so
    assert all(p.grad is not None for p in jm.parameters())

    # The curriculum's place and the generator travel with the loss's state.
    sampler.current_steps = 2
    state = loss_fn.state_dict()
    fresh = PGDNegatives(steps=3, start_steps=1)
    other = jem.JEMLoss(fresh, jem.ReplayBuffer(64, SHAPE, reinit_freq=1.0), px_weight=0.0)
    other.add_term(TERM_NAME, weight=0.5)
    other.load_state_dict(state)
    assert fresh.current_steps == 2 and fresh.generator is not None
    assert torch.equal(fresh.generator.get_state(), g.get_state())

    # Validation (no gradients) neither writes the buffer nor moves the curriculum.
    before, steps = buffer.samples(), sampler.current_steps
    with torch.no_grad():
        loss_fn(jm, x, y)
    assert torch.equal(buffer.samples(), before) and sampler.current_steps == steps


def test_dat_setup_builds_the_pieces():
    jm = _jm()
    x, y = _digits()
    setup = dat_setup(jm, (x[:200], y[:200]), steps=4, curriculum=True, total_iters=10, batch_size=32)
    loss = setup.loss
    assert isinstance(setup.sampler, PGDNegatives) and loss.sampler is setup.sampler
    assert setup.sampler.current_steps == 0 and setup.sampler.steps == 4
    assert loss.px_weight == 0.0 and loss.n_samples == 32 and setup.buffer.reinit_freq == 1.0
    assert TERM_NAME in loss._term_kwargs
    # Negatives through BatchNorm with the data, running statistics recomputed from the data after.
    assert setup.sampler.batchnorm == "joint"
    assert any(isinstance(e, RecomputeBatchNorm) for e in setup.extensions)
    out = loss(jm, x[:32], y[:32])
    out.loss.backward()
    assert math.isfinite(out.metrics["loss"])


def test_a_short_training_on_digits_raises_log_px_auroc_against_noise():
    from sklearn.metrics import roc_auc_score

    x, y = _digits()
    x_train, y_train, x_test = x[:1200], y[:1200], x[1200:1500]
    torch.manual_seed(0)
    jm = jem.wrap(nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 10)), data_range=(-1, 1))
    noise = jm.domain.uniform(300, SHAPE, generator=torch.Generator().manual_seed(1))

    def auroc() -> float:
        with torch.no_grad():
            scores = torch.cat([torch.logsumexp(jm(x_test), 1), torch.logsumexp(jm(noise), 1)])
        return float(roc_auc_score([1] * 300 + [0] * 300, scores.numpy()))

    untrained = auroc()
    g = torch.Generator().manual_seed(0)
    loss_fn = jem.JEMLoss(
        PGDNegatives(steps=5, generator=g), jem.ReplayBuffer(256, SHAPE, reinit_freq=1.0), px_weight=0.0, generator=g
    )
    loss_fn.add_term(TERM_NAME)
    optimizer = torch.optim.Adam(jm.parameters(), lr=1e-3)
    for _ in range(100):
        idx = torch.randint(0, len(x_train), (64,), generator=g)
        out = loss_fn(jm, x_train[idx], y_train[idx])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert auroc() > untrained + 0.15
    assert out.metrics[f"{TERM_NAME}/auc"] > 0.8  # the energy tells data from its own negatives
    assert out.metrics["acc"] > 0.8


def test_the_cost_check_builds_and_runs_its_contenders():
    from benchmarks.check_pgd_negatives_cost import build_contenders

    contenders = build_contenders("digits_cnn", batch=8, dat_steps=(1,), per_class=150)
    assert set(contenders) == {"ce", "default", "fast", "dat_1"}
    for contender in contenders.values():
        contender.fn()
