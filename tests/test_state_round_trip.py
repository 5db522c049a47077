"""Every constructor argument of SGLD, ReplayBuffer and JEMLoss survives a checkpoint.

The arguments are read from the constructors' signatures, not from a list kept here: a new
argument without a test value below fails ``test_every_argument_has_a_test_value``, and one that the
state forgets fails the round trip. The state goes through ``torch.save`` and a ``weights_only``
load, as a checkpoint does.
"""

from __future__ import annotations

import inspect
import io
from typing import Any

import pytest
import torch

import jem_plugin as jem
from jem_plugin.covariance import Full
from jem_plugin.errors import CheckpointError
from jem_plugin.inits import Gaussian
from jem_plugin.schedules import Poly

# A value other than the default for every constructor argument.
SGLD_VALUES: dict[str, Any] = {
    "steps": 7,
    "step_size": lambda: Poly(0.5, power=0.7, end=0.1),  # a factory: a schedule is callable itself
    "noise": 0.02,
    "clamp": False,
    "grad_clamp": 0.03,
    "generator": lambda: torch.Generator().manual_seed(11),
    "max_energy": 1e4,
    "cuda_graph": "off",
    "batchnorm": "separate",
    "colours": "data",
}
BUFFER_VALUES: dict[str, Any] = {
    "capacity": 12,
    "sample_shape": (1, 4, 4),
    "reinit_freq": 0.2,
    "init": Gaussian(covariance=Full(), jitter=1e-3),
    "num_classes": 3,
    "device": torch.device("meta"),  # where it lives is not configuration: see BUFFER_NOT_SAVED
}
# Arguments that are not part of a buffer's state, and why.
BUFFER_NOT_SAVED = {"device": "the buffer follows the model's device when it is used"}
# Arguments that fix the buffer's tensors: a buffer built otherwise refuses the state in one line.
BUFFER_STRUCTURE = {"capacity", "sample_shape", "init", "num_classes"}
LOSS_VALUES: dict[str, Any] = {
    "sampler": lambda: jem.SGLD(**_built(SGLD_VALUES)),
    "buffer": lambda: jem.ReplayBuffer(**_built({k: v for k, v in BUFFER_VALUES.items() if k != "device"})),
    "ce_weight": 0.5,
    "px_weight": 0.25,
    "pxy_weight": 0.75,
    "l2_weight": 0.1,
    "data_noise": 0.01,
    "n_samples": 6,
    "class_conditional_px": True,
    "generator": lambda: torch.Generator().manual_seed(12),
}
# Loss terms are added with add_term; they travel as the arguments they were built from.
LOSS_TERMS = {"energy_bounded": {"m_in": -3.0, "m_out": -1.0, "weight": 0.2, "outliers": "uniform"}}


def _arguments(cls: type) -> dict[str, inspect.Parameter]:
    """The named arguments."""
    return {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}


def _built(values: dict[str, Any]) -> dict[str, Any]:
    """The values, with factories called (generators and modules are made fresh for each use)."""
    return {k: v() if callable(v) else v for k, v in values.items()}


