"""Every `jem` subcommand, end to end on tiny budgets, and its one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jem_plugin.app.cli import main


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    rc = main(["train", "--epochs", "1", "--sgld-steps", "2", "--buffer-size", "500", "--warmup-iters", "10",
               "--lr", "1e-3", "--out", str(out), "--quiet"])
    assert rc == 0
    return out


def test_train_writes_model_checkpoints_history(trained_run):
    assert (trained_run / "model.pt").is_file()
    assert list((trained_run / "checkpoints").glob("*.pt"))
    history = json.loads((trained_run / "history.json").read_text())
    assert history["epochs"][0]["iterations"] > 0
    assert (trained_run / "buffer.png").stat().st_size > 100


def test_train_resumes_from_its_checkpoints(trained_run, capsys):
    # Asking for 2 epochs in the same directory continues from epoch 1 instead of starting over.
    rc = main(["train", "--epochs", "2", "--sgld-steps", "2", "--buffer-size", "500", "--warmup-iters", "10",
               "--lr", "1e-3", "--out", str(trained_run), "--quiet"])
    assert rc == 0
    history = json.loads((trained_run / "history.json").read_text())
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]


def test_eval(trained_run, capsys, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", str(trained_run / "model.pt"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert 0.0 <= result["accuracy"] <= 1.0 and "ece_before" in result and "ece_after" in result


def test_ood(trained_run, tmp_path):
    out = tmp_path / "ood.json"
    assert main(["ood", str(trained_run / "model.pt"), "--scores", "logpx,msp", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {f"{s}/{o}" for s in ("logpx", "msp") for o in ("noise", "patches", "blends", "transposed")}
    assert all(0.0 <= r["auroc"] <= 1.0 for r in result.values())


def test_sample(trained_run, tmp_path):
    out = tmp_path / "grid.png"
    assert main(["sample", str(trained_run / "model.pt"), "--per-class", "--n", "20", "--sgld-steps", "3",
                 "--out", str(out)]) == 0
    assert out.stat().st_size > 100


def test_plugins_lists_builtins(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "jem_adapters.timm_adapter" in text and "jem_register_ood_scores" in text
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "jem_plugin.builtins.ood_scores" for r in rows)


def test_demo_smoke_writes_report(tmp_path, capsys):
    assert main(["demo", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "report:" in out and "baseline" in out
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in html and "auroc" in html
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    for name, ok in metrics["targets"].items():  # the targets, met or not, up front
        assert f"{'met' if ok else 'MISSED'}: {name.replace('_', ' ')}" in html
    assert set(metrics["runs"]) >= {"baseline", "JEM"}
    # The demo's models are ordinary model files: the post-hoc commands read them.
    assert main(["eval", str(tmp_path / "model_JEM.pt"), "--quiet"]) == 0
    evaluated = json.loads(capsys.readouterr().out)  # same test split: the same accuracy
    assert evaluated["accuracy"] == pytest.approx(metrics["runs"]["JEM"]["summary"]["accuracy"])
    assert main(["ood", str(tmp_path / "model_baseline.pt"), "--scores", "grad_norm_projected", "--quiet"]) == 0
    assert "grad_norm_projected" in capsys.readouterr().out


def test_config_file_sets_defaults_and_flags_win(tmp_path):
    from jem_plugin.app.cli import parse_args

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"epochs": 7, "sgld-steps": 3}))
    args = parse_args(["train", "--config", str(cfg), "--epochs", "2"])
    assert args.epochs == 2 and args.sgld_steps == 3
    toml = tmp_path / "c.toml"
    toml.write_text("epochs = 5\n")
    assert parse_args(["train", "--config", str(toml)]).epochs == 5


@pytest.mark.parametrize("argv, message", [
    (["eval", "does/not/exist.pt"], "no checkpoint at"),
    (["train", "--data", "cifar10:/nonexistent", "--epochs", "1"], "CIFAR-10 not found"),
    (["train", "--data", "mnist"], "unknown --data"),
    (["train", "--model", "not_a_model_anywhere"], "unknown --model"),
    (["train", "--config", "missing.json"], "does not exist"),
])
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


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """`jem plugins | head -0`: the reader is gone before jem writes (it is still importing torch)."""
    proc = subprocess.Popen([sys.executable, "-m", "jem_plugin.app.cli", "plugins", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "jem_plugin.app.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout and "plugins" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "jem_plugin.app.cli", "train", "--epochs", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid int value" in bad.stderr
