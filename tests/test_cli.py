"""Every `jem` subcommand, end to end on tiny budgets, and its one-line errors."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from jem_plugin.app.cli import main
from jem_plugin.covariance import Diagonal
from jem_plugin.errors import UntrainedDensityWarning


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    rc = main(
        [
            "train",
            "--epochs",
            "1",
            "--sgld-steps",
            "2",
            "--buffer-capacity",
            "500",
            "--warmup-iters",
            "10",
            "--lr",
            "1e-3",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    return out


@pytest.mark.slow
def test_train_writes_model_checkpoints_history(trained_run):
    assert (trained_run / "model.pt").is_file()
    assert list((trained_run / "checkpoints").glob("*.pt"))
    history = json.loads((trained_run / "history.json").read_text())
    assert history["epochs"][0]["iterations"] > 0
    assert (trained_run / "buffer.png").stat().st_size > 100
    # Sample quality by an independent judge, once at the end, with its reference points (issue 16)
    q = history["sample_quality"]
    assert set(q) == {
        "fd_buffer",
        "fd_init",
        "fd_heldout_floor",
        "fd_n_samples",
        "judge_acc_heldout",
        "judge_acc_samples",
        "judge_acc_init",
    }
    assert q["fd_n_samples"] == 180  # half the 360 held-out digits: every distance at the same n
    assert q["fd_heldout_floor"] < q["fd_init"] and q["judge_acc_heldout"] > 0.5  # the judge sees digits
    assert 0.0 <= q["judge_acc_samples"] <= 1.0 and q["fd_buffer"] >= 0.0


@pytest.mark.slow
def test_train_resumes_from_its_checkpoints(trained_run, capsys):
    # Asking for 2 epochs in the same directory continues from epoch 1 instead of starting over.
    rc = main(
        [
            "train",
            "--epochs",
            "2",
            "--sgld-steps",
            "2",
            "--buffer-capacity",
            "500",
            "--warmup-iters",
            "10",
            "--lr",
            "1e-3",
            "--out",
            str(trained_run),
            "--quiet",
        ]
    )
    assert rc == 0
    history = json.loads((trained_run / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]


@pytest.mark.slow
def test_eval(trained_run, capsys, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", str(trained_run / "model.pt"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert 0.0 <= result["accuracy"] <= 1.0 and "ece" in result and "ece_after" in result["refit"]
    # the reliability diagram beside the JSON, named on stderr (stdout stays the JSON)
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    assert f"figure: {tmp_path / 'eval.png'}" in capsys.readouterr().err


@pytest.mark.slow
def test_ood(trained_run, tmp_path):
    out = tmp_path / "ood.json"
    assert main(["ood", str(trained_run / "model.pt"), "--scores", "logpx,msp", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {f"{s}/{o}" for s in ("logpx", "msp") for o in ("noise", "patches", "blends", "transposed")}
    assert all(0.0 <= r["auroc"] <= 1.0 for r in result.values())


@pytest.mark.slow
def test_sample(trained_run, tmp_path):
    out = tmp_path / "grid.png"
    assert (
        main(
            [
                "sample",
                str(trained_run / "model.pt"),
                "--per-class",
                "--n",
                "20",
                "--sgld-steps",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    from PIL import Image

    w, h = Image.open(out).size
    assert w >= 200 and h >= 300  # upscaled: 10 labelled rows of 8x8 digits, not an 84 px grid


@pytest.mark.slow
def test_sample_defaults_to_the_model_directory(trained_run, capsys):
    assert main(["sample", str(trained_run / "model.pt"), "--n", "4", "--sgld-steps", "2"]) == 0
    assert (trained_run / "model_samples.png").is_file()
    assert str(trained_run / "model_samples.png") in capsys.readouterr().out


def test_the_sample_check_says_what_its_figures_say():
    """`jem sample` printed "Lower distance than the starts: the chains moved towards the data"
    after figures that said the opposite (342 for the samples, 331 for their starts)."""
    from jem_plugin.app.commands.sample import sample_check_line

    worse = {"judge_acc_heldout": 0.94, "n": 64, "fd_samples": 342.0, "fd_starts": 331.0}
    line = sample_check_line(worse)
    assert "342 for the samples" in line and "NOT closer to the data than their starts" in line
    assert "moved towards it" not in line and "\n" not in line
    better = dict(worse, fd_samples=120.0, judge_acc_samples=0.9, judge_acc_starts=0.5)
    line = sample_check_line(better)
    assert "closer to the data than their starts: the chains moved towards it" in line and "NOT" not in line
    assert "90% of the samples" in line and "no more samples" not in line
    assert "no more samples than starts" in sample_check_line(dict(better, judge_acc_samples=0.5))


def test_plugins_lists_builtins(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "jem_adapters.timm_adapter" in text and "jem_register_ood_scores" in text
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "jem_plugin.builtins.ood_scores" for r in rows)


@pytest.mark.slow
def test_demo_smoke_writes_report(tmp_path, capsys, recwarn):
    assert main(["demo", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    # The baseline is scored with the JEM scores on purpose: its caption says what they assume,
    # and the console carries no warning the demo itself caused.
    assert not [w for w in recwarn if issubclass(w.category, UntrainedDensityWarning)]
    out = capsys.readouterr().out
    assert "report:" in out and "baseline" in out
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in html
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["runs"]) >= {"baseline", "JEM"}
    # Reads like a result: readable names with meanings, a computed summary, captions, no targets.
    assert "Test accuracy" in html and "share of held-out images classified correctly" in html
    assert "log p(x) vs uniform noise" in html and "auroc_logpx_noise" not in html
    assert "<h2>Summary</h2>" in html and "took" in html and "CPU time" in html
    assert "each row should show its class" in html and "reliability diagram" in html
    assert "on a model trained without the JEM loss (the baseline) it can rank OOD images higher" in html
    assert "MISSED" not in html and "targets" not in metrics
    # Sample quality of the JEM by an independent judge, reference points beside it (issue 16)
    q = metrics["runs"]["JEM"]["summary"]
    assert {
        "fd_buffer",
        "fd_init",
        "fd_heldout_floor",
        "fd_n_samples",
        "judge_acc_samples",
        "judge_acc_init",
        "judge_acc_heldout",
    } <= set(q)
    assert "fd_buffer" not in metrics["runs"]["baseline"]["summary"]  # no buffer, no samples to judge
    assert q["fd_heldout_floor"] < q["fd_init"]
    assert "Sample distance: replay buffer (FD)" in html and "reference: initial distribution (FD)" in html
    assert "own held-out FD" in html and "Judge accuracy on class samples" in html
    assert (
        "should fall well below its initial distribution" in html and "fd_buffer" not in html.split("<h2>Settings")[0]
    )
    # The demo's models are ordinary model files: the post-hoc commands read them.
    assert main(["eval", str(tmp_path / "model_JEM.pt"), "--quiet"]) == 0
    evaluated = json.loads(capsys.readouterr().out)  # same test split: the same accuracy
    assert evaluated["accuracy"] == pytest.approx(metrics["runs"]["JEM"]["summary"]["accuracy"])
    assert main(["ood", str(tmp_path / "model_baseline.pt"), "--scores", "grad_norm_projected", "--quiet"]) == 0
    assert "grad_norm_projected" in capsys.readouterr().out
    # Every run's summary and figures (run_digits_demo, the demo's entry point)
    from jem_plugin.app.experiments import OOD_SCORES

    for run in metrics["runs"].values():
        s = run["summary"]
        for key in ("accuracy", "ece", "ece_temp_scaled", "seconds_per_epoch", "train_cpu_seconds"):
            assert isinstance(s[key], float), key
        for method in OOD_SCORES:
            for ood_set in ("noise", "patches", "blends", "transposed"):
                assert 0.0 <= s[f"auroc_{method}_{ood_set}"] <= 1.0
    for png in (
        "samples_buffer.png",
        "samples_per_class.png",
        "curves_training.png",
        "reliability_JEM.png",
        "roc_logpx_baseline.png",
    ):
        assert (tmp_path / png).stat().st_size > 1000, png
    # ... and jem.load rebuilds them (one demo run for all three checks: it is among the suite's costliest)
    import jem_plugin as jem
    from jem_plugin.app import data as D

    ds = D.load_digits("test", seed=0)
    x, y = torch.stack([ds[i][0] for i in range(len(ds))]), torch.tensor([ds[i][1] for i in range(len(ds))])
    for name in ("model_JEM.pt", "model_baseline.pt"):
        jm = jem.load(tmp_path / name)
        assert jm.num_classes == 10 and jm.classes == [str(i) for i in range(10)] and jm.temperature is None
        assert torch.isfinite(jm.log_px(x[:8])).all()
    with torch.no_grad():  # model_JEM.pt is the model the demo evaluated: the same test accuracy
        accuracy = metrics["runs"]["JEM"]["summary"]["accuracy"]
        assert float((jem.load(tmp_path / "model_JEM.pt")(x).argmax(1) == y).float().mean()) == pytest.approx(accuracy)
    with pytest.raises(jem.CheckpointError, match="no sampler file") as err:
        jem.load_sampler(tmp_path / "model_JEM.pt")  # the demo keeps no sampler
    assert err.value.reason == "missing"


def test_config_file_sets_defaults_and_flags_win(tmp_path):
    from jem_plugin.app.cli import parse_args

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"epochs": 7, "sgld-steps": 3}))
    args = parse_args(["train", "--config", str(cfg), "--epochs", "2"])
    assert args.epochs == 2 and args.sgld_steps == 3
    toml = tmp_path / "c.toml"
    toml.write_text("epochs = 5\n")
    assert parse_args(["train", "--config", str(toml)]).epochs == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "does/not/exist.pt"], "no model file at"),
        (["train", "--data", "cifar10:/nonexistent", "--epochs", "1"], "CIFAR-10 not found"),
        (["train", "--data", "mnist"], "unknown --data"),
        (["train", "--model", "not_a_model_anywhere"], "unknown --model"),
        (["train", "--config", "missing.json"], "does not exist"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jem: error:") and message in err and "\n" not in err


def test_incompatible_checkpoint_is_one_line(tmp_path, capsys):
    import torch

    bad = tmp_path / "plain.pt"
    torch.save({"weight": torch.zeros(2)}, bad)
    assert main(["eval", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "jem: error:" in err and "Traceback" not in err


def test_config_with_unknown_option(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"epochz": 7}))
    assert main(["train", "--config", str(cfg)]) == 2
    assert "epochz" in capsys.readouterr().err


@pytest.mark.slow
def test_output_into_a_closed_pipe_is_not_a_traceback():
    """`jem plugins | head -0`: the reader is gone before jem writes (it is still importing torch)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jem_plugin.app.cli", "plugins", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.slow
