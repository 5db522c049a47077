"""Figures: every one lives in jem_plugin.viz, draws on its own Figure and leaves matplotlib's
backend alone; importing the library pulls in neither matplotlib nor torchvision."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from jem_plugin import viz
from jem_plugin.errors import InvalidInputError, InvalidScoresError

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path) -> np.ndarray:
    import matplotlib.image as mpimg

    with open(path, "rb") as f:
        assert f.read(8) == PNG
    img = mpimg.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 100 and np.std(img) > 0.05  # something drawn
    return img


def _scores(n, shift, seed):
    return np.random.default_rng(seed).normal(shift, 1.0, n)


@pytest.mark.slow
def test_ood_plots_write_pngs(tmp_path):
    s_in, near, far = _scores(300, 1.0, 0), _scores(200, 0.0, 1), _scores(200, -3.0, 2)
    h = viz.plot_histograms(s_in, {"near": near, "far": far}, str(tmp_path / "h.png"), "test")
    r = viz.plot_roc(torch.as_tensor(s_in), {"near": near, "far": far}, str(tmp_path / "r.png"))
    single = viz.plot_histograms(s_in, near, str(tmp_path / "s.png"))
    assert (h, r, single) == tuple(str(tmp_path / n) for n in ("h.png", "r.png", "s.png"))
    for p in (h, r, single):
        _png(p)
    with pytest.raises(InvalidScoresError, match="empty dict"):
        viz.plot_roc(s_in, {}, str(tmp_path / "x.png"))
    with pytest.raises(InvalidScoresError, match="non-finite"):
        viz.plot_histograms([0.0, float("nan")], near, str(tmp_path / "x.png"))


def test_reliability_diagram_png(tmp_path):
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(2000, 10, generator=g)
    labels = torch.randint(0, 10, (2000,), generator=g)
    path = viz.reliability_diagram(logits, labels, str(tmp_path / "rel.png"), title="overconfident", from_logits=True)
    assert path == str(tmp_path / "rel.png")
    _png(path)


def test_robust_accuracy_plot_one_or_several_results(tmp_path):
    base = {"eps": [0.0, 0.1, 0.3], "accuracy": [0.95, 0.5, 0.1], "norm": "linf", "attack": "pgd"}
    defended = {**base, "accuracy": [0.9, 0.7, 0.3], "attack": "pgd-bpda-eot1"}
    _png(
        viz.plot_robust_accuracy(
            {"baseline": base, "defence": defended}, str(tmp_path / "r.png"), "test", eps_scale=255
        )
    )
    _png(viz.plot_robust_accuracy(base, str(tmp_path / "single.png")))
    with pytest.raises(ValueError, match="empty"):
        viz.plot_robust_accuracy({}, str(tmp_path / "x.png"))


def test_save_samples_refuses_what_is_not_a_batch_of_images(tmp_path):
    for shape in ((8, 2), (8, 2, 8, 8), (1, 8, 8)):  # 2D points, two channels, one unbatched image
        with pytest.raises(InvalidInputError, match=r"\[B, 1 or 3, H, W\]"):
            viz.save_samples(torch.zeros(shape), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_functions_left_the_science_modules():
    from jem_plugin import buffer, calibration, ood, robustness

    for mod, name in (
        (ood, "plot_histograms"),
        (ood, "plot_roc"),
        (calibration, "reliability_diagram"),
        (robustness, "plot_robust_accuracy"),
        (robustness, "plot_curve"),
    ):
        assert not hasattr(mod, name), f"{mod.__name__}.{name}"
    assert "matplotlib" not in open(buffer.__file__).read()


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_importing_the_library_imports_neither_matplotlib_nor_torchvision():
    res = _run("""
        import importlib, json, pkgutil, sys
        import jem_plugin
        core = [m.name for m in pkgutil.iter_modules(jem_plugin.__path__)
                if m.name not in ("viz", "app", "integrations", "builtins")]
        for name in core:
            importlib.import_module("jem_plugin." + name)
        print(json.dumps({"core": core, "loaded": [m for m in ("matplotlib", "torchvision") if m in sys.modules]}))
    """)
    assert {"training", "distributed", "ood", "calibration", "robustness", "buffer"} <= set(res["core"])
    assert res["loaded"] == []


@pytest.mark.slow
def test_viz_never_changes_the_backend_nor_uses_pyplot(tmp_path):
    res = _run(f"""
        import json, sys
        import matplotlib
        matplotlib.use("svg")  # a user's (non-Agg) choice, as a notebook would have its own
        import numpy as np, torch
        from jem_plugin import viz
        from jem_plugin.buffer import ReplayBuffer
        from jem_plugin.adapter import InputDomain
        out = {str(tmp_path)!r}
        s = np.linspace(0, 1, 50)
        viz.plot_histograms(s, s - 0.5, out + "/h.png")
        viz.plot_roc(s, s - 0.5, out + "/r.png")
        viz.reliability_diagram(torch.randn(50, 3), torch.randint(0, 3, (50,)), out + "/c.png", from_logits=True)
        viz.plot_robust_accuracy({{"eps": [0, 1], "accuracy": [1, 0]}}, out + "/a.png")
        viz.plot_training_curves({{"loss": [3, 2, 1], "acc": [0.1, 0.5, 0.9]}}, out + "/t.png")
        viz.save_image_grid(torch.rand(8, 1, 8, 8) * 2 - 1, out + "/g.png")
        viz.plot_density_2d(out + "/d.png", true=lambda x: -(x ** 2).sum(1), n=20)
        buf = ReplayBuffer(16, (1, 8, 8))
        buf.sample(8, domain=InputDomain())
        viz.save_samples(buf.samples(8), out + "/b.png", domain=InputDomain())
        print(json.dumps({{"pyplot": "matplotlib.pyplot" in sys.modules, "backend": matplotlib.get_backend()}}))
    """)
    assert res == {"pyplot": False, "backend": "svg"}
    for name in "hrcatgdb":
        with open(tmp_path / f"{name}.png", "rb") as f:
            assert f.read(8) == PNG, name


@pytest.fixture
def drawn(monkeypatch):
    """The figures ``viz`` saves during the test, in order (each still drawable)."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def keep_and_save(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_and_save)
    return figures


