"""SGLD's settings: one knob per coupled choice, the old spellings for one release, and checkpoints.

The step size carries its schedule (``step_size=Poly(...)``), the elementwise gradient clamp is
``grad_clamp``, BatchNorm has one vocabulary (``"joint"``/``"separate"``), and recording is chosen
per call. Each old spelling warns with the new one and means exactly what it meant.
"""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch
from conftest import TinyCNN
from torch import nn

import jem_plugin as jem
from jem_plugin import sampling
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
def test_at_most_ten_named_parameters_and_one_catch_all():
    params = inspect.signature(SGLD.__init__).parameters
    assert len(_named(SGLD.__init__)) <= 10
    catch_all = [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]
    assert catch_all == ["deprecated"]
    assert set(_named(SGLD.__init__)) >= {"step_size", "grad_clamp", "batchnorm", "colours", "cuda_graph"}
    for old in ("schedule", "decay_power", "final_step_size", "grad_clip", "record_trajectory", "progress"):
        assert old not in params
    assert len(_named(SGLD.run)) <= 10 and len(_named(SGLD.sample)) <= 10
    for fn in (SGLD.run, SGLD.sample):
        assert {"record_trajectory", "record_energies", "progress"} <= set(_named(fn))
    assert sampling.BATCHNORM_MODES == ("joint", "separate")
    assert "deprecated" not in sampling._SETTINGS and "generator" not in sampling._SETTINGS


# ---------------------------------------------------------------- deprecated spellings
OLD_AND_NEW = [
    (
        dict(schedule="poly", decay_power=0.55, final_step_size=0.01),
        dict(step_size=Poly(1.0, power=0.55, end=0.01)),
        "SGLD(schedule='poly', decay_power=0.55, final_step_size=0.01) is deprecated; "
        "write SGLD(step_size=Poly(1.0, power=0.55, end=0.01))",
    ),
    (
        dict(step_size=2.0, schedule="poly"),
        dict(step_size=Poly(2.0)),
        "SGLD(schedule='poly') is deprecated; write SGLD(step_size=Poly(2.0, power=0.55))",
    ),
    (
        dict(step_size=0.5, schedule="poly", decay_power=0.8),
        dict(step_size=Poly(0.5, power=0.8)),
        "write SGLD(step_size=Poly(0.5, power=0.8))",
    ),
    (dict(step_size=0.5, schedule="constant"), dict(step_size=0.5), "write SGLD(step_size=0.5)"),
    (dict(grad_clip=0.03), dict(grad_clamp=0.03), "SGLD(grad_clip=0.03) is deprecated; write SGLD(grad_clamp=0.03)"),
    (dict(batchnorm="eval"), dict(batchnorm="joint"), "write SGLD(batchnorm='joint')"),
    (dict(batchnorm="batch"), dict(batchnorm="separate"), "write SGLD(batchnorm='separate')"),
]


@pytest.mark.parametrize("old, new, message", OLD_AND_NEW, ids=[m.split(")")[0] for _, _, m in OLD_AND_NEW])
def test_an_old_spelling_warns_with_the_new_one_and_means_the_same(old, new, message):
    with pytest.warns(DeprecationWarning) as caught:
        was = SGLD(steps=9, **old)
    assert any(message in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in caught)  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling is silent
        now = SGLD(steps=9, **new)
    assert was.step_sizes() == now.step_sizes()
    assert _settings(was) == _settings(now)
    assert repr(was) == repr(now)


def test_old_poly_steps_are_the_same_numbers_for_every_combination():
    # SGLD.step_sizes() before Poly, written out: a_t = a (1 + t / b) ** -gamma, the last one `end`.
    for steps in (0, 1, 2, 5, 20):
        for a, power, end in ((1.0, 0.55, None), (2.0, 1.0, 0.5), (0.3, 0.7, 0.3), (1.0, 0.55, 1e-3)):
            b = 1.0
            if end is not None and steps > 1:
                ratio = (a / end) ** (1.0 / power) - 1.0
                b = (steps - 1) / ratio if ratio > 0 else float("inf")
            expected = [a * (1.0 + t / b) ** -power for t in range(steps)]
            with pytest.warns(DeprecationWarning):
                old = SGLD(steps=steps, step_size=a, schedule="poly", decay_power=power, final_step_size=end)
            assert old.step_sizes() == expected
            assert SGLD(steps=steps, step_size=Poly(a, power=power, end=end)).step_sizes() == expected


def test_a_deprecated_schedule_leaves_a_callable_step_size_alone():
    with pytest.warns(DeprecationWarning, match="write SGLD\\(step_size="):
        s = SGLD(steps=3, step_size=lambda t: 0.1 * (t + 1), schedule="poly")
    assert s.step_sizes() == [0.1, 0.2, 0.1 * 3]


