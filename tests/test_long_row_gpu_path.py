"""The long row's GPU plumbing, exercised on the CPU through the same code (bench_long_row with
``device="cpu"``): the model, loss and chains on the run's device with their own generator, the
points evaluated on CPU copies, DAT's negatives in a run, the deadline, and the merge of a GPU
archive into the CPU's results."""

from __future__ import annotations

import json
import os
import tarfile
import time

import pytest
import torch

from benchmarks import bench_generalisation as GB
from benchmarks import bench_long_row as L
from jem_plugin.builtins.pgd_negatives import TERM_NAME, PGDNegatives
from jem_plugin.recipes import RECIPES


def _setting():
    c = L.cell("textures", "test_resnet", "default", 0, epochs=2, tiny=True)
    return GB.setting(GB.dataset("textures", True), c["net"], c["per_class"], 0)


def test_a_run_on_a_device_draws_its_chains_from_its_own_generator_and_the_cpu_run_is_unchanged():
    S = _setting()
    cpu = L.G.start_run(S, "generative", 10, seed=3, fit_init="train")
    assert cpu["loss_fn"].sampler.generator is cpu["g"] and cpu["device"] is None  # as before
    dev = L.G.start_run(S, "generative", 10, seed=3, fit_init="train", device="cpu")
    gen = dev["loss_fn"].sampler.generator
    assert gen is not dev["g"] and gen is dev["loss_fn"].generator and gen.device.type == "cpu"
    assert gen.initial_seed() == 3 and dev["g"].initial_seed() == 3
    # the same model at the start, wherever it trains
    for a, b in zip(cpu["model"].state_dict().values(), dev["model"].state_dict().values()):
        assert torch.equal(a, b)
    idx = torch.arange(8)
    metrics = L.G.train_step(dev, S["x"][idx], S["y"][idx])
    assert set(metrics) >= {"loss"}


def test_a_point_is_evaluated_on_cpu_copies_that_leave_the_run_as_it_was():
    S = _setting()
    ctx = L.G.start_run(S, "generative", 10, seed=0, fit_init="train", device="cpu")
    idx = torch.arange(16)
    L.G.train_step(ctx, S["x"][idx], S["y"][idx])
    loss_fn = ctx["loss_fn"]
    gen, state = loss_fn.generator, loss_fn.generator.get_state()
    copy = L.cpu_copy_of_loss(loss_fn, seed=7)
    assert copy is not loss_fn and copy.buffer is not loss_fn.buffer
    assert torch.equal(copy.buffer.data, loss_fn.buffer.data) and copy.buffer.data.device.type == "cpu"
    for o in (copy, copy.sampler):
        assert o.generator is not gen and o.generator.initial_seed() == 7
    assert loss_fn.generator is gen and loss_fn.sampler.generator is gen  # the run's, put back
    before = {k: v.clone() for k, v in ctx["model"].state_dict().items()}
    judge = GB.judge_for("textures", True)
    ev = L.evaluate_point(S, ctx, judge, baseline=False, tiny=True)
    assert 0.0 <= ev["accuracy"] <= 1.0 and "fd" in ev["buffer"]
    assert torch.equal(loss_fn.generator.get_state(), state)  # evaluation drew nothing from the run's chains
    assert all(torch.equal(before[k], v) for k, v in ctx["model"].state_dict().items())


def test_dat_negatives_replace_sgld_in_the_choices_recipe():
    S = _setting()
    ctx = L.G.start_run(S, "generative", 10, seed=0, fit_init="train", negatives="dat")
    loss_fn, r = ctx["loss_fn"], ctx["recipe"]
    assert isinstance(loss_fn.sampler, PGDNegatives) and loss_fn.sampler.generator is ctx["g"]
    assert TERM_NAME in dict(loss_fn._all_terms()) and loss_fn.px_weight == 0.0
    assert r.buffer.reinit_freq == 1.0 and r.bn_stats_from_data
    idx = torch.arange(8)
    metrics = L.G.train_step(ctx, S["x"][idx], S["y"][idx])
    assert any("auc" in k for k in metrics)
    with pytest.raises(ValueError, match="baseline"):
        L.G.start_run(S, "baseline", 10, negatives="dat")
    c = L.cell("textures", "resnet10t", "dat", 0, epochs=1, tiny=True)
    assert c["negatives"] == "dat" and "+dat" in GB.cell_name(c)
    assert GB.cell_name(c) != GB.cell_name(L.cell("textures", "resnet10t", "default", 0, epochs=1, tiny=True))


