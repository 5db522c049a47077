"""Smoke test of benchmarks/bench_long_row.py: a tiny long row (2 evaluation points) killed after its
first point resumes to exactly the evaluation JSON of an uninterrupted run; a finished cell is
skipped; the report draws its curves and table from partial results."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import bench_long_row as L

#: what differs between two runs of the same cell: the clock
TIMING = {"train_cpu_s", "train_wall_s", "eval_cpu_s"}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
def test_a_killed_long_row_resumes_to_the_uninterrupted_evaluations(tmp_path, monkeypatch, one_thread):
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

    # a finished cell trains nothing
    monkeypatch.setattr(L.G, "start_run", lambda *a, **k: pytest.fail("a finished cell ran again"))
    L.run(cells, str(killed), workers=1, report_each=False)


@pytest.mark.slow
def test_the_report_works_on_partial_results(tmp_path, one_thread):
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
def test_a_checkpoint_that_does_not_fit_starts_the_cell_over_and_is_kept_aside(tmp_path, one_thread):
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
