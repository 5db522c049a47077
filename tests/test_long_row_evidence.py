"""jem train follows the long row (issue 45 item 2): the targets table the long row's report writes
is what jem train reads; a recipe that met every target on data it was not tuned on becomes the
choice once the user's run is at least that long, and a shorter run is told what the generative
half needs."""

from __future__ import annotations

import json

import pytest

from jem_plugin.app.default_recipe import LONG_ROW_TARGETS, default_choice, generative_half


def _cell(dataset="textures", net="resnet10t", kind="BN", recipe="fast", settings=None, all_at=1200, kept=True):
    run = recipe + ("[" + ",".join(f"{k}={v:g}" for k, v in (settings or {}).items()) + "]" if settings else "")
    return dict(
        dataset=dataset,
        net=net,
        kind=kind,
        recipe=recipe,
        settings=settings or {},
        run=run,
        evaluated_to=3000,
        first={"accuracy": 300, "auroc": 300, "fd": all_at, "all": all_at},
        met_at_last=kept,
    )


def _table(*cells):
    return {"judged_on": ["textures"], "cells": list(cells)}


CHOICE = default_choice(500, batchnorm=True)  # generative with px_weight 0.03


def test_a_run_as_long_as_the_evidence_gets_the_recipe_that_met_every_target():
    choice, line = generative_half(CHOICE, 5000, True, table=_table(_cell()))
    assert choice.recipe == "fast" and choice.settings == {}
    assert "past the 1200 after which fast met every target" in choice.reason
    assert "fast met all three targets" in line and "after 1200 iterations" in line and "this run has 5000" in line


def test_a_shorter_run_is_told_how_many_iterations_the_generative_half_needs():
    choice, line = generative_half(CHOICE, 800, True, table=_table(_cell()))
    assert choice == CHOICE  # the choice that holds accuracy stays
    assert line.startswith("log p(x) and samples need about 1200 iterations at this size")
    assert "this run has 800" in line


def test_the_earliest_recipe_wins_and_the_choice_itself_is_kept_when_it_is_that_recipe():
    table = _table(_cell(recipe="fast", all_at=2400), _cell(recipe="generative", settings={"px_weight": 0.03}))
    choice, line = generative_half(CHOICE, 3000, True, table=table)
    assert choice == CHOICE and "generative[px_weight=0.03] met all three targets" in line
    assert "after 1200 iterations" in line


@pytest.mark.parametrize(
    "cell",
    [
        _cell(dataset="digits32"),  # the data the recipes were tuned on decides nothing
        _cell(kind="other"),  # a LayerNorm network's evidence says nothing about a BatchNorm one
        _cell(kept=False),  # met once, missed again at the last point
        _cell(recipe="dat"),  # not a registered recipe: shown in the table, never switched to
    ],
)
def test_only_evidence_that_holds_for_this_kind_of_network_on_judged_data_switches(cell):
    choice, _ = generative_half(CHOICE, 10_000, True, table=_table(cell))
    assert choice == CHOICE


def test_where_no_recipe_met_the_targets_the_line_says_how_far_the_measurements_go():
    cell = _cell(all_at=None)
    choice, line = generative_half(CHOICE, 10_000, True, table=_table(cell))
    assert choice == CHOICE
    assert "no recipe met all three targets" in line and "within the 3000 iterations measured" in line
    assert "this run has 10000" in line and "weak energy term" in line
    assert generative_half(CHOICE, 10_000, False, normalised=False, table=_table(cell)) == (CHOICE, None)


def test_a_run_longer_than_the_measurements_is_told_so_not_told_what_the_short_runs_showed():
    """A 20,000-iteration run was told to "expect a classifier with a weak energy term, and samples
    near their init" from cells measured to 3,000: a claim past the data. Now the line says where the
    measurements end; a run within them keeps the plain line."""
    cell = _cell(all_at=None)
    _, longer = generative_half(CHOICE, 20_000, True, table=_table(cell))
    assert (
        "this run has 20000, longer than any measured: up to 3000" in longer
        and "past it nothing was measured" in longer
    )
    _, within = generative_half(CHOICE, 3000, True, table=_table(cell))
    assert "longer than any measured" not in within and within.endswith("samples near their init")


def test_the_shipped_table_is_the_long_rows_report_of_the_committed_cells():
    """The package's table cannot go stale against the committed results: it equals what the
    long row's report makes of benchmarks/results/long_row/cells."""
    bench = pytest.importorskip("benchmarks.bench_long_row")
    rows = bench.load_rows(bench.RESULTS)
    assert json.loads(LONG_ROW_TARGETS.read_text()) == json.loads(
        json.dumps(bench.targets_evidence(rows, bench.curves(rows)))
    )


def test_jem_train_prints_what_the_long_row_says_for_its_run(tmp_path, capsys, monkeypatch):
    import jem_plugin.app.ledger_evidence as evidence
    from benchmarks.folders import write_digits_folder
    from jem_plugin.app import default_recipe
    from jem_plugin.app.cli import main

    table = tmp_path / "targets.json"
    table.write_text(json.dumps(_table(_cell(kind="none", all_at=10**6))))
    monkeypatch.setattr(default_recipe, "LONG_ROW_TARGETS", table)
    ledger = tmp_path / "ledger_evidence.json"  # the ledger measured this kind too: its line must not hide this one
    ledger.write_text(json.dumps({"entries": [dict(kind="none", recipe="generative", settings={"px_weight": 0.03, "l2_weight": 0.0},
        dataset="textures", net="wrn10-1", iteration=1512, seeds=3, measured=9, cost_ratio=6.0, called=[])]}))  # fmt: skip
    monkeypatch.setattr(evidence, "LEDGER_EVIDENCE", ledger)
    (tmp_path / "plain.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, **options):\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),"
        " nn.Linear(4, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    folder = write_digits_folder(tmp_path / "d", classes=[0, 1], per_class=20, size=8)
    args = ["train", "--data", f"folder:{folder}", "--model", "plain:build", "--image-size", "8", "--epochs", "2"]
    assert main([*args, "--batch-size", "8", "--sgld-steps", "1", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    # 2 epochs of 32 training images (20% held out) at batch 8: 2 x 4 iterations
    assert "jem train: log p(x) and samples need about 1000000 iterations at this size" in out, out
    assert "this run has 8:" in out, out
    assert "jem train: the benefit ledger (docs/what-jem-buys.md) measured this recipe on textures with wrn10-1" in out