def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "jem_plugin.app.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout and "plugins" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jem_plugin.app.cli", "train", "--epochs", "x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "invalid int value" in bad.stderr


# ----------------------------------------------------------------------------- jem train settings
@pytest.fixture
def captured_fit(monkeypatch):
    """Replace the training loop: record what `jem train` asks of it, train nothing."""
    from jem_plugin import training

    calls = []

    def fake_fit(jm, train_loader, recipe=None, *, epochs, optimizer=None, loss_fn=None, options=None, **kw):
        setup, options = recipe, options or training.FitOptions()
        history = training.History()
        calls.append(
            dict(
                jm=jm,
                loader=train_loader,
                epochs=epochs,
                setup=setup,
                loss_fn=setup.loss if setup is not None else loss_fn,
                optimizer=setup.optimizer if setup is not None else optimizer,
                warmup_iters=(
                    setup.warmup_iters if setup is not None else optimizer.warmup_for(epochs * len(train_loader))
                ),
                amp=options.amp,
                channels_last=options.channels_last,
                checkpoint_every=options.checkpoint_every,
                options=options,
                **kw,
            )
        )
        # As fit does after the last step: the recipe's extensions (the BatchNorm recompute) run.
        state = training.TrainState(jm, None, None, None, history, val_data=kw.get("val_data"))
        for ext in setup.extensions if setup is not None else ():
            ext.on_fit_end(state, train_loader)
        return history

    monkeypatch.setattr(training, "fit", fake_fit)
    return calls


