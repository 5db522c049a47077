"""SGLD's settings: one knob per coupled choice, and checkpoints.

The step size carries its schedule (``step_size=Poly(...)``), the elementwise gradient clamp is
``grad_clamp``, BatchNorm has one vocabulary (``"joint"``/``"separate"``), and recording is chosen
per call.
"""

from __future__ import annotations

import inspect
import io
import warnings

import pytest
import torch
from conftest import TinyCNN
from torch import nn

import jem_plugin as jem
from jem_plugin import chains, sampling
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.sampling import SGLD
from jem_plugin.schedules import Constant, Poly
from jem_plugin.stability import DivergenceGuard

SHAPE = (1, 8, 8)


@pytest.fixture
def jm():
    torch.manual_seed(0)
    return jem.wrap(TinyCNN())


def _x(n: int = 6) -> torch.Tensor:
    return torch.rand(n, *SHAPE, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _through_checkpoint(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _settings(sampler: SGLD) -> dict:
    return {k: v for k, v in sampler.state_dict().items() if not k.startswith("generator")}


def _named(fn) -> list[str]:
    return [
        n
        for n, p in inspect.signature(fn).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


# ---------------------------------------------------------------- the signature
def test_at_most_ten_named_parameters_and_no_catch_all():
    params = inspect.signature(SGLD.__init__).parameters
    assert len(_named(SGLD.__init__)) <= 10
    assert not [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]
    assert set(_named(SGLD.__init__)) >= {"step_size", "grad_clamp", "batchnorm", "colours", "cuda_graph"}
    for old in ("schedule", "decay_power", "final_step_size", "grad_clip", "record_trajectory", "progress"):
        assert old not in params
    assert len(_named(SGLD.run)) <= 10 and len(_named(SGLD.sample)) <= 10
    for fn in (SGLD.run, SGLD.sample):
        assert {"record_trajectory", "record_energies", "progress"} <= set(_named(fn))
    assert sampling.BATCHNORM_MODES == ("joint", "separate")
    assert "generator" not in sampling._SETTINGS


# ---------------------------------------------------------------- the step-size schedule
def test_poly_steps_are_the_welling_teh_decay_for_every_combination():
    # a_t = a (1 + t / b) ** -gamma, with b set so that the last step is `end`.
    for steps in (0, 1, 2, 5, 20):
        for a, power, end in ((1.0, 0.55, None), (2.0, 1.0, 0.5), (0.3, 0.7, 0.3), (1.0, 0.55, 1e-3)):
            b = 1.0
            if end is not None and steps > 1:
                ratio = (a / end) ** (1.0 / power) - 1.0
                b = (steps - 1) / ratio if ratio > 0 else float("inf")
            expected = [a * (1.0 + t / b) ** -power for t in range(steps)]
            assert SGLD(steps=steps, step_size=Poly(a, power=power, end=end)).step_sizes() == expected


# ---------------------------------------------------------------- one spelling per setting
@pytest.mark.parametrize(
    "old", [dict(schedule="poly"), dict(decay_power=0.55), dict(final_step_size=0.01), dict(grad_clip=0.03)]
)
def test_a_removed_keyword_is_a_type_error(old):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(old))}'"):
        SGLD(**old)


@pytest.mark.parametrize("name", ["record_trajectory", "record_energies", "progress"])
def test_recording_is_not_a_constructor_setting(name):
    with pytest.raises(TypeError, match=name):
        SGLD(**{name: True})
    assert not hasattr(SGLD(), name) and not hasattr(SGLD(), "grad_clip")


def test_the_validation_errors():
    with pytest.raises(ValueError, match="must not exceed start"):
        SGLD(step_size=Poly(0.1, end=1.0))  # checked by the schedule
    with pytest.raises(ValueError, match="power"):
        SGLD(step_size=Poly(1.0, power=0))
    for mode in ("running", "eval", "batch"):  # "eval"/"batch" were the names before joint/separate
        with pytest.raises(ValueError, match="batchnorm must be one of"):
            SGLD(batchnorm=mode)
    with pytest.raises(ValueError, match="grad_clamp"):
        SGLD(grad_clamp=-1.0)
    with pytest.raises(ValueError, match="step_size"):
        SGLD(step_size=-1.0)


# ---------------------------------------------------------------- grad_clamp and batchnorm behave
def test_grad_clamp_bounds_each_coordinate_of_the_step(jm):
    jm.eval()
    x0 = _x(8)
    free = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False).run(jm, x0)
    c = float((free - x0).abs().median()) / 0.5  # half the coordinates saturate
    clamped = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False, grad_clamp=c).run(jm, x0)
    assert (clamped - x0).abs().max() <= 0.5 * c + 1e-6 and not torch.equal(clamped, free)


def test_the_batchnorm_modes_sample_differently(jm):
    jm.train()
    x0 = _x(8)
    chains = {mode: SGLD(steps=3, noise=0.0, batchnorm=mode).run(jm, x0) for mode in ("joint", "separate")}
    assert not torch.allclose(chains["joint"], chains["separate"])  # the modes do differ on this model


