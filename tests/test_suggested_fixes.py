"""Every fix a message suggests works (issue 59, item 3), each tried here as the message gives it:

- the demo's 1-channel model on an RGB folder: the shape message's `--image-size 8` repeated the
  same error, since `--data folder:` read RGB where `--ood folder:` read the model's channels;
- the demo report's settings block said `"name": "paper"` with the paper's summary (20 SGLD steps,
  Adam 1e-4, 1000 warm-up) above the 5 steps, lr 3e-4 and warm-up 200 that ran;
- `UntrainedDensityWarning` printed from the CLI as a raw Python warning quoting `bin/jem:8` and
  `sys.exit(main())` and listing 32 score names; now one `jem: warning:` line whose fix is tried.
"""

from __future__ import annotations

import html
import json
from dataclasses import replace

import pytest

from benchmarks.folders import write_digits_folder
from jem_plugin.app import experiments
from jem_plugin.app.cli import main
from jem_plugin.app.report import write_report
from jem_plugin.recipes import Recipe


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """A model file as `jem demo` writes it (the digits CNN: 1 channel, 8x8; log p(x) untrained)."""
    root = tmp_path_factory.mktemp("demo_model")
    cfg = experiments.DigitsConfig()
    experiments._save_model(root / "model_baseline.pt", experiments._build(cfg, "cpu"), cfg)
    return root / "model_baseline.pt"


def test_the_grey_demo_model_reads_an_rgb_data_folder_at_the_size_the_message_names(demo_model, tmp_path, capsys):
    folder = write_digits_folder(tmp_path / "rgb", per_class=2, size=16)  # RGB PNGs, 16 pixels
    argv = ["eval", str(demo_model), "--data", f"folder:{folder}", "--quiet"]
    assert main([*argv, "--image-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "takes inputs of shape (1, 8, 8)" in err and "--image-size 8 for a folder" in err
    assert main([*argv, "--image-size", "8"]) == 0  # the fix the message gives
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n"] == 20
    assert "converted 20 of the 20 images" in captured.err and "to L" in captured.err


def test_the_demo_reports_the_recipe_that_ran_not_the_registered_one(tmp_path):
    demo_settings = {k: v for k, v in experiments.DEMO_RECIPE.items() if k != "epochs"}
    ran = experiments.DIGITS_RECIPE.replace(**demo_settings)
    config = replace(experiments.DigitsConfig(), recipe=ran).as_dict()
    record = config["recipe"]
    assert record["name"] == "paper, changed"
    assert "changed here: sgld_steps 20 -> 5" in record["summary"] and "lr 0.0001 -> 0.0003" in record["summary"]
    assert "warmup_iters 1000 -> 200" in record["summary"]
    assert Recipe.from_dict(record).flat() == ran.flat()  # the values are those that ran
    page = write_report(tmp_path, {"runs": {}, "config": config}).read_text()
    assert html.escape('"name": "paper, changed"') in page and html.escape("sgld_steps 20 -> 5") in page
    unchanged = replace(experiments.DigitsConfig(), recipe=Recipe.from_dict(experiments.DIGITS_RECIPE.to_dict()))
    assert unchanged.as_dict()["recipe"]["name"] == "paper, changed"  # warm-up uncapped: said too
    assert "warmup_max_fraction" in unchanged.as_dict()["recipe"]["summary"]


def test_a_warning_is_one_jem_line_and_its_fix_works(demo_model, capsys):
    argv = ["ood", str(demo_model), "--quiet", "--out", str(demo_model.with_name("ood.json"))]
    assert main(argv) == 0  # the default scores include grad_norm, which assumes a JEM-trained model
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "warning" in ln.lower()]
    assert len(lines) == 1, err
    (line,) = lines
    assert line.startswith("jem: warning: the OOD score grad_norm assumes a JEM-trained model")
    assert "--scores logpx,msp" in line
    assert "sys.exit" not in err and "bin/jem" not in err and "UntrainedDensityWarning" not in err
    assert "mahalanobis" not in err  # not the library's list of every other score
    assert main([*argv, "--scores", "logpx,msp"]) == 0  # the fix the line gives
    assert "warning" not in capsys.readouterr().err.lower()
