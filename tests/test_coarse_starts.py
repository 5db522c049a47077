"""Coarse chain starts: the ``gaussian`` init's ``coarse`` share of constant or low-resolution images."""

from __future__ import annotations

import pickle

import pytest
import torch
from _digits import TRAIN, digits8, train_steps
from torch import nn

import jem_plugin as jem
from jem_plugin.adapter import IMAGENET_MEAN, IMAGENET_STD, InputDomain
from jem_plugin.builtins.init_distributions import GaussianInit, coarse_images
from jem_plugin.covariance import Stationary
from jem_plugin.errors import CheckpointError, InvalidInputError
from jem_plugin.inits import Gaussian
from jem_plugin.recipes import get_recipe

IMAGENET = InputDomain.from_normalization(IMAGENET_MEAN, IMAGENET_STD)


def test_coarse_images_are_smooth_grey_or_coloured_and_inside_the_domain():
    x = coarse_images(400, (3, 32, 32), IMAGENET, torch.Generator().manual_seed(0))
    lo, hi = IMAGENET.bounds(x)
    assert x.shape == (400, 3, 32, 32) and bool(((x >= lo - 1e-5) & (x <= hi + 1e-5)).all())
    unit = (x - lo) / (hi - lo)  # pixel values in [0, 1]
    grey = (unit - unit[:, :1]).abs().amax((1, 2, 3)) < 1e-4
    assert 0.4 < float(grey.float().mean()) < 0.6  # half grey, half coloured
    constant = unit.flatten(2).std(2).amax(1) < 1e-5
    assert 0.15 < float(constant.float().mean()) < 0.35  # a quarter are one flat colour (the 1x1 grid)
    # at most an 8x8 grid, upsampled: far smoother than per-pixel noise
    step = (unit[..., 1:] - unit[..., :-1]).abs().mean()
    assert float(step) < 0.05
    assert torch.equal(x, coarse_images(400, (3, 32, 32), IMAGENET, torch.Generator().manual_seed(0)))
    with pytest.raises(InvalidInputError, match=r"image inputs \[C, H, W\].*coarse=0"):
        coarse_images(4, (10,), IMAGENET)


def test_a_coarse_share_replaces_that_share_of_draws_and_leaves_the_others_as_they_were():
    x = torch.rand(40, 3, 16, 16) * 0.2 + 0.4
    y = torch.arange(40) % 4
    domain = InputDomain.from_range(0.0, 1.0)
    plain = GaussianInit(covariance=Stationary()).fit(x, y)
    mixed = GaussianInit(covariance=Stationary(), coarse=0.3)
    mixed.load_state_dict(plain.state_dict())
    a = plain.sample(2000, (3, 16, 16), domain, torch.Generator().manual_seed(1))
    b = mixed.sample(2000, (3, 16, 16), domain, torch.Generator().manual_seed(1))
    replaced = (a != b).flatten(1).any(1)
    assert 0.25 < float(replaced.float().mean()) < 0.35
    assert torch.equal(a[~replaced], b[~replaced])  # the Gaussian's draws, unchanged
    # coarse=0 spends no random numbers: a seeded run without coarse starts is what it was
    g0, g1 = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    plain.sample(8, (3, 16, 16), domain, g0)
    GaussianInit(covariance=Stationary(), coarse=0.0).fit(x, y).sample(8, (3, 16, 16), domain, g1)
    assert torch.equal(g0.get_state(), g1.get_state())
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="coarse is a share in"):
            Gaussian(coarse=bad)


def test_coarse_starts_for_grey_data_in_an_rgb_model_are_grey_and_add_no_state(monkeypatch):
    # grey digits-like images, ImageNet-normalised (each channel differently): the data's one colour axis
    unit = torch.rand(40, 1, 16, 16).expand(40, 3, 16, 16)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    x, y = (unit - mean) / std, torch.arange(40) % 4
    init = GaussianInit(covariance=Stationary(), coarse=1.0).fit(x, y)
    starts = init.sample(500, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(0))
    pixels = starts * std + mean
    assert float((pixels - pixels.mean(1, keepdim=True)).abs().max()) < 1e-4  # grey, as the data
    assert float(pixels.flatten(1).std(1).mean()) > 0.05 and float(pixels.amin()) > -1e-4  # varied, in range
    # read once per fit (not at every restarted chain), and again after a refit on colour data
    from jem_plugin.builtins import init_distributions

    calls = []
    real = init_distributions.colour_projection
    monkeypatch.setattr(init_distributions, "colour_projection", lambda t: calls.append(1) or real(t))
    init.sample(8, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(1))
    assert calls == []  # the first draw above read it already
    init.fit((torch.rand(40, 3, 16, 16) - mean) / std, y)
    coloured = init.sample(500, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(0)) * std + mean
    init.sample(8, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(1))
    assert calls == [1] and float((coloured - coloured.mean(1, keepdim=True)).abs().max()) > 0.1
    again = pickle.loads(pickle.dumps(init))  # the cache is not state: a pickled init draws the same
    assert torch.equal(
        again.sample(4, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(3)),
        init.sample(4, (3, 16, 16), IMAGENET, torch.Generator().manual_seed(3)),
    )
    # read from the fitted means, so the init's state is what it was before coarse starts existed
    assert set(init.state_dict()) == set(GaussianInit(covariance=Stationary()).fit(x, y).state_dict())


