"""SAM for JEM: BatchNorm statistics frozen on the second pass, weights restored before the base
step, one sampling per iteration."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin.sam import SAM, frozen_bn_stats, reuse_samples


class BNNet(nn.Module):  # hand-written: conv + BatchNorm + linear head
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class CountingSampler:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def sample(self, *a, **kw):
        self.calls += 1
        return self.inner.sample(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _setup(seed=0):
    torch.manual_seed(seed)
    model = BNNet()
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(3, 8, 8), num_classes=5)
    sampler = CountingSampler(jem.SGLD(steps=2, generator=torch.Generator().manual_seed(1)))
    buffer = jem.ReplayBuffer(50, (3, 8, 8))
    loss_fn = jem.JEMLoss(sampler, buffer, data_noise=0.0)
    x = torch.rand(6, 3, 8, 8) * 2 - 1
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    return model, jm, sampler, buffer, loss_fn, x, y


def _bn_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def test_second_pass_leaves_bn_statistics_and_samples_once():
    model, jm, sampler, buffer, loss_fn, x, y = _setup()
    model.train()
    sam = SAM(torch.optim.SGD(model.parameters(), lr=0.1), rho=2.0, adaptive=True)
    seen, after_first = [], {}

    def closure():
        out = loss_fn(jm, x, y)
        out.loss.backward()
        seen.append(buffer.data.clone())
        if not after_first:
            after_first.update(_bn_state(model))
        return out

    before = _bn_state(model)
    sam.step(closure, model=model, loss_fn=loss_fn)
    final = _bn_state(model)
    assert sampler.calls == 1, "the second pass must reuse the first pass's samples"
    assert torch.equal(seen[0], seen[1]), "the replay buffer must not be written twice"
    assert not torch.equal(before["bn.running_mean"], after_first["bn.running_mean"]), "first pass updates BN"
    for k in final:
        assert torch.equal(final[k], after_first[k]), f"{k} changed on the second pass"
    assert loss_fn.sampler is sampler, "the real sampler is put back"


def test_base_step_starts_from_the_restored_weights_with_the_perturbed_gradient():
    model, jm, _, _, loss_fn, x, y = _setup()
    model.eval()  # deterministic forward: the gradient at w + e can be recomputed by hand
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    sam = SAM(base, rho=0.5, adaptive=False)
    w0 = [p.detach().clone() for p in model.parameters()]
    seen_at_step = []
    real_step = base.step
    base.step = lambda *a, **k: (
        seen_at_step.append([p.detach().clone() for p in model.parameters()]),
        real_step(*a, **k),
    )[1]
    fixed = torch.rand(6, 3, 8, 8) * 2 - 1  # samples fixed so both passes see the same loss

    def loss_at(m):
        logits = m(torch.cat([x, fixed]))
        return nn.functional.cross_entropy(logits[:6], y) + torch.logsumexp(logits[6:], 1).mean()

    def closure():
        loss = loss_at(model)
        loss.backward()
        return loss

    # the expected update, by hand
    ref = copy.deepcopy(model)
    g = torch.autograd.grad(loss_at(ref), list(ref.parameters()))
    norm = torch.sqrt(sum((gi**2).sum() for gi in g))
    with torch.no_grad():
        for p, gi in zip(ref.parameters(), g):
            p.add_(0.5 * gi / norm)
    g2 = torch.autograd.grad(loss_at(ref), list(ref.parameters()))

    sam.step(closure, model=model)
    for w, seen in zip(w0, seen_at_step[0]):
        assert torch.equal(w, seen), "the base optimiser must step from the restored weights"
    for w, gi, p in zip(w0, g2, model.parameters()):
        torch.testing.assert_close(p.detach(), w - 0.1 * gi, rtol=1e-4, atol=1e-6)


def test_frozen_bn_stats_restores_a_torchvision_resnet():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(weights=None, num_classes=3).train()
    before = _bn_state(model)
    with frozen_bn_stats(model):
        model(torch.randn(2, 3, 32, 32))
    after = _bn_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sam_refuses_bad_arguments():
    p = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="rho"):
        SAM(torch.optim.SGD(p, lr=0.1), rho=0)
    with pytest.raises(TypeError, match="Optimizer"):
        SAM(p)
    with pytest.raises(RuntimeError, match="backward"):
        SAM(torch.optim.SGD(p, lr=0.1)).first_step()


def test_frozen_pass_does_not_break_a_graph_built_before_it():
    # A train-mode pass before the block, a frozen pass inside, one backward after: the frozen
    # pass must not modify the running statistics in place (autograd saved them).
    torch.manual_seed(0)
    model = BNNet().train()
    a = model(torch.randn(4, 3, 8, 8))
    before = _bn_state(model)
    with frozen_bn_stats(model):
        b = model(torch.randn(4, 3, 8, 8))
    (a.sum() + b.sum()).backward()
    after = _bn_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.bn.track_running_stats


class OldReplay:
    """What ``sam.reuse_samples`` swapped in for the sampler before JEMLoss.reusing_samples: it
    records the first pass's draws and hands them back, in order, once ``replaying`` is set."""

    def __init__(self, inner):
        self.inner, self.recorded, self.replaying = inner, [], False

    def sample(self, jm, n=None, **kwargs):
        if not self.replaying:
            x = self.inner.sample(jm, n, **kwargs)
            self.recorded.append(x)
            return x
        return self.recorded.pop(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sam_run(new_api: bool, iterations: int = 3):
    """``iterations`` SAM steps of a JEMLoss with p(x), p(x|y) and data noise on a BatchNorm net:
    the final weights, buffer, losses and the sampler's call count."""
    torch.manual_seed(0)
    model = BNNet().train()
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(3, 8, 8), num_classes=5)
    sampler = CountingSampler(jem.SGLD(steps=2, generator=torch.Generator().manual_seed(1)))
    buffer = jem.ReplayBuffer(50, (3, 8, 8), num_classes=5)
    loss_fn = jem.JEMLoss(sampler, buffer, pxy_weight=0.5, l2_weight=0.1, generator=torch.Generator().manual_seed(2))
    sam = SAM(torch.optim.SGD(model.parameters(), lr=0.05), rho=0.5, adaptive=True)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(iterations):
        x, y = torch.rand(6, 3, 8, 8, generator=g) * 2 - 1, torch.randint(0, 5, (6,), generator=g)

        def closure(x=x, y=y):
            out = loss_fn(jm, x, y)
            out.loss.backward()
            losses.append(out.loss.detach())
            return out

        if new_api:
            sam.step(closure, model=model, loss_fn=loss_fn)
        else:  # the loop SAM.step ran before, with the old sampler proxy
            replay = OldReplay(loss_fn.sampler)
            loss_fn.sampler = replay
            sam.zero_grad()
            closure()
            sam.first_step(zero_grad=True)
            replay.replaying = True
            with frozen_bn_stats(model):
                closure()
            sam.second_step(zero_grad=True)
            loss_fn.sampler = replay.inner
    return [p.detach().clone() for p in model.state_dict().values()], buffer.data.clone(), losses, sampler.calls