def _title_inside(fig, needle: str):
    """The text of ``fig`` containing ``needle``, asserted to lie inside the figure's frame."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    renderer = FigureCanvasAgg(fig).get_renderer()
    (title,) = [t for t in fig.findobj(Text) if needle in t.get_text()]
    box, frame = title.get_window_extent(renderer), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1, (box, frame)
    return title


@pytest.mark.parametrize("n_sets", [1, 2, 6])
def test_the_ood_heat_map_title_stays_inside_the_figure(n_sets, tmp_path, drawn):
    """`jem ood` on a run with one OOD set drew "model.pt: AUROC per score and OOD" clipped at the
    right edge: the title sat over the one-column axes, narrower than the text."""
    rows = [{"score": s, "set": f"set{j}", "auroc": 0.5 + 0.05 * i} for i, s in enumerate("abc") for j in range(n_sets)]
    viz.plot_ood_table(rows, str(tmp_path / "t.png"), title="a_long_checkpoint_name.pt: AUROC per score and OOD set")
    _title_inside(drawn[0], "AUROC per score")


@pytest.mark.parametrize("n_scores", [3, 55])
def test_the_ood_heat_map_title_stays_clear_of_the_table(n_scores, tmp_path, drawn):
    """bench_posthoc's heat maps (55 scores beside pytorch-ood's) drew their title over the top row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    rows = [
        {"score": f"s{i:02d}", "set": f"set{j}", "auroc": 0.5 + 0.005 * i} for i in range(n_scores) for j in range(6)
    ]
    viz.plot_ood_table(rows, str(tmp_path / "t.png"), title="resnet10t: AUROC per score and OOD set")
    fig = drawn[0]
    renderer = FigureCanvasAgg(fig).get_renderer()
    title = _title_inside(fig, "AUROC per score").get_window_extent(renderer)
    table = fig.axes[0].get_window_extent(renderer)
    assert title.y0 >= table.y1, (title, table)


def test_a_long_title_is_wrapped_inside_the_reliability_diagram(tmp_path, drawn):
    """`jem eval` titles its diagram with the checkpoint and the data ("model.pt on folder:...,
    the 0.2 held out from training: reliability"): the title ran off both edges."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(200, 4, generator=g) * 3, torch.randint(0, 4, (200,), generator=g)
    long = "model.pt on folder:/home/someone/datasets/digits, the 0.2 held out from training: reliability"
    viz.reliability_diagram(logits, labels, str(tmp_path / "r.png"), title=long, from_logits=True)
    title = _title_inside(drawn[0], "held out")
    assert title.get_text().replace("\n", " ") == long  # wrapped, not cut
