"""gram (issue 29): Sastry & Oore's Gram-matrix detector. Its statistic equals the paper's row
sums of Gram matrices written out here (where float32 would overflow too), its score equals
pytorch-ood's ``Gram`` with nothing held out, its typical deviations come from the held-out fit
images alone, the fit streams, and it flags the low-level shifts a classifier maps onto its
classes. Also ``JEM.layer_maps``, the unpooled layer outputs it reads."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import train_by_cross_entropy
from torch import nn

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.builtins import posthoc
from jem_plugin.builtins.posthoc import gram as gram_module
from jem_plugin.errors import NotFittedError

K = 3


def _block(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class UserCNN(nn.Module):
    """A user's own network the torchvision way: a ``features`` chain that halves the resolution
    twice, BatchNorm and ReLU, a linear ``classifier``."""

    def __init__(self, k: int = K, c_in: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(_block(c_in, 4), _block(4, 6, 2), _block(6, 8, 2))
        self.classifier = nn.Linear(8, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    model = UserCNN()
    with torch.no_grad():  # BatchNorm statistics of the data, as after training
        model.train()
        for _ in range(10):
            model(torch.rand(64, 3, 8, 8, generator=g))
    model.eval()
    x_fit = torch.rand(120, 3, 8, 8, generator=g)
    y_fit = torch.arange(120) % K
    x_test = torch.rand(20, 3, 8, 8, generator=g) * 1.3
    return jem.wrap(model, data_range=(0.0, 1.3)), model, x_fit, y_fit, x_test


def _maps(model: UserCNN, x: torch.Tensor) -> list[torch.Tensor]:
    """The three blocks' outputs, ``[B, C, H*W]``, by running the blocks by hand."""
    out, h = [], x
    with torch.no_grad():
        for block in model.features:
            h = block(h)
            out.append(h.flatten(2))
    return out


def test_layer_maps_are_the_layers_outputs_channels_first_and_layer_features_their_mean(setup):
    jm, model, _, _, x = setup
    assert jm.feature_layers() == ["features.0", "features.1", "features.2"]
    maps, logits = jm.layer_maps(x)
    for got, want in zip(maps, _maps(model, x)):
        torch.testing.assert_close(got, want)
    pooled, _ = jm.layer_features(x)
    for p, m in zip(pooled, maps):
        torch.testing.assert_close(p, m.mean(dim=2))
    torch.testing.assert_close(logits, model(x))


def test_a_vits_tokens_are_read_as_channels_by_tokens():
    timm = pytest.importorskip("timm")
    model = timm.create_model("test_vit", img_size=32, patch_size=8, num_classes=K).eval()
    jm = jem.wrap(model, input_size=(3, 32, 32))
    x = torch.rand(2, 3, 32, 32)
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda _m, _a, out: seen.append(out))
    maps, _ = jm.layer_maps(x, ["blocks.0"])
    handle.remove()
    torch.testing.assert_close(maps[0], seen[0].transpose(1, 2))  # [B, tokens, C] -> [B, C, tokens]


def _paper_rows(f: torch.Tensor, p: int) -> torch.Tensor:
    """The paper's statistic in float64: the ``p``-th order Gram matrix ``(F^p)(F^p)^T``, summed
    over its rows, then its signed ``p``-th root."""
    fp = f.double() ** p
    r = (fp @ fp.transpose(1, 2)).sum(dim=2)
    return r.sign() * r.abs() ** (1.0 / p)


def test_the_statistic_is_the_row_sums_of_the_papers_gram_matrices_even_where_float32_overflows():
    g = torch.Generator().manual_seed(1)
    maps = torch.randn(4, 5, 9, generator=g) * 200.0  # 200^20: beyond float32's range
    naive = (maps**10 @ (maps**10).transpose(1, 2)).sum(dim=2)
    assert not torch.isfinite(naive).all()  # the statistic computed as written, in float32
    powers = [3, 1, 10, 2]  # in any order
    rows = gram_module._gram_rows(maps, powers)
    assert rows.shape == (4, 4, 5) and torch.isfinite(rows).all()
    for i, p in enumerate(powers):
        torch.testing.assert_close(rows[:, i].double(), _paper_rows(maps, p), rtol=1e-5, atol=1e-3)


def test_the_statistic_is_computed_a_few_images_at_a_time_with_the_same_numbers(monkeypatch):
    maps = torch.randn(10, 6, 20, generator=torch.Generator().manual_seed(2))
    whole = gram_module._gram_rows(maps, [1, 2, 3])
    monkeypatch.setattr(gram_module, "_GRAM_CHUNK_ENTRIES", 3 * 6 * 20)  # three images per chunk
    torch.testing.assert_close(gram_module._gram_rows(maps, [1, 2, 3]), whole, rtol=0, atol=0)


