"""What a newcomer met (issue 48): an unfair baseline, closing lines that disagree, samples at the
wrong size, and no way from raw images to the model's input."""

from __future__ import annotations

import json

import pytest
import torch

from jem_plugin.app.cli import main, parse_args

# A BatchNorm network whose running statistics cannot keep up with a short run: its activations sit
# 20 above zero before a BatchNorm that moves its running mean 0.1% a step. Training normalises
# each batch by its own statistics (and classifies); evaluation by running ones near 0 (chance).
LAGGING_BN = """
import torch.nn as nn


class Shift(nn.Module):
    def forward(self, x):
        return x + 20.0


def build(num_classes, **options):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 64), Shift(), nn.BatchNorm1d(64, momentum=0.001), nn.ReLU(),
        nn.Linear(64, num_classes),
    )
"""


@pytest.fixture
def lagging_bn(tmp_path, monkeypatch):
    (tmp_path / "lagbn.py").write_text(LAGGING_BN)
    monkeypatch.chdir(tmp_path)
    return ["train", "--baseline", "--model", "lagbn:build", "--epochs", "3", "--lr", "3e-3", "--quiet"]


# ----------------------------------------------------------------------------- 1. a fair baseline
def test_the_baseline_gets_the_jem_runs_batchnorm_step_evidence_gated(lagging_bn, tmp_path, capsys):
    """The reported run: `jem train --baseline` saved a model at chance (0.200) while the JEM run's
    BatchNorm statistics were recomputed (0.200 -> 0.975). The baseline now gets the same step,
    kept on the same held-out evidence, and says so in history.json and metrics.json."""
    assert main([*lagging_bn, "--out", "run"]) == 0
    out = capsys.readouterr().out
    assert "BatchNorm running statistics recomputed from the training data, held-out" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    steps = {d["step"]: d for d in metrics["post_training"]}
    assert set(steps) == {"bn_stats_from_data", "temperature"}
    bn = steps["bn_stats_from_data"]
    assert bn["kept"] and bn["before"] < 0.3 and bn["after"] > 0.8
    assert metrics["held_out"]["accuracy"] == pytest.approx(bn["after"])
    assert "near chance" not in out


def test_a_baseline_near_chance_says_why_and_how_to_fix_it(lagging_bn, tmp_path, capsys):
    """Without the step (--no-bn-stats-from-data) the held-out split is at chance while training
    accuracy is high: one warning names the lagging BatchNorm statistics and the flag that fixes it."""
    assert main([*lagging_bn, "--no-bn-stats-from-data", "--out", "run"]) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "near chance" in line)
    assert warning.startswith("jem train: warning: held-out accuracy")
    assert "BatchNorm running statistics that lag a short run" in warning and "--bn-stats-from-data" in warning
    steps = [d["step"] for d in json.loads((tmp_path / "run" / "metrics.json").read_text())["post_training"]]
    assert steps == ["temperature"]


def test_near_chance_names_another_cause_where_batchnorm_is_not_it():
    from jem_plugin.app import post_training
    from jem_plugin.extensions import Decision

    labels = torch.arange(5).repeat(20)
    line = post_training.near_chance_warning(0.21, 0.97, labels, batchnorm=False, recomputed=None, iterations=25)
    assert line is not None and "no BatchNorm layer" in line and "--bn-stats-from-data" not in line
    kept = Decision("bn_stats_from_data", True, "kept: held-out accuracy is not lower", 0.2, 0.21, 100)
    line = post_training.near_chance_warning(0.21, 0.97, labels, batchnorm=True, recomputed=kept, iterations=25)
    assert line is not None and "not the cause" in line
    assert post_training.near_chance_warning(0.6, 0.97, labels, batchnorm=True, recomputed=None, iterations=25) is None
    assert post_training.near_chance_warning(0.2, 0.4, labels, batchnorm=True, recomputed=None, iterations=25) is None


def _flag_argv(name: str, info: dict) -> list[str]:
    """A valid command-line spelling of the recipe setting ``name``."""
    flag = "--" + name.replace("_", "-")
    if info["type"] is bool:
        return [flag]
    if info["choices"]:
        return [flag, str(info["choices"][0])]
    return [flag, "2" if info["type"] is int else "0.5"]