def test_the_gpu_plan_puts_resnet18_then_dat_first_and_skips_cells_done_on_the_cpu(tmp_path):
    cpu = L.plan(tiny=True)
    done = tmp_path / "cells"
    done.mkdir()
    (done / (GB.cell_name(cpu[0]) + ".json")).write_text(json.dumps({"done": True}))
    (done / (GB.cell_name(cpu[1]) + ".json")).write_text(json.dumps({"points": []}))  # unfinished
    cells = L.gpu_plan(str(done), tiny=True)
    weights = [(d, n, "weight") for d in L.DATASETS for n in L.NETWORKS]  # at GPU_PX_WEIGHTS' one weight
    head = [(c["dataset"], c["net"], c["role"]) for c in cells[: 4 + len(weights)]]
    assert head == [
        ("textures", "resnet18", "baseline"),
        ("textures", "resnet18", "default"),
        *weights,
        ("textures", "resnet10t", "dat"),
        ("digits32", "resnet10t", "dat"),
    ]
    assert {c["set"]["px_weight"] for c in cells[2 : 2 + len(weights)]} == set(L.GPU_PX_WEIGHTS)
    assert cells[0]["epochs"] == L.epochs_for("textures", L.GPU_ITERATIONS, tiny=True)
    names = [GB.cell_name(c) for c in cells[4 + len(weights) :]]
    assert names == [GB.cell_name(c) for c in cpu[1:]]  # the rest of the CPU plan, in order
    (done / (GB.cell_name(cells[2]) + ".json")).write_text(json.dumps({"done": True}))  # a weight cell the CPU ran
    assert [GB.cell_name(c) for c in L.gpu_plan(str(done), tiny=True, px_weights=(0.1,))][2:4] == [
        GB.cell_name(L.cell("textures", n, "weight", 0, cells[2]["epochs"], tiny=True, px_weight=0.1))
        for n in L.NETWORKS[:2]
    ]
    assert GB.cell_name(cells[2]) not in [GB.cell_name(c) for c in L.gpu_plan(str(done), tiny=True)]


def _tiny(role: str, epochs: int = 3) -> dict:
    return {**L.cell("textures", "test_resnet", role, 0, epochs=epochs, tiny=True), "evals": epochs}


@pytest.mark.slow
def test_a_cell_stops_at_its_first_point_after_the_deadline_and_resumes_later(tmp_path):
    c = _tiny("baseline")
    L.run([], str(tmp_path), workers=1, report_each=False)  # the judges
    row = L.run_cell(c, str(tmp_path), device="cpu", deadline=time.time())
    assert [p["epoch"] for p in row["points"]] == [1] and row["stopped"] == "deadline" and not row.get("done")
    assert row["device"] == "cpu" and row["points"][0]["train_wall_s"] > 0
    saved = json.loads(open(L._paths(str(tmp_path), c)[0]).read())
    assert saved["stopped"] == "deadline" and os.path.exists(L._paths(str(tmp_path), c)[1])
    # no cell starts after the deadline
    other = _tiny("default")
    L.run([other], str(tmp_path), workers=1, report_each=False, device="cpu", deadline=time.time() - 1)
    assert not os.path.exists(L._paths(str(tmp_path), other)[0])
    # without one, the stopped cell resumes from its checkpoint to the end
    row = L.run_cell(c, str(tmp_path), device="cpu")
    assert row["done"] and "stopped" not in row and [p["epoch"] for p in row["points"]] == [1, 2, 3]


def _archive(tmp_path, rows: dict[str, dict]) -> str:
    work = tmp_path / "work"
    (work / "cells").mkdir(parents=True)
    for name, row in rows.items():
        (work / "cells" / f"{name}.json").write_text(json.dumps(row))
    (work / "runs.json").write_text(json.dumps([{"device": "cuda", "cells_run": len(rows)}]))
    (work / "run.log").write_text("log\n")
    path = tmp_path / "long_row_gpu.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name in ("cells", "runs.json", "run.log"):
            tar.add(work / name, arcname=name)
    return str(path)