def _deviation(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (torch.relu(lo - g) / (lo.abs() + 1e-6) + torch.relu(g - hi) / (hi.abs() + 1e-6)).sum(dim=-1)


def test_the_score_is_minus_the_normalised_deviation_from_the_bounds_of_the_predicted_class(setup):
    """The formula written out: per-class bounds from every fit image, each layer's typical
    deviation the mean over the held-out images (a seeded draw, a quarter here) against their
    own class's bounds over the other images, and the score."""
    jm, model, x_fit, y_fit, x_test = setup
    det = ood.detector("gram", powers=5, held_out=0.25, seed=3).fit(jm, (x_fit, y_fit), batch_size=50)
    assert det.powers == [1, 2, 3, 4, 5] and "powers=[1, 2, 3, 4, 5], held_out=0.25" in repr(det)
    held = torch.rand(len(x_fit), generator=torch.Generator().manual_seed(3)) < 0.25
    assert 20 < int(held.sum()) < 40
    stats_fit = [torch.stack([_paper_rows(m, p) for p in det.powers], 1) for m in _maps(model, x_fit)]
    stats_test = [torch.stack([_paper_rows(m, p) for p in det.powers], 1) for m in _maps(model, x_test)]
    pred = model(x_test).argmax(1)
    per_layer = []
    for layer, (s_fit, s_test) in enumerate(zip(stats_fit, stats_test)):
        lo = torch.stack([s_fit[y_fit == c].amin(0) for c in range(K)])  # [K, P, C]
        hi = torch.stack([s_fit[y_fit == c].amax(0) for c in range(K)])
        lo_others = torch.stack([s_fit[~held & (y_fit == c)].amin(0) for c in range(K)])
        hi_others = torch.stack([s_fit[~held & (y_fit == c)].amax(0) for c in range(K)])
        typical = _deviation(s_fit[held], lo_others[y_fit[held]], hi_others[y_fit[held]]).sum(1).mean()
        assert math.isclose(float(det.layer_norm[layer]), float(typical), rel_tol=1e-4)
        per_layer.append(-_deviation(s_test, lo[pred], hi[pred]).sum(1) / typical)
    expected = torch.stack(per_layer, dim=1)
    torch.testing.assert_close(det.layer_scores(jm, x_test).double(), expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(det.score(jm, x_test).double(), expected.sum(dim=1), rtol=1e-4, atol=1e-3)


def test_equals_pytorch_oods_gram_with_nothing_held_out(setup):
    """pytorch-ood's ``Gram`` on the same layers (its ``predict(x)`` chains its layers, so they
    are handed over as maps), at the same powers; it sets its bounds without its held-out tenth
    of each class, a random draw of its own, so both hold out nothing here."""
    detector = pytest.importorskip("pytorch_ood.detector")
    jm, model, x_fit, y_fit, x_test = setup

    class OnTheseMaps(detector.Gram):
        def _create_feature_list(self, data):
            maps, logits = jm.layer_maps(data)
            return logits, maps

    theirs = OnTheseMaps(nn.Identity(), [nn.Identity()] * 3, K, list(range(1, 11)))
    theirs.validation_fraction = 0.0
    theirs.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_fit, y_fit), batch_size=32))
    ours = ood.score(jm, x_test, "gram", fit_data=(x_fit, y_fit), held_out=0.0)
    torch.testing.assert_close(ours, -theirs.predict(x_test), rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:gram. the fit data has no image")  # a random net predicts few classes
def test_an_image_inside_its_classes_bounds_scores_zero_and_others_below(setup):
    jm, _, x_fit, _, _ = setup
    det = ood.detector("gram", labels="predicted", held_out=0.0).fit(jm, x_fit)
    assert torch.equal(det.score(jm, x_fit), torch.zeros(len(x_fit)))  # every fit image is inside
    flat = det.score(jm, torch.linspace(0.0, 1.3, 10).view(-1, 1, 1, 1).expand(-1, 3, 8, 8))
    assert (flat <= 0).all() and (flat < 0).sum() >= 8  # images without texture: mostly out of range


def test_by_default_each_layers_typical_deviation_is_the_leave_one_out_mean_over_every_fit_image(setup):
    """``E_l`` written out: each fit image against the bounds of the other images of its class,
    one refit per image; a duplicated image (a shared extreme) deviates from nothing, and a class
    of one image adds nothing. No draw: the seed changes nothing."""
    jm, model, x_fit, y_fit, _ = setup
    two = y_fit < K - 1
    # classes 0 and 1 (the first of their images twice), and one image of class K - 1
    x = torch.cat([x_fit[two][:30], x_fit[two][:1], x_fit[~two][:1]])
    y = torch.cat([y_fit[two][:30], y_fit[two][:1], y_fit[~two][:1]])
    det = ood.detector("gram", powers=3).fit(jm, (x, y), batch_size=4)
    assert det.held_out is None and "held_out=None" in repr(det)
    stats = [torch.stack([_paper_rows(m, p) for p in det.powers], 1) for m in _maps(model, x)]
    for layer, s in enumerate(stats):
        total = 0.0
        for i in range(len(x)):
            others = [j for j in range(len(x)) if j != i and y[j] == y[i]]
            if not others:  # the class of one image
                assert y[i] == K - 1
                continue
            lo, hi = s[others].amin(0), s[others].amax(0)
            total += float(_deviation(s[i], lo, hi).sum())
        assert math.isclose(float(det.layer_norm[layer]), total / len(x), rel_tol=1e-4)
    again = ood.detector("gram", powers=3, seed=7).fit(jm, (x, y), batch_size=len(x))
    torch.testing.assert_close(again.layer_norm, det.layer_norm)


def test_two_smallest_per_class_with_ties_and_single_rows():
    stats = torch.tensor([[3.0, 1.0], [1.0, 1.0], [2.0, 5.0], [7.0, 0.0], [4.0, 4.0]])
    y = torch.tensor([0, 0, 0, 2, 0])
    first, second = gram_module._two_smallest(stats, y, 3)
    torch.testing.assert_close(first, torch.tensor([[1.0, 1.0], [math.inf, math.inf], [7.0, 0.0]]))
    torch.testing.assert_close(second, torch.tensor([[2.0, 1.0], [math.inf, math.inf], [math.inf, math.inf]]))


def test_fit_streams_the_same_bounds_and_held_out_images_whatever_the_batches(setup):
    jm, _, x_fit, y_fit, x_test = setup
    whole = posthoc.Gram().fit(jm, (x_fit, y_fit), batch_size=len(x_fit))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_fit, y_fit), batch_size=7)
    streamed = posthoc.Gram().fit(jm, loader)
    torch.testing.assert_close(streamed.layer_norm, whole.layer_norm)
    torch.testing.assert_close(streamed.score(jm, x_test), whole.score(jm, x_test))


