"""benchmarks/check_simple_inputs.py: where a long-row checkpoint's log p(x) puts simple inputs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_generative as G
from benchmarks import check_simple_inputs as C
from benchmarks.bench_generalisation import OOD_NAMES
from jem_plugin.checkpoint import save_checkpoint


def test_simple_inputs_are_what_they_say_in_the_datas_normalisation():
    mean, std = torch.tensor(G.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(G.IMAGENET_STD).view(1, 3, 1, 1)
    x = (torch.rand(5, 3, 16, 16) - mean) / std
    sets = {k: v * std + mean for k, v in C.simple_inputs(x).items()}  # back to [0, 1]
    assert all(v.shape == x.shape for v in sets.values())
    assert torch.allclose(sets["constant grey 0.5"], torch.full_like(x, 0.5), atol=1e-6)
    assert float(sets["constant colours"].std(dim=(2, 3)).max()) < 1e-6  # one colour per image
    grey = sets["test in grey"]
    assert torch.allclose(grey[:, 0], grey[:, 1], atol=1e-6) and torch.allclose(grey[:, 1], grey[:, 2], atol=1e-6)


@pytest.mark.slow
def test_a_checkpoint_is_ranked_with_both_batchnorm_statistics(tmp_path, capsys):
    torch.manual_seed(0)
    model = G.make_model("test_resnet")
    path = tmp_path / "cell.pt"
    save_checkpoint(path, model=model)
    out = C.check(str(path), "textures", "test_resnet", tiny=True, with_complexity=True)
    complexity = {k: out.pop(k) for k in ("complexity_as_trained", "complexity_from_data")}
    assert set(out) == {"as_trained", "from_data"}
    # the PNG lengths do not depend on the statistics; log p(x) does
    first, second = complexity.values()
    assert all(first[k]["auroc_bits"] == second[k]["auroc_bits"] for k in OOD_NAMES)
    assert first["test"]["logpx_mean"] != second["test"]["logpx_mean"]
    assert "| test split (from data) |" in C.complexity_markdown(complexity)
    for ranks in out.values():
        assert set(OOD_NAMES) <= set(ranks) and "constant grey 0.5" in ranks
        assert all(0.0 <= v <= 1.0 for v in ranks.values())
    assert out["as_trained"] != out["from_data"]  # the statistics were recomputed


def _normalised(u: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(G.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(G.IMAGENET_STD).view(1, 3, 1, 1)
    return (u - mean) / std


def test_serra_score_is_the_compressed_length_when_log_px_cannot_tell_the_sets_apart():
    # a network whose log p(x) is the same everywhere: the corrected score ranks by PNG length alone,
    # busy images (the test split here) above flat ones
    g = torch.Generator().manual_seed(0)
    busy = _normalised(torch.rand(12, 3, 16, 16, generator=g))
    flat = _normalised(torch.rand(12, 3, 1, 1, generator=g).expand(-1, -1, 16, 16))
    assert (C.png_bits(flat).max() < C.png_bits(busy).min()).item()
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 4))
    torch.nn.init.zeros_(net[1].weight)
    out = C.complexity(net, {"wrap_kw": {}, "xt": busy, "ood": {"flat": flat}})
    assert out["flat"]["auroc_logpx"] == pytest.approx(0.5)
    assert out["flat"]["auroc_bits"] == out["flat"]["auroc_serra"] == 1.0
    assert out["test"]["logpx_sd"] == pytest.approx(0.0, abs=1e-6)
    assert out["test"]["bits_mean"] > 4 * out["flat"]["bits_mean"]
