"""Smoke test of benchmarks/bench_long_row.py: a tiny long row (2 evaluation points) killed after its
first point resumes to exactly the evaluation JSON of an uninterrupted run; a finished cell is
skipped; the report draws its curves and table from partial results."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import bench_long_row as L
from benchmarks.bench_train_step import CUTS
from jem_plugin.app.default_recipe import default_choice, generative_half
from jem_plugin.recipes import RECIPES

#: what differs between two runs of the same cell: the clock
TIMING = {"train_cpu_s", "train_wall_s", "eval_cpu_s"}


def _cells() -> list[dict]:
    # generative holds the most state (a buffer never restarted, the data's colour axes, BatchNorm
    # statistics recomputed at evaluation); on 6 images per class jem train would choose fast.
    # One batch per epoch; 3 epochs, evaluated after epochs 2 and 3.
    return [
        {**L.cell("textures", "test_resnet", r, 0, epochs=3, tiny=True), "evals": 2} for r in ("baseline", "generative")
    ]


def _points(out, c) -> list[dict]:
    row = json.loads(open(L._paths(str(out), c)[0]).read())
    return [{k: v for k, v in p.items() if k not in TIMING} for p in row["points"]]


class Killed(Exception):
    pass


def _kill_at_step(monkeypatch, n: int) -> None:
    """The process dies in its ``n``-th training step."""
    calls, step = [0], L.G.train_step

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise Killed
        return step(*args, **kwargs)

    monkeypatch.setattr(L.G, "train_step", dying)


@pytest.mark.slow
def test_a_killed_long_row_resumes_to_the_uninterrupted_evaluations(tmp_path, monkeypatch):
    cells = _cells()
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    L.run(cells, str(whole), workers=1, report_each=False)
    for c in cells:
        row = json.loads(open(L._paths(str(whole), c)[0]).read())
        assert row["done"] and [p["epoch"] for p in row["points"]] == [2, 3]
        assert not os.path.exists(L._paths(str(whole), c)[1])  # a finished cell keeps no checkpoint

    L.run([], str(killed), workers=1, report_each=False)  # the judges, as a run makes them first
    base, gen = cells
    # the baseline dies in epoch 3, after the checkpoint of epoch 2 and before its point was written
    with monkeypatch.context() as m:
        _kill_at_step(m, 3)
        with pytest.raises(Killed):
            L.run_cell(base, str(killed), checkpoint_every_s=1e9)
    row = json.loads(open(L._paths(str(killed), base)[0]).read())
    row["points"] = []
    open(L._paths(str(killed), base)[0], "w").write(json.dumps(row))
    # generative dies in epoch 3, after its point of epoch 2 (checkpoints after every epoch here)
    with monkeypatch.context() as m:
        _kill_at_step(m, 3)
        with pytest.raises(Killed):
            L.run_cell(gen, str(killed), checkpoint_every_s=0.0)
    assert len(_points(killed, gen)) == 1 and os.path.exists(L._paths(str(killed), gen)[1])

    L.run(cells, str(killed), workers=1, report_each=False)
    for c in cells:
        assert _points(killed, c) == _points(whole, c), c["role"]
    assert _points(whole, gen)[0]["cond"]["judge_acc"] is not None  # the recipes' class samples
    # log p(x) with the BatchNorm statistics the selection did not keep, on every OOD set, beside the kept
    for p in _points(whole, gen):
        sel = p["bn_selection"]
        other = sel["auroc_as_trained" if sel["kept"] == "from_data" else "auroc_from_data"]
        assert set(other) == set(p["auroc"]["logpx"]) == set(L.OOD_NAMES)

    # a finished cell trains nothing
    monkeypatch.setattr(L.G, "start_run", lambda *a, **k: pytest.fail("a finished cell ran again"))
    L.run(cells, str(killed), workers=1, report_each=False)


@pytest.mark.slow
def test_the_report_works_on_partial_results(tmp_path):
    cells = _cells()
    L.run(cells[:1], str(tmp_path), workers=1, report_each=False)
    L.run_cell(cells[1], str(tmp_path), stop_after=1)  # one point of two
    readme, docs = tmp_path / "README.md", tmp_path / "img"
    readme.write_text("# benchmarks\n\nother sections\n")
    md = L.report(str(tmp_path), readme=str(readme), docs=str(docs))
    assert readme.read_text().startswith("# benchmarks\n\nother sections\n") and L.HEADING in readme.read_text()
    row = next(line for line in md.splitlines() if line.startswith("| textures | test_resnet |"))
    assert "| 2 (3) |" in row  # evaluated to iteration 2 of 3
    assert (docs / "long-row-textures.png").stat().st_size > 0 and (tmp_path / "long-row-textures.png").exists()


def _p(it, acc, auroc, fd):
    return {"iteration": it, "acc_gap": acc, "auroc_gap": auroc, "fd_ratio": fd}


def test_first_met_names_the_first_evaluation_and_a_target_lost_again():
    pts = [_p(300, -5.0, -0.1, 0.9), _p(600, -0.5, 0.01, 0.6), _p(900, -0.2, -0.02, 0.4)]
    assert L.first_met(pts, "accuracy") == "600"
    assert L.first_met(pts, "auroc") == "600, not at 900"
    assert L.first_met(pts, "fd") == "900"
    assert L.first_met(pts, "all") == "not yet (at 900)"
    assert L.first_met([_p(300, 0.0, 0.0, None)], "fd") == "not yet (at 300)"


def test_the_plan_puts_the_judged_resnet_first_and_pairs_every_recipe_with_its_baseline():
    cells = L.plan(tiny=True)
    first = [(c["dataset"], c["net"], c["role"], c["seed"]) for c in cells[:4]]
    assert first == [
        ("textures", "resnet10t", "baseline", 0),
        ("textures", "resnet10t", "default", 0),
        ("digits32", "resnet10t", "baseline", 0),
        ("digits32", "resnet10t", "default", 0),
    ]
    names = {L.GB.cell_name(c) for c in cells}
    assert len(names) == len(cells)
    for c in cells:
        assert L.GB.cell_name(L.cell(c["dataset"], c["net"], "baseline", c["seed"], c["epochs"], True)) in names
    assert L.eval_epochs(125) == [12, 25, 38, 50, 62, 75, 88, 100, 112, 125]


def test_jem_trains_choice_at_the_rows_size_is_generative_at_a_low_px_weight():
    d = L.jem_train_choice(150, "resnet10t")
    assert d[0] == "generative" and dict(d[1]).get("px_weight", 0.75) < 0.75
    assert dict(L.jem_train_choice(150, "wrn10-1")[1]).get("l2_weight") == 0.0  # no normalisation: no energy L2
    assert L.cell("textures", "resnet10t", "generative", 0, 1, tiny=True).get("set") is None  # as it is


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_starts_the_cell_over_and_is_kept_aside(tmp_path):
    base = _cells()[0]
    L.run([base], str(tmp_path / "whole"), workers=1, report_each=False)
    out = tmp_path / "other_code"
    L.run([], str(out), workers=1, report_each=False)
    json_path, ckpt_path = L._paths(str(out), base)
    os.makedirs(os.path.dirname(ckpt_path))
    L.save_checkpoint(ckpt_path, model=torch.nn.Linear(2, 2), epoch=2, train_cpu_s=1.0, metrics={})
    os.makedirs(os.path.dirname(json_path))
    open(json_path, "w").write(json.dumps({**base, "points": [{"epoch": 2, "stale": True}]}))
    L.run([base], str(out), workers=1, report_each=False)
    assert _points(out, base) == _points(tmp_path / "whole", base)  # from the start, nothing of the old run
    assert os.path.exists(ckpt_path + ".stale") and os.path.exists(json_path + ".stale")


# ---------------------------------------------------------------------------- the cheap cut (issue 45 item 3)
def test_the_cheap_role_is_jem_trains_choice_with_the_cut_under_a_name_of_its_own():
    for net in ("resnet10t", "convnext_atto", "wrn10-1"):  # fast on 6 per class; generative; without the L2
        default, cheap = (L.cell("textures", net, r, 0, 1, tiny=True) for r in ("default", "cheap"))
        assert cheap["run"] == default["run"] and cheap["role"] == "cheap"
        assert cheap["set"] == {**default.get("set", {}), **CUTS["steps5_shared"]}
        assert L.GB.cell_name(cheap) != L.GB.cell_name(default)  # both cells coexist
    order = [(c["dataset"], c["net"], c["role"]) for c in L.plan(tiers=L.CHEAP_TIERS, tiny=True)]
    assert order == [("textures", n, "cheap") for n in L.NETWORKS] + [("digits32", "resnet10t", "cheap")]


def _row(role: str, acc: float, auroc: float, fd: float, cpu_s: float, cut: str | None = None) -> dict:
    """A textures/resnet10t cell of ``role`` with two points (300 and 600 iterations)."""
    c = L.cell("textures", "resnet10t", role, 0, 1, cut=cut)
    points = [
        {
            "iteration": it,
            "accuracy": acc,
            "auroc": {"logpx": dict.fromkeys(L.OOD_NAMES, auroc)},
            "ece": 0.1,
            "ece_ts": 0.05,
            "init_fd": 10.0,
            "buffer": {"fd": fd * 10.0},
            "cond": {"judge_acc": 0.5, "judge_acc_init": 0.4},
            "train_cpu_s": cpu_s * it,
        }
        for it in (300, 600)
    ]
    return {**c, "points": points, "iterations": 600}


def _cheap_rows() -> list[dict]:
    # the choice meets accuracy and AUROC but not FD; the cheap cut meets all three at half the CPU
    return [
        _row("baseline", 0.80, 0.60, 1.0, 0.2),
        _row("default", 0.80, 0.61, 0.9, 1.0),
        _row("cheap", 0.80, 0.62, 0.4, 0.5),
    ]


def test_the_report_draws_and_tabulates_the_cheap_cut_apart_from_the_choice(tmp_path, monkeypatch):
    rows = _cheap_rows()
    entries = L.curves(rows)
    assert [e["role"] for e in entries] == ["default", "cheap"]
    table = L.targets_table(entries)
    assert "| **generative[px_weight=0.03]** |" in table
    assert "| cheap: generative[px_clean_data=0,px_weight=0.03,sgld_steps=5] |" in table

    (v,) = L.cheap_against_choice(rows, entries)
    assert all(v["targets"][t]["missed"] == [] for t in L.TARGETS) and v["targets"]["fd"]["only_cheap"] == [300, 600]
    assert v["cost"] == {"default": pytest.approx(5.0), "cheap": pytest.approx(2.5)} and v["no_worse"]
    md = L.to_markdown(entries, {}, 3, 0, 0.0, versus=[v])
    line = next(
        x for x in md.splitlines() if x.startswith("| textures | resnet10t | steps5_shared | 0 | 600 (2 points) |")
    )
    assert "yes, all 2 of the choice's" in line and "choice: never; cheap: 300, 600" in line
    assert "| 5.0 / 2.5 |" in line  # its cost beside the choice's

    drawn = []
    monkeypatch.setattr(L.shutil, "copy", lambda *a: None)
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    L.curves_figure(entries, "textures", str(tmp_path / "t.png"))
    (fig,) = drawn
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "jem train's choice" in labels and f"cheap: the choice with {L.CHEAP_CUT}" in labels
    curves = [line for line in fig.axes[0].get_lines() if line.get_marker() not in (None, "None")]  # not targets
    assert len({(line.get_linestyle(), line.get_marker()) for line in curves}) == 2  # cheap unlike the choice


def test_a_second_cut_runs_under_a_name_of_its_own_and_is_judged_apart(tmp_path, monkeypatch):
    """--cheap-cut: chains16_shared (16 chains, p(x) on the classification forward) beside the first
    cut on the same cells: its own settings and file, its own row against the choice with its own
    side-by-side cost, and a triangle of its own in the curves."""
    first, second = (L.cell("textures", "resnet10t", "cheap", 0, 1, cut=c) for c in (None, "chains16_shared"))
    assert "cut" not in first  # the first cut's cells keep the names and keys they were written with
    default = L.cell("textures", "resnet10t", "default", 0, 1)
    assert second["set"] == {**default.get("set", {}), **CUTS["chains16_shared"]}  # the choice's 10 SGLD steps
    assert L.GB.cell_name(second) not in (L.GB.cell_name(first), L.GB.cell_name(default))
    assert [L.cut_of(c) for c in (first, second, default)] == [
        "steps5_shared",
        "chains16_shared",
        None,
    ]
    with pytest.raises(ValueError, match="cut goes with the 'cheap' role"):
        L.cell("textures", "resnet10t", "default", 0, 1, cut="chains16_shared")
    with pytest.raises(ValueError, match="names one of"):
        L.cell("textures", "resnet10t", "cheap", 0, 1, cut="steps3")
    cells = L.plan(["textures"], ["resnet10t"], tiers=L.CHEAP_TIERS, tiny=True, cut="chains16_shared")
    assert [c.get("cut") for c in cells] == ["chains16_shared"]

    rows = _cheap_rows() + [_row("cheap", 0.75, 0.55, 0.95, 0.6, cut="chains16_shared")]
    entries = L.curves(rows)
    assert [L.cut_of(e) for e in entries] == [None, "steps5_shared", "chains16_shared"]
    side = {
        "train_step_cuts": {
            "networks": {
                "resnet10t": {
                    "time": {
                        "choice": {"ratio": 4.7},
                        "steps5_shared": {"ratio": 2.5},
                        "chains16_shared": {"ratio": 2.6},
                    }
                }
            }
        }
    }
    (tmp_path / "cuts.json").write_text(json.dumps(side))
    monkeypatch.setattr(L, "TRAIN_STEP_CUTS", str(tmp_path / "cuts.json"))
    first_v, second_v = L.cheap_against_choice(rows, entries)
    assert (first_v["cut"], second_v["cut"]) == ("steps5_shared", "chains16_shared")
    assert first_v["side_by_side_ce"]["cheap"] == 2.5 and second_v["side_by_side_ce"]["cheap"] == 2.6
    assert first_v["no_worse"] and not second_v["no_worse"]  # worse accuracy, AUROC and FD than the choice
    assert second_v["targets"]["accuracy"]["missed"] == second_v["targets"]["auroc"]["missed"] == [300, 600]
    md = L.to_markdown(entries, {}, 4, 0, 0.0, versus=[first_v, second_v])
    assert "| textures | resnet10t | chains16_shared | 0 | 600 (2 points) |" in md
    assert "chains16_shared (n_samples=16, px_clean_data=False)" in md  # the caption says what each cut is

    drawn = []
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    L.curves_figure(entries, "textures", str(tmp_path / "t.png"))
    (fig,) = drawn
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"cheap: the choice with steps5_shared", "cheap: the choice with chains16_shared"} <= set(labels)
    curves = [line for line in fig.axes[0].get_lines() if line.get_marker() not in (None, "None")]
    assert len({(line.get_linestyle(), line.get_marker()) for line in curves}) == 3  # each cut its own


def test_the_plan_projects_a_cut_from_the_side_by_side_ratio_and_a_run_from_its_own_cells(tmp_path, monkeypatch):
    """--plan printed "-" for every cheap cell (no probe figure for the role), and projected the
    choice from the matrix's short cells while the row's own ran ~4x slower: a cut now costs the
    choice's time x its side-by-side ratio, and a run with a cell of its own on the CPU its own."""
    side = {
        "train_step_cuts": {
            "networks": {"resnet10t": {"time": {"choice": {"ratio": 4.0}, "chains16_shared": {"ratio": 2.0}}}}
        }
    }
    (tmp_path / "cuts.json").write_text(json.dumps(side))
    monkeypatch.setattr(L, "TRAIN_STEP_CUTS", str(tmp_path / "cuts.json"))
    speed = {"iteration": {"resnet10t/default": 1.0}, "evaluation": {"resnet10t/default": 0.0}}
    cheap = L.cell("textures", "resnet10t", "cheap", 0, 1, cut="chains16_shared")
    its = L.batches_per_epoch("textures")
    assert L.projected_cpu_s(cheap, speed) == pytest.approx(0.5 * its)  # half the choice's, as timed side by side
    assert (
        L.projected_cpu_s(L.cell("textures", "resnet10t", "cheap", 0, 1), speed) is None
    )  # steps5_shared: not timed here

    cells = tmp_path / "cells"
    cells.mkdir()
    ran = {**cheap, "points": [{"iteration": 300, "train_cpu_s": 900.0}]}  # 3 CPU s per iteration on this row
    (cells / "a.json").write_text(json.dumps(ran))
    (cells / "b.json").write_text(json.dumps({**ran, "device": "cuda"}))  # a GPU's clock is not the CPU's
    row = L.speed_on_the_row(str(cells))
    assert row == {f"resnet10t/{L.GB.run_label(cheap)}": 3.0}
    assert L.projected_cpu_s(cheap, speed, row) == pytest.approx(3.0 * its)
    assert f"| {3.0 * its / 3600:.2f} |" in L.plan_table([cheap], speed, row)


