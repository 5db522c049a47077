"""Smoke test of benchmarks/bench_generative.py at tiny sizes: it runs, writes its JSON, markdown
and grids, and the numbers it reports are the kind it says they are."""

from __future__ import annotations

import json
import os

import pytest
import torch

import jem_plugin as jem
from benchmarks import bench_generative as B
from jem_plugin.recipes import get_recipe


def test_to32_is_imagenet_normalised_rgb():
    x8 = torch.full((2, 1, 8, 8), 1.0)  # white
    x = B.to32(x8)
    assert x.shape == (2, 3, 32, 32)
    torch.testing.assert_close(x[0, :, 0, 0], (1 - torch.tensor(B.IMAGENET_MEAN)) / torch.tensor(B.IMAGENET_STD))


def test_eval_bn_mode_keeps_data_statistics_apart():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
    data, samples = torch.randn(8, 2), torch.randn(8, 2) * 10 + 50
    net = B.SamplesInEvalMode(model).train()
    net.n_data = 8
    out = net(torch.cat([data, samples]))
    # the data part is normalised with its own batch statistics, whatever the samples are
    torch.testing.assert_close(out[:8].mean(0), torch.zeros(2), atol=1e-5, rtol=0)
    assert model.training


def test_grid_shows_the_buffer_spread_over_all_its_slots():
    idx = B.grid_buffer_index(360)
    assert len(idx) == 80 and idx[0] == 0 and idx[-1] == 359 and bool((idx.diff() > 0).all())
    assert B.grid_buffer_index(30).tolist() == list(range(30))


def test_bn_modes_map_to_the_library_options():
    """The loss's BatchNorm pass is the sampler's batchnorm; the chains' is the same except in the
    bench's own ``separate`` mode (the samples' own pass, chains on the running statistics)."""
    r = B.recipe_for("jempp", quick=True, bn_mode="batch")
    sampler = B.sampler_for(r, "batch")
    assert r.sampler.batchnorm == "separate" and type(sampler) is jem.SGLD and sampler.batchnorm == "separate"
    r = B.recipe_for("fast", quick=True, bn_mode="eval")  # the wrapper needs the joint forward to split
    assert r.sampler.batchnorm == "joint" and B.sampler_for(r, "eval").batchnorm == "joint"
    r = B.recipe_for("fast_uniform", quick=True, bn_mode="separate", overrides={"sgld_step_size": 2.0})
    assert (r.name, r.sampler.batchnorm, r.sampler.step_size, r.flat()["init"]) == (
        "fast_uniform",
        "separate",
        2.0,
        "uniform",
    )
    sampler = B.sampler_for(r, "separate")
    assert isinstance(sampler, B.ChainsOnRunningStatistics) and sampler.step_size == 2.0
    loss = jem.JEMLoss(sampler, jem.ReplayBuffer(8, (2,)))
    assert loss.batchnorm == "separate"  # the loss's second pass: the samples on their own
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 3))
    model[0].running_mean.fill_(100.0)  # chains on the running statistics: far from a batch's own
    jm = jem.wrap(model, data_range=(-1.0, 1.0), input_size=(2,), num_classes=3)
    x0 = torch.rand(6, 2)
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    sampler.sample(jm, x_init=x0)
    running = (x0 - 100.0) / (1.0 + 1e-5) ** 0.5
    torch.testing.assert_close(seen[0], running, atol=1e-4, rtol=0)
    assert sampler.batchnorm == "separate" and model.training