# ---------------------------------------------------------------- recording per call
def test_recording_is_chosen_per_call(jm):
    s = SGLD(steps=3)
    x0 = _x(4)
    out, diag = s.run(jm, x0, return_diagnostics=True, record_trajectory=True, record_energies=True)
    assert len(diag.trajectory) == 4 and torch.equal(diag.trajectory[-1], out)
    assert diag.energies.shape == (4, 4)
    _, plain = s.run(jm, x0, return_diagnostics=True)
    assert plain.trajectory is None and plain.energies is None  # nothing stayed on the sampler
    _, only_e = s.sample(jm, x_init=x0, return_diagnostics=True, record_energies=True)
    assert only_e.trajectory is None and only_e.energies.shape == (4, 4)
    buf = ReplayBuffer(16, SHAPE)
    xb, db = s.sample(jm, 4, buffer=buf, return_diagnostics=True, record_trajectory=True)
    assert len(db.trajectory) == 4 and db.energies is None and xb.shape == (4, *SHAPE)
    _, du = s.sample(jm, 4, shape=SHAPE, return_diagnostics=True, record_energies=True)
    assert du.energies.shape == (4, 4)
    for call in (lambda: s.run(jm, x0, record_energies=True), lambda: s.sample(jm, 4, record_trajectory=True)):
        with pytest.raises(ValueError, match="return_diagnostics=True"):
            call()  # recorded and thrown away: say so


def test_progress_is_chosen_per_call(jm, monkeypatch):
    bars = []
    monkeypatch.setattr(chains, "tqdm", lambda it, **kw: bars.append(kw["desc"]) or it)
    s = SGLD(steps=2)
    s.run(jm, _x(2))
    assert bars == []
    s.sample(jm, x_init=_x(2), progress=True)
    assert bars == ["SGLD"]


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("schedule", [Poly(0.5, power=0.7, end=0.1), Poly(2.0), Constant(0.3)])
def test_a_schedule_round_trips_through_a_weights_only_checkpoint(schedule):
    src = SGLD(steps=6, step_size=schedule, grad_clamp=0.03, batchnorm="separate")
    state = src.state_dict()
    assert state["step_size"]["kind"] == schedule.kind  # plain data, not the object
    assert all(isinstance(v, (str, float, type(None))) for v in state["step_size"].values())
    dst = SGLD()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dst.load_state_dict(_through_checkpoint(state))
    assert type(dst.step_size) is type(schedule) and dst.step_size == schedule
    assert dst.step_sizes() == src.step_sizes() and (dst.grad_clamp, dst.batchnorm) == (0.03, "separate")


def test_a_float_step_size_stays_a_float_and_a_callable_one_is_kept():
    state = SGLD(step_size=0.25).state_dict()
    assert state["step_size"] == 0.25 and isinstance(state["step_size"], float)
    fn = lambda t: 0.1
    src = SGLD(step_size=fn)
    assert src.state_dict()["step_size"] is None  # not data
    dst = SGLD(step_size=fn)
    dst.load_state_dict(_through_checkpoint(src.state_dict()))
    assert dst.step_size is fn


def test_the_state_builds_an_equal_sampler():
    src = SGLD(steps=4, step_size=Poly(1.0, end=0.2), grad_clamp=0.1)
    settings = {k: v for k, v in src.state_dict().items() if not k.startswith("generator")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = SGLD(**settings)  # plain data as the step size: the schedule it describes
    assert again.step_size == src.step_size and again.step_sizes() == src.step_sizes()


# ---------------------------------------------------------------- repr and the divergence guard
def test_repr_uses_the_new_names():
    r = repr(SGLD(step_size=Poly(1.0, end=0.01), grad_clamp=0.03, batchnorm="separate", colours="data"))
    assert r == (
        "SGLD(steps=20, step_size=Poly(1.0, power=0.55, end=0.01), noise=0.01, grad_clamp=0.03, "
        "batchnorm='separate', colours='data', clamp=True)"
    )


class _Loss(nn.Module):
    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler
        self.l2_weight = 0.0


@pytest.mark.parametrize(
    "step_size, halved",
    [(Poly(1.0, end=0.1), Poly(0.5, end=0.05)), (Constant(0.4), Constant(0.2)), (0.4, 0.2)],
)
def test_the_guards_rollback_halves_the_whole_schedule(step_size, halved):
    sampler = SGLD(steps=5, step_size=step_size)
    guard = DivergenceGuard(nn.Linear(2, 2), loss_fn=_Loss(sampler), remedies=("sgld_step",))
    changes = guard._apply_remedies()
    assert sampler.step_size == halved and changes and "step_size" in changes[0]
    assert sampler.step_sizes() == pytest.approx([0.5 * a for a in SGLD(steps=5, step_size=step_size).step_sizes()])
    SGLD().load_state_dict(_through_checkpoint(sampler.state_dict()))  # still data


@pytest.mark.parametrize("fn", [lambda t: 1.0 / (t + 1), lambda t, steps: 1.0 / (steps - t)])
def test_the_guards_rollback_halves_a_callable_step_size(fn):
    sampler = SGLD(steps=4, step_size=fn)
    before = sampler.step_sizes()
    guard = DivergenceGuard(nn.Linear(2, 2), loss_fn=_Loss(sampler), remedies=("sgld_step",))
    guard._apply_remedies()
    assert sampler.step_sizes() == [0.5 * a for a in before]
