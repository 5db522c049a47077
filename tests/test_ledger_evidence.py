"""jem train's line on what the benefit ledger measured: only the user's kind of network and recipe,
only benefits whose interval excludes 0, only with the rule's seeds, and a longer run told so."""

from __future__ import annotations

from jem_plugin.app.ledger_evidence import LEDGER_EVIDENCE, ledger_line


def _entry(**kw):
    e = dict(kind="BN", recipe="generative", settings={"px_weight": 0.03}, dataset="textures", net="resnet10t",
             iteration=1512, seeds=3, measured=24, cost_ratio=5.33, called=[])  # fmt: skip
    return {**e, **kw}


ECE = dict(label="ECE, raw", unit="points", diff=-0.021, lo=-0.03, hi=-0.012, better=True)
NOISE = dict(label="AUROC logpx, noise", unit="", diff=-0.2, lo=-0.3, hi=-0.1, better=False)


def test_the_line_names_only_the_called_benefits_and_counts_the_rest():
    line = ledger_line("BN", "generative", {"px_weight": 0.03}, 1000, {"entries": [_entry(called=[ECE, NOISE])]})
    assert "better on ECE, raw -2.1 points [-3.0, -1.2]" in line
    assert "worse on AUROC logpx, noise -0.200 [-0.300, -0.100]" in line
    assert "no difference on the other 22 benefits" in line and "5.3x its CPU cost" in line
    assert "3 seeds" in line and "past what was measured" not in line


def test_a_longer_run_is_told_it_is_past_the_measurements():
    line = ledger_line("BN", "generative", {"px_weight": 0.03}, 5000, {"entries": [_entry()]})
    assert line.endswith("this run has 5,000 iterations, past what was measured")
    assert "no difference on any of 24" in line


def test_another_kind_of_network_gets_nothing_and_too_few_seeds_or_another_recipe_get_unmeasured():
    table = {"entries": [_entry(seeds=2)]}
    assert ledger_line("none", "generative", {"px_weight": 0.03}, 1000, table) is None
    assert "has not measured this recipe with 3 seeds" in ledger_line(
        "BN", "generative", {"px_weight": 0.03}, 1000, table
    )
    table = {"entries": [_entry()]}
    assert "has not measured" in ledger_line("BN", "fast", {}, 1000, table)


def test_the_shipped_table_reads():
    import json

    table = json.loads(LEDGER_EVIDENCE.read_text())
    assert isinstance(table["entries"], list)
    for e in table["entries"]:
        assert e["seeds"] >= 1 and e["kind"] in ("BN", "other", "none")


def test_jem_train_prints_the_ledgers_line_for_its_kind_of_network(tmp_path, monkeypatch, capsys):
    import json

    import jem_plugin.app.ledger_evidence as evidence
    from jem_plugin.app.cli import main
    from jem_plugin.app.default_recipe import kind_name, network_kind
    from jem_plugin.app.nets import DigitsCNN

    table = tmp_path / "ledger_evidence.json"
    kind = kind_name(*network_kind(DigitsCNN()))  # jem train's network for the bundled digits
    table.write_text(json.dumps({"entries": [_entry(kind=kind, recipe="none of these", seeds=3)]}))
    monkeypatch.setattr(evidence, "LEDGER_EVIDENCE", table)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--epochs", "1", "--out", "run", "--quiet"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "benefit ledger" in ln]
    assert lines == [
        "jem train: the benefit ledger (docs/what-jem-buys.md) has not measured this recipe with 3 seeds on textures "
        "with resnet10t yet; what JEM buys you here is unmeasured"
    ]
