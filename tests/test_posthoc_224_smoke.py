"""Smoke test of benchmarks/bench_posthoc_224.py at a tiny size: one network, gradient-free scores
through the one shared forward, mcd and a gradient score, the per-detector loop beside it with the
same scores, the CPU cost of each phase written out, and the GPU command's device comparison run
on the CPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("timm")
pytest.importorskip("torchvision")

from benchmarks import bench_posthoc_224 as B  # noqa: E402 (it imports timm through bench_posthoc: skipped above without it)

#: A few of the gradient-free scores (each kind of output: logits, features, layers, maps), for time
FEW = ["logpx", "msp", "knn", "vim", "gram", "ash"]


def test_tiny_224_run_scores_every_detector_once_and_states_its_cost(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "gradient_free_scores", lambda: FEW)
    monkeypatch.setattr(B, "GRADIENT_SCORES", ("odin",))
    monkeypatch.setattr(B, "FIT_ALONE", ("knn", "vim"))  # the device comparison's fits: the cheap ones
    # 7 per class x 8 classes = 56 fit images: knn's k = 50 fits
    args = ["--size", "32", "--per-class", "7", "--per-class-test", "1", "--epochs", "1", "--compare"]
    res = B.main([*args, "--out", str(tmp_path)])
    st = res["settings"]
    assert st["size"] == 32 and st["n_train"] == 56 and set(st["n_ood"]) == set(B.SETS)
    assert st["n_ood"]["held_out"] == 16 == st["n_ood"]["photo"]  # classes 8-9 of both splits, never trained on
    scores = {r["score"] for r in res["rows"]}
    assert scores == {*FEW, "mcd", "odin"} and res["gradient_free"] == FEW
    assert {r["set"] for r in res["rows"]} == set(B.SETS)
    mcd = [r for r in res["rows"] if r["score"] == "mcd"]
    assert all(r["status"] == "ok" for r in mcd)  # mobilenet_v3_small's classifier has its dropout
    # one shared forward: a handful of passes against one or more per detector, the same scores
    assert res["forwards_shared"] * 4 < res["forwards_loop"] and res["loop_max_rel_score_diff"] < 1e-5
    assert all(v["cpu_s"] > 0 and len(v["load_start"]) == 3 for v in res["phases"].values())
    assert set(res["phases"]) == {"data", "training", "shared", "mcd_and_gradient", "loop", "devices"}
    # the --device cuda comparison's code, on the CPU: the shared path and the fits alone timed
    dev = res["devices"]
    assert set(dev["cpu"]["fit_s"]) == set(B.FIT_ALONE) and dev["cpu"]["evaluate_all_s"] > 0
    assert dev["max_rel_score_diff"] == 0.0 and dev["threads"] == 1
    saved = json.loads((tmp_path / "posthoc_224.json").read_text())["posthoc_224"]
    assert saved["rows"] == res["rows"] and saved["cpu_s"] == res["cpu_s"]
    md = (tmp_path / "posthoc_224.md").read_text()
    assert "CPU minutes" in md and "per-detector loop" in md and "| mcd |" in md
    assert (tmp_path / "posthoc_224.png").stat().st_size > 5000
