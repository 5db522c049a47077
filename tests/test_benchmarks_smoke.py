"""Smoke tests of benchmarks/: tiny settings, so the benchmarks cannot rot, plus the strongest
correctness check we have for the sampler: it computes exactly the bare loop's chain."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from benchmarks import (
    bench_gpu_path,
    bench_quality,
    bench_sampler,
    bench_scaling,
    bench_scoring,
    bench_train_step,
    common,
    run_all,
)
from benchmarks.bench_quality import check_targets
from benchmarks.common import floor_chain, frozen, make_model, uniform_batch
from jem_plugin.sampling import SGLD


@pytest.mark.parametrize("model_name", ["digits_cnn", "test_resnet"])
@pytest.mark.parametrize("conditional", [False, True])
def test_sampler_computes_the_floors_chain_bit_for_bit(model_name, conditional):
    # Same start, same generator: the library's chain (parameter freezing, mode handling, hooks
    # check, divergence check, no clamp) must be exactly the bare loop's chain, not just close.
    model, jm, shape = make_model(model_name)
    model.train()  # the sampler must switch BatchNorm (test_resnet) to eval itself; the floor runs in eval
    x0 = uniform_batch(4, shape, seed=5)
    y = torch.tensor([0, 3, 7, 9]) if conditional else None
    ours = SGLD(steps=3, step_size=1.0, noise=0.01, clamp=False, generator=torch.Generator().manual_seed(42)).sample(
        jm, x_init=x0, y=y
    )
    assert model.training, "the sampler must restore the model's train mode"
    model.eval()
    with frozen(model):
        ref = floor_chain(model, x0, 3, 1.0, 0.01, generator=torch.Generator().manual_seed(42), y=y)
    assert ours.dtype == torch.float32
    assert not torch.equal(ref, x0), "the chain must move, or the comparison proves nothing"
    assert torch.equal(ours, ref)


def test_floor_and_contenders_are_the_same_update():
    # The reference transcription and torchebm make the same Langevin update as the floor
    # (noise off, so the RNGs do not matter): they are compared on the same work.
    from benchmarks.contenders import ReferenceJEM, torchebm_sampler

    model, jm, shape = make_model("digits_cnn")
    x0 = uniform_batch(4, shape, seed=9)
    with frozen(model):
        ref = floor_chain(model, x0, 3, 1.0, 0.0)
    pytest.importorskip("torchebm")
    te, _ = torchebm_sampler(model, step_size=1.0, noise=1e-12)
    torch.testing.assert_close(te.sample(x=x0, n_steps=3), ref, rtol=0, atol=1e-5)
    rj = ReferenceJEM(model, shape, buffer_size=4, reinit_freq=0.0, sgld_std=0.0, n_steps=3, batch_size=4)
    rj.replay_buffer = x0.clone()
    torch.manual_seed(0)
    out = rj.sample_q()
    # sample_p_0's first draw picks the buffer slots: replay it to know each chain's start.
    torch.manual_seed(0)
    inds = torch.randint(0, 4, (4,))
    with frozen(model):
        expected = floor_chain(model, x0[inds], 3, 1.0, 0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_quick_benchmarks_write_the_report(tmp_path):
    results = {"machine": common.machine_info()}
    results["sampler"] = bench_sampler.run(quick=True, repeats=1, memory=False)
    results["train_step"] = bench_train_step.run(quick=True, repeats=1)
    results["scoring"] = bench_scoring.run(quick=True, repeats=1)
    results["scaling"] = bench_scaling.run(quick=True, repeats=1, memory=False)
    results["gpu_path"] = bench_gpu_path.run(quick=True, compile=False)
    md = run_all.write_report(results, str(tmp_path), "pytest")
    data = json.loads((tmp_path / "results.json").read_text())

    for key in ("cpu", "cores", "torch", "torch_threads"):
        assert key in data["machine"]
    s = data["sampler"]
    assert s["agreement"]["ours_equal_floor"] is True
    times = s["models"]["digits_cnn"]["time"]
    assert {"floor", "jem_plugin", "reference"} <= set(times)
    for stats in times.values():
        assert stats["median_s"] > 0 and stats["ratio"] > 0
    assert times["floor"]["ratio"] == pytest.approx(1.0)
    assert "le_1.02x_floor" in s["targets"]["digits_cnn"]
    ts = data["train_step"]["models"]["digits_cnn"]
    assert {"ce", "parts_fwdbwd"} <= set(ts["time"]) and ts["jem_vs_sum_of_parts"] > 0
    sc = data["scoring"]["models"]["digits_cnn"]
    assert sc["check"]["max_abs_diff"] == 0.0 and sc["check"]["identical"] is True
    assert sc["check"]["grad_norm_max_abs_diff_vs_floor"] < 1e-5
    assert set(data["scaling"]["vs_batch"]) and set(data["scaling"]["vs_steps"])
    corr = data["gpu_path"]["cpu_correctness"]
    for name in ("eager_fp32", "autocast_bf16", "channels_last"):
        assert corr[name]["ok"] and corr[name]["dtype"] == "torch.float32", corr[name]
    assert "## Targets" in md and "| sampler <= 1.02x floor (digits_cnn)" in md
    assert (tmp_path / "results.md").read_text() == md


@pytest.mark.slow
def test_memory_probe_runs_in_a_fresh_process():
    r = common.probe_memory(
        {
            "kind": "sampler",
            "impl": "jem_plugin",
            "model": "digits_cnn",
            "batch": 4,
            "steps": 2,
            "buffer_size": 16,
            "threads": 1,
        }
    )
    assert "error" not in r, r
    assert r["delta_mb"] >= 0 and r["method"] in ("VmHWM reset", "ru_maxrss delta")


def test_quality_comparisons_and_table():
    # The training runs are too slow for the suite; the bookkeeping around them is not.
    def row(acc, auroc, cpu):
        r = {"accuracy": acc, "ece": 0.01, "cpu_seconds_per_epoch": cpu, "seconds_per_epoch": cpu}
        r.update({f"auroc_{m}_{s}": auroc for m in ("logpx", "grad_norm") for s in bench_quality.SETS})
        r["train_cpu_seconds"] = 150 * cpu
        return r

    res = {
        "epochs": 1,
        "workers": 1,
        "wall_s": 1.0,
        "heldout": {},
        "table": {
            "baseline": row(0.95, 0.5, 1.0),
            "jem_20": row(0.95, 0.99, 13.0),
            "jem_5": row(0.93, 0.99, 5.0),
            "baseline_fast": row(0.97, 0.5, 2.0),
            "jem_5_fast": row(0.948, 0.98, 7.0),
            "jem_5_proximal": {"diverged": "|energy_sample| = 2e+04 exceeds max_abs_energy=1e+04"},
        },
    }
    res["comparisons"] = bench_quality.compare(res)
    c = res["comparisons"]
    assert c["jem_5"]["matches_20step"] is False  # 2 points below
    assert c["jem_5_fast"]["matches_20step"] is True  # 0.2 point, 0.01 AUROC below
    # cost and accuracy against the baseline trained with the same optimiser (baseline_fast)
    assert c["fast_recipe_cost_ok"] is True and c["fast_recipe_cost_vs_baseline"] == pytest.approx(3.5)
    assert res["table"]["jem_5_fast"]["acc_vs_baseline"] == pytest.approx(-0.022)
    assert res["table"]["jem_20"]["cpu_cost_vs_baseline"] == pytest.approx(13.0)
    assert c["jem_5_proximal"]["matches_20step"] is False
    md = bench_quality.to_markdown(res)
    assert "jem_5_fast" in md and "MISSED" in md and "diverged" in md

    # Other seeds: one meets every target, one is 2 points below its baseline.
    res["seeds"] = {
        "1": {"baseline": row(0.97, 0.5, 2.0), "jem": row(0.965, 0.995, 7.0)},
        "2": {"baseline": row(0.97, 0.5, 2.0), "jem": row(0.95, 0.995, 7.0)},
    }
    for r in res["seeds"].values():
        r["targets"] = check_targets({"runs": {"baseline": {"summary": r["baseline"]}, "JEM": {"summary": r["jem"]}}})
    fs = bench_quality.compare(res)["fast_recipe_seeds"]
    assert fs["n"] == 3 and fs["all_targets_met"] == 1  # seed 0: logpx AUROC 0.98 < 0.99
    assert fs["worst_acc_vs_baseline"] == pytest.approx(-0.022)  # seed 0: 0.948 vs 0.97
    res["comparisons"] = bench_quality.compare(res)
    md = bench_quality.to_markdown(res)
    assert "1 of 3 seeds meet every target" in md and "missed: accuracy_within_1pt" in md


@pytest.mark.slow
def test_robustness_table_from_a_digits_run(tmp_path):
    """bench_robustness reads the models a digits run saved and tabulates robust accuracy."""
    from benchmarks import bench_robustness
    from jem_plugin.app.experiments import run_digits

    # no sample-quality judge (run_digits' judge_epochs=0), a defence of 2 steps and 2 chains: for time
    run_digits(
        tmp_path,
        epochs=1,
        sgld_steps=2,
        buffer_capacity=200,
        class_sample_steps=2,
        judge_epochs=0,
        progress=False,
        plots=False,
    )
    res = bench_robustness.run(
        tmp_path, n=16, steps=2, defense_step_sizes=(1.0, 0.1), defense_steps=2, defense_chains=2
    )
    assert set(res["results"]) == {"baseline", "JEM"} | {
        f"{m} + SGLD defence (step {s}, worst case)" for m in ("baseline", "JEM") for s in ("1", "0.1")
    }
    for r in res["results"].values():
        assert len(r["accuracy"]) == len(bench_robustness.EPS_255)
        # PGD can only lower accuracy as the budget grows (eps 0 = clean accuracy)
        assert r["accuracy"][-1] <= r["accuracy"][0] + 1e-9
    assert "eps 8/255" in bench_robustness.to_markdown(res)


def test_inner_steps_check_tells_a_linear_stem_from_a_nonlinear_cut():
    # README's reason for leaving JEM++'s inner steps out: through a linear first layer their
    # direction is the outer gradient wherever the chain has moved; through a ReLU it is not.
    import timm

    from benchmarks.check_inner_steps import measure

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10)
    layer, at_point, moved = measure(model, (3, 32, 32), through_activation=False)
    assert layer == "Conv2d" and at_point < 1e-6 and moved < 1e-6
    layer, at_point, moved = measure(model, (3, 32, 32), through_activation=True)
    assert layer == "ReLU" and at_point < 1e-6 and moved > 0.1


@pytest.mark.slow
def test_jem_train_default_check_runs_the_cli_and_compares_with_the_same_seeds_baseline(tmp_path):
    """benchmarks/check_jem_train_default.py: jem train as typed, through the command line, against
    `jem train --baseline` on the same seed; the points are the held-out accuracies' difference."""
    from benchmarks import check_jem_train_default as C

    out = tmp_path / "default.json"
    res = C.main(["--seeds", "0", "--runs", "default", "baseline", "--epochs", "1", "--out", str(out)])
    runs = res["runs"]
    assert "recipe generative (px-weight 0.03, l2-weight 0)" in runs["default"]["0"]["run_line"]
    acc = {k: runs[k]["0"]["metrics"]["held_out"]["accuracy"] for k in ("default", "baseline")}
    assert res["points_vs_baseline"]["default"]["per_seed"] == [pytest.approx(100 * (acc["default"] - acc["baseline"]))]
    assert json.loads(out.read_text())["points_vs_baseline"] == res["points_vs_baseline"]