def test_a_saved_detector_scores_as_before(setup, tmp_path):
    jm, _, x_fit, y_fit, x_test = setup
    det = ood.detector("gram").fit(jm, (x_fit, y_fit))
    torch.save(det, tmp_path / "gram.pt")
    again = torch.load(tmp_path / "gram.pt", weights_only=False)  # a detector object, not a state dict
    torch.testing.assert_close(again.score(jm, x_test), det.score(jm, x_test))
    torch.testing.assert_close(again.layer_scores(jm, x_test), det.layer_scores(jm, x_test))


def test_options_a_missing_class_and_unfitted_use_are_said_in_one_line(setup):
    jm, _, x_fit, y_fit, x_test = setup
    with pytest.raises(NotFittedError, match="fit"):
        posthoc.Gram().score(jm, x_test)
    for bad in ({"powers": 0}, {"powers": [1, 0]}, {"powers": True}, {"held_out": 1.0}, {"max_held_out": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            posthoc.Gram(**bad)
    with pytest.raises(ValueError, match="layers"):
        posthoc.Gram(layers="features.0")  # a string, not a list of names
    keep = y_fit != 2
    with pytest.warns(RuntimeWarning, match=r"no image of class\(es\) \[2\]; inputs predicted as them"):
        det = posthoc.Gram().fit(jm, (x_fit[keep], y_fit[keep]))
    assert torch.isfinite(det.score(jm, x_test)).all()  # inputs predicted as class 2 included


def test_flags_the_low_level_shifts_a_digits_classifier_maps_onto_its_classes():
    """What it is for: on a digits CNN the softmax ranks inverted, transposed and half-contrast
    digits among the test digits (AUROC 0.84-0.88 here); their Gram statistics are out of range."""
    from jem_plugin.app.data import digits_tensors, transposed

    torch.manual_seed(0)
    x, y = digits_tensors("train")
    x_test, _ = digits_tensors("test")
    model = train_by_cross_entropy(UserCNN(10, c_in=1), x, y, epochs=5)
    jm = jem.wrap(model, data_range=(-1, 1))
    shifted = {"inverted": -x_test, "transposed": transposed(x_test), "half contrast": 0.5 * x_test}
    table = ood.evaluate_all(jm, x_test, shifted, ["msp", "gram"], fit_data=(x, y), progress=False)
    auroc = {(r["score"], r["set"]): r["auroc"] for r in table.rows()}
    for name in shifted:
        assert auroc["gram", name] > max(0.95, auroc["msp", name] + 0.05), auroc
