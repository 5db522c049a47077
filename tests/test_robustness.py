"""PGD attacks, the SGLD defence and robust accuracy on a tiny model trained on separable data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jem_plugin as jem
from jem_plugin import robustness as rob
from jem_plugin.errors import InvalidInputError, InvalidLabelError
from jem_plugin.robustness import PGD


def _separable(n: int, seed: int):
    """Two classes of 1x4x4 'images' in [0, 1]: mean 0.3 vs 0.7 per pixel, small noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = 0.3 + 0.4 * y.float().view(-1, 1, 1, 1) + 0.08 * torch.randn(n, 1, 4, 4, generator=g)
    return x.clamp(0, 1), y


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    x, y = _separable(512, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    jm = jem.wrap(model, data_range=(0.0, 1.0), input_size=(1, 4, 4))
    return model, jm


@pytest.fixture
def test_data():
    return _separable(200, 1)


def _acc(jm, x, y):
    with torch.no_grad():
        return float((jm(x).argmax(1) == y).float().mean())


def test_eps_zero_is_clean_accuracy(trained, test_data):
    _, jm = trained
    x, y = test_data
    clean = _acc(jm, x, y)
    assert clean > 0.95
    for norm in ("linf", "l2"):
        r = rob.robust_accuracy(jm, x, y, [0.0, 0.05], PGD(norm=norm), progress=False)
        assert r["accuracy"][0] == clean
        assert r["eps"] == [0.0, 0.05] and r["norm"] == norm and r["n"] == 200
    torch.testing.assert_close(rob.pgd_attack(jm, x, y, 0.0), x)


@pytest.mark.parametrize("norm,eps", [("linf", 0.3), ("l2", 1.2)])
def test_pgd_breaks_the_classifier(trained, test_data, norm, eps):
    model, jm = trained
    x, y = test_data
    x_adv = rob.pgd_attack(jm, x, y, eps, PGD(norm=norm, steps=20), generator=torch.Generator().manual_seed(0))
    assert _acc(jm, x_adv, y) < 0.1 < 0.95 < _acc(jm, x, y)
    # a smaller budget hurts less: accuracy decreases with eps
    r = rob.robust_accuracy(jm, x, y, [0.0, eps / 4, eps / 2, eps], PGD(norm=norm, steps=20), progress=False)
    assert r["accuracy"] == sorted(r["accuracy"], reverse=True)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters()) and model.training


def test_pgd_is_stronger_than_random_noise(trained, test_data):
    _, jm = trained
    x, y = test_data
    eps = 0.22  # the class means are 0.2 per pixel from the boundary
    noise = (x + eps * (2 * torch.rand_like(x) - 1)).clamp(0, 1)
    assert _acc(jm, rob.pgd_attack(jm, x, y, eps), y) < 0.5 < 0.9 < _acc(jm, noise, y)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_perturbation_respects_eps_and_per_channel_domain(norm):
    # ImageNet-style normalised input: the valid range differs per channel.
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    jm = jem.wrap(model, mean=mean, std=std, input_size=(3, 6, 6))
    pixels = torch.rand(16, 3, 6, 6)
    pixels[:, :, 0, 0] = 1.0  # on the domain's edge: the attack must not leave it
    pixels[:, :, 0, 1] = 0.0
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    x = (pixels - m) / s
    y = torch.randint(0, 3, (16,))
    eps = 8 / 255 if norm == "linf" else 0.5
    x_adv = rob.pgd_attack(
        jm, x, y, eps, PGD(norm=norm, steps=5, step_size=eps), generator=torch.Generator().manual_seed(1)
    )
    lo, hi = jm.domain.bounds(x)
    assert (x_adv >= lo - 1e-6).all() and (x_adv <= hi + 1e-6).all()
    delta_pixels = (x_adv - x) * s  # unit space = un-normalised pixels here
    if norm == "linf":
        assert float(delta_pixels.abs().max()) <= eps + 1e-6
        assert float(delta_pixels.abs().max()) > eps * 0.9  # the budget is used
    else:
        norms = delta_pixels.flatten(1).norm(dim=1)
        assert float(norms.max()) <= eps + 1e-5
        assert float(norms.max()) > eps * 0.9
    # inputs outside the domain (Gaussian noise in normalised space): eps still holds, and no
    # coordinate moves further out of the domain than it was
    x_out = 3 * torch.randn(16, 3, 6, 6)
    x_adv = rob.pgd_attack(jm, x_out, y, eps, PGD(norm=norm, steps=5, step_size=eps))
    delta_pixels = (x_adv - x_out) * s
    bound = delta_pixels.abs().max() if norm == "linf" else delta_pixels.flatten(1).norm(dim=1).max()
    assert float(bound) <= eps + 1e-5
    assert ((x_adv >= torch.minimum(lo, x_out) - 1e-6) & (x_adv <= torch.maximum(hi, x_out) + 1e-6)).all()
    # eps in raw input units instead
    x_raw = rob.pgd_attack(jm, x, y, 0.1, PGD(norm="linf", steps=3, eps_space="input"))
    assert float((x_raw - x).abs().max()) <= 0.1 + 1e-6