def test_train_defaults_to_the_generative_recipe_with_warmup_capped(captured_fit, tmp_path, capsys):
    """With no --recipe, the digits (over 50 per class) train generative with its p(x) term at
    DEFAULT_PX_WEIGHT and, the default digits-cnn having no normalisation layer, no energy L2;
    every other setting the recipe's."""
    from jem_plugin.app.default_recipe import DEFAULT_PX_WEIGHT, NO_NORMALISATION_L2_WEIGHT
    from jem_plugin.recipes import get_recipe

    assert main(["train", "--out", str(tmp_path), "--quiet"]) == 0
    call = captured_fit[0]
    default = get_recipe("generative")
    iters = len(call["loader"])
    assert call["epochs"] == 150
    assert call["warmup_iters"] == default.optim.warmup_for(150 * iters) == default.optim.warmup_iters
    sampler = call["loss_fn"].sampler
    assert (sampler.steps, sampler.noise, sampler.grad_clamp, sampler.colours) == (10, 0.0, 0.03, "data")
    assert call["loss_fn"].px_weight == DEFAULT_PX_WEIGHT != default.loss.px_weight and default.bn_stats_from_data
    assert call["loss_fn"].n_samples == default.loss.n_samples and sampler.batchnorm == "joint"
    assert call["loss_fn"].buffer.init_spec == default.buffer.init and call["loss_fn"].buffer.init_dist.fitted
    assert call["optimizer"].param_groups[0]["lr"] == default.optim.lr
    built = default.replace(buffer_capacity=10000, px_weight=DEFAULT_PX_WEIGHT, l2_weight=NO_NORMALISATION_L2_WEIGHT)
    assert call["setup"].recipe == built  # the one recipe, as built
    changed = f"px-weight {DEFAULT_PX_WEIGHT:g}, l2-weight {NO_NORMALISATION_L2_WEIGHT:g}"
    assert f"recipe generative ({changed})" in capsys.readouterr().out


