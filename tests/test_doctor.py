"""`jem doctor`: the report a user reads, the torch/torchvision mismatch caught before any training,
the one-line device errors, the JSON file, and the self-test's checks on the CPU."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from jem_plugin.app import doctor
from jem_plugin.app.cli import main
from jem_plugin.app.commands import demo as demo_command
from jem_plugin.app.commands import train as train_command
from jem_plugin.app.nets import WideResNet

NMS = "operator torchvision::nms does not exist"


def _broken_torchvision():
    raise RuntimeError(NMS)


@pytest.fixture(scope="module")
def report():
    return doctor.run_doctor(device="cpu", seconds=0)


def test_report_names_the_versions_and_the_devices(report):
    import torchvision

    assert set(report) == {"install", "devices", "device", "self_test", "ok"}
    v = report["install"]["versions"]
    assert v == {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": importlib.metadata.version("timm"),
        "pluggy": importlib.metadata.version("pluggy"),
    }
    assert report["install"]["problems"] == [] and report["ok"] is True
    assert report["install"]["torch_cuda"] == torch.version.cuda
    assert report["devices"]["cpu"]["cores"] >= 1 and report["devices"]["cpu"]["torch_threads"] == 1
    assert len(report["devices"]["cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["device"] == "cpu" and set(report["self_test"]) == set(doctor.CHECKS)
    json.dumps(report)  # what --json writes


def test_cpu_self_test_checks_pass(report):
    checks = report["self_test"]
    assert checks["cuda_graph"]["status"] == "skipped" and checks["cuda_graph"]["detail"] == "needs a CUDA device"
    assert checks["autocast_channels_last"]["status"] == "ok", checks["autocast_channels_last"]["detail"]
    assert checks["generator"]["status"] == "ok", checks["generator"]["detail"]
    assert checks["timing"] == {"status": "skipped", "detail": "--seconds 0", "seconds": 0.0}
    assert all("\n" not in c["detail"] for c in checks.values())


def test_timing_reports_iterations_per_second_against_the_flop_floor():
    t = doctor.check_timing(torch.device("cpu"), seconds=0.01, batch=16, sgld_steps=1)
    assert t["status"] in ("ok", "warning") and t["iterations_timed"] >= 1 and t["iterations_per_s"] > 0
    # 1 chain step (forward + input gradient of 16) and the training step (forward + backward of 32)
    assert t["iteration_gflop"] * 1e9 == doctor.iteration_flops(lambda: WideResNet(10, 1), 16, 16, 1)
    assert t["matmul_tflops"] > 0 and math.isfinite(t["x_floor"]) and t["x_floor"] > 0
    assert "x its FLOP floor" in t["detail"] and "\n" not in t["detail"]


def test_one_failing_check_does_not_stop_the_others(monkeypatch):
    def boom(device):
        raise RuntimeError("no kernel image is available\nsecond line")

    monkeypatch.setitem(doctor.CHECKS, "generator", boom)
    checks = doctor.self_test("cpu", seconds=0)
    assert checks["generator"]["status"] == "failed"
    assert checks["generator"]["detail"] == "RuntimeError: no kernel image is available"
    assert checks["autocast_channels_last"]["status"] == "ok"


def test_doctor_reports_a_torchvision_that_fails_to_import(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "check_torchvision_import", _broken_torchvision)
    assert main(["doctor", "--device", "cpu", "--seconds", "0"]) == 1
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if "PROBLEM" in ln]
    base = torch.__version__.partition("+")[0]
    assert NMS in line and f"pip install torch=={base} " in line and "torchvision" in line
    assert "MISMATCH" in out


@pytest.mark.parametrize("command", ["demo", "train"])
def test_mismatch_stops_demo_and_train_before_any_training(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(doctor, "check_torchvision_import", _broken_torchvision)

    def trained(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(demo_command, "run_digits_demo", trained)
    monkeypatch.setattr(train_command.training, "fit", trained)
    monkeypatch.setattr(train_command.jdist, "init_distributed", trained)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main([command, "--out", str(out), "--quiet"] + (["--smoke"] if command == "demo" else ["--epochs", "1"]))
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert rc == 2 and elapsed < 1.0
    assert err.count("\n") == 1 and err.startswith("jem: error: torchvision ") and NMS in err
    assert "pip install torch==" in err
    assert not out.exists()  # no model, no checkpoint, no report


def test_torchvision_for_cuda_beside_a_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(doctor, "check_torchvision_import", lambda: 12040)
    monkeypatch.setattr(torch.version, "cuda", None)
    [problem] = doctor.install_report(full=False)["problems"]
    assert "built for CUDA 12.4 but torch" in problem and "CPU-only" in problem and "pip install torch==" in problem
    monkeypatch.setattr(torch.version, "cuda", "11.8")
    [problem] = doctor.install_report(full=False)["problems"]
    assert "CUDA 12.4, torch" in problem and "for CUDA 11.8" in problem


def test_torchvision_pinned_to_another_torch(monkeypatch):
    real = importlib.metadata.requires
    monkeypatch.setattr(
        importlib.metadata, "requires", lambda name: ["torch==1.99.0"] if name == "torchvision" else real(name)
    )
    [problem] = doctor.install_report(full=False)["problems"]
    assert "was built for torch==1.99.0" in problem and f"not torch {torch.__version__}" in problem


def test_fix_names_the_matching_pair_and_the_index():
    assert doctor._fix("2.5.1+cpu") == (
        "pip uninstall -y torchvision && "
        'pip install torch==2.5.1 "torchvision==0.20.*" --index-url https://download.pytorch.org/whl/cpu'
    )
    assert doctor._fix("2.4.0+cu121").endswith("/whl/cu121") and doctor._fix("2.4.0", installed=False) == (
        'pip install torch==2.4.0 "torchvision==0.19.*"'
    )


def _fake_wheel(folder: pathlib.Path, name: str, version: str, requires: str | None = None) -> None:
    """A wheel with metadata only: what pip reads to resolve, install and uninstall it."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + (f"Requires-Dist: {requires}\n" if requires else ""),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    project = folder / name
    project.mkdir(parents=True, exist_ok=True)
    wheel = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(project / wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")


@pytest.mark.slow
def test_the_printed_fix_replaces_a_torchvision_built_for_cuda_beside_a_cpu_torch(tmp_path, monkeypatch):
    # The PyTorch CPU index as pip sees it, in miniature: two torch releases and the torchvision
    # made for each; plus the CUDA build of torchvision that a plain `pip install` brought in.
    index, cuda_build = tmp_path / "simple", tmp_path / "cu130"
    for version in ("2.13.0", "2.13.1"):
        _fake_wheel(index, "torch", f"{version}+cpu")
        _fake_wheel(index, "torchvision", f"0.28.{version[-1]}+cpu", requires=f"torch=={version}")
    _fake_wheel(cuda_build, "torchvision", "0.28.0+cu130", requires="torch==2.13.0")
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "--no-input"]
    offline = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    wheels = [index / "torch/torch-2.13.0+cpu-py3-none-any.whl", *cuda_build.glob("torchvision/*.whl")]
    subprocess.run([*pip, "install", "-q", "--no-deps", *map(str, wheels)], check=True, env=offline)

    def installed() -> dict[str, str]:
        return {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[site])}

    assert installed() == {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cu130"}
    # What jem doctor reads of that install: its metadata, and the CUDA version of its operators.
    monkeypatch.syspath_prepend(site)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(doctor, "_torchvision_version", lambda: doctor._version("torchvision"))
    monkeypatch.setattr(doctor, "check_torchvision_import", lambda: 13000)
    [problem] = doctor.install_report(full=False)["problems"]
    assert "torchvision 0.28.0+cu130 is built for CUDA 13.0 but torch 2.13.0+cpu is CPU-only" in problem
    fix = problem.split("from one index: ", 1)[1]
    for command in fix.split(" && "):  # run as printed, pip pointed at the venv and the index at the copy
        words = shlex.split(command)
        assert words[0] == "pip"
        if "--index-url" in words:
            at = words.index("--index-url") + 1
            assert words[at] == "https://download.pytorch.org/whl/cpu"
            words[at] = index.as_uri()
        subprocess.run([*pip, *words[1:]], check=True, env=offline, capture_output=True)
    assert installed() == {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}


@pytest.mark.slow
def test_precheck_is_cheap_and_leaves_torchvision_unimported():
    code = (
        "import sys, time; from jem_plugin.app import doctor; t = time.perf_counter(); "
        "p = doctor.install_problem(); print(p, time.perf_counter() - t, 'torchvision' in sys.modules)"
    )
    problem, seconds, imported = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert problem == "None" and float(seconds) < 1.0 and imported == "False"


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_missing_device_is_one_line_and_exit_2(device, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert main(["doctor", "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"jem: error: --device {device}") and "use --device cpu" in captured.err


def test_json_writes_the_report(tmp_path, capsys):
    path = tmp_path / "sub" / "doctor.json"
    assert main(["doctor", "--device", "cpu", "--seconds", "0", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert set(data) == {"install", "devices", "device", "self_test", "ok"} and data["ok"] is True
    assert all(c["status"] in ("ok", "skipped") and c["detail"] for c in data["self_test"].values())
    out = capsys.readouterr().out
    assert "they match" in out and f"report: {path}" in out and "all good" in out