def test_pgd_random_start_is_reproducible_and_works_in_inference_mode(trained, test_data):
    _, jm = trained
    x, y = test_data
    a = rob.pgd_attack(jm, x, y, 0.1, PGD(steps=3), generator=torch.Generator().manual_seed(3))
    b = rob.pgd_attack(jm, x, y, 0.1, PGD(steps=3), generator=torch.Generator().manual_seed(3))
    c = rob.pgd_attack(jm, x, y, 0.1, PGD(steps=3), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, c)
    with torch.inference_mode():
        d = rob.pgd_attack(jm, x.clone(), y.clone(), 0.1, PGD(steps=3), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(d, a)


def test_bad_attack_arguments(trained, test_data):
    _, jm = trained
    x, y = test_data
    with pytest.raises(ValueError, match="norm"):
        PGD(norm="l1")
    for bad in (dict(steps=-1), dict(steps=2.5), dict(eot_samples=0), dict(step_size=0.0), dict(eps_space="pixels")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PGD(**bad)
    with pytest.raises(TypeError, match="PGD"):
        rob.pgd_attack(jm, x, y, 0.1, {"norm": "l2"})
    with pytest.raises(ValueError, match="eps"):
        rob.pgd_attack(jm, x, y, -0.1)
    with pytest.raises(InvalidLabelError, match="labels"):
        rob.pgd_attack(jm, x, y[:5], 0.1)
    with pytest.raises(InvalidInputError):
        rob.pgd_attack(jm, x.long(), y, 0.1)
    with pytest.raises(ValueError, match="eps_list"):
        rob.robust_accuracy(jm, x, y, [], progress=False)
    with pytest.raises(ValueError, match="bpda"):
        rob.robust_accuracy(jm, x, y, [0.1], defense=lambda t: jm(t), attack="bpda", progress=False)


# ---------------------------------------------------------------- defence
def test_defense_shapes_identity_and_determinism(trained, test_data):
    _, jm = trained
    x, _ = test_data
    x = x[:20]
    with torch.no_grad():
        plain = jm(x)
    # zero steps: every chain is the input itself, so the average is the plain logits
    torch.testing.assert_close(rob.SGLDDefense(jm, steps=0, n_chains=3)(x), plain)
    d = rob.SGLDDefense(jm, steps=4, step_size=0.01, noise=0.05, n_chains=3)
    assert d.refine(x, torch.Generator().manual_seed(0)).shape == (60, 1, 4, 4)
    a = d(x, generator=torch.Generator().manual_seed(0))
    b = d(x, generator=torch.Generator().manual_seed(0))
    c = d(x, generator=torch.Generator().manual_seed(1))
    assert a.shape == (20, 2)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, c)
    f = rob.SGLDDefense(
        jm, steps=4, step_size=0.01, noise=0.05, n_chains=3, generator=torch.Generator().manual_seed(0)
    )(x)
    torch.testing.assert_close(f, a)  # the generator given at construction is the default
    # chunking the chains changes only which noise goes where: without noise it changes nothing
    whole = rob.SGLDDefense(jm, steps=4, step_size=0.01, noise=0.0, n_chains=3)(x)
    chunked = rob.SGLDDefense(jm, steps=4, step_size=0.01, noise=0.0, n_chains=3, chunk_size=7)(x)
    torch.testing.assert_close(chunked, whole)
    assert not torch.allclose(whole, plain)  # the refinement moved the inputs
    assert d.predict(x, generator=torch.Generator().manual_seed(0)).shape == (20,)
    with pytest.raises(ValueError, match="n_chains"):
        rob.SGLDDefense(jm, n_chains=0)


def test_robust_accuracy_with_defense_transfer_and_bpda(trained, test_data):
    _, jm = trained
    x, y = test_data
    x, y = x[:64], y[:64]
    d = rob.SGLDDefense(
        jm, steps=2, step_size=0.001, noise=0.01, n_chains=2, generator=torch.Generator().manual_seed(0)
    )
    eps = [0.0, 0.3]
    base = rob.robust_accuracy(jm, x, y, eps, PGD(steps=10), progress=False)
    transfer = rob.robust_accuracy(jm, x, y, eps, PGD(steps=10), defense=d, progress=False)
    bpda = rob.robust_accuracy(jm, x, y, eps, PGD(steps=10), defense=d, attack="bpda", progress=False)
    assert base["attack"] == "pgd" and transfer["attack"] == "pgd-transfer"
    assert bpda["attack"] == "pgd-bpda-eot1"
    # the tiny, gentle refinement cannot undo a large attack: both evaluations see it break
    assert transfer["accuracy"][1] < 0.3 and bpda["accuracy"][1] < 0.3
    assert transfer["accuracy"][0] > 0.9


def test_worst_case_over_attacks_and_margin_loss(trained, test_data):
    _, jm = trained
    x, y = test_data
    x, y = x[:64], y[:64]
    # deterministic defence and attacks, so the three evaluations see the same examples
    d = rob.SGLDDefense(jm, steps=2, step_size=0.001, noise=0.0, n_chains=2)
    eps = [0.0, 0.2, 0.25]
    kw = dict(pgd=PGD(steps=10, random_start=False), defense=d, progress=False)
    transfer = rob.robust_accuracy(jm, x, y, eps, attack="transfer", **kw)["accuracy"]
    bpda = rob.robust_accuracy(jm, x, y, eps, attack="bpda", **kw)["accuracy"]
    worst = rob.robust_accuracy(jm, x, y, eps, attack="worst", **kw)
    assert worst["attack"] == "pgd-worst(transfer,bpda-eot1)"
    for w, t, b in zip(worst["accuracy"], transfer, bpda):
        assert w <= min(t, b)
    assert worst["accuracy"][0] == transfer[0] == bpda[0]
    # the Carlini-Wagner margin objective breaks the plain classifier as well as cross-entropy
    margin = rob.robust_accuracy(jm, x, y, [0.3], PGD(loss="margin", steps=20), progress=False)
    assert margin["accuracy"][0] < 0.1 and margin["attack"] == "pgd-margin"
    with pytest.raises(ValueError, match="loss"):
        PGD(loss="hinge")


def test_per_example_results_say_which_inputs_survived_each_budget(trained, test_data):
    # the benefit ledger pairs two models on the same inputs: it needs each input's outcome
    _, jm = trained
    x, y = test_data
    x, y = x[:64], y[:64]
    d = rob.SGLDDefense(jm, steps=2, step_size=0.001, noise=0.0, n_chains=2)
    kw = dict(pgd=PGD(steps=10, random_start=False), defense=d, progress=False)
    r = rob.robust_accuracy(jm, x, y, [0.0, 0.2], attack="worst", **kw)
    assert [len(c) for c in r["correct"]] == [64, 64]
    assert [sum(c) / 64 for c in r["correct"]] == r["accuracy"]
    with torch.no_grad():
        assert r["correct"][0] == (d(x).argmax(1) == y).tolist()  # eps 0: the defended clean predictions


# ---------------------------------------------------------------- one spelling: PGD(...)
def test_the_settings_are_given_as_pgd_only(trained, test_data):
    _, jm = trained
    x, y = test_data
    x, y = x[:4], y[:4]
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        rob.pgd_attack(jm, x, y, 0.1, steps=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        rob.robust_accuracy(jm, x, y, [0.1], steps=3)
    with pytest.raises(TypeError, match="PGD, got str"):  # not the norm as a positional string
        rob.pgd_attack(jm, x, y, 0.1, "l2")
    with pytest.raises(TypeError, match="PGD, got str"):
        rob.robust_accuracy(jm, x, y, [0.1], "l2")
