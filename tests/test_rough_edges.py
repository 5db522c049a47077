"""A new user's first hour with `jem` (issue 30): each rough edge they met, smoothed and pinned here.

Unreadable images are named in one line (or skipped with --skip-bad-images); data that cannot train
is refused before training; a flat folder is an OOD set; score names are checked first; a model
wrapped for its data samples at its trained size; every flag's help gives its default and
`jem --version` answers; Ctrl-C says how to resume; `jem demo` keeps an earlier report unless
--force; a finished `jem train` run says so and rewrites nothing; the report explains a temperature
below 1, gives one cost ratio, and its reliability figure's legend has every colour it shows.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from benchmarks.folders import write_digits_folder, write_photo_folder
from jem_plugin.app.cli import build_parser, main


def _truncated_jpeg(path: Path) -> Path:
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path)  # noise: the cut falls in the scan data, which verify() does not read
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: error:") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def run32(tmp_path_factory):
    """A resnet10t (timm) baseline trained at 32x32 through `jem train` on a folder holding a
    non-image .png and a truncated JPEG, skipped with --skip-bad-images."""
    root = tmp_path_factory.mktemp("rough")
    folder = write_digits_folder(root / "train", classes=(0, 1), per_class=12, size=32)
    (folder / "0" / "notes.png").write_text("not an image")
    _truncated_jpeg(folder / "1" / "cut.jpg")
    out = root / "run"
    argv = ["train", "--data", f"folder:{folder}", "--model", "resnet10t", "--image-size", "32", "--baseline"]
    argv += ["--epochs", "1", "--batch-size", "8", "--val-fraction", "0.25", "--out", str(out), "--quiet"]
    argv += ["--skip-bad-images"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 0
    return root, out, argv, err.getvalue()


# ----------------------------------------------------------------------------- 1. unreadable images
def test_a_non_image_png_is_named_in_one_line_before_training(run32, tmp_path, capsys):
    root, _, argv, _ = run32
    out = tmp_path / "run"
    bad = root / "train" / "0" / "notes.png"
    args = [a for a in argv if a != "--skip-bad-images"]
    args[args.index("--out") + 1] = str(out)
    capsys.readouterr()
    assert main(args) == 2
    err = _one_line_error(capsys)
    assert f"{bad}: not a readable image" in err and "--skip-bad-images" in err and "1 more" in err
    assert not out.exists()


def test_a_truncated_jpeg_is_caught_up_front(tmp_path):
    from jem_plugin.app.data import UnreadableImageError, image_folder

    folder = write_digits_folder(tmp_path / "d", classes=(0, 1), per_class=3, size=16)
    cut = _truncated_jpeg(folder / "1" / "cut.jpg")
    with pytest.raises(UnreadableImageError, match=f"{cut}: not a readable image .*no JPEG end-of-image marker"):
        image_folder(folder, image_size=16)
    ds = image_folder(folder, image_size=16, skip_bad=True)
    assert len(ds) == 6 and ds.skipped == [str(cut)]


def test_a_file_that_fails_to_decode_later_names_itself(tmp_path):
    """A file spoilt after the check (or one the check cannot see) fails with its name, not PIL's
    bare `OSError: image file is truncated` in the middle of training."""
    from jem_plugin.app.data import UnreadableImageError, image_folder

    folder = write_digits_folder(tmp_path / "d", classes=(0, 1), per_class=2, size=16)
    ds = image_folder(folder, image_size=16)
    path = ds.samples[0][0]
    Path(path).write_bytes(Path(path).read_bytes()[:60])
    with pytest.raises(UnreadableImageError, match=f"{path}: not a readable image"):
        ds[0]


def test_skip_bad_images_trains_and_says_what_it_skipped(run32, capsys):
    _, out, _, err = run32
    line = next(x for x in err.splitlines() if "skipped" in x)
    assert line.startswith("jem: skipped 2 unreadable images of folder:")
    assert line.endswith(": 0/notes.png, 1/cut.jpg")
    spec = json.loads((out / "spec.json").read_text())
    assert spec["skip_bad_images"] is True and spec["held_out"]["n_total"] == 24
    # eval reads the run's folder as training read it: the flag travels in the model file
    assert main(["eval", str(out / "model.pt"), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 6


def test_skip_note_lists_three_names_at_most():
    from types import SimpleNamespace

    from jem_plugin.app.data import skipped_note

    note = skipped_note(SimpleNamespace(skipped=["a", "b", "c", "d", "e"]), "folder:x")
    assert note == "skipped 5 unreadable images of folder:x: a, b, c, ... (2 more)"


# ----------------------------------------------------------------------------- 2. data refused early
def test_a_one_class_folder_is_refused_before_the_batch_size(tmp_path, capsys):
    """With the default --batch-size (64 > its 16 training images) the class count, not the
    batch size, is what the user must fix; nothing is written."""
    folder = write_digits_folder(tmp_path / "one", classes=(3,), per_class=20, size=16)
    out = tmp_path / "run"
    assert (
        main(
            ["train", "--data", f"folder:{folder}", "--model", "resnet10t", "--image-size", "16"] + ["--out", str(out)]
        )
        == 2
    )
    err = _one_line_error(capsys)
    assert "a classifier needs at least two" in err and "batch" not in err
    assert not out.exists()


def test_too_few_images_for_the_batch_are_refused_before_training(tmp_path, capsys):
    folder = write_digits_folder(tmp_path / "few", classes=(0, 1), per_class=5, size=16)
    out = tmp_path / "run"
    argv = ["train", "--data", f"folder:{folder}", "--model", "resnet10t", "--image-size", "16", "--out", str(out)]
    assert main(argv) == 2
    assert "fewer than --batch-size 64; lower --batch-size" in _one_line_error(capsys)
    assert not (out / "checkpoints").exists() and not (out / "model.pt").exists()


# ----------------------------------------------------------------------------- 3. flat OOD folders
def test_a_flat_folder_is_an_ood_set(run32, tmp_path, capsys):
    _, out, _, _ = run32
    flat = write_photo_folder(tmp_path / "p", n=6, size=16) / "photos"  # images directly in it
    (flat / "junk.png").write_text("not an image")
    argv = ["ood", str(out / "model.pt"), "--scores", "msp", "--ood", f"folder:{flat}", "--quiet"]
    argv += ["--out", str(tmp_path / "ood.json")]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the run's own skipped images said first
    assert err[-1].startswith("jem: error:") and f"{flat / 'junk.png'}: not a readable image" in err[-1]
    assert main([*argv, "--skip-bad-images"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) == {"msp/photos"}
    assert "skipped 1 unreadable image of folder:" in captured.err


# ----------------------------------------------------------------------------- 4. score names first
def test_unknown_score_names_fail_before_anything_is_loaded(tmp_path, capsys):
    assert main(["ood", str(tmp_path / "no_such_model.pt"), "--scores", "logpx,energy"]) == 2
    err = _one_line_error(capsys)
    assert "unknown OOD score 'energy'" in err and "msp" in err and "logpx" in err


# ----------------------------------------------------------------------------- 5. trained size
def test_a_timm_model_samples_at_its_trained_size(run32):
    """README: `jem.SGLD(steps=100).sample(jm, n=64)` drew 176x176 images (timm's pretrained size)
    for a model trained at 32x32; the model file's domain carries the trained size."""
    import jem_plugin as jem
    from jem_plugin.app.model_files import load_model_checkpoint

    _, out, _, _ = run32
    jm, spec = load_model_checkpoint(str(out / "model.pt"))
    assert spec["model"] == "resnet10t" and tuple(jm.domain.input_size) == (3, 32, 32)
    assert jem.SGLD(steps=1).sample(jm, n=2).shape == (2, 3, 32, 32)
    assert jem.SGLD(steps=1).sample(jem.load(out / "model.pt"), n=2).shape == (2, 3, 32, 32)  # the README's way


# ----------------------------------------------------------------------------- 6. help and version
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"jem": parser, **{f"jem {name}": p for name, p in sub.choices.items()}}


