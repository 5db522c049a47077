"""benchmarks/bench_ledger.py: its statistics agree with the library's and scikit-learn's, its
intervals are paired and honest, its decision rule reads them as written, and a tiny ledger runs,
keeps each point's model, leaves the training run as it was without it, and reports."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

import jem_plugin as jem
from benchmarks import bench_ledger as L
from benchmarks import bench_long_row as LR


def test_the_vectorised_ece_is_the_librarys_ece():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 10, generator=g) * 3
    y = torch.randint(10, (300,), generator=g)
    p = logits.softmax(1)
    conf, correct = p.max(1).values.numpy()[None], (p.argmax(1) == y).numpy().astype(float)[None]
    assert L._ece(conf, correct)[0] == pytest.approx(jem.calibration.ece(p, y), abs=1e-9)


def test_the_auroc_of_resampled_scores_is_scikit_learns_with_ties_counted_half():
    rs = np.random.RandomState(0)
    inside, outside = rs.randint(0, 5, (3, 40)).astype(float), rs.randint(0, 4, (3, 30)).astype(float)
    labels = np.r_[np.ones(40), np.zeros(30)]
    expected = [roc_auc_score(labels, np.r_[i, o]) for i, o in zip(inside, outside)]
    np.testing.assert_allclose(L._auroc(inside, outside), expected)


def _stats(values_by_seed, d):
    return {s: {"accuracy": v[d["test"]].mean(1)} for s, v in values_by_seed.items()}


def test_a_constant_gain_on_the_same_inputs_is_called_and_a_null_difference_is_not():
    rs = np.random.RandomState(1)
    d = L.draws({"test": 400}, n_boot=500)
    base = {s: (rs.rand(400) < 0.7).astype(float) for s in range(3)}
    gain = {s: np.maximum(v, (np.arange(400) % 10 == 0)) for s, v in base.items()}  # a few more right, same inputs
    res = L.paired_bootstrap(_stats(gain, d), _stats(base, d), n_boot=500)["accuracy"]
    assert res["lo"] > 0 and res["diff"] == pytest.approx(np.mean([gain[s].mean() - base[s].mean() for s in range(3)]))
    same = L.paired_bootstrap(_stats(base, d), _stats(base, d), n_boot=500)["accuracy"]
    assert same["diff"] == 0 and same["lo"] == 0 and same["hi"] == 0
    other = {s: (rs.rand(400) < 0.7).astype(float) for s in range(3)}  # another model, no real difference
    res = L.paired_bootstrap(_stats(other, d), _stats(base, d), n_boot=500)["accuracy"]
    assert res["lo"] < 0 < res["hi"]


def test_the_interval_resamples_the_seeds_too():
    # the same inputs, but seeds that disagree: the interval must be wide where one seed alone is not
    d = L.draws({"test": 400}, n_boot=500)
    base = {s: np.zeros(400) for s in range(3)}
    arm = {0: np.ones(400), 1: np.zeros(400), 2: np.zeros(400)}
    res = L.paired_bootstrap(_stats(arm, d), _stats(base, d), n_boot=500)["accuracy"]
    assert res["lo"] == 0 and res["hi"] == 1  # some draws have seed 0 never, some only it


def test_with_the_seeds_held_fixed_only_the_inputs_widen_the_interval():
    # seeds that disagree and inputs that do not: the seeds' resampling is the whole interval
    d = L.draws({"test": 400}, n_boot=500)
    base = {s: np.zeros(400) for s in range(3)}
    arm = {0: np.ones(400), 1: np.zeros(400), 2: np.zeros(400)}
    fixed = L.paired_bootstrap(_stats(arm, d), _stats(base, d), n_boot=500, resample_seeds=False)["accuracy"]
    assert fixed["lo"] == fixed["hi"] == fixed["diff"] == pytest.approx(1 / 3)
    full = L.paired_bootstrap(_stats(arm, d), _stats(base, d), n_boot=500)["accuracy"]
    cmp = {"result": {"accuracy": full}, "inputs_only": {"accuracy": fixed}}
    assert L.precision_text(cmp).startswith("Precision: the accuracy difference's interval reaches 50.0 points")
    assert "0.0 from the test inputs alone" in L.precision_text(cmp)
    assert L.precision_text({"result": {"accuracy": full}}) == ""


def _cmp(**diffs):
    rows = L.benefit_rows(["near", "other"], ["other"])
    result = {
        k: {"diff": v[0], "lo": v[1], "hi": v[2], "arm": 0.0, "base": 0.0, "seeds": v[3] if len(v) > 3 else 3}
        for k, v in diffs.items()
    }
    return {"result": result}, rows


def test_the_rule_passes_an_arm_non_inferior_on_accuracy_and_worse_nowhere():
    cmp, rows = _cmp(
        accuracy=(-0.002, -0.009, 0.005), ece_scaled=(0.001, -0.01, 0.02), auroc_logpx_mean=(0.01, -0.02, 0.05)
    )
    assert L.decide(cmp, rows) == {"passes": True, "failed": [], "seeds": 3}


def test_the_rule_fails_on_accuracy_below_minus_one_point_on_a_worse_benefit_and_on_two_seeds():
    cmp, rows = _cmp(accuracy=(0.0, -0.011, 0.01))
    assert not L.decide(cmp, rows)["passes"]
    cmp, rows = _cmp(accuracy=(0.0, -0.005, 0.01), ece_scaled=(0.02, 0.005, 0.04))  # higher ECE is worse
    d = L.decide(cmp, rows)
    assert not d["passes"] and d["failed"][0].startswith("ece_scaled")
    cmp, rows = _cmp(accuracy=(0.0, -0.005, 0.01), robust_direct_2=(-0.05, -0.08, -0.01))
    assert not L.decide(cmp, rows)["passes"]
    cmp, rows = _cmp(accuracy=(0.0, -0.005, 0.01, 2))
    assert L.decide(cmp, rows)["failed"] == ["2 seeds (the rule asks for 3)"]


def test_the_fine_tune_starts_from_the_baselines_first_point():
    c = L.arm_cell("textures", "resnet10t", "finetune", 1, 1500, 2, out_dir="/out")
    epochs = LR.epochs_for("textures", 1500)
    base = LR.cell("textures", "resnet10t", "baseline", 1, epochs)
    assert c["start_iteration"] == LR.eval_epochs(epochs, 2)[0] * LR.batches_per_epoch("textures")
    assert c["init_from"] == f"/out/models/{L.GB.cell_name(base)}/it{c['start_iteration']}.pt"
    assert c["epochs"] == round(L.FINETUNE_SHARE * epochs) and c["evals"] == 1 and c["role"] == "finetune"


@pytest.mark.slow
def test_a_tiny_ledger_keeps_its_points_leaves_the_run_as_it_was_and_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "ROBUST_N", 8)  # the attacks' cost, not their logic
    monkeypatch.setattr(L, "DEFENCE_CHAINS", 2)
    out = str(tmp_path / "ledger")
    cells = [
        {**L.arm_cell("textures", "test_resnet", arm, 0, 3, 2, tiny=True, out_dir=out)}
        for arm in ("baseline", "default", "finetune")
    ]
    loads = []
    real_load = LR.load_checkpoint
    monkeypatch.setattr(LR, "load_checkpoint", lambda path, **kw: loads.append(str(path)) or real_load(path, **kw))
    LR.run(cells, out, workers=1, report_each=False, point_hook=L.keep_point)
    for c in cells:
        row = json.load(open(os.path.join(out, "cells", L.GB.cell_name(c) + ".json")))
        assert row["done"]
        for p in row["points"]:
            kept, npz, js = L._paths(out, L.GB.cell_name(c), p["iteration"])
            assert os.path.exists(kept) and os.path.exists(npz)
            meta = json.load(open(js))
            assert meta["iteration"] == p["iteration"] + c.get("start_iteration", 0)
            assert ("defended" in meta["robust"]) == (c["role"] != "baseline" and p is row["points"][-1])
            assert ("posthoc_auroc" in meta) == (c["role"] == "baseline")
    # the ledger's evaluation changes nothing in the run: the same cell without the hook
    plain = str(tmp_path / "plain")
    LR.run(cells[1:2], plain, workers=1, report_each=False)
    timing = {"train_cpu_s", "train_wall_s", "eval_cpu_s"}
    strip = lambda path: [{k: v for k, v in p.items() if k not in timing} for p in json.load(open(path))["points"]]
    name = L.GB.cell_name(cells[1]) + ".json"
    assert strip(os.path.join(out, "cells", name)) == strip(os.path.join(plain, "cells", name))
    # the fine-tune started from the baseline's first kept point, not from scratch
    assert loads == [cells[2]["init_from"]] and cells[2]["init_from"].startswith(out)
    # each network's cost is its own: another network's measurement never prices this one
    for net, ratio in (("test_resnet", 3.3), ("resnet10t", 9.9)):
        cost = {"s_per_iteration": {"baseline": 0.1, "default": 0.1 * ratio}, "load_before": [0.5, 0.5, 0.5],
                "ratio_to_ce": {"baseline": 1.0, "default": ratio}}  # fmt: skip
        L.write_json(os.path.join(out, L.COST_JSON.format(net=net)), cost)
    md = L.report(out, docs_page=None, docs_img=None, evidence=str(tmp_path / "evidence.json"))
    assert "| accuracy (higher is better) |" in md and "finetune at" in md
    assert "**Rule, finetune at" in md and "1 seed (the rule asks for 3)" in md
    assert "default 0.33 (3.3x)" in md and "9.9x" not in md
    assert "A column of one seed resamples its test inputs only" in md  # its interval is not a 3-seed one
    assert os.path.exists(os.path.join(out, "ledger-textures-test_resnet.png"))
    evidence = json.load(open(tmp_path / "evidence.json"))["entries"]
    # never the fine-tune, and priced with its own network's cost
    assert [(e["arm"], e["seeds"], e["kind"], e["cost_ratio"]) for e in evidence] == [("default", 1, "BN", 3.3)]


def test_merging_a_gpu_archive_brings_its_points_with_its_cells_and_never_overwrites_a_done_cell(tmp_path):
    import tarfile

    work = tmp_path / "work"
    (work / "cells").mkdir(parents=True)
    (work / "points").mkdir()
    for name, done in (("a_cell", True), ("b_cell", True)):
        (work / "cells" / f"{name}.json").write_text(
            json.dumps({"name": name, "done": done, "points": [{}], "device": "cuda"})
        )
        (work / "points" / f"{name}_it8.json").write_text(json.dumps({"cell": name, "iteration": 8}))
        np.savez(work / "points" / f"{name}_it8.npz", correct=np.ones(3))
    archive = tmp_path / "ledger_gpu.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work / "cells", "cells")
        tar.add(work / "points", "points")
    out = tmp_path / "out"
    (out / "cells").mkdir(parents=True)
    (out / "cells" / "b_cell.json").write_text(json.dumps({"name": "b_cell", "done": True, "points": [{}]}))
    lines = L.merge_from(str(archive), str(out))
    assert lines == ["added (cuda, done): a_cell.json", "kept (done here): b_cell.json"]
    assert sorted(os.listdir(out / "points")) == ["a_cell_it8.json", "a_cell_it8.npz"]


def test_equal_compute_reads_the_long_rows_baseline_at_the_arms_cost_and_names_its_seeds(tmp_path, monkeypatch):
    (tmp_path / "cells").mkdir()
    curve = {"seed": 0, "points": [{"iteration": i, "accuracy": a} for i, a in ((500, 0.6), (1000, 0.7), (2000, 0.8))]}
    (tmp_path / "cells" / "textures_150_wrn10-1_baseline_s0_e125_lr0.003.json").write_text(json.dumps(curve))
    monkeypatch.setattr(LR, "RESULTS", str(tmp_path))
    point = {"arm": "default", "iteration": 300, "arrays": {"correct": np.array([1, 1, 0, 1])}, "row": {}}
    rows, seeds = L.equal_compute([point], {"default": 4.0}, "textures", "wrn10-1")
    # 300 JEM iterations at 4x are 1,200 cross-entropy ones: the curve's point at or below that is 1,000
    assert rows == [["default", "300", "75.0", "1,200", "1,000", "70.0"]] and seeds == [0]
    assert L.equal_compute([point], {"default": 4.0}, "textures", "resnet18") == ([], [])