def test_every_recipe_flag_applies_to_the_baseline_or_is_refused():
    """`--baseline --bn-stats-from-data` was accepted and ignored. Each recipe flag now either
    applies to a baseline (the optimiser, SAM, the post-training steps) or is refused."""
    from jem_plugin.app.commands.train import BASELINE_SETTINGS, _generative_only
    from jem_plugin.recipes import flat_names

    names = flat_names()
    applies = set()
    for name, info in names.items():
        args = parse_args(["train", "--baseline", *_flag_argv(name, info)])
        refused = _generative_only(args)
        if info["path"].startswith(BASELINE_SETTINGS):
            applies.add(name)
            assert refused == [], name
        else:
            assert refused == ["--" + name.replace("_", "-")], name
    assert applies == {n for n in names if n.startswith(("lr", "optimizer", "weight_decay", "warmup", "max_grad"))} | {
        "sam_rho",
        "sam_adaptive",
        "bn_stats_from_data",
    }


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--sgld-steps", "5"], "--sgld-steps"),
        (["--px-weight", "0.1", "--buffer-capacity", "100"], "--buffer-capacity, --px-weight"),
        (["--checkpoint-buffer", "none"], "--checkpoint-buffer none"),
    ],
)
def test_a_generative_flag_with_baseline_is_refused_in_one_line(flags, named, tmp_path, capsys):
    assert main(["train", "--baseline", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("jem: error: --baseline") and named in err
    assert not (tmp_path / "run").exists()


def test_the_baseline_takes_the_recipes_optimiser_sam_and_batchnorm_step(monkeypatch, tmp_path, capsys):
    """The flags that apply reach the baseline's fit: the learning rate, SAM, the BatchNorm step."""
    from jem_plugin import training
    from jem_plugin.extensions import RecomputeBatchNorm, SharpnessAware

    calls = []

    def fake_fit(jm, loader, recipe=None, *, epochs, optimizer=None, callbacks=None, **kw):
        calls.append(dict(recipe=recipe, optimizer=optimizer, callbacks=list(callbacks or [])))
        return training.History()

    monkeypatch.setattr(training, "fit", fake_fit)
    argv = ["train", "--baseline", "--lr", "0.02", "--sam-rho", "0.05", "--bn-stats-from-data", "--quiet"]
    assert main([*argv, "--recipe", "fast", "--out", str(tmp_path / "run")]) == 0
    (call,) = calls
    assert call["recipe"] is None and call["optimizer"].lr == 0.02
    sam = [c for c in call["callbacks"] if isinstance(c, SharpnessAware)]
    assert len(sam) == 1 and sam[0].rho == 0.05
    assert any(isinstance(c, RecomputeBatchNorm) for c in call["callbacks"])
    assert "SAM rho 0.05" in capsys.readouterr().out
    # `fast` has no BatchNorm step: its baseline gets none either, as its JEM run
    assert main(["train", "--baseline", "--recipe", "fast", "--quiet", "--out", str(tmp_path / "fast")]) == 0
    assert not any(isinstance(c, RecomputeBatchNorm) for c in calls[-1]["callbacks"])


def test_the_report_puts_both_runs_post_training_steps_side_by_side(tmp_path):
    """A reader of the report sees which steps each run got; runs that got different ones are named
    as not like for like, first."""
    from jem_plugin.app.report import post_training_rows, write_report

    bn = {"step": "bn_stats_from_data", "kept": True, "reason": "kept", "before": 0.2, "after": 0.975, "n_heldout": 80}
    temp = {"step": "temperature", "kept": False, "reason": "not kept", "before": 0.05, "after": 0.06, "n_heldout": 80}
    runs = {
        "baseline": {"summary": {"accuracy": 0.2}, "post_training": [temp]},
        "JEM": {"summary": {"accuracy": 0.975}, "post_training": [bn, temp]},
    }
    rows = dict(post_training_rows(runs))
    assert rows["BatchNorm running statistics recomputed from the training data"] == [
        "not run",
        "kept (held-out 0.200 -> 0.975)",
    ]
    assert rows["a temperature on the logits"] == ["not kept (held-out 0.050 -> 0.060)"] * 2
    text = write_report(tmp_path, {"runs": runs}, title="t").read_text()
    assert "Steps after training" in text and "not like for like" in text
    assert text.index("not like for like") < text.index("Accuracy: JEM")
    runs["baseline"]["post_training"] = [bn, temp]
    assert "not like for like" not in write_report(tmp_path, {"runs": runs}, title="t").read_text()


# ----------------------------------------------------------------------------- 6. closing lines that agree
def test_ece_and_temperature_are_printed_after_the_steps_that_change_the_model(lagging_bn, tmp_path, capsys):
    """`jem train` printed "ECE 0.268; no temperature fitted" before the BatchNorm line that changed
    the model. The calibration line now follows every step and is the saved model's; `jem eval` on
    the same held-out split agrees on whether a temperature was fitted."""
    assert main([*lagging_bn, "--out", "run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = {
        key: next(i for i, line in enumerate(lines) if key in line) for key in ("BatchNorm", "a temperature on", "ECE")
    }
    ece = next(i for i, line in enumerate(lines) if line.startswith("held-out calibration"))
    assert at["BatchNorm"] < at["a temperature on"] < ece
    assert "the saved model" in lines[ece]
    calibration = json.loads((tmp_path / "run" / "metrics.json").read_text())["calibration"]
    assert calibration["temperature_kept"] == ("after a temperature of" in lines[ece])
    # the network is the user's own lagbn:build, which a model file runs only when told to
    assert main(["eval", "run/model.pt", "--out", "eval.json", "--trust-factory"]) == 0
    evaluated = json.loads((tmp_path / "eval.json").read_text())
    assert evaluated["refit"]["temperature_fitted"] == calibration["temperature_fitted"]
    assert evaluated["temperature_kept"] == calibration["temperature_kept"]
    # one name, one meaning in both files: the temperature model.pt keeps, None where it keeps none
    assert evaluated["temperature"] == pytest.approx(calibration["temperature"])
    assert evaluated["accuracy"] == pytest.approx(
        json.loads((tmp_path / "run" / "metrics.json").read_text())["held_out"]["accuracy"]
    )


@pytest.fixture(scope="module")
def digits_baseline(tmp_path_factory):
    """One epoch of a digits baseline (seconds): under-confident, so jem train keeps a temperature."""
    out = tmp_path_factory.mktemp("tempered") / "run"
    assert main(["train", "--baseline", "--epochs", "1", "--out", str(out), "--quiet"]) == 0
    return out


def test_jem_eval_reports_the_model_files_temperature_and_its_refit_apart(digits_baseline, capsys):
    """`jem eval` reported its own temperature, fitted on the data it scored, as "temperature",
    beside jem train's kept one in model.pt (which jem.load applies): two values under one name.
    Now "temperature" is the model file's, its ECE the saved model's (as jem train's closing line
    gives it), and eval's own fit is under "refit", said apart on stderr."""
    import jem_plugin as jem

    calibration = json.loads((digits_baseline / "metrics.json").read_text())["calibration"]
    assert calibration["temperature_kept"]  # the premise: jem train kept one
    capsys.readouterr()
    assert main(["eval", str(digits_baseline / "model.pt")]) == 0
    captured = capsys.readouterr()
    evaluated = json.loads(captured.out)
    assert evaluated["temperature"] == pytest.approx(jem.load(digits_baseline / "model.pt").temperature)
    assert evaluated["temperature"] == pytest.approx(calibration["temperature"]) and evaluated["temperature_kept"]
    assert evaluated["ece"] == pytest.approx(calibration["ece_saved"], abs=1e-6)
    refit = evaluated["refit"]
    assert refit["temperature_fitted"] is calibration["temperature_fitted"] is True
    assert refit["temperature"] != pytest.approx(evaluated["temperature"])  # fitted on all of it, not the halves
    (line,) = [ln for ln in captured.err.splitlines() if ln.startswith("jem eval:")]
    assert f"the model's temperature {evaluated['temperature']:.2f} (kept in the model file)" in line
    assert f"refitted on this data itself, {refit['temperature']:.2f}" in line and "not saved" in line


def test_train_and_eval_agree_on_a_temperature_where_one_half_is_all_right():
    """80 held-out images, 2 wrong, both in one half: jem train's cross-fit had no temperature for the
    other half and said "no temperature fitted"; jem eval fitted one. Both now say fitted; jem
    train keeps it only where a half it was not fitted on shows it helps (here none can)."""
    from jem_plugin import calibration
    from jem_plugin.app import post_training

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (80,), generator=g)
    logits = torch.nn.functional.one_hot(y, 5).float() * 3 + 0.2 * torch.randn(80, 5, generator=g)
    for i in (1, 3):  # odd indices: the even half stays all right
        logits[i] = torch.nn.functional.one_hot((y[i] + 1) % 5, 5).float() * 3
    decision, report = post_training.choose_temperature(logits, y)
    evaluated = calibration.calibration_report(logits, y)  # what jem eval reports
    assert report["temperature_fitted"] is evaluated["temperature_fitted"] is True
    assert report["temperature_candidate"] == pytest.approx(evaluated["temperature"])
    assert not decision.kept and not report["temperature_kept"] and not report["temperature_cross_fitted"]
    assert report["temperature"] is None  # the model's, as jem eval reports a model file that keeps none
    assert "jem eval fits the same" in decision.reason
    everything_right = torch.nn.functional.one_hot(y, 5).float() * 3
    decision, report = post_training.choose_temperature(everything_right, y)
    assert report["temperature_fitted"] is calibration.calibration_report(everything_right, y)["temperature_fitted"]
    assert report["temperature_fitted"] is False and "no misclassified image" in decision.reason


def test_the_sample_quality_line_names_its_references_and_what_32_images_tell():
    """ "buffer FD 232 (init 358, held-out floor 571; 32 images)" called a reference above the
    measured value a floor, and said nothing of what 32 images can tell."""
    from jem_plugin.app.report import sample_quality_line

    q = {
        "fd_buffer": 232.0,
        "fd_init": 358.0,
        "fd_heldout_floor": 571.0,
        "fd_n_samples": 32.0,
        "judge_acc_samples": 0.41,
        "judge_acc_init": 0.3,
        "judge_acc_heldout": 0.95,
    }
    line = sample_quality_line(q)
    assert "floor" not in line.replace("not a floor", "")
    assert "the data's own held-out FD 571 (real images against real ones: a reference, not a floor" in line
    assert "the chains' init 358" in line and "below its init's, not far" in line
    assert "32 images tell a buffer that left its init from one that did not; they cannot rank two close models" in line
    assert "\n" not in line
    assert "well below its init's" in sample_quality_line(dict(q, fd_buffer=100.0))
    assert "have not moved" in sample_quality_line(dict(q, fd_buffer=400.0))


# ----------------------------------------------------------------------------- 2. sampling at the trained size
def test_the_readme_loop_then_its_sampling_line_runs():
    """After the README's loop, `jem.SGLD(steps=100).sample(jm, n=64)` raised "the input shape is
    unknown": neither JEMLoss nor jm(x) recorded the size of the batches. Now the first training
    batch does."""
    import jem_plugin as jem

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    jm = jem.wrap(model, data_range=(-1, 1))
    assert jm.trained_input_size is None and jm.domain.input_size is None
    loss_fn = jem.JEMLoss(jem.SGLD(steps=2), jem.ReplayBuffer(100, sample_shape=(1, 8, 8)), l2_weight=0.1)
    loss_fn(jm, torch.rand(16, 1, 8, 8) * 2 - 1, torch.randint(0, 10, (16,))).loss.backward()
    assert jm.trained_input_size == (1, 8, 8)
    assert jem.SGLD(steps=3).sample(jm, n=5).shape == (5, 1, 8, 8)
    # what the model file, jem.load and checkpoints hold is unchanged: the weights alone
    assert set(jm.state_dict()) == {f"model.{k}" for k in model.state_dict()}


def test_a_pretrained_size_is_not_used_silently_where_training_said_otherwise():
    """A timm resnet10t trained on 32x32 digits: jm.domain.input_size is timm's pretrained
    (1, 176, 176), and SGLD.sample(jm, y=labels) sampled at 176x176 for over 5 minutes."""
    import warnings

    import timm

    import jem_plugin as jem

    jm = jem.wrap(timm.create_model("resnet10t", num_classes=10, in_chans=1, pretrained=False))
    assert jm.domain.input_size == (1, 176, 176)
    jm.eval()
    jm(torch.zeros(2, 1, 64, 64))  # evaluation: not a training batch
    assert jm.trained_input_size is None
    jm.train()
    jm(torch.rand(4, 1, 32, 32) * 2 - 1)  # a training step's forward
    sgld = jem.SGLD(steps=1)
    with pytest.warns(UserWarning, match=r"sampling at \(1, 32, 32\).*\(1, 176, 176\)") as caught:
        assert sgld.sample(jm, y=torch.arange(3)).shape == (3, 1, 32, 32)
    assert caught[0].filename == __file__  # at the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        assert jem.SGLD(steps=1).sample(jm, n=2).shape == (2, 1, 32, 32)
        assert sgld.sample(jm, n=1, shape=(1, 48, 48)).shape == (1, 1, 48, 48)  # a shape given wins


# ----------------------------------------------------------------------------- 9. raw images in
@pytest.fixture(scope="module")
def folder_model(tmp_path_factory):
    """A model file from `jem train` on a folder of PNGs (resnet10t at 12x12, one epoch)."""
    from benchmarks.folders import write_digits_folder

    root = tmp_path_factory.mktemp("raw")
    folder = write_digits_folder(root / "train", classes=(0, 1), per_class=8, size=20)
    argv = ["train", "--baseline", "--data", f"folder:{folder}", "--image-size", "12", "--epochs", "1"]
    assert main([*argv, "--batch-size", "4", "--val-fraction", "0.25", "--out", str(root / "run"), "--quiet"]) == 0
    return folder, root / "run" / "model.pt"


def test_a_loaded_model_turns_files_pil_images_and_uint8_arrays_into_its_input(folder_model):
    """A user of `jem.load` on raw images had to read jm.domain to find the mean and std. The model
    now gives the preprocessing its training used, and it gives exactly what training fed it."""
    import numpy as np
    from PIL import Image

    import jem_plugin as jem
    from jem_plugin.app.data import image_folder

    folder, model_file = folder_model
    jm = jem.load(model_file)
    prep = jm.preprocessing()
    assert prep.size == (3, 12, 12) and "12x12" in repr(prep)
    trained = image_folder(folder, image_size=12)  # what jem train read
    path, _ = trained.samples[3]
    assert torch.allclose(prep(path), trained[3][0], atol=1e-6)
    pil = Image.open(path)
    pixels = np.asarray(pil.convert("RGB"))
    assert torch.allclose(prep(pil), prep(path)) and torch.allclose(prep(pixels), prep(path))
    batch = prep([path, pil, pixels])
    assert batch.shape == (3, 3, 12, 12) and jm(batch).shape == (3, 2)
    assert prep(pixels[None].repeat(2, 0)).shape == (2, 3, 12, 12)  # a uint8 batch (B, H, W, C)
    # and the model file's size is what sampling uses (not timm's pretrained 176x176)
    assert jm.sample_shape() == (3, 12, 12)
    assert jem.SGLD(steps=1).sample(jm, n=2).shape == (2, 3, 12, 12)


def test_wrap_gives_preprocessing_into_its_domain():
    import numpy as np

    import jem_plugin as jem
    from jem_plugin.errors import InvalidInputError

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(1, 8, 8))
    pixels = np.zeros((16, 16), dtype=np.uint8)
    pixels[:, 8:] = 255
    x = jm.preprocessing()(pixels)
    assert x.shape == (1, 8, 8) and x.min() == -1.0 and x.max() == 1.0  # 0..255 onto the range
    assert jm.preprocessing()([pixels, pixels]).shape == (2, 1, 8, 8)
    with pytest.raises(InvalidInputError, match="uint8"):
        jm.preprocessing()(pixels.astype(np.float32))
    normalised = jem.wrap(model, mean=(0.5,), std=(0.25,), input_size=(1, 4, 4))
    assert torch.allclose(normalised.preprocessing()(np.full((4, 4), 255, np.uint8)), torch.full((1, 4, 4), 2.0))
    with pytest.raises(InvalidInputError, match="input size is unknown"):
        jem.wrap(model, data_range=(-1, 1)).preprocessing()
