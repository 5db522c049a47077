"""DivergenceGuard: forced divergences are caught; raise names the remedies; rollback restores bitwise."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import GenerativeLossMixin
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.errors import DivergenceError
from jem_plugin.losses import JEMLoss, LossOutput
from jem_plugin.sampling import SGLD
from jem_plugin.stability import DivergenceGuard, GuardLimits


def setup(lr=1e-3, **guard_kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.SiLU(), nn.Linear(16, 4))
    jm = jem.wrap(net, num_classes=4)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loss_fn = JEMLoss(SGLD(steps=2, step_size=1.0), ReplayBuffer(64, (1, 8, 8)))
    guard = DivergenceGuard(jm, opt, loss_fn=loss_fn, **guard_kwargs)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(16, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 4, (16,), generator=g)
    return net, jm, opt, loss_fn, guard, (x, y)


def train_step(jm, opt, loss_fn, guard, x, y):
    """The documented loop body; returns the metrics, or None when the step was rolled back."""
    with guard:
        out = loss_fn(jm, x, y)
        guard.check(out)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        return out.metrics
    return None


def blow_up(net, factor=1e20):
    with torch.no_grad():
        net[-1].weight.mul_(factor)


def states(jm, opt, loss_fn):
    clone = lambda sd: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in sd.items()}
    return {
        "model": clone(jm.state_dict()),
        "buffer": loss_fn.buffer.data.clone(),
        "opt": {i: clone(s) for i, s in opt.state_dict()["state"].items()},
        "gen": loss_fn.state_dict()["_extra_state"],
    }


def test_healthy_training_passes_and_snapshots_only_every_n(monkeypatch):
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="rollback", snapshot_every=5)
    taken = []
    original = guard.snapshot
    monkeypatch.setattr(guard, "snapshot", lambda it=None: (taken.append(it), original(it)))
    for _ in range(12):
        assert train_step(jm, opt, loss_fn, guard, x, y) is not None
    assert taken == [0, 5, 10] and guard.rollbacks == 0


@pytest.mark.parametrize("how", ["explode", "nan"])
def test_raise_policy_names_iteration_values_and_remedies(how):
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="raise")
    for _ in range(3):
        train_step(jm, opt, loss_fn, guard, x, y)
    if how == "explode":
        blow_up(net)  # energies ~1e20: finite, so only the guard's threshold catches it
        match = r"iteration 3: \|energy_\w+\| = .*e\+\d\d exceeds max_abs_energy=1e\+04"
    else:
        with torch.no_grad():
            net[-1].bias.fill_(float("nan"))  # the sampler itself raises on non-finite chains
        match = "non-finite"
    with pytest.raises(DivergenceError, match=match) as info:
        train_step(jm, opt, loss_fn, guard, x, y)
    msg = str(info.value)
    for remedy in ("l2_weight", "SGLD(step_size", "learning rate", "checkpoint"):
        assert remedy in msg
    err = info.value  # fields, not a message to parse
    assert err.iteration == 3 and err.remedies == jem.stability.DIVERGENCE_REMEDIES
    assert "Known remedies" not in err.reason and "iteration" not in err.reason
    if how == "explode":
        assert "exceeds max_abs_energy" in err.reason and err.energy > 1e4
        assert set(err.metrics) >= {"loss", "energy_data"}
    else:
        assert err.reason.startswith("SGLD diverged") and isinstance(err.__cause__, DivergenceError)


def test_rollback_restores_snapshot_bitwise_and_training_continues_finite():
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="rollback", snapshot_every=3)
    lr0, step0 = opt.param_groups[0]["lr"], loss_fn.sampler.step_size
    recorded = {}
    original = guard.snapshot

    def spy(it=None):  # what the guard saw when it snapshotted, copied independently
        original(it)
        recorded[guard.snapshot_iteration] = states(jm, opt, loss_fn)

    guard.snapshot = spy
    for _ in range(9):  # snapshots at iterations 0, 3, 6; iterations 7 and 8 move everything on
        assert train_step(jm, opt, loss_fn, guard, x, y) is not None
    snap_it = guard.snapshot_iteration
    assert snap_it == 6
    expected = recorded[6]
    assert not torch.equal(states(jm, opt, loss_fn)["buffer"], expected["buffer"])
    assert not torch.equal(jm.state_dict()["model.1.weight"], expected["model"]["model.1.weight"])

    blow_up(net)
    with pytest.warns(RuntimeWarning, match=f"Rolled back to the snapshot of iteration {snap_it}"):
        assert train_step(jm, opt, loss_fn, guard, x, y) is None
    got = states(jm, opt, loss_fn)
    for k, v in expected["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert torch.equal(got["buffer"], expected["buffer"])
    for i, s in expected["opt"].items():
        for k, v in s.items():
            assert torch.equal(got["opt"][i][k], v), (i, k)
    assert guard.rollbacks == 1
    # safer settings: energy L2 on, half the SGLD step, half the learning rate
    assert loss_fn.l2_weight == 0.1
    assert loss_fn.sampler.step_size == 0.5 * step0
    assert opt.param_groups[0]["lr"] == 0.5 * lr0

    for _ in range(10):
        m = train_step(jm, opt, loss_fn, guard, x, y)
        assert m is not None and all(abs(v) < 1e4 for v in m.values())
    assert guard.rollbacks == 1


def test_rollback_handles_sampler_divergence_and_gives_up_after_max_rollbacks():
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="rollback", snapshot_every=2, max_rollbacks=2)
    for _ in range(3):
        train_step(jm, opt, loss_fn, guard, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):
            with torch.no_grad():
                net[-1].bias.fill_(float("nan"))
            assert train_step(jm, opt, loss_fn, guard, x, y) is None  # SGLD's own DivergenceError
            assert torch.isfinite(net[-1].bias).all()
    assert loss_fn.l2_weight == 0.2 and loss_fn.sampler.step_size == 0.25  # cumulative
    blow_up(net)
    with pytest.raises(DivergenceError, match="after 2 rollbacks.*l2_weight 0 -> 0.1; .*l2_weight 0.1 -> 0.2"):
        train_step(jm, opt, loss_fn, guard, x, y)


def test_check_outside_a_with_block_returns_false_after_rollback():
    """The loop style `if not guard.check(loss, metrics, iteration=i): continue` (as in fit())."""
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="rollback", snapshot_every=1)
    out = loss_fn(jm, x, y)
    guard.before_step(10)
    assert guard.check(out.loss, out.metrics, iteration=10) is True
    assert guard.snapshot_iteration == 10
    before = {k: v.clone() for k, v in jm.state_dict().items()}
    blow_up(net)
    out = loss_fn(jm, x, y)
    with pytest.warns(RuntimeWarning):
        assert guard.check(out.loss, out.metrics, iteration=11) is False
    assert all(torch.equal(v, before[k]) for k, v in jm.state_dict().items())
    event = guard.last_event
    assert event["diverged_at"] == 11 and event["restored_iteration"] == 10 and event["rollbacks"] == 1
    assert "max_abs_energy" in event["problem"] and any("l2_weight" in c for c in event["changes"])
    blow_up(net)
    with pytest.warns(RuntimeWarning):
        assert guard.step(loss_fn(jm, x, y)) is False
    assert all(torch.equal(v, before[k]) for k, v in jm.state_dict().items())


def _fake(e):
    return LossOutput(torch.tensor(0.0), {"loss": 1.0, "energy_data": e, "energy_sample": e + 1})


def _explodes_at(guard):
    """The first energy of a rising series the guard calls a divergence."""
    for e in (-5.0, -6.0, -5.5, -7.0, -6.5, -6.0, -40.0, -200.0, -2e4):
        try:
            guard.check(_fake(e))
        except DivergenceError as exc:
            return e, exc.reason
    return None


def test_relative_explosion_detection():
    net, jm, opt, loss_fn, guard, _ = setup(policy="raise", limits=GuardLimits(explode_factor=10.0, min_history=5))
    for e in (-5.0, -6.0, -5.5, -7.0, -6.5, -6.0):
        guard.check(_fake(e))
    guard.check(_fake(-40.0))  # below 10x the median
    with pytest.raises(DivergenceError, match="running median"):
        guard.check(_fake(-200.0))


def test_the_limits_are_one_guard_limits_value():
    small = setup(policy="raise", limits=GuardLimits(max_abs_energy=100.0))[4]
    assert "exceeds max_abs_energy=100" in _explodes_at(small)[1]
    assert setup(limits=GuardLimits(window=4))[4]._history.maxlen == 4
    for old in ("max_abs_energy", "explode_factor", "window", "min_history"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
            setup(**{old: 1.0})
    with pytest.raises(TypeError, match="GuardLimits"):
        setup(limits={"max_abs_energy": 1.0})
    with pytest.raises(ValueError, match="explode_factor"):
        GuardLimits(explode_factor=0.5)


def test_rollback_without_snapshot_and_bad_arguments():
    net, jm, opt, loss_fn, guard, (x, y) = setup(policy="rollback")
    blow_up(net)
    with pytest.raises(DivergenceError, match="no healthy iteration"):
        train_step(jm, opt, loss_fn, guard, x, y)
    with pytest.raises(ValueError, match="policy"):
        DivergenceGuard(jm, opt, policy="ignore")
    with pytest.raises(ValueError, match="optimizer"):
        DivergenceGuard(jm, policy="rollback")
    for bad, match in ((dict(max_abs_energy=0.0), "max_abs_energy"), (dict(explode_factor=1.0), "explode_factor")):
        with pytest.raises(ValueError, match=match):
            GuardLimits(**bad)
    with pytest.raises(ValueError, match="window"):
        GuardLimits(window=0)


class Classifier(GenerativeLossMixin, nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
        self.configure_jem("net", sampler=SGLD(steps=1), buffer=ReplayBuffer(32, (1, 8, 8)))


def test_rollback_of_a_mixin_module_restores_its_buffer_and_keeps_remedies_in_state():
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = DivergenceGuard(model, opt, policy="rollback", snapshot_every=100)
    x, y = torch.rand(8, 1, 8, 8) * 2 - 1, torch.randint(0, 4, (8,))
    with guard:
        out = model.generative_loss(x, y)
        guard.check(out)
    buf = model.jem_loss.buffer.data.clone()
    model.generative_loss(x, y)  # moves the buffer on
    blow_up(model.net)
    with pytest.warns(RuntimeWarning):
        assert guard.step(model.generative_loss(x, y)) is False
    assert torch.equal(model.jem_loss.buffer.data, buf)
    assert model.jem_loss.l2_weight == 0.1

    state = guard.state_dict()
    fresh = Classifier()
    guard2 = DivergenceGuard(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), policy="rollback")
    guard2.load_state_dict(state)
    assert guard2.rollbacks == 1 and fresh.jem_loss.l2_weight == 0.1


class OwnLoop(nn.Module):
    """A model of the user's own loop holding its JEM loss as ``jem_loss``, without the mixin."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
        self.jem = jem.wrap(self.net, num_classes=4)
        self.jem_loss = JEMLoss(SGLD(steps=1), ReplayBuffer(32, (1, 8, 8)))


def test_the_remedies_reach_a_jem_loss_submodule_of_a_model_without_the_mixin():
    torch.manual_seed(0)
    model = OwnLoop()
    guard = DivergenceGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="rollback")
    x, y = torch.rand(8, 1, 8, 8) * 2 - 1, torch.randint(0, 4, (8,))
    with guard:
        guard.check(model.jem_loss(model.jem, x, y))
    blow_up(model.net)
    with pytest.warns(RuntimeWarning):
        assert guard.step(model.jem_loss(model.jem, x, y)) is False
    assert model.jem_loss.l2_weight == 0.1
