"""Bad input raises the documented, exported exception with a message that names the fix."""

from __future__ import annotations

import pytest
import torch

import jem_plugin as jem


class TupleNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x), x.mean(1)


def test_tuple_output_without_logits_option_says_how_to_fix():
    jm = jem.wrap(TupleNet())
    with pytest.raises(jem.NoLogitsError, match=r"logits=0"):
        jm.energy(torch.randn(2, 4))


def test_tuple_output_with_named_index_works():
    net = TupleNet()
    jm = jem.wrap(net, logits=0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jm.energy(x), -torch.logsumexp(net.fc(x), 1))


def test_bad_logits_spec_is_clear():
    jm = jem.wrap(TupleNet(), logits=5)
    with pytest.raises(jem.NoLogitsError, match="valid index"):
        jm(torch.randn(2, 4))


def test_output_of_wrong_rank():
    jm = jem.wrap(lambda x: x.sum(1))
    with pytest.raises(jem.NoLogitsError, match=r"\[B=2, K\]"):
        jm.energy(torch.randn(2, 4))


def test_integer_input():
    jm = jem.wrap(torch.nn.Linear(4, 3))
    with pytest.raises(jem.InvalidInputError, match="floating-point"):
        jm.energy(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(jem.InvalidInputError, match="torch.Tensor"):
        jm.energy([[1.0, 2.0, 3.0, 4.0]])


def test_wrong_rank_input_for_image_model():
    import timm

    jm = jem.wrap(timm.create_model("test_resnet", pretrained=False, num_classes=4))
    with pytest.raises(jem.InvalidInputError, match="unsqueeze"):
        jm.energy(torch.randn(3, 32, 32))


@pytest.mark.parametrize(
    "labels, pattern",
    [
        (torch.tensor([0, 3]), r"\[0, 3\)"),
        (torch.tensor([-1, 0]), r"\[0, 3\)"),
        (torch.tensor([0.0, 1.0]), "integer"),
        (torch.tensor([0, 1, 2]), "shape"),
    ],
)
def test_bad_labels(labels, pattern):
    jm = jem.wrap(torch.nn.Linear(4, 3))
    with pytest.raises(jem.InvalidLabelError, match=pattern):
        jm.energy(torch.randn(2, 4), labels)


def test_non_finite_logits():
    jm = jem.wrap(torch.nn.Linear(4, 3))
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    with pytest.raises(jem.NonFiniteLogitsError, match="check_finite=False"):
        jm.energy(x)
    assert torch.isnan(jem.wrap(torch.nn.Linear(4, 3), check_finite=False).energy(x)).any()


def test_errors_are_also_builtin_types():
    assert issubclass(jem.InvalidInputError, ValueError)
    assert issubclass(jem.InvalidLabelError, ValueError)
    assert issubclass(jem.NoLogitsError, TypeError)
    assert issubclass(jem.DivergenceError, RuntimeError)
    for cls in (jem.NoLogitsError, jem.InvalidInputError, jem.InvalidLabelError, jem.NonFiniteLogitsError):
        assert issubclass(cls, jem.JEMError)


def test_unknown_adapter_name():
    with pytest.raises(jem.NoLogitsError, match="no adapter accepted"):
        jem.wrap(torch.nn.Linear(4, 3), adapter="nope")


def test_bad_data_range():
    with pytest.raises(ValueError, match="low < high"):
        jem.wrap(torch.nn.Linear(4, 3), data_range=(1, 0))


def test_divergence_and_checkpoint_errors_carry_fields_that_survive_pickling():
    import pickle

    err = jem.DivergenceError(
        "|energy_data| = 2e+04 exceeds max_abs_energy=1e+04",
        remedies=("a", "b"),
        iteration=7,
        energy=2e4,
        metrics={"loss": 1.5},
    )
    assert str(err) == (
        "JEM training diverged at iteration 7: |energy_data| = 2e+04 exceeds "
        "max_abs_energy=1e+04 (loss=1.5). Known remedies: (1) a; (2) b."
    )
    back = pickle.loads(pickle.dumps(err))  # errors cross process boundaries (DDP, workers)
    assert (back.reason, back.remedies, back.iteration, back.energy, back.metrics, str(back)) == (
        err.reason,
        err.remedies,
        err.iteration,
        err.energy,
        err.metrics,
        str(err),
    )
    plain = jem.DivergenceError("chains exploded")
    assert plain.reason == "chains exploded" and plain.remedies == () and plain.iteration is None
    ck = pickle.loads(pickle.dumps(jem.CheckpointError("bad file", reason="corrupt")))
    assert ck.reason == "corrupt" and str(ck) == "bad file"
    assert jem.CheckpointError("x").reason is None