def test_sam_with_reusing_samples_draws_once_per_iteration_and_matches_the_old_replay_bit_for_bit():
    weights, data, losses, calls = _sam_run(new_api=True)
    assert calls == 3 * 2, "one p(x) and one p(x|y) draw per iteration, none on the second pass"
    old_weights, old_data, old_losses, old_calls = _sam_run(new_api=False)
    assert old_calls == calls
    assert len(losses) == len(old_losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(losses, old_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, old_weights))
    assert torch.equal(data, old_data)
    assert not torch.equal(losses[0], losses[1]), "the second pass is at the perturbed weights"


def test_reusing_samples_records_the_first_forward_and_replays_it_to_every_later_one():
    model, jm, sampler, buffer, loss_fn, x, y = _setup()
    with loss_fn.reusing_samples() as replay:
        first = loss_fn(jm, x, y)
        after_first = buffer.data.clone()
        assert replay.replaying and len(replay.draws) == 1
        second, third = loss_fn(jm, x, y), loss_fn(jm, x, y)
    assert sampler.calls == 1 and torch.equal(buffer.data, after_first)
    assert second.metrics["energy_sample"] == third.metrics["energy_sample"]
    assert first.metrics["energy_sample"] == second.metrics["energy_sample"]  # same weights, same samples
    loss_fn(jm, x, y)  # outside the block: draws again
    assert sampler.calls == 2
    with pytest.raises(RuntimeError, match="nest"):
        with loss_fn.reusing_samples(), loss_fn.reusing_samples():
            pass


def test_reuse_samples_keeps_the_loops_written_for_it_working():
    model, jm, sampler, buffer, loss_fn, x, y = _setup()
    with reuse_samples(loss_fn) as replay:  # the old public spelling, flipped by hand
        loss_fn(jm, x, y)
        replay.replaying = True
        loss_fn(jm, x, y)
    assert sampler.calls == 1 and loss_fn.sampler is sampler


def test_sam_step_refuses_a_loss_that_cannot_reuse_samples():
    model, jm, sampler, buffer, loss_fn, x, y = _setup()
    sam = SAM(torch.optim.SGD(model.parameters(), lr=0.1))

    class PlainLoss:  # what SAM.step(loss_fn=) took before: anything with a sampler
        def __init__(self, sampler):
            self.sampler = sampler

    with pytest.raises(TypeError, match="reusing_samples"):
        sam.step(lambda: None, model=model, loss_fn=PlainLoss(sampler))
    assert sampler.calls == 0
