"""Training's one extension mechanism: everything fit(callbacks=...) is given is an Extension, called
at the same named points as a recipe's, in order; no sorting by type."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin.extensions import Extension, as_extension
from jem_plugin.training import FitOptions, fit

QUIET = FitOptions(progress=False)


def _run(callbacks, epochs=2):
    torch.manual_seed(0)
    x, y = torch.rand(16, 4) * 2 - 1, torch.arange(16) % 3
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    jm = jem.wrap(nn.Linear(4, 3), data_range=(-1, 1))
    return fit(jm, loader, epochs=epochs, callbacks=callbacks, options=QUIET)


class Recorder(Extension):
    def __init__(self, log):
        self.log = log

    def on_fit_start(self, state, loader):
        self.log.append("fit_start")

    def on_batch(self, state, x, y):
        self.log.append("batch")

    def on_step_end(self, state):
        self.log.append("step_end")

    def on_epoch_end(self, state):
        self.log.append("epoch_end")

    def on_fit_end(self, state, loader):
        self.log.append("fit_end")


def test_an_extension_is_called_at_every_point_of_a_run():
    log: list[str] = []
    _run([Recorder(log)])
    epoch = ["batch", "step_end"] * 2 + ["epoch_end"]
    assert log == ["fit_start", *epoch, *epoch, "fit_end"]


def test_an_object_with_some_hooks_and_a_callable_are_extensions_too():
    log: list[str] = []

    class OnBatchAndStep:  # not an Extension: its on_batch was never called before
        def on_batch(self, state, x, y):
            log.append("batch")

        def on_step_end(self, state):
            log.append("step_end")
            state.stop = state.iteration == 3

    _run([OnBatchAndStep(), lambda state: log.append(f"epoch {state.epoch}")])
    assert log == ["batch", "step_end"] * 2 + ["epoch 1"] + ["batch", "step_end"]


def test_anything_else_is_refused_in_one_line():
    with pytest.raises(TypeError, match="on_step_end"):
        _run([object()])
    ext = Recorder([])
    assert as_extension(ext) is ext