def _through_checkpoint(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _same_generator(a: torch.Generator | None, b: torch.Generator | None) -> bool:
    return a is not None and b is not None and torch.equal(a.get_state(), b.get_state())


@pytest.mark.parametrize(
    "cls, values", [(jem.SGLD, SGLD_VALUES), (jem.ReplayBuffer, BUFFER_VALUES), (jem.JEMLoss, LOSS_VALUES)]
)
def test_every_argument_has_a_test_value(cls, values):
    arguments = _arguments(cls)
    missing = sorted(set(arguments) - set(values))
    assert not missing, f"{cls.__name__} has arguments without a test value here: {missing}"
    built = _built(values)
    for name, param in arguments.items():  # a default value would not show that the state carries it
        assert built[name] is not param.default and built[name] != param.default, name


def test_sgld_state_carries_every_argument():
    src = jem.SGLD(**_built(SGLD_VALUES))
    dst = jem.SGLD()
    dst.load_state_dict(_through_checkpoint(src.state_dict()))
    for name in _arguments(jem.SGLD):
        if name == "generator":
            assert _same_generator(dst.generator, src.generator)
        else:
            assert getattr(dst, name) == getattr(src, name), name


def test_sgld_state_is_validated_together_on_load():
    state = {**jem.SGLD().state_dict(), "step_size": {"kind": "poly", "start": 0.1, "power": 0.55, "end": 1.0}}
    with pytest.raises(ValueError, match="exceed"):
        jem.SGLD().load_state_dict(state)


def test_replay_buffer_state_carries_every_argument():
    values = {k: v for k, v in _built(BUFFER_VALUES).items() if k not in BUFFER_NOT_SAVED}
    src = jem.ReplayBuffer(**values)
    state = _through_checkpoint(src.state_dict())
    # Built with the same structure and every other argument at its default: the state restores them.
    dst = jem.ReplayBuffer(**{k: values[k] for k in BUFFER_STRUCTURE})
    dst.load_state_dict(state)
    assert dst.config() == src.config()
    assert set(src.config()) == set(_arguments(jem.ReplayBuffer)) - set(BUFFER_NOT_SAVED)
    # Built with any one structural argument at its default: one clear line naming the fix.
    for name in sorted(BUFFER_STRUCTURE):
        other = {k: values[k] for k in BUFFER_STRUCTURE if k != name}
        with pytest.raises(CheckpointError, match="create") as err:
            jem.ReplayBuffer(**other).load_state_dict(state)
        assert "\n" not in str(err.value)


def test_jem_loss_state_carries_every_argument():
    src = jem.JEMLoss(**_built(LOSS_VALUES))
    for name, options in LOSS_TERMS.items():
        src.add_term(name, **options)
    dst = jem.JEMLoss()  # no buffer, no terms, a default sampler: all come from the state
    dst.load_state_dict(_through_checkpoint(src.state_dict()))
    for name in _arguments(jem.JEMLoss):
        if name == "generator":
            assert _same_generator(dst.generator, src.generator)
        elif name == "sampler":
            for setting in _arguments(jem.SGLD):
                if setting == "generator":
                    assert _same_generator(dst.sampler.generator, src.sampler.generator)
                else:
                    assert getattr(dst.sampler, setting) == getattr(src.sampler, setting), setting
        elif name == "buffer":
            assert dst.buffer.config() == src.buffer.config()
        else:
            assert getattr(dst, name) == getattr(src, name), name
    restored, saved = dict(dst._all_terms()), dict(src._all_terms())
    assert set(restored) == set(saved) == {"energy_bounded"}
    assert restored["energy_bounded"].weight == saved["energy_bounded"].weight == 0.2


def test_a_restored_fast_loss_samples_as_the_saved_one():
    """The reported bug: a loss saved with SGLD(batchnorm="separate") came back sampling with "joint"."""
    src = jem.JEMLoss(sampler=jem.SGLD(steps=2, batchnorm="separate"))
    dst = jem.JEMLoss(sampler=jem.SGLD(steps=2))
    dst.load_state_dict(_through_checkpoint(src.state_dict()))
    assert dst.sampler.batchnorm == "separate" and dst.batchnorm == "separate"


# A CUDA generator's state is its Philox seed and offset (16 bytes); a CPU generator's is 5056.
_CUDA_STATE = {"state": torch.arange(16, dtype=torch.uint8), "device": "cuda:0"}


def _cuda_written(owner: str) -> tuple[Any, dict[str, Any]]:
    """A fresh ``owner`` (SGLD or JEMLoss) and a state of it as a GPU run writes it."""
    if owner == "SGLD":
        obj: Any = jem.SGLD(steps=3, generator=torch.Generator().manual_seed(0))
        state = obj.state_dict()
        state["generator_state"], state["generator_device"] = _CUDA_STATE["state"], _CUDA_STATE["device"]
    else:
        obj = jem.JEMLoss(jem.SGLD(steps=3), generator=torch.Generator().manual_seed(0))
        state = obj.state_dict()
        extra = state["_extra_state"]  # a Module: its own settings and generator travel as extra state
        extra["generator"], extra["generator_device"] = _CUDA_STATE["state"], _CUDA_STATE["device"]
    return obj, state


@pytest.mark.parametrize("owner", ["SGLD", "JEMLoss"])
def test_a_gpu_runs_generator_resumed_on_the_cpu_is_seeded_from_its_state_with_one_warning(owner):
    # Before: SGLD/JEMLoss.load_state_dict passed the CUDA state to the CPU generator, and torch
    # stopped the resume with "Expected a CPUGeneratorImplState of size 5056 but found ... 16".
    draws = []
    for _ in range(2):
        obj, state = _cuda_written(owner)
        with pytest.warns(jem.errors.DeviceChangeWarning, match=f"{owner}: the checkpoint's generator ran on cuda:0"):
            obj.load_state_dict(state)
        assert obj.generator.device.type == "cpu"
        draws.append(torch.rand(4, generator=obj.generator))
    assert torch.equal(draws[0], draws[1])  # the same checkpoint resumes the same way every time
    fresh = torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(draws[0], fresh)  # seeded from the saved state, not left where it was


def test_without_a_generator_of_its_own_a_cuda_state_restores_on_the_cpu_where_there_is_no_gpu(monkeypatch):
    # Before: torch.Generator(device="cuda:0") on a machine without a usable GPU raised a CUDA error.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sampler, state = _cuda_written("SGLD")
    sampler.generator = None
    with pytest.warns(jem.errors.DeviceChangeWarning):
        sampler.load_state_dict(state)
    assert sampler.generator is not None and sampler.generator.device.type == "cpu"


def test_a_generator_resumed_on_its_own_kind_of_device_restores_exactly_and_silently(recwarn):
    saved = jem.SGLD(steps=3, generator=torch.Generator().manual_seed(5))
    torch.rand(3, generator=saved.generator)
    state = saved.state_dict()
    restored = jem.SGLD(steps=3, generator=torch.Generator().manual_seed(0))
    restored.load_state_dict(state)
    assert torch.equal(restored.generator.get_state(), saved.generator.get_state())
    assert not [w for w in recwarn if issubclass(w.category, jem.errors.DeviceChangeWarning)]