def test_train_sizes_the_replay_buffer_for_the_run_unless_told(captured_fit, tmp_path, capsys):
    """generative draws each buffer slot about 40 times (issue 16, e79): 60 digits epochs of 22
    iterations get 1056 slots, said in one line; --buffer-capacity is taken as given."""
    assert main(["train", "--epochs", "60", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    iters = len(captured_fit[0]["loader"])
    assert captured_fit[0]["loss_fn"].buffer.capacity == 60 * iters * 32 // 40
    assert f"replay buffer of {60 * iters * 32 // 40} slots, not 10000" in capsys.readouterr().out
    assert main(["train", "--epochs", "60", "--buffer-capacity", "5000", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert captured_fit[1]["loss_fn"].buffer.capacity == 5000 and "slots, not" not in capsys.readouterr().out
    assert main(["train", "--epochs", "60", "--buffer-visits", "80", "--out", str(tmp_path / "c"), "--quiet"]) == 0
    assert captured_fit[2]["loss_fn"].buffer.capacity == 60 * iters * 32 // 80


def test_train_recipe_paper_on_a_short_run_caps_the_warmup(captured_fit, tmp_path):
    assert (
        main(
            [
                "train",
                "--recipe",
                "paper",
                "--epochs",
                "10",
                "--n-samples",
                "16",
                "--amp",
                "bf16",
                "--channels-last",
                "--checkpoint-every",
                "7",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    call = captured_fit[0]
    # The paper's 1000 warm-up iterations would outlast 10 epochs of 22 iterations; a tenth of the run.
    assert call["warmup_iters"] == 22 and call["loss_fn"].sampler.steps == 20
    assert call["loss_fn"].n_samples == 16 and call["optimizer"].param_groups[0]["lr"] == 1e-4
    assert (call["amp"], call["channels_last"], call["checkpoint_every"]) == ("bf16", True, 7)


def test_recipe_choices_come_from_the_registry(monkeypatch, captured_fit, tmp_path):
    import dataclasses

    from jem_plugin import recipes

    monkeypatch.setitem(
        recipes.RECIPES, "mine", dataclasses.replace(recipes.get_recipe("fast").replace(sgld_steps=3), name="mine")
    )
    assert main(["train", "--recipe", "mine", "--epochs", "1", "--out", str(tmp_path), "--quiet"]) == 0
    assert captured_fit[0]["loss_fn"].sampler.steps == 3


def test_factory_from_the_current_directory(captured_fit, tmp_path, monkeypatch):
    (tmp_path / "mynet.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, **options):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "mynet:build", "--epochs", "1", "--out", "run", "--quiet"]) == 0
    assert json.loads((tmp_path / "run" / "spec.json").read_text())["model"] == "mynet:build"


@pytest.mark.parametrize("data, model", [("folder", "resnet10t"), ("toy2d", "toy-mlp")])
def test_train_without_model_picks_a_network_made_for_the_data(data, model, captured_fit, tmp_path, capsys):
    """`jem train --data folder:PATH` with no --model stopped with "digits-cnn fails on inputs of
    shape (3, 32, 32)": the default was the net for the bundled 8x8 digits, whatever the data."""
    from benchmarks.folders import write_digits_folder

    if data == "folder":
        write_digits_folder(tmp_path / "imgs", classes=(0, 1, 2), per_class=6)
        data = f"folder:{tmp_path / 'imgs'}"
    argv = ["train", "--data", data, "--epochs", "1", "--batch-size", "8", "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0
    spec = json.loads((tmp_path / "run" / "spec.json").read_text())
    assert spec["model"] == model and len(captured_fit) == 1
    said = capsys.readouterr().out
    assert (f"--model {model}, the default for --data folder" in said) == (model == "resnet10t")


# ----------------------------------------------------------------------------- folders, resume, checkpoints
@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    from benchmarks.folders import write_digits_folder, write_photo_folder

    root = tmp_path_factory.mktemp("folders")
    write_digits_folder(root / "train", classes=(0, 1, 2), per_class=10)
    write_digits_folder(root / "other", classes=(0, 1, 2), per_class=4, offset=10)
    write_photo_folder(root / "ood", n=8)
    out = root / "run"
    assert (
        main(
            [
                "train",
                "--data",
                f"folder:{root / 'train'}",
                "--image-size",
                "16",
                "--model",
                "resnet10t",
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--sgld-steps",
                "1",
                "--buffer-capacity",
                "64",
                "--checkpoint-buffer",
                "none",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    return root


@pytest.mark.slow
def test_folder_run_holds_out_a_stratified_split_and_evaluates_on_it(folder_run, capsys):
    spec = json.loads((folder_run / "run" / "spec.json").read_text())
    assert spec["classes"] == ["0", "1", "2"] and spec["held_out"] == {"fraction": 0.2, "seed": 0, "n_total": 30}
    capsys.readouterr()
    assert main(["eval", str(folder_run / "run" / "model.pt"), "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 6 and "held out from training" in result["data"]  # 2 of each class's 10
    # 6 held-out images are too few to measure samples with: said, not silently left out
    quality = json.loads((folder_run / "run" / "history.json").read_text())["sample_quality"]
    assert "needs >= 20 held-out images, got 6" in quality["skipped"]
    assert main(["eval", str(folder_run / "run" / "model.pt"), "--data", f"folder:{folder_run / 'other'}"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 12


@pytest.mark.slow
def test_eval_figures_never_overwrite_the_training_run_or_each_other(folder_run, capsys):
    run = folder_run / "run"
    training = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and "model_eval" not in p.parts}
    capsys.readouterr()
    assert main(["eval", str(run / "model.pt"), "--quiet"]) == 0
    assert main(["eval", str(run / "model.pt"), "--data", f"folder:{folder_run / 'other'}", "--quiet"]) == 0
    figures = [pathlib.Path(f) for f in re.findall(r"^figure: (.+)$", capsys.readouterr().err, re.M)]
    assert [f.name for f in figures] == ["held-out_reliability.png", "folder_other_reliability.png"]
    assert all(f.parent == run / "model_eval" and f.stat().st_size > 10_000 for f in figures)
    assert {p: p.read_bytes() for p in training} == training  # the run's own files are untouched


@pytest.mark.slow
def test_ood_against_named_folders_and_noise(folder_run, capsys):
    capsys.readouterr()
    assert (
        main(
            [
                "ood",
                str(folder_run / "run" / "model.pt"),
                "--scores",
                "logpx",
                "--quiet",
                "--ood",
                f"folder:{folder_run / 'ood'}",
                "--ood",
                "noise",
            ]
        )
        == 0
    )
    assert set(json.loads(capsys.readouterr().out)) == {"logpx/ood", "logpx/noise"}


@pytest.mark.slow
def test_checkpoint_without_buffer_is_smaller_and_resumes(folder_run, capsys):
    import torch

    ckpt = sorted((folder_run / "run" / "checkpoints").glob("*.pt"))[-1]
    state = torch.load(ckpt, weights_only=True)
    loss_state = state["objects"]["loss"]
    assert any(k.startswith("buffer.") for k in loss_state) and not any(k.endswith("buffer.data") for k in loss_state)
    assert (
        main(
            [
                "train",
                "--data",
                f"folder:{folder_run / 'train'}",
                "--image-size",
                "16",
                "--model",
                "resnet10t",
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--sgld-steps",
                "1",
                "--buffer-capacity",
                "64",
                "--checkpoint-buffer",
                "none",
                "--out",
                str(folder_run / "run"),
                "--quiet",
            ]
        )
        == 0
    )
    assert "continuing it" in capsys.readouterr().out
    history = json.loads((folder_run / "run" / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]


@pytest.mark.slow
def test_refused_resume_changes_no_file(folder_run, capsys):
    run = folder_run / "run"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert (
        main(
            [
                "train",
                "--data",
                f"folder:{folder_run / 'train'}",
                "--image-size",
                "16",
                "--model",
                "resnet18",
                "--epochs",
                "3",
                "--batch-size",
                "8",
                "--out",
                str(run),
                "--quiet",
            ]
        )
        == 2
    )
    assert "holds a run of --model resnet10t" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_run_cut_short_says_so_in_the_result_and_the_report(tmp_path, monkeypatch, capsys):
    from jem_plugin.app import experiments
    from jem_plugin.app.commands.demo import SMOKE_DEMO

    # The demo's budget, after its evaluation reserve, leaves 0.05 s: both runs stop early.
    monkeypatch.setattr(experiments, "DEMO_EVAL_SECONDS", 0.0)
    monkeypatch.setattr(
        experiments,
        "DEMO_RECIPE",
        # the smoke demo's sampler and judge (what the evaluation costs), with 4 epochs to cut short
        {**experiments.DEMO_RECIPE, **SMOKE_DEMO, "epochs": 4, "buffer_capacity": 200, "class_sample_steps": 1},
    )
    real_run = experiments.run_digits
    monkeypatch.setattr(
        experiments,
        "run_digits",
        lambda *a, budget_seconds, **k: real_run(*a, budget_seconds=None, max_seconds=0.05, **k),
    )
    assert main(["demo", "--quiet", "--budget-seconds", "20", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["truncated"]["JEM"][1] == 4 and metrics["truncated"]["JEM"][0] < 4
    assert "JEM stopped after" in metrics["warning"] and "not representative" in metrics["warning"]
    assert "of 4 epochs" in metrics["description"] and "4 epochs each" not in metrics["description"]
    assert metrics["warning"] in out and out.index("not meaningful yet") < out.index("Test accuracy")
    assert "class='warning'" in (tmp_path / "report.html").read_text()


def test_truncation_note_suggests_a_budget():
    from jem_plugin.app.experiments import truncation_note

    note = truncation_note({"JEM": (14, 150)}, 200.0)
    assert note.startswith("JEM stopped after 14 of 150 epochs") and "--budget-seconds 210" in note


@pytest.mark.slow
def test_val_data_is_what_eval_uses_by_default(folder_run, captured_fit, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--data",
                f"folder:{folder_run / 'train'}",
                "--val-data",
                f"folder:{folder_run / 'other'}",
                "--image-size",
                "16",
                "--model",
                "resnet10t",
                "--batch-size",
                "8",
                "--baseline",
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    assert len(captured_fit[0]["loader"].dataset) == 30  # nothing split off: the held-out set is --val-data
    capsys.readouterr()
    assert main(["eval", str(out / "model.pt")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 12 and "--val-data" in result["data"]


def test_checkpoint_every_n_iterations(tmp_path):
    assert (
        main(["train", "--baseline", "--epochs", "1", "--checkpoint-every", "5", "--out", str(tmp_path), "--quiet"])
        == 0
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert any("000000020" in n for n in names), names  # mid-epoch (an epoch is 22 iterations)


def test_train_batchnorm_flags_reach_the_loss_and_fast_keeps_the_samples_apart(captured_fit, tmp_path):
    assert main(["train", "--epochs", "1", "--recipe", "fast", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    loss_fn = captured_fit[0]["loss_fn"]
    assert loss_fn.sampler.batchnorm == "separate"  # one knob: the loss reads its sampler's
    assert loss_fn.buffer.init_dist.fitted  # fast fits its per-class Gaussian on the training data
    assert (
        main(
            [
                "train",
                "--epochs",
                "1",
                "--recipe",
                "fast",
                "--sgld-batchnorm",
                "joint",
                "--out",
                str(tmp_path / "b"),
                "--quiet",
            ]
        )
        == 0
    )
    assert captured_fit[1]["loss_fn"].sampler.batchnorm == "joint"


def test_train_recipe_flags_have_one_name_each(captured_fit, tmp_path):
    from jem_plugin.app import CLIError
    from jem_plugin.app.cli import build_parser

    flags = ["--recipe", "fast", "--sgld-grad-clamp", "0.05", "--buffer-capacity", "300"]
    assert main(["train", "--epochs", "1", *flags, "--out", str(tmp_path), "--quiet"]) == 0
    loss_fn = captured_fit[0]["loss_fn"]
    assert (loss_fn.sampler.grad_clamp, loss_fn.buffer.capacity) == (0.05, 300)
    # the names before the recipe tree, and the BatchNorm modes before joint/separate
    for old in (
        ["--grad-clip", "0.05"],
        ["--buffer-size", "300"],
        ["--batchnorm", "joint"],
        ["--sgld-batchnorm", "batch"],
    ):
        with pytest.raises(CLIError, match=old[0] if old[1] != "batch" else "invalid choice: 'batch'"):
            build_parser().parse_args(["train", *old])


def test_train_flags_are_the_recipe_trees_flat_names(capsys):
    from jem_plugin.app.cli import build_parser
    from jem_plugin.recipes import flat_names

    train = next(a for a in build_parser()._actions if a.dest == "command").choices["train"]
    options = {o for a in train._actions for o in a.option_strings}
    for name in flat_names():
        assert "--" + name.replace("_", "-") in options, name
    assert (
        main(["train", "--recipe", "jempp", "--sgld-steps", "3", "--init-covariance", "lowrank", "--show-recipe"]) == 0
    )
    out = capsys.readouterr().out
    assert "recipe 'jempp'" in out and "sgld_steps             3" in out and "init_covariance        'lowrank'" in out
    assert "no --recipe" not in out


def test_show_recipe_without_a_recipe_says_that_jem_train_picks_by_the_data(capsys):
    """With no --recipe, the recipe jem train trains depends on the data and the network (fast on
    small BatchNorm data, else generative at DEFAULT_PX_WEIGHT): --show-recipe, which reads no data,
    says so under the general default it prints, rather than passing that off as what will run."""
    from jem_plugin.app.default_recipe import DEFAULT_PX_WEIGHT

    assert main(["train", "--show-recipe"]) == 0
    out = capsys.readouterr().out
    assert "recipe 'generative'" in out
    assert "no --recipe: jem train picks by the data and the network" in out
    assert f"px_weight {DEFAULT_PX_WEIGHT:g}" in out.splitlines()[-1]


def test_train_init_covariance_flag_reaches_the_fitted_init(captured_fit, tmp_path):
    """--init-covariance lowrank: the recipe's Gaussian init keeps principal directions per class."""
    assert (
        main(
            [
                "train",
                "--epochs",
                "1",
                "--recipe",
                "jempp",
                "--init-covariance",
                "lowrank",
                "--init-rank",
                "4",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    init = captured_fit[0]["loss_fn"].buffer.init_dist
    assert init.fitted and init.factor.shape == (10, 64, 4)
    assert (
        main(
            [
                "train",
                "--epochs",
                "1",
                "--recipe",
                "jempp",
                "--init-covariance",
                "stationary",
                "--out",
                str(tmp_path / "s"),
                "--quiet",
            ]
        )
        == 0
    )
    init = captured_fit[1]["loss_fn"].buffer.init_dist
    assert init.fitted and init.std.shape == (10, 1, 8, 8)


def test_train_sgld_colours_flag_reaches_the_sampler(captured_fit, tmp_path):
    """--sgld-colours data: the chains' steps follow the colour axes of the data the buffer was fitted on."""
    assert main(["train", "--epochs", "1", "--sgld-colours", "data", "--out", str(tmp_path), "--quiet"]) == 0
    loss_fn = captured_fit[0]["loss_fn"]
    assert loss_fn.sampler.colours == "data"
    assert torch.equal(loss_fn.buffer.colour_projection, torch.eye(1))  # 1-channel digits: one axis, kept


def test_train_generative_on_points_falls_back_from_its_image_pieces_and_says_so(captured_fit, tmp_path, capsys):
    """toy2d points are not images: the stationary init and colour steps give way, with one line each."""
    assert (
        main(
            [
                "train",
                "--recipe",
                "generative",
                "--data",
                "toy2d",
                "--model",
                "toy-mlp",
                "--epochs",
                "1",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    loss_fn = captured_fit[0]["loss_fn"]
    assert loss_fn.buffer.init_spec.covariance == Diagonal() and loss_fn.sampler.colours == "all"
    out = capsys.readouterr().out
    assert "init_covariance 'stationary' -> 'diagonal'" in out and "sgld_colours 'data' -> 'all'" in out


@pytest.mark.slow
def test_train_reports_held_out_calibration_before_and_after_a_temperature(tmp_path, capsys):
    """The generative default costs calibration that one temperature restores: jem train says both."""
    assert main(["train", "--baseline", "--epochs", "2", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    cal = json.loads((tmp_path / "history.json").read_text())["calibration"]
    assert cal["n"] == 360 and cal["temperature"] > 0  # each half scaled by the other's temperature
    assert 0.0 <= cal["ece_after"] <= 1.0 and 0.0 <= cal["ece_before"] <= 1.0
    assert f"ECE {cal['ece_before']:.3f}, {cal['ece_after']:.3f} after a temperature" in out


def test_generative_train_recomputes_batchnorm_statistics_from_the_training_data(
    captured_fit, tmp_path, monkeypatch, capsys
):
    """The joint pass mixes samples into BatchNorm's running statistics; `generative` recomputes
    them from the training data after training, keeps them only if held-out accuracy is not lower,
    and says which with the held-out accuracy before and after (console, history.json,
    metrics.json); --no-bn-stats-from-data and `fast` leave them alone."""
    (tmp_path / "bnnet.py").write_text(
        "import torch.nn as nn\n"
        "def build(num_classes, **options):\n"
        "    return nn.Sequential(nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(64, num_classes))\n"
    )
    monkeypatch.chdir(tmp_path)
    runs = {"on": [], "off": ["--no-bn-stats-from-data"], "fast": ["--recipe", "fast"]}
    for name, flags in runs.items():
        assert main(["train", "--model", "bnnet:build", "--epochs", "1", "--out", name, "--quiet", *flags]) == 0
    bn = {name: call["jm"].model[0] for name, call in zip(runs, captured_fit)}
    x = captured_fit[0]["loader"].dataset.tensors[0]
    for name in ("off", "fast"):  # untrained (the fit is replaced): near BatchNorm's initial statistics
        assert bn[name].num_batches_tracked.item() <= 1  # jem train's input check is one forward
        assert abs(bn[name].running_mean.item() - x.mean().item()) > 0.2
    steps = {
        n: {d["step"]: d for d in json.loads((tmp_path / n / "history.json").read_text())["post_training"]}
        for n in runs
    }
    record = steps["on"]["bn_stats_from_data"]
    assert 0.0 <= record["before"] <= 1.0 and 0.0 <= record["after"] <= 1.0 and record["n_heldout"] == 360
    assert record["kept"] == (record["after"] >= record["before"])  # accuracy equal: NLL decided
    assert "bn_stats_from_data" not in steps["off"] and "bn_stats_from_data" not in steps["fast"]
    out = capsys.readouterr().out
    assert "BatchNorm running statistics recomputed from the training data, held-out" in out
    assert ("kept: held-out accuracy is not lower" in out) == record["kept"]
    metrics = json.loads((tmp_path / "on" / "metrics.json").read_text())
    assert metrics["post_training"][0] == record and metrics["held_out"]["n"] == 360


@pytest.mark.slow
def test_train_continued_for_more_epochs_keeps_the_replay_buffer_it_began_with(tmp_path, capsys):
    """The buffer is sized for the run's length; a finished run continued with a larger --epochs
    resumes its chains in the slots it began with (a buffer sized anew failed to load)."""
    out = tmp_path / "run"
    flags = ["--sgld-steps", "1", "--out", str(out), "--quiet"]
    assert main(["train", "--epochs", "1", *flags]) == 0
    slots = json.loads((out / "spec.json").read_text())["replay_buffer_slots"]
    assert slots == 32  # 22 iterations of 32 chains: never fewer slots than chains
    assert main(["train", "--epochs", "3", *flags]) == 0
    assert "continuing it" in capsys.readouterr().out
    assert json.loads((out / "spec.json").read_text())["replay_buffer_slots"] == slots
    assert [e["epoch"] for e in json.loads((out / "history.json").read_text())["epochs"]][-1] == 3