def test_the_merge_never_overwrites_a_done_cell_and_replaces_an_unfinished_one(tmp_path):
    out = tmp_path / "results"
    (out / "cells").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    here = {
        "done_here": {"done": True, "points": [{"epoch": 1}], "device": "cpu"},
        "unfinished_here": {"points": [{"epoch": 1}], "device": "cpu"},
        "more_here": {"points": [{"epoch": 1}, {"epoch": 2}], "device": "cpu"},
    }
    for name, row in here.items():
        (out / "cells" / f"{name}.json").write_text(json.dumps(row))
    (out / "checkpoints" / "unfinished_here.pt").write_bytes(b"x")
    (out / "runs.json").write_text(json.dumps([{"device": "cpu"}]))
    gpu = {"points": [{"epoch": 1}], "device": "cuda", "stopped": "deadline"}
    archive = _archive(
        tmp_path,
        {
            "done_here": {**gpu, "done": True},
            "unfinished_here": {**gpu, "done": True},
            "more_here": gpu,
            "new": gpu,
        },
    )
    lines = L.merge_from(archive, str(out))
    cells = {n: json.loads((out / "cells" / f"{n}.json").read_text()) for n in [*here, "new"]}
    assert cells["done_here"]["device"] == "cpu"
    assert cells["unfinished_here"]["device"] == "cuda" and cells["unfinished_here"]["done"]
    assert not (out / "checkpoints" / "unfinished_here.pt").exists()  # set aside: no run resumes into it
    assert (out / "checkpoints" / "unfinished_here.pt.stale").exists()
    assert cells["more_here"]["device"] == "cpu" and cells["new"]["device"] == "cuda"
    assert [r["device"] for r in json.loads((out / "runs.json").read_text())] == ["cpu", "cuda"]
    assert (out / "gpu-long_row_gpu.log").read_text() == "log\n" and len(lines) == 4


def test_a_cpu_run_leaves_a_cell_another_device_started_to_it(tmp_path, monkeypatch):
    c = _tiny("baseline")
    json_path, _ = L._paths(str(tmp_path), c)
    os.makedirs(os.path.dirname(json_path))
    open(json_path, "w").write(json.dumps({**c, "points": [], "device": "cuda", "stopped": "deadline"}))
    monkeypatch.setattr(L.G, "start_run", lambda *a, **k: pytest.fail("a cell of another device trained here"))
    L.run([c], str(tmp_path), workers=1, report_each=False)
    assert L.run_cell(c, str(tmp_path))["device"] == "cuda"


def test_the_table_says_where_a_cell_trained_and_its_wall_cost_on_a_gpu():
    def row(run, device, wall, cpu, role):
        p = {
            "iteration": 10,
            "accuracy": 0.5,
            "auroc": {"logpx": dict.fromkeys(L.OOD_NAMES, 0.6)},
            "ece": 0.1,
            "ece_ts": 0.05,
            "init_fd": 10.0,
            "train_wall_s": wall,
            "train_cpu_s": cpu,
        }
        return {
            "dataset": "textures",
            "net": "resnet18",
            "run": run,
            "seed": 0,
            "role": role,
            "points": [p],
            "device": device,
        }

    rows = [row("baseline", "cuda", 1.0, 5.0, "baseline"), row("generative", "cuda", 3.0, 5.0, "default")]
    (e,) = L.curves(rows)
    assert e["device"] == "cuda" and e["cost"] == pytest.approx(3.0)  # wall seconds on a GPU
    assert e["points"][0]["wall_s"] == 3.0
    rows[0]["device"] = "cpu"
    (e,) = L.curves(rows)
    assert e["device"] == "cuda (baseline cpu)" and e["cost"] is None  # no cost across devices
    assert "| cuda (baseline cpu) |" in L.targets_table([e])


def test_jem_train_never_reads_a_dat_cell_as_its_recipe():
    base = {"dataset": "textures", "net": "resnet10t", "seed": 0, "run": "baseline", "role": "baseline"}
    point = {
        "iteration": 10,
        "accuracy": 0.5,
        "auroc": {"logpx": dict.fromkeys(L.OOD_NAMES, 0.9)},
        "ece": 0.1,
        "ece_ts": 0.05,
        "init_fd": 10.0,
        "buffer": {"fd": 1.0},
        "train_cpu_s": 1.0,
    }
    dat = {**base, "run": "generative", "set": {"px_weight": 0.03}, "negatives": "dat", "role": "dat"}
    rows = [{**base, "points": [point]}, {**dat, "points": [point]}]
    (cell,) = L.targets_evidence(rows, L.curves(rows))["cells"]
    assert cell["role"] == "dat" and cell["recipe"] == "generative+dat" and cell["met_at_last"]
    assert cell["recipe"] not in RECIPES  # so jem train never switches to it