def test_jem_train_never_reads_the_cheap_cut_as_a_recipe_to_switch_to():
    rows = _cheap_rows()  # the cheap cell spelled out, as a report reads it from its JSON
    rows[2] = {**rows[2], "run": "generative", "set": {"px_weight": 0.03, **CUTS["steps5_shared"]}, "role": "cheap"}
    evidence = L.targets_evidence(rows, L.curves(rows))
    cheap = next(c for c in evidence["cells"] if c["role"] == "cheap")
    assert cheap["first"]["all"] == 300 and cheap["met_at_last"]  # it met every target...
    assert cheap["recipe"] not in RECIPES  # ...and is shown, never switched to
    choice = default_choice(150, batchnorm=True)
    assert generative_half(choice, 10_000, True, table=evidence)[0] == choice


# ---------------------------------------------------------------------------- a heavier p(x) weight (issue 45)
def test_the_weight_role_is_jem_trains_choice_at_another_px_weight_and_needs_one():
    for net in ("convnext_atto", "wrn10-1"):  # generative at 0.03; without the L2 on wrn10-1
        default = L.cell("textures", net, "default", 0, 1)
        heavier = L.cell("textures", net, "weight", 0, 1, px_weight=0.3)
        assert heavier["run"] == default["run"] == "generative" and heavier["set"] == {
            **default["set"],
            "px_weight": 0.3,
        }
        assert L.GB.cell_name(heavier) != L.GB.cell_name(default)
    with pytest.raises(ValueError, match="px_weight goes with the roles"):
        L.cell("textures", "resnet10t", "weight", 0, 1)
    with pytest.raises(ValueError, match="px_weight goes with the roles"):
        L.cell("textures", "resnet10t", "default", 0, 1, px_weight=0.3)
    cells = L.weight_plan(["digits32", "textures"], ["wrn10-1", "resnet10t"], [0.1, 0.3], seeds=[0, 1], tiny=True)
    order = [(c["dataset"], c["net"], c["seed"], c["set"]["px_weight"]) for c in cells]
    assert order[:3] == [
        ("textures", "resnet10t", 0, 0.1),
        ("textures", "resnet10t", 0, 0.3),
        ("textures", "resnet10t", 1, 0.1),
    ]
    assert len(order) == 16 and order[-1] == ("digits32", "wrn10-1", 1, 0.3)