def test_every_flag_has_help_that_states_its_default():
    missing = []
    for command, parser in _subparsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if action.help == argparse.SUPPRESS:  # the old recipe flags, accepted but not listed
                continue
            text = formatter._expand_help(action) if action.help else ""
            switch = action.nargs == 0 and action.default is False  # a plain on/off switch: off
            if not text or (not switch and "default" not in text):
                missing.append(f"{command} {action.option_strings[0]}: {text!r}")
            elif action.default not in (None, False) and "default" not in (action.help or ""):
                assert f"(default: {action.default})" in text, (command, action.option_strings, text)
    assert not missing, "\n".join(missing)
    text = _subparsers()["jem train"].format_help()
    assert "--sgld-steps" in text and "(default: the recipe's)" in text and "(default: 64)" in text


def test_version(capsys):
    from jem_plugin import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out


# ----------------------------------------------------------------------------- 7. Ctrl-C
def test_ctrl_c_in_train_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from jem_plugin import training

    def interrupted_fit(*args, options, **kwargs):
        options.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        (options.checkpoint_dir / "epoch_0001.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "fit", interrupted_fit)
    out = tmp_path / "run"
    assert main(["train", "--baseline", "--epochs", "1", "--out", str(out), "--quiet"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: interrupted;") and str(out / "checkpoints") in err
    assert "run the same command again" in err and "--no-resume" in err


# ----------------------------------------------------------------------------- 8. demo over a report
def test_demo_keeps_an_earlier_report_unless_forced(tmp_path, monkeypatch, capsys):
    from jem_plugin.app.commands import demo

    (tmp_path / "report.html").write_text("the earlier report")
    assert main(["demo", "--smoke", "--out", str(tmp_path)]) == 2
    err = _one_line_error(capsys)
    assert "already holds a report" in err and "--force" in err and "--out elsewhere" in err
    assert (tmp_path / "report.html").read_text() == "the earlier report"
    monkeypatch.setattr(demo, "run_digits_demo", lambda out, **kw: {"runs": {}})
    assert main(["demo", "--smoke", "--force", "--quiet", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").read_text() != "the earlier report"


# ----------------------------------------------------------------------------- 9. a finished run
def test_a_finished_run_says_so_and_rewrites_nothing(run32, capsys):
    _, out, argv, _ = run32
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "this run is complete" in text and str(out / "model.pt") in text and "--no-resume starts over" in text
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()} == before


# ----------------------------------------------------------------------------- 10. the report
def _result(temperature: float) -> dict:
    def run(acc, t, cpu, train_cpu, wall):
        return {
            "summary": {
                "accuracy": acc,
                "ece": 0.05,
                "temperature": t,
                "cpu_seconds_per_epoch": cpu,
                "train_cpu_seconds": train_cpu,
                "train_seconds": wall,
                "cost_vs_baseline": train_cpu / 10.0,
                "wall_cost_vs_baseline": wall / 5.0,
            }
        }

    return {"runs": {"baseline": run(0.9, 1.2, 1.0, 10.0, 5.0), "JEM": run(0.91, temperature, 4.0, 30.0, 20.0)}}


def test_the_report_explains_a_temperature_below_one_and_gives_one_cost_ratio(tmp_path):
    from jem_plugin.app.report import COST_RATIO, write_report

    html = write_report(tmp_path, _result(0.8)).read_text()
    assert "below 1: the model was under-confident, its logits are sharpened" in html
    assert "Fitted temperature below 1 for JEM (0.80)" in html  # the summary names the run
    # one ratio, CPU time per epoch (4.0 / 1.0), under one name in the summary and the table
    assert html.count(COST_RATIO) == 2 and f"{COST_RATIO} 4.0" in html
    assert "Wall-time cost" not in html and "CPU cost vs baseline" not in html and "3x" not in html
    assert "JEM (0.80)" not in write_report(tmp_path, _result(1.3)).read_text()


def test_the_reliability_legend_has_every_colour_the_figure_shows(tmp_path, monkeypatch):
    """The gap was drawn translucent over the accuracy bars: where a bin was under-confident the two
    blended into a purple the legend lacked. Every patch is opaque now, each colour in the legend."""
    from matplotlib.colors import to_rgba
    from matplotlib.figure import Figure

    from jem_plugin import viz

    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), real_savefig(self, *a, **k)))
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (2000,), generator=g)
    logits = torch.randn(2000, 10, generator=g)
    logits[torch.arange(1200), labels[:1200]] += 2.0  # over-confident bins and under-confident ones
    viz.reliability_diagram(logits, labels, str(tmp_path / "r.png"), from_logits=True)
    fig = figures[-1]
    legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()
    in_legend = {to_rgba(h.get_facecolor()) for h in legend.legend_handles if hasattr(h, "get_facecolor")}
    top = fig.axes[0]
    shown = {to_rgba(p.get_facecolor()) for p in top.patches}
    assert all(c[3] == 1.0 for c in shown), shown  # opaque: no blend of two patches
    assert shown <= in_legend, shown - in_legend
    assert len(shown) == 3  # accuracy bars, over- and under-confident gaps