def test_the_share_is_a_recipe_setting_and_a_buffer_saved_before_it_existed_still_loads():
    r = get_recipe("generative").replace(init_coarse=0.25)
    assert r.flat()["init_coarse"] == 0.25 and r.buffer.init == Gaussian(covariance=Stationary(), coarse=0.25)
    assert type(r).from_dict(r.to_dict()) == r
    flat, notes = r.for_inputs((20,))  # not images: no coarse starts, and the recipe says so
    assert flat.buffer.init.coarse == 0.0 and any("init_coarse 0.25 -> 0.0" in n for n in notes)
    x, y = torch.rand(20, 3, 8, 8), torch.arange(20) % 2
    buffer = jem.ReplayBuffer(10, (3, 8, 8), init=Gaussian(), num_classes=2).fit(x, y)
    state = buffer.state_dict()
    del state["_extra_state"]["config"]["init"]["coarse"]  # as a checkpoint written before the option
    again = jem.ReplayBuffer(10, (3, 8, 8), init=Gaussian(), num_classes=2)
    again.load_state_dict(state)
    assert torch.equal(again.init_dist.mean, buffer.init_dist.mean)
    other = jem.ReplayBuffer(10, (3, 8, 8), init=Gaussian(coarse=0.5), num_classes=2)
    with pytest.raises(CheckpointError, match=r"coarse=0\.0.*coarse=0\.5"):
        other.load_state_dict(buffer.state_dict())


def test_coarse_starts_without_the_energy_l2_warn_once_at_the_loss_and_not_with_it(recwarn):
    buffer = jem.ReplayBuffer(10, (3, 8, 8), init=Gaussian(coarse=0.25), num_classes=2)
    with pytest.warns(UserWarning, match="25% of its chains from coarse images"):
        jem.JEMLoss(jem.SGLD(steps=1), buffer)
    recwarn.clear()
    jem.JEMLoss(jem.SGLD(steps=1), buffer, l2_weight=0.1)
    jem.JEMLoss(jem.SGLD(steps=1), buffer, px_weight=0.0)  # no samples drawn: nothing at risk
    jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(10, (3, 8, 8), init=Gaussian(), num_classes=2))
    assert not [w for w in recwarn if "coarse" in str(w.message)]
    with pytest.warns(UserWarning, match="coarse images"):  # what a recipe builds says it too
        get_recipe("generative").replace(init_coarse=0.25, l2_weight=0.0).build(
            _tiny_net(), (torch.rand(8, 3, 8, 8), torch.arange(8) % 2), total_iters=10, batch_size=4
        )


def _tiny_net() -> jem.JEM:
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    return jem.wrap(net, input_size=(3, 8, 8), num_classes=2, data_range=(0, 1))


def _train(coarse: float, steps: int = 150) -> jem.JEM:
    """A user's small CNN without normalisation (a network the rest of the suite does not name),
    trained with the p(x) term on 8x8 digits, its chains started from the fitted Gaussian."""
    torch.manual_seed(0)
    x, y = digits8()
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.SiLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    jm = jem.wrap(net, input_size=(1, 8, 8), num_classes=10, data_range=(-1, 1))
    buffer = jem.ReplayBuffer(256, (1, 8, 8), 0.05, init=Gaussian(coarse=coarse), num_classes=10)
    buffer.fit(x[:TRAIN], y[:TRAIN])
    if coarse:  # without the energy L2 the loss says what it risks (here it did not diverge)
        with pytest.warns(UserWarning, match="coarse images and l2_weight is 0.*set l2_weight"):
            loss_fn = jem.JEMLoss(jem.SGLD(steps=5), buffer, px_weight=1.0)
    else:
        loss_fn = jem.JEMLoss(jem.SGLD(steps=5), buffer, px_weight=1.0)
    return train_steps(jm, loss_fn, steps, lr=1e-3)


@pytest.mark.slow
def test_coarse_starts_teach_the_energy_that_flat_images_are_unlikely():
    x, _ = digits8()
    held_out = x[TRAIN:]
    flat = coarse_images(
        200, (1, 8, 8), InputDomain.from_range(-1.0, 1.0), torch.Generator().manual_seed(9), grids=(1,)
    )
    auroc = {}
    for coarse in (0.0, 0.5):
        jm = _train(coarse)
        with torch.no_grad():
            data, simple = jm.log_px(held_out), jm.log_px(flat)
        auroc[coarse] = float((data[:, None] > simple[None]).float().mean())  # held-out digits likelier
    # Without them the chains never visit flat images and the energy rates them near the data or
    # above it (AUROC 0.03-0.51 over seeds 0-2); with half the starts coarse, 0.89-1.0.
    assert auroc[0.5] > 0.85 and auroc[0.5] > auroc[0.0] + 0.2, auroc


def test_check_coarse_energy_writes_the_two_l2_weights_side_by_side(tmp_path, monkeypatch):
    from benchmarks import check_coarse_energy as C

    def fake(l2_weight, iterations, every, net, tiny=False):
        scale = 1e10 if l2_weight == 0 else 1.0  # what wrn10-1 did without the L2
        return [
            {"iteration": i, "acc": 0.1, "energy_data": -scale, "energy_sample": scale, "energy_gap": 2 * scale}
            for i in range(every, iterations + 1, every)
        ]

    monkeypatch.setattr(C, "energies", fake)
    C.main(["--l2-weights", "0", "0.1", "--iterations", "50", "--every", "25", "--out", str(tmp_path)])
    text = (tmp_path / "coarse_energy.md").read_text()
    assert "| iteration | acc (L2 0) |" in text and "energy_gap (L2 0.1) |" in text
    assert "| 50 | 0.1 | -1e+10 | 1e+10 | 2e+10 | 0.1 | -1 | 1 | 2 |" in text
