"""The user's paths on a GPU, end to end: `jem train/eval/ood/sample --device cuda`, `jem.load` onto
the GPU, `jem.fit` with a recipe on a CUDA model, and the post-hoc detectors (feature maps
included) on a timm network on the GPU, each against the same computation on the CPU.

Every test here needs a CUDA device and skips with a reason without one (CI has none); the same
helpers run on the CPU in ``test_the_end_to_end_helpers_run_on_the_cpu`` so what they ask of the
library is checked where CI runs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import cuda
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.app import data as D
from jem_plugin.app.cli import main
from jem_plugin.errors import UntrainedDensityWarning
from jem_plugin.recipes import get_recipe

timm = pytest.importorskip("timm")


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 without TF32, so GPU scores can be compared with the CPU's at a tight tolerance."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def _cli_run(root, device: str, *train_args: str) -> dict:
    """`jem train` for one short epoch, then `eval`, `ood` and `sample` on its model file, all on
    ``device``; returns eval's report."""
    run = root / "run"
    common = ["--device", device, "--quiet"]
    argv = ["train", "--recipe", "fast", "--epochs", "1", "--sgld-steps", "2", "--buffer-capacity", "200"]
    assert main([*argv, *train_args, *common, "--out", str(run)]) == 0
    model = run / "model.pt"
    assert model.is_file() and (run / "metrics.json").is_file()
    assert main(["eval", str(model), *common, "--out", str(root / "eval.json")]) == 0
    report = json.loads((root / "eval.json").read_text())
    assert main(["ood", str(model), *common, "--out", str(root / "ood.json")]) == 0
    assert json.loads((root / "ood.json").read_text())
    assert main(["sample", str(model), *common, "--sgld-steps", "2", "--n", "16"]) == 0
    assert (run / "model_samples.png").is_file()
    per_class = ["--per-class", "--from-buffer", "--no-check", "--out", str(root / "per_class.png")]
    assert main(["sample", str(model), *common, "--sgld-steps", "2", "--n", "20", *per_class]) == 0
    assert (root / "per_class.png").is_file()
    return report


def _fit_with_recipe(device: str) -> jem.JEM:
    """One epoch of the ``fast`` recipe through ``jem.fit`` on a timm ResNet on ``device``."""
    torch.manual_seed(0)
    x = torch.rand(64, 3, 16, 16, device=device) * 2 - 1
    y = torch.arange(64, device=device) % 4
    net = timm.create_model("test_resnet", num_classes=4, pretrained=False).to(device)
    jm = jem.wrap(net, data_range=(-1.0, 1.0), input_size=(3, 16, 16), num_classes=4)
    recipe = get_recipe("fast").replace(sgld_steps=2, buffer_capacity=64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    history = jem.fit(jm, loader, recipe, epochs=1, options=jem.FitOptions(progress=False))
    assert len(history.epochs) == 1 and all(torch.isfinite(torch.tensor(v)) for v in history.epochs[0].values())
    return jm


def _timm_scores(device: str) -> dict[str, torch.Tensor]:
    """Every registered score on an (untrained, seeded) timm ResNet on ``device``, moved to the
    CPU. The SGLD scores are left out: their chains draw from ``device``'s generator, and the CPU's
    and the GPU's draw different numbers from one seed."""
    torch.manual_seed(0)
    net = timm.create_model("test_resnet", num_classes=5, pretrained=False).eval().to(device)
    jm = jem.wrap(net, input_size=(3, 32, 32))
    g = torch.Generator().manual_seed(1)
    x = torch.rand(12, 3, 32, 32, generator=g).to(device)
    # 300 fitting images for 96 features: a well-conditioned covariance, so the Mahalanobis scores
    # do not amplify the last bits in which the devices differ
    fit = (torch.rand(300, 3, 32, 32, generator=g).to(device), (torch.arange(300) % 5).to(device))
    maps, to_logits = jm.feature_maps(x)
    assert maps.device.type == torch.device(device).type
    torch.testing.assert_close(to_logits(maps), net(x))
    # rankfeat on 64x64: at 32x32 this stride-32 net's last maps are 1x1, which rankfeat refuses
    x64 = torch.rand(12, 3, 64, 64, generator=g).to(device)
    out = {}
    for method in ood.available_scores():
        if method.endswith("_sgld") or method == "mcd":  # mcd: timm's test_resnet has no dropout
            continue
        kw: dict = {"fit_data": fit} if ood.score_info(method)["needs_fit"] else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UntrainedDensityWarning)  # an untrained net, on purpose
            s = ood.score(jm, x64 if method == "rankfeat" else x, method, progress=False, **kw)
        assert s.shape == (12,) and s.device.type == torch.device(device).type and torch.isfinite(s).all(), method
        out[method] = s.cpu()
    return out