def test_gpu_path_gpu_only_leaves_the_cpu_out():
    """bench_gpu_path --gpu-only (what run_gpu_checks.sh runs): no CPU correctness or timings, so
    a short GPU lease is spent on the GPU's figures; without a GPU it says so and nothing else."""
    res = bench_gpu_path.run(quick=True, compile=False, gpu_only=True)
    assert "cpu_correctness" not in res and "cpu_timings" not in res
    if not torch.cuda.is_available():
        assert "gpu_correctness" not in res and "no CUDA device" in res["gpu_note"]
        assert "GPU: no CUDA device" in bench_gpu_path.to_markdown(res)


@pytest.mark.slow
def test_train_step_cuts_time_each_cut_against_cross_entropy():
    # issue 45 (3): every cut is a recipe setting on top of jem train's choice, timed in the same
    # run as the cross-entropy iteration; the report says which meet the 3x target.
    # the tiny textures, one timed round and no warm-up: the table's rows, not its timings
    res = bench_train_step.run_cuts(
        quick=True, repeats=1, warmup=0, tiny=True, networks=["resnet10t"], cuts=["steps5_shared"]
    )
    times = res["networks"]["resnet10t"]["time"]
    assert set(times) == {"ce", "choice", "steps5_shared", "ce_cl", "choice_cl"}
    assert times["ce"]["ratio"] == pytest.approx(1.0)
    assert all(s["median_s"] > 0 for s in times.values())
    md = bench_train_step.cuts_to_markdown(res)
    assert "| resnet10t | steps5_shared | sgld_steps=5, px_clean_data=False |" in md and "load average" in md


_CLIS = sorted(
    f.stem
    for f in (Path(__file__).parents[1] / "benchmarks").glob("*.py")
    if not f.stem.startswith("_") and "argparse" in (text := f.read_text()) and "def main(argv" in text
)


@pytest.mark.parametrize("module", _CLIS)
def test_every_benchmark_prints_its_help(module, capsys):
    """--help is how a reader finds a benchmark's options; argparse %-formats each help string, so a
    bare % in one (bench_long_row's "25% of chains") crashed it."""
    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"benchmarks.{module}").main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out