def _weight_rows() -> list[dict]:
    # the choice misses FD; the choice at p(x) weight 0.3 meets all three (a registered recipe's settings)
    heavier = _row("default", 0.80, 0.62, 0.4, 1.0)
    heavier.update(L.cell("textures", "resnet10t", "weight", 0, 1, px_weight=0.3))
    return [_row("baseline", 0.80, 0.60, 1.0, 0.2), _row("default", 0.80, 0.61, 0.9, 1.0), heavier]


def test_a_heavier_weight_that_met_every_target_is_drawn_apart_and_can_become_jem_trains_choice(tmp_path, monkeypatch):
    rows = _weight_rows()
    entries = L.curves(rows)
    assert [e["role"] for e in entries] == ["default", "weight"]
    assert "| weight: generative[px_weight=0.3] |" in L.targets_table(entries)

    evidence = L.targets_evidence(rows, entries)
    heavier = next(c for c in evidence["cells"] if c["role"] == "weight")
    assert heavier["recipe"] in RECIPES and heavier["settings"] == {"px_weight": 0.3} and heavier["first"]["all"] == 300
    choice, line = generative_half(default_choice(150, batchnorm=True), 10_000, True, table=evidence)
    assert (choice.recipe, choice.settings) == ("generative", {"px_weight": 0.3}) and "after 300 iterations" in line

    drawn = []
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    L.curves_figure(entries, "textures", str(tmp_path / "t.png"))
    (fig,) = drawn
    assert "weight: p(x) 0.3" in [t.get_text() for t in fig.legends[0].get_texts()]
    # one marker per weight: wrn10-1's choice (no energy L2) at 0.3 is drawn as the others' 0.3
    assert L._px_weight("generative[l2_weight=0,px_weight=0.3]") == L._px_weight("generative[px_weight=0.3]") == "0.3"
    curves = [line for line in fig.axes[0].get_lines() if line.get_marker() not in (None, "None")]
    assert len({(str(line.get_linestyle()), line.get_marker()) for line in curves}) == 2


