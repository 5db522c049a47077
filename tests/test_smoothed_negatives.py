"""The ``smoothed_negatives`` loss term: each image likelier than a blurred copy of itself."""

from __future__ import annotations

import pytest
import torch
from _digits import TRAIN, digits8, train_steps
from torch import nn

import jem_plugin as jem
from jem_plugin import plugins
from jem_plugin.builtins.smoothed_negatives import SmoothedNegativesTerm, smoothed_copy
from jem_plugin.errors import InvalidInputError
from jem_plugin.losses import LossBatch


def _net() -> nn.Module:
    """A user's small CNN with BatchNorm (no network the rest of the suite names)."""
    return nn.Sequential(
        nn.Conv2d(1, 12, 3, padding=1),
        nn.BatchNorm2d(12),
        nn.SiLU(),
        nn.Conv2d(12, 16, 3, padding=1, stride=2),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _train(with_term: bool, steps: int = 60) -> jem.JEM:
    torch.manual_seed(0)
    jm = jem.wrap(_net(), input_size=(1, 8, 8), num_classes=10)
    loss_fn = jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(64, (1, 8, 8)), px_weight=0.0)
    if with_term:
        loss_fn.add_term("smoothed_negatives", sigma=1.0)
    return train_steps(jm, loss_fn, steps, lr=3e-3)


@pytest.mark.slow
def test_training_with_the_term_makes_held_out_images_likelier_than_their_smoothed_copies():
    x, _ = digits8()
    held_out = x[TRAIN:]
    won = {}
    for with_term in (False, True):
        jm = _train(with_term)
        with torch.no_grad():
            gap = jm.log_px(held_out) - jm.log_px(smoothed_copy(held_out, 1.0))
        won[with_term] = float((gap > 0).float().mean())
    assert won[True] > 0.95 and won[True] > won[False] + 0.1, won


def test_the_smoothed_pass_leaves_batchnorm_statistics_and_modes_alone_and_trains_the_network():
    net = _net()
    jm = jem.wrap(net, input_size=(1, 8, 8), num_classes=10).train()
    x = digits8()[0][:16]
    logits = jm(x)  # the loss's data forward (it updates the running statistics, as training does)
    bn = net[1]
    before = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    batch = LossBatch(x=x, y=None, x_data=x, logits_data=logits, energy_data=-torch.logsumexp(logits, 1))
    term = SmoothedNegativesTerm(sigma=(1.0, 2.0), generator=torch.Generator().manual_seed(3))
    loss, metrics = term(jm, batch)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert int(bn.num_batches_tracked) == before[2]
    assert all(m.training for m in net.modules())
    loss.backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0
    assert 1.0 <= metrics["sigma"] <= 2.0 and 0.0 <= float(metrics["win"]) <= 1.0


def test_a_resumed_loss_draws_the_blur_the_uninterrupted_one_would():
    def loss_with_term(seed: int) -> tuple[jem.JEMLoss, SmoothedNegativesTerm]:
        loss_fn = jem.JEMLoss(jem.SGLD(steps=1), jem.ReplayBuffer(8, (1, 8, 8)), px_weight=0.0)
        return loss_fn, loss_fn.add_term("smoothed_negatives", generator=torch.Generator().manual_seed(seed))

    first, term = loss_with_term(0)
    term._draw_sigma()
    state = first.state_dict()
    expected = [term._draw_sigma() for _ in range(3)]
    resumed, other = loss_with_term(99)  # another seed: only the checkpoint can make the draws equal
    resumed.load_state_dict(state)
    assert [other._draw_sigma() for _ in range(3)] == expected


def test_it_is_registered_through_the_hook_and_refuses_bad_settings_and_inputs_in_one_line():
    entry = plugins.lookup("jem_register_loss_terms", "smoothed_negatives", "loss term")
    assert entry["item"] is SmoothedNegativesTerm
    with pytest.raises(ValueError, match="sigma must be"):
        SmoothedNegativesTerm(sigma=(3.0, 1.0))
    with pytest.raises(ValueError, match="weight must be"):
        SmoothedNegativesTerm(weight=-1)
    with pytest.raises(InvalidInputError, match=r"images \[N, C, H, W\]") as err:
        smoothed_copy(torch.zeros(4, 2), 1.0)
    assert "\n" not in str(err.value)


def test_the_kernel_fits_a_small_image_and_blurring_keeps_values_in_range():
    x = torch.rand(2, 3, 6, 6) * 2 - 1
    s = smoothed_copy(x, 3.0)  # a 19-pixel kernel would not fit: it is cut to 5
    assert s.shape == x.shape and s.min() >= x.min() - 1e-6 and s.max() <= x.max() + 1e-6
    assert s.std() < x.std()