@pytest.mark.slow
def test_the_end_to_end_helpers_run_on_the_cpu(tmp_path):
    report = _cli_run(tmp_path, "cpu")
    assert 0.0 <= report["accuracy"] <= 1.0
    _fit_with_recipe("cpu")
    assert "ash" in _timm_scores("cpu")


@cuda
@pytest.mark.slow
def test_the_cli_trains_evaluates_scores_and_samples_on_cuda(tmp_path):
    report = _cli_run(tmp_path, "cuda")
    assert 0.0 <= report["accuracy"] <= 1.0
    jm = jem.load(tmp_path / "run" / "model.pt", device="cuda")
    on_cpu = jem.load(tmp_path / "run" / "model.pt")
    assert next(jm.parameters()).is_cuda
    ds = D.load_digits("test", seed=0)
    x = torch.stack([ds[i][0] for i in range(32)])
    with torch.no_grad():
        torch.testing.assert_close(jm(x.cuda()).cpu(), on_cpu(x), rtol=1e-3, atol=1e-3)


@cuda
@pytest.mark.slow
def test_a_timm_network_trains_under_bf16_and_channels_last_and_is_scored_by_every_detector(tmp_path):
    """What a GPU user types: a timm CNN, bf16 autocast, channels_last; then every score at once."""
    _cli_run(tmp_path, "cuda", "--model", "resnet10t", "--image-size", "32", "--amp", "bf16", "--channels-last")
    model = tmp_path / "run" / "model.pt"
    out = tmp_path / "all.json"
    assert main(["ood", str(model), "--device", "cuda", "--quiet", "--scores", "all", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    scores = {key.split("/")[0] for key in table}
    assert scores >= {"logpx", "ash", "scale", "gmm", "vim", "knn", "mahalanobis_odin"}, scores
    # every score ran to a number, but two that say why in their rows: mcd (this network has no
    # dropout) and rankfeat (resnet10t's last maps are 1x1 at 32x32, so it would score a constant)
    expected = {"mcd": "no dropout layer", "rankfeat": "NoFeaturesError"}
    failed = {key for key, row in table.items() if "auroc" not in row}
    assert {key.split("/")[0] for key in failed} <= set(expected), {key: table[key] for key in failed}
    assert all(expected[key.split("/")[0]] in table[key]["reason"] for key in failed), failed
    assert all(0.0 <= row["auroc"] <= 1.0 for key, row in table.items() if key not in failed), table
    assert (tmp_path / "all.csv").is_file() and (tmp_path / "all.png").is_file()


@cuda
@pytest.mark.slow
def test_jem_train_as_first_typed_runs_its_post_training_steps_on_cuda(tmp_path):
    """The default recipe's extra steps (BatchNorm statistics from data, the temperature, the
    sample-quality judge), each decided on held-out data, on the GPU."""
    argv = ["train", "--epochs", "1", "--sgld-steps", "2", "--device", "cuda", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= metrics["held_out"]["accuracy"] <= 1.0
    assert metrics["post_training"] and all(isinstance(step["kept"], bool) for step in metrics["post_training"])
    assert metrics["sample_quality"]["fd_buffer"] > 0


@cuda
def test_fit_with_a_recipe_trains_a_cuda_model_and_keeps_it_there():
    jm = _fit_with_recipe("cuda")
    assert all(p.is_cuda for p in jm.parameters())


@cuda
def test_every_post_hoc_score_on_a_timm_network_on_cuda_matches_the_cpu(exact_fp32):
    on_gpu, on_cpu = _timm_scores("cuda"), _timm_scores("cpu")
    assert on_gpu.keys() == on_cpu.keys()
    for method in on_cpu:
        torch.testing.assert_close(
            on_gpu[method], on_cpu[method], rtol=2e-3, atol=2e-3, msg=lambda m, method=method: f"{method}: {m}"
        )
