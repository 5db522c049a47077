"""The energy view of a classifier: identities, gradients, parameter sharing, checkpoints."""

from __future__ import annotations

import torch
from conftest import TinyCNN

import jem_plugin as jem


def test_forward_is_the_model_bit_for_bit(tiny_cnn):
    tiny_cnn.eval()
    jm = jem.wrap(tiny_cnn)
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(jm(x), tiny_cnn(x))
    assert torch.equal(jm.logits(x), tiny_cnn(x))


def test_parameters_are_shared_not_copied(tiny_cnn):
    jm = jem.wrap(tiny_cnn)
    assert jm.model is tiny_cnn
    ours = dict(jm.named_parameters())
    for name, p in tiny_cnn.named_parameters():
        assert ours["model." + name] is p
    with torch.no_grad():
        tiny_cnn.head.bias.add_(1.0)  # a change to the user's model is seen by the wrapper
    assert torch.equal(jm.model.head.bias, tiny_cnn.head.bias)


def test_energy_identities(tiny_cnn):
    tiny_cnn.eval()
    jm = jem.wrap(tiny_cnn)
    x = torch.randn(6, 1, 8, 8)
    y = torch.randint(0, 10, (6,))
    logits = tiny_cnn(x)
    torch.testing.assert_close(jm.energy(x), -torch.logsumexp(logits, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(jm.energy(x, y), -logits[torch.arange(6), y], atol=1e-6, rtol=0)
    torch.testing.assert_close(jm.log_px(x), -jm.energy(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(jm.log_pxy(x, y), -jm.energy(x, y), atol=1e-6, rtol=0)
    torch.testing.assert_close(jm.log_py_given_x(x, y), jm.log_pxy(x, y) - jm.log_px(x), atol=1e-6, rtol=0)
    torch.testing.assert_close(jm.log_py_given_x(x), torch.log_softmax(logits, 1), atol=1e-6, rtol=0)
    assert jm.energy(x).shape == (6,) and jm.energy(x, y).shape == (6,)


def test_gradients_flow_to_inputs_and_parameters(tiny_cnn):
    jm = jem.wrap(tiny_cnn)
    x = torch.randn(4, 1, 8, 8, requires_grad=True)
    jm.log_px(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in tiny_cnn.parameters())
    assert tiny_cnn.head.weight.grad.abs().sum() > 0


def test_user_checkpoint_loads_into_wrapper_and_back(tmp_path):
    user = TinyCNN()
    torch.save(user.state_dict(), tmp_path / "user.pt")
    jm = jem.wrap(TinyCNN())
    jm.load_state_dict(torch.load(tmp_path / "user.pt", weights_only=True))
    for k, v in user.state_dict().items():
        assert torch.equal(jm.model.state_dict()[k], v)
    # a JEM checkpoint (with the model. prefix) round-trips too, and the bare model loads from jm.model
    other = jem.wrap(TinyCNN())
    other.load_state_dict(jm.state_dict())
    fresh = TinyCNN()
    fresh.load_state_dict(other.model.state_dict())
    for k, v in user.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_wrap_a_plain_callable():
    w = torch.randn(64, 3)
    jm = jem.wrap(lambda x: x.flatten(1) @ w)
    assert jm.num_classes is None
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(jm.energy(x), -torch.logsumexp(x.flatten(1) @ w, 1))
    assert jm.num_classes == 3  # learned from the first checked forward


def test_input_grad_enabled_under_inference_mode(tiny_cnn):
    tiny_cnn.eval()
    jm = jem.wrap(tiny_cnn)
    with torch.inference_mode():
        x = torch.randn(3, 1, 8, 8)
        with jem.input_grad_enabled(x) as xg:
            (g,) = torch.autograd.grad(jm.log_px(xg).sum(), xg)
    assert g.shape == x.shape and torch.isfinite(g).all() and g.abs().sum() > 0
    with torch.no_grad():
        with jem.input_grad_enabled(torch.randn(3, 1, 8, 8)) as xg:
            (g2,) = torch.autograd.grad(jm.log_px(xg).sum(), xg)
    assert g2.abs().sum() > 0