@pytest.mark.slow
def test_bench_generative_quick_run(tmp_path):
    threads = torch.get_num_threads()  # the benchmark's jobs run on one thread each
    try:
        res = B.run(
            settings=("digits8_cnn",),
            runs=("baseline", "sadajem"),
            epochs8=1,
            quick=True,
            out_dir=str(tmp_path),
            workers=1,
            n_train=128,
            n_test=100,  # of the 360 test digits (and 100 per OOD set): for time
        )
    finally:
        torch.set_num_threads(threads)
    rows = {r["run"]: r for r in res["rows"]}
    assert set(rows) == {"baseline", "sadajem"}
    for r in rows.values():
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["cond"]["judge_acc"] <= 1.0
        assert set(r["auroc"]) == set(B.OOD_METHODS)
        assert os.path.exists(tmp_path / r["grid"])
    assert "buffer" in rows["sadajem"] and "buffer" not in rows["baseline"]
    trace = rows["sadajem"]["chains"]["trace"]
    assert [t["steps"] for t in trace] == [0, get_recipe("sadajem").sampler.steps]
    assert trace[0]["fd"] == pytest.approx(rows["sadajem"]["buffer"]["fd"], rel=1e-6), "round 0 is the buffer itself"
    assert rows["baseline"]["cost_vs_baseline"] == pytest.approx(1.0)
    ref = res["references"]["digits8_cnn"]["fd"]
    assert ref["heldout_halves"] < ref["uniform_init"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"][0]["run"] == "baseline"
    md = (tmp_path / "results.md").read_text()
    assert "| digits8_cnn | sadajem |" in md and "chains continued" in md


@pytest.mark.slow
def test_a_recipe_is_reported_as_jem_train_leaves_it_with_batchnorm_statistics_from_data(monkeypatch):
    """A recipe that recomputes BatchNorm running statistics after training (as jem train does with
    it) is reported recomputed; --bn-from-data adds the model as trained, and for the others the
    recomputed model."""
    monkeypatch.setattr(B, "_judge", lambda S, quick: B.train_judge(S["x"], S["y"], epochs=1, seed=0))
    monkeypatch.setattr(B, "update_bn", lambda loader, model: calls.append(len(loader)))
    monkeypatch.setattr(B, "save_grid", lambda path, *a, **k: path)
    calls: list[int] = []
    job = lambda run, both: [
        r["run"]
        for r in B._job(
            (
                "digits8_cnn",
                run,
                1,
                None,
                True,
                "",
                64,
                {"bn_stats_from_data": run == "generative"},
                "",
                0,
                "loop",
                both,
                60,  # test digits (of 360), and as many per OOD set: for time
            )
        )
    ]
    torch_threads = torch.get_num_threads()
    try:
        assert job("generative", False) == ["generative"] and calls == [1]
        assert job("generative", True) == ["generative_bnastrained", "generative"]
        assert job("fast", False) == ["fast"] and len(calls) == 2
        assert job("fast", True) == ["fast", "fast_bnfromdata"] and len(calls) == 3
    finally:
        torch.set_num_threads(torch_threads)


def test_fit_init_train_fits_the_init_on_the_clean_training_set():
    S = B.load_setting("digits8_cnn", n_train=128)
    res = B.train_run(S, "fast", 1, quick=True, fit_init="train")
    init = res["loss_fn"].buffer.init_dist
    want = torch.stack([S["x"][S["y"] == k].mean(0).flatten() for k in range(10)])
    torch.testing.assert_close(init.mean, want, atol=1e-5, rtol=0)


def test_plugin_files_register_an_init_the_recipes_can_name():
    """--plugin FILE.py: the bench's experimental inits go through the hook third parties use;
    half_noisy draws half its samples with the residual noise and half without."""
    path = os.path.join(os.path.dirname(B.__file__), "plugins", "noise_inits.py")
    names = B.register_plugin_files([path])
    try:
        buf = jem.ReplayBuffer(40, (1, 8, 8), init="half_noisy", num_classes=2)
        g = torch.Generator().manual_seed(0)
        buf.fit(torch.randn(60, 1, 8, 8, generator=g) * 0.3, torch.arange(60) % 2)
        init = buf.init_dist
        draws = init.sample(400, (1, 8, 8), jem.InputDomain(), g, "cpu", y=torch.zeros(400)).flatten(1)
        basis = torch.linalg.qr(init.clean.factor[0])[0]  # the class's 8 directions
        centred = draws - init.clean.mean[0]
        outside = (centred - centred @ basis @ basis.T).std(1)
        noisy = outside > 3 * float(init.clean.std[0])
        assert 0.4 < noisy.float().mean() < 0.6
    finally:
        for name in names:
            jem.unregister(name=name)
    with pytest.raises(jem.UnknownNameError):
        jem.ReplayBuffer(4, (1, 8, 8), init="half_noisy")


def test_structured_noise_inits_are_grey_in_pixels_and_smooth_where_asked():
    """grey_noisy / smooth_noisy (e50): the added noise is the same in every channel once mapped
    back to pixels, and smooth_noisy's has no pixel-to-pixel jumps beyond the scaled-up grid's."""
    path = os.path.join(os.path.dirname(B.__file__), "plugins", "noise_inits.py")
    names = B.register_plugin_files([path])
    try:
        dom = jem.wrap(torch.nn.Linear(1, 1), mean=B.IMAGENET_MEAN, std=B.IMAGENET_STD, input_size=(3, 16, 16)).domain
        g = torch.Generator().manual_seed(0)
        x, y = (torch.rand(40, 3, 16, 16, generator=g) - 0.5) * 0.2, torch.arange(40) % 2
        std = torch.tensor(B.IMAGENET_STD).view(1, 3, 1, 1)
        jumps = {}
        for name in ("grey_noisy", "smooth_noisy"):
            init = jem.ReplayBuffer(8, (3, 16, 16), init=name, num_classes=2).fit(x, y).init_dist
            yy = torch.zeros(200, dtype=torch.long)
            # the same seed draws the same noise-free part first, then the noise on top
            added = init.sample(
                200, (3, 16, 16), dom, torch.Generator().manual_seed(5), "cpu", y=yy
            ) - init.clean.sample(200, (3, 16, 16), dom, torch.Generator().manual_seed(5), "cpu", y=yy)
            noise_px = added * std  # back to pixel units
            for a, b in ((0, 1), (1, 2)):  # equal in every channel (ImageNet's stds differ by 2%)
                assert (noise_px[:, a] - noise_px[:, b]).abs().max() < 1e-3 * noise_px.abs().max()
            jumps[name] = float((noise_px[..., 1:] - noise_px[..., :-1]).abs().mean() / noise_px.abs().mean())
        assert jumps["smooth_noisy"] < 0.5 * jumps["grey_noisy"]
    finally:
        for name in names:
            jem.unregister(name=name)
