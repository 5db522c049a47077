"""What `jem demo` leads with when a slow machine's time budget cuts its runs short (issue 48,
item 3): a newcomer saw "JEM test accuracy 0.292 vs the baseline's 0.597" first, from models
stopped after 4 of 150 epochs, and the warning only after the numbers. A cut-short comparison
now leads with the sentence that it is not meaningful yet, in the console and in the report."""

from __future__ import annotations

import pytest

from jem_plugin.app import experiments
from jem_plugin.app.cli import main
from jem_plugin.app.commands import demo
from jem_plugin.app.report import headline, write_report


def _result(truncated: bool) -> dict:
    runs = {
        "baseline": {"summary": {"accuracy": 0.597, "ece": 0.05, "epochs": 4.0}, "planned_epochs": 150},
        "JEM": {"summary": {"accuracy": 0.292, "ece": 0.2, "epochs": 4.0}, "planned_epochs": 150},
    }
    result: dict = {"description": "digits", "runs": runs}
    if truncated:
        result["truncated"] = {"baseline": (4, 150), "JEM": (4, 150)}
        result["warning"] = experiments.truncation_note(result["truncated"], 6900.0)
    return result


@pytest.fixture
def fake_demo(monkeypatch):
    def use(result):
        monkeypatch.setattr(demo, "run_digits_demo", lambda out, **kw: result)

    return use


def test_a_cut_short_demo_leads_with_not_meaningful_rather_than_numbers(fake_demo, tmp_path, capsys):
    fake_demo(_result(truncated=True))
    assert main(["demo", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.strip())
    assert first.startswith("The comparison is not meaningful yet"), out
    assert "baseline stopped after 4 of 150 epochs" in first and "--budget-seconds 6900" in first
    assert out.index("not meaningful yet") < out.index("0.292")


def test_the_report_of_a_cut_short_demo_leads_with_it_too(tmp_path):
    page = write_report(tmp_path, _result(truncated=True)).read_text()
    body = page.split("</h1>", 1)[1]
    assert body.index("The comparison is not meaningful yet") < body.index("29.2%") < body.index("0.292")
    assert "Summary of the cut-short runs" in body and "<h2>Summary</h2>" not in body


def test_a_finished_demo_leads_with_its_numbers(fake_demo, tmp_path, capsys):
    result = _result(truncated=False)
    assert headline(result) is None
    fake_demo(result)
    assert main(["demo", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not meaningful" not in out and "0.292" in out
    assert "<h2>Summary</h2>" in (tmp_path / "report.html").read_text()