def _candidate_that_met_every_target(cell: dict, tmp_path, monkeypatch) -> tuple:
    """A candidate role's cell (``cell``) that met every target at 300: it is in jem train's evidence
    under a name no recipe has, and jem train keeps its choice. Returns its legend handle in the
    textures curves and the figure's title."""
    rows = _weight_rows()
    rows[2] = {**rows[2], **cell}
    entries = L.curves(rows)
    evidence = L.targets_evidence(rows, entries)
    found = next(x for x in evidence["cells"] if x["role"] == cell["role"])
    assert found["first"]["all"] == 300 and found["recipe"] not in RECIPES
    choice = default_choice(150, batchnorm=True)
    assert generative_half(choice, 10_000, True, table=evidence)[0] == choice
    drawn = []
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    L.curves_figure(entries, "textures", str(tmp_path / "t.png"))
    (fig,) = drawn
    legend = {t.get_text(): h for t, h in zip(fig.legends[0].get_texts(), fig.legends[0].legend_handles)}
    return legend[L.ROLE_LEGEND[cell["role"]]], fig._suptitle.get_text()


# ---------------------------------------------------------------------------- smoothed negatives (issue 45)
@pytest.mark.slow
def test_the_smoothed_role_is_the_weight_plus_smoothed_negatives_shown_but_never_switched_to(tmp_path, monkeypatch):
    c = L.cell("textures", "resnet10t", "smoothed", 0, 1, px_weight=0.3)
    weight = L.cell("textures", "resnet10t", "weight", 0, 1, px_weight=0.3)
    assert c["set"] == weight["set"] and c["negatives"] == "smoothed"
    assert L.GB.run_label(c) == "generative+smoothed[px_weight=0.3]" != L.GB.run_label(weight)
    with pytest.raises(ValueError, match="px_weight goes with the roles"):
        L.cell("textures", "resnet10t", "smoothed", 0, 1)
    plan = L.weight_plan(["textures", "digits32"], ["resnet10t"], [0.3], role="smoothed")
    assert [(p["dataset"], p["role"]) for p in plan] == [("textures", "smoothed"), ("digits32", "smoothed")]
    # the run trains with the term, from the run's own generator
    S = L.GB.setting(L.GB.dataset("textures", tiny=True), "test_resnet", 6, 0)
    ctx = L.G.start_run(S, "fast", 2, negatives="smoothed")
    term = dict(ctx["loss_fn"]._all_terms())["smoothed_negatives"]
    assert term.generator is ctx["g"]

    handle, title = _candidate_that_met_every_target(c, tmp_path, monkeypatch)
    assert handle.get_marker() == "*" and "smoothed copies of the data" in title


