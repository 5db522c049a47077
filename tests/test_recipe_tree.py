"""The recipe tree: one configuration, said once. Every field reaches the object it configures,
survives plain data and a checkpoint, and every preset runs in full through fit (SAM included)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin.covariance import LowRank, Stationary
from jem_plugin.extensions import FitInitFromBatches, RecomputeBatchNorm, SharpnessAware
from jem_plugin.inits import Gaussian, Uniform
from jem_plugin.recipes import (
    RECIPES,
    BufferConfig,
    LossConfig,
    OptimConfig,
    Recipe,
    SAMConfig,
    SamplerConfig,
    flat_names,
    get_recipe,
)
from jem_plugin.schedules import Poly
from jem_plugin.training import FitOptions, fit


def _bn_net(seed: int = 0, k: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, k),
    )


def _data(n: int = 48, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % k
    x = (torch.rand(n, 3, 6, 6, generator=g) * 0.6 - 0.3 + (y.float() - 1).view(-1, 1, 1, 1) * 0.4).clamp(-1, 1)
    return x, y


def _jm(seed: int = 0):
    return jem.wrap(_bn_net(seed), data_range=(-1, 1), input_size=(3, 6, 6), num_classes=3)


# A value different from every preset's for each leaf field, so the field's effect is visible.
_CHANGED = {
    SamplerConfig: dict(
        steps=3,
        step_size=Poly(0.5, power=0.6, end=0.1),
        noise=0.002,
        grad_clamp=0.07,
        clamp=False,
        batchnorm="separate",
        colours="data",
    ),
    BufferConfig: dict(
        capacity=77, visits=None, reinit_freq=0.2, init=Gaussian(covariance=LowRank(rank=2, residual=0.5))
    ),
    LossConfig: dict(
        ce_weight=0.9,
        px_weight=0.6,
        pxy_weight=0.3,
        l2_weight=0.2,
        data_noise=0.01,
        n_samples=5,
        class_conditional_px=True,
        px_clean_data=True,
    ),
    OptimConfig: dict(
        optimizer="sgd", lr=0.02, weight_decay=1e-3, warmup_iters=7, warmup_max_fraction=1.0, max_grad_norm=3.0
    ),
    SAMConfig: dict(rho=0.5, adaptive=False),
}

# Where each field lands in what build() returns: a reader per field. The test walks the dataclass
# fields, so a field added without a reader here fails it.
_READERS = {
    SamplerConfig: lambda s, name: getattr(s.sampler, name),
    LossConfig: lambda s, name: (
        s.recipe.loss.px_clean_data  # a loop's choice: which batch it passes as px_data (fit passes none)
        if name == "px_clean_data"
        else getattr(s.loss, name)
    ),
    BufferConfig: lambda s, name: {
        "capacity": lambda: s.buffer.capacity,
        "visits": lambda: None,  # checked by test_buffer_visits_size_the_buffer_for_the_run
        "reinit_freq": lambda: s.buffer.reinit_freq,
        "init": lambda: s.buffer.init_spec,
    }[name](),
    OptimConfig: lambda s, name: {
        "optimizer": lambda: type(s.optimizer).__name__.lower(),
        "lr": lambda: s.optimizer.param_groups[0]["lr"],
        "weight_decay": lambda: s.optimizer.param_groups[0]["weight_decay"],
        "warmup_iters": lambda: s.warmup_iters,  # total_iters=1000 below: 7 is under the cap
        "warmup_max_fraction": lambda: s.warmup_iters / 1000,  # the paper's 1000 warm-up iterations, capped
        "max_grad_norm": lambda: s.recipe.optim.max_grad_norm,  # fit clips with it: test_fit_clips_...
    }[name](),
    SAMConfig: lambda s, name: {
        "rho": lambda: next(e.rho for e in s.extensions if isinstance(e, SharpnessAware)),
        "adaptive": lambda: next(e.adaptive for e in s.extensions if isinstance(e, SharpnessAware)),
    }[name](),
}


def _section_of(cls: type) -> str:
    return next(f.name for f in dataclasses.fields(Recipe) if f.type in (cls.__name__, cls))


@pytest.mark.parametrize("cls", list(_CHANGED))
def test_every_field_reaches_the_object_it_configures(cls):
    section = _section_of(cls)
    assert {f.name for f in dataclasses.fields(cls)} == set(_CHANGED[cls]), "a new field needs a changed value here"
    x, y = _data()
    for f in dataclasses.fields(cls):
        value = _CHANGED[cls][f.name]
        base = get_recipe("paper")
        recipe = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{f.name: value})})
        if cls is SAMConfig and f.name == "adaptive":
            recipe = dataclasses.replace(recipe, sam=SAMConfig(rho=1.0, adaptive=False))
        setup = recipe.build(_jm(), (x, y), total_iters=1000, batch_size=8)
        got = _READERS[cls](setup, f.name)
        if f.name == "visits":
            continue
        assert value != getattr(getattr(base, section), f.name), f"{section}.{f.name}: pick a value the preset lacks"
        assert got == value, f"{section}.{f.name}: built {got!r}, configured {value!r}"


def test_bn_stats_from_data_reaches_the_extensions():
    x, y = _data()
    on = get_recipe("paper").replace(bn_stats_from_data=True).build(_jm(), (x, y))
    off = get_recipe("paper").build(_jm(), (x, y))
    assert any(isinstance(e, RecomputeBatchNorm) for e in on.extensions)
    assert not any(isinstance(e, RecomputeBatchNorm) for e in off.extensions)


def test_buffer_visits_size_the_buffer_for_the_run():
    x, y = _data()
    r = get_recipe("generative")
    assert r.buffer.visits == 40 and r.loss.n_samples == 32
    assert r.build(_jm(), (x, y), total_iters=1380).buffer.capacity == 1104  # 1380 * 32 / 40
    assert r.build(_jm(), (x, y), total_iters=150 * 782).buffer.capacity == 10000  # capped
    assert r.buffer.capacity_for(3, 32) == 32  # never fewer slots than chains per iteration
    with pytest.warns(RuntimeWarning, match="total_iters"):
        assert r.build(_jm(), (x, y)).buffer.capacity == 10000


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_presets_round_trip_through_plain_data_and_print_every_setting(name):
    r = get_recipe(name)
    text = json.dumps(r.to_dict())
    assert Recipe.from_dict(json.loads(text)) == r
    printed = str(r)
    for flat in flat_names():
        if flat in r.flat():
            assert f"  {flat} " in printed, flat
    changed = r.replace(init="gaussian", init_covariance="lowrank", init_rank=5, sgld_steps=2)
    assert Recipe.from_dict(json.loads(json.dumps(changed.to_dict()))) == changed
    poly = dataclasses.replace(r, sampler=dataclasses.replace(r.sampler, step_size=Poly(1.0, end=0.1)))
    assert Recipe.from_dict(json.loads(json.dumps(poly.to_dict()))) == poly


def test_flat_names_are_derived_from_the_fields():
    names = flat_names()
    leaves = []
    for section in (SamplerConfig, LossConfig, OptimConfig, SAMConfig):
        leaves += [f.name for f in dataclasses.fields(section)]
    for leaf in leaves:
        assert any(n == leaf or n.endswith("_" + leaf) for n in names), leaf
    assert names["sgld_steps"]["path"] == "sampler.steps"
    assert names["init"]["choices"] == ["uniform", "gaussian", "normal"]
    assert names["init_covariance"]["choices"] == ["diagonal", "full", "lowrank", "stationary"]
    assert names["init_rank"]["path"] == "buffer.init.covariance.rank"
    assert names["sgld_batchnorm"]["choices"] == ["joint", "separate"]


def test_replace_sets_kinds_before_their_settings_and_refuses_settings_the_kind_lacks():
    r = get_recipe("paper").replace(init_rank=3, init_covariance="lowrank", init="gaussian")
    assert r.buffer.init == Gaussian(covariance=LowRank(rank=3))
    assert get_recipe("generative").replace(init_covariance="stationary").buffer.init.covariance == Stationary()
    with pytest.raises(jem.InvalidInputError, match="init_rank does not apply.*init_covariance"):
        get_recipe("generative").replace(init_rank=3)
    with pytest.raises(jem.InvalidInputError, match="unknown setting"):
        get_recipe("paper").replace(sgld_stepz=3)
    with pytest.raises(jem.InvalidInputError, match="init must be one of"):
        get_recipe("paper").replace(init="laplace")
    with pytest.raises(jem.InvalidInputError, match="buffer visits"):
        get_recipe("paper").replace(buffer_visits=0)


def test_each_setting_has_one_name():
    """The spellings before the tree are gone: replace refuses them and a recipe reads by section."""
    r = get_recipe("fast")
    for old in ("step_size", "noise", "grad_clip", "buffer_size", "reinit_freq", "batchnorm"):
        with pytest.raises(jem.InvalidInputError, match="unknown setting"):
            r.replace(**{old: 1})
    with pytest.raises(jem.InvalidInputError, match="batchnorm must be one of"):
        r.replace(sgld_batchnorm="eval")
    for gone in ("sgld_steps", "lr", "buffer_size", "build_loss", "build_optimizer", "build_sam", "warmup_for"):
        assert not hasattr(r, gone), gone


def test_uniform_recipes_build_without_labels_and_informative_ones_ask_for_them():
    x, y = _data()
    setup = get_recipe("paper").build(_jm(), x)
    assert setup.buffer.init_spec == Uniform() and setup.buffer.num_classes is None
    with pytest.raises(jem.InvalidInputError, match=r"\(x, y\)"):
        get_recipe("fast").build(jem.wrap(_bn_net(), data_range=(-1, 1), input_size=(3, 6, 6)), x)


def test_build_fits_the_init_once_and_the_loss_builds_nothing_later():
    x, y = _data()
    setup = get_recipe("fast").replace(buffer_capacity=40).build(_jm(), (x, y), total_iters=10)
    init = setup.buffer.init_dist
    assert init.fitted
    mean = init.mean.clone()
    buffer = setup.buffer
    out = setup.loss(_jm(), x[:8], y[:8])
    out.loss.backward()
    assert setup.loss.buffer is buffer and torch.equal(setup.buffer.init_dist.mean, mean)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fit_runs_every_preset_in_full(name):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, drop_last=True)
    recipe = get_recipe(name).replace(sgld_steps=2, buffer_capacity=40)
    history = fit(_jm(), loader, recipe, epochs=1, val_data=(x, y), options=FitOptions(progress=False))
    assert len(history) == 1 and "val_acc" in history.last and history.last["loss"] == history.last["loss"]
    post = [e for e in history.events if e.get("event") == "post_training"]
    assert bool(post) == recipe.bn_stats_from_data


def test_fit_runs_sam_with_two_passes_and_one_sampling_per_iteration(monkeypatch):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False, drop_last=True)
    jm = _jm()
    setup = get_recipe("sadajem").replace(sgld_steps=1, buffer_capacity=40).build(jm, loader, total_iters=6)
    assert [type(e) for e in setup.extensions] == [SharpnessAware]
    samples, forwards = [], []
    real_sample, real_forward = type(setup.sampler).sample, type(setup.loss).forward
    monkeypatch.setattr(
        type(setup.sampler), "sample", lambda self, *a, **k: samples.append(1) or real_sample(self, *a, **k)
    )
    monkeypatch.setattr(
        type(setup.loss), "forward", lambda self, *a, **k: forwards.append(1) or real_forward(self, *a, **k)
    )
    fit(jm, loader, setup, epochs=1, options=FitOptions(progress=False))
    assert len(forwards) == 2 * len(loader) and len(samples) == len(loader)


def test_fit_clips_the_gradient_norm_the_optim_config_names(monkeypatch):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True)
    norms = []
    monkeypatch.setattr(nn.utils, "clip_grad_norm_", lambda params, max_norm: norms.append(max_norm))
    fit(_jm(), loader, optimizer=OptimConfig(max_grad_norm=0.25), epochs=1, options=FitOptions(progress=False))
    assert norms == [0.25] * len(loader)


def test_a_checkpoint_holds_the_recipe_as_plain_data_beside_the_tensors(tmp_path):
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True)
    recipe = get_recipe("fast").replace(sgld_steps=1, buffer_capacity=40)
    fit(_jm(), loader, recipe, epochs=1, options=FitOptions(progress=False, checkpoint_dir=tmp_path))
    (path,) = sorted(tmp_path.glob("*.pt"))
    saved = torch.load(path, weights_only=True)
    kinds, objects = saved["kinds"], saved["objects"]
    assert kinds["config"] == "value" and Recipe.from_dict(objects["config"]) == recipe  # the configuration
    assert kinds["loss"] == "state_dict" and "buffer.data" in objects["loss"]  # the tensors, apart


def test_recompute_batchnorm_is_kept_only_with_held_out_evidence():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True)
    jm = _jm()
    bn = jm.model[1]
    bn.running_mean.fill_(5.0)  # statistics far from the data's: recomputing them helps
    state = type("S", (), {"jm": jm, "val_data": None, "history": jem.training.History()})()
    ext = RecomputeBatchNorm()
    ext.on_fit_end(state, loader)
    assert not ext.decision.kept and float(bn.running_mean.mean()) == 5.0, "no held-out data: nothing changes"
    state.val_data = (x, y)
    ext.on_fit_end(state, loader)
    assert ext.decision.kept and float(bn.running_mean.abs().max()) < 5.0
    assert state.history.events[-1]["step"] == "bn_stats_from_data"


def test_an_extension_given_as_a_callback_runs_at_its_points_in_a_loop_with_your_own_loss():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True)
    jm = _jm()
    buffer = jem.ReplayBuffer(40, (3, 6, 6), init=Gaussian(), num_classes=3)
    loss_fn = jem.JEMLoss(jem.SGLD(steps=1), buffer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no legacy auto-fit: the extension fits it
        fit(jm, loader, loss_fn=loss_fn, epochs=1, callbacks=[FitInitFromBatches()], options=FitOptions(progress=False))
    assert buffer.init_dist.fitted and buffer.fit_count >= 1