def test_the_old_validation_errors_stay():
    with pytest.raises(ValueError, match="schedule must be one of"):
        SGLD(schedule="cosine")
    with pytest.raises(ValueError, match="final_step_size only applies"):
        SGLD(final_step_size=0.1)  # constant schedule
    with pytest.raises(ValueError, match="final_step_size only applies"):
        SGLD(step_size=lambda t: 1.0, schedule="poly", final_step_size=0.1)
    with pytest.raises(ValueError, match="exceed"):
        SGLD(schedule="poly", step_size=0.1, final_step_size=1.0)
    with pytest.raises(ValueError, match="decay_power"):
        SGLD(schedule="poly", decay_power=0)
    with pytest.raises(TypeError, match="grad_clamp only"):
        SGLD(grad_clamp=0.1, grad_clip=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'grad_clipp'"):
        SGLD(grad_clipp=0.1)
    with pytest.raises(ValueError, match="batchnorm must be one of"):
        SGLD(batchnorm="running")
    with pytest.raises(ValueError, match="grad_clamp"):
        SGLD(grad_clamp=-1.0)


# ---------------------------------------------------------------- grad_clamp and batchnorm behave
def test_grad_clamp_bounds_each_coordinate_of_the_step_and_grad_clip_is_the_same(jm):
    jm.eval()
    x0 = _x(8)
    free = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False).run(jm, x0)
    c = float((free - x0).abs().median()) / 0.5  # half the coordinates saturate
    clamped = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False, grad_clamp=c).run(jm, x0)
    assert (clamped - x0).abs().max() <= 0.5 * c + 1e-6 and not torch.equal(clamped, free)
    with pytest.warns(DeprecationWarning, match="grad_clamp"):
        old = SGLD(steps=1, step_size=0.5, noise=0.0, clamp=False, grad_clip=c)
    assert old.grad_clamp == c and torch.equal(old.run(jm, x0), clamped)


def test_batchnorm_old_values_sample_as_the_new_ones(jm):
    jm.train()
    x0 = _x(8)
    chains = {}
    for mode in ("joint", "separate", "eval", "batch"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = SGLD(steps=3, noise=0.0, batchnorm=mode)
        chains[mode] = s.run(jm, x0)
        assert s.batchnorm == {"eval": "joint", "batch": "separate"}.get(mode, mode)
    assert torch.equal(chains["eval"], chains["joint"]) and torch.equal(chains["batch"], chains["separate"])
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
    monkeypatch.setattr(sampling, "tqdm", lambda it, **kw: bars.append(kw["desc"]) or it)
    s = SGLD(steps=2)
    s.run(jm, _x(2))
    assert bars == []
    s.sample(jm, x_init=_x(2), progress=True)
    assert bars == ["SGLD"]


def test_old_recording_keywords_become_the_samplers_default_for_its_calls(jm, monkeypatch):
    bars = []
    monkeypatch.setattr(sampling, "tqdm", lambda it, **kw: bars.append(kw["desc"]) or it)
    with pytest.warns(DeprecationWarning) as caught:
        s = SGLD(steps=2, record_trajectory=True, record_energies=True, progress=True)
    messages = [str(w.message) for w in caught]
    assert any("record_energies=True, return_diagnostics=True" in m for m in messages)
    assert any("record_trajectory=True, return_diagnostics=True" in m for m in messages)
    assert any("sampler.sample(..., progress=True)" in m for m in messages)
    x0 = _x(3)
    out, diag = s.run(jm, x0, return_diagnostics=True)
    assert len(diag.trajectory) == 3 and diag.energies.shape == (3, 3) and bars == ["SGLD"]
    assert isinstance(s.run(jm, x0), torch.Tensor)  # as before: recorded, returned only when asked
    _, off = s.run(jm, x0, return_diagnostics=True, record_trajectory=False, record_energies=False)
    assert off.trajectory is None and off.energies is None  # a call's own choice wins
    assert "record" not in str(s.state_dict())  # not a setting a checkpoint carries


def test_old_attribute_names_warn_and_read_through(jm):
    s = SGLD(grad_clamp=0.5)
    with pytest.warns(DeprecationWarning, match="grad_clamp"):
        assert s.grad_clip == 0.5
    with pytest.warns(DeprecationWarning, match="grad_clamp"):
        s.grad_clip = 0.25
    assert s.grad_clamp == 0.25
    with pytest.warns(DeprecationWarning, match="per call"):
        assert s.record_energies is False
    twin = copy.copy(s)
    with pytest.warns(DeprecationWarning, match="per call"):
        twin.record_energies = True
    _, diag = twin.run(jm, _x(2), return_diagnostics=True)
    assert diag.energies is not None
    _, diag = s.run(jm, _x(2), return_diagnostics=True)
    assert diag.energies is None  # the copy's default is its own


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


def test_a_state_written_by_the_old_code_loads_silently():
    old_state = {  # what SGLD.state_dict() wrote before these names
        "steps": 7,
        "step_size": 0.5,
        "noise": 0.02,
        "schedule": "poly",
        "decay_power": 0.7,
        "final_step_size": 0.1,
        "clamp": False,
        "grad_clip": 0.03,
        "record_trajectory": True,
        "record_energies": True,
        "progress": True,
        "max_energy": 1e4,
        "cuda_graph": "auto",
        "batchnorm": "batch",
        "colours": "data",
        "generator_state": torch.Generator().manual_seed(11).get_state(),
        "generator_device": "cpu",
    }
    dst = SGLD()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint is not the user's spelling
        dst.load_state_dict(_through_checkpoint(old_state))
    assert dst.step_size == Poly(0.5, power=0.7, end=0.1)
    assert (dst.steps, dst.noise, dst.clamp, dst.grad_clamp) == (7, 0.02, False, 0.03)
    assert (dst.max_energy, dst.cuda_graph, dst.batchnorm, dst.colours) == (1e4, "auto", "separate", "data")
    assert dst._recording == {}  # chosen per call now
    assert torch.equal(dst.generator.get_state(), old_state["generator_state"])
    plain = {"steps": 2, "step_size": 0.5, "schedule": "constant", "decay_power": 0.55, "final_step_size": None}
    dst.load_state_dict({**plain, "grad_clip": None, "batchnorm": "eval"})
    assert (dst.step_size, dst.grad_clamp, dst.batchnorm) == (0.5, None, "joint")


def test_an_old_state_without_a_step_size_decays_the_current_one():
    dst = SGLD(step_size=2.0)
    dst.load_state_dict({"step_size": None, "schedule": "poly", "decay_power": 0.55, "final_step_size": None})
    assert dst.step_size == Poly(2.0)


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