# ---------------------------------------------------------------------------- coarse chain starts (issue 45)
@pytest.mark.slow
def test_the_coarse_role_is_the_weight_with_coarse_starts_shown_but_never_switched_to(tmp_path, monkeypatch):
    c = L.cell("textures", "wrn10-1", "coarse", 0, 1, px_weight=0.3)
    weight = L.cell("textures", "wrn10-1", "weight", 0, 1, px_weight=0.3)
    assert c["set"] == {**weight["set"], "init_coarse": L.COARSE_SHARE} and "negatives" not in c
    assert L.GB.run_label(c) == "generative[init_coarse=0.25,l2_weight=0,px_weight=0.3]"
    with pytest.raises(SystemExit):
        L.main(["--px-weights", "0.3", "--smoothed", "--coarse", "--plan", "--out", str(tmp_path)])

    coarse = L.cell("textures", "resnet10t", "coarse", 0, 1, px_weight=0.3)
    handle, title = _candidate_that_met_every_target(coarse, tmp_path, monkeypatch)
    assert handle.get_marker() == "o" and "25% of chains from coarse images" in title


# ---------------------------------------------------------------------------- which BatchNorm statistics
@pytest.mark.slow
def test_the_report_shows_log_px_with_both_batchnorm_statistics_where_a_point_recorded_them(tmp_path, monkeypatch):
    rows = _weight_rows()
    rows[1]["points"][1]["bn_selection"] = {
        "kept": "as_trained",
        "val_acc_as_trained": 0.824,
        "val_acc_from_data": 0.821,
        "auroc_from_data": dict.fromkeys(L.OOD_NAMES, 0.70),  # the kept (as trained) read 0.61, the baseline 0.60
    }
    table = L.bn_statistics_table(rows)
    (row,) = [line for line in table.splitlines() if line.startswith("| textures")]
    assert "| 600 | as_trained | 0.824 / 0.821 | +0.010 / +0.100 |" in row
    assert L.bn_statistics_table(_weight_rows()) == ""  # no point recorded both: no table
    assert "Which BatchNorm statistics" in L.to_markdown(L.curves(rows), {}, 3, 3, 0.1, bn_table=table)

    # --report on another directory writes its own summary, never the README section or the docs' figures
    monkeypatch.setattr(L.GB, "write_readme", lambda *a, **k: pytest.fail("wrote the README from another directory"))
    monkeypatch.setattr(L, "DOCS_IMG", str(tmp_path / "docs-img"))
    monkeypatch.setattr(L.shutil, "copy", lambda *a, **k: pytest.fail("copied a figure into the docs"))
    os.makedirs(tmp_path / "cells")
    for r in rows:
        for p in r["points"]:
            p["eval_cpu_s"] = 1.0
        (tmp_path / "cells" / f"{L.GB.cell_name(r)}.json").write_text(json.dumps(r))
    L.main(["--report", "--out", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    assert "Which BatchNorm statistics" in summary
    assert f"`{tmp_path / 'cells'}`" in summary and "results/long_row/cells" not in summary  # names its own cells
