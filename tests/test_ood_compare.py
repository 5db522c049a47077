"""evaluate_all as one call comparing every OOD score: the table, fit-able detectors, failures, the figure."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import TinyCNN
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin import ood
from jem_plugin.errors import InvalidInputError, UnknownNameError

CALLS: list[str] = []


class CentreDistance:
    """A fit-able test detector: minus the distance of the logits to their training mean."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale, self.centre = scale, None

    def fit(self, jm, data, batch_size=256, progress=None):
        loader = data.split(batch_size) if isinstance(data, torch.Tensor) else (b[0] for b in data)
        with torch.no_grad():
            total, n = 0.0, 0
            for x in loader:  # streams: one batch at a time
                z = jm.logits(x)
                total, n = total + z.sum(0), n + len(z)
        self.centre = total / n
        return self

    def score(self, jm, x):
        CALLS.append("centre")
        return -self.scale * (jm.logits(x) - self.centre).norm(dim=1)


class Broken(CentreDistance):
    def score(self, jm, x):
        raise RuntimeError("detector exploded\nsecond line of the traceback text")


def nan_score(jm, x):
    s = jm.logits(x)[:, 0].clone()
    s[0] = float("nan")
    return s


class TestPlugin:
    @jem.hookimpl
    def jem_register_ood_scores(self, register):
        register("t_centre", CentreDistance, needs_grad=False, needs_fit=True, description="test: centre distance")
        register("t_broken", Broken, needs_grad=False, needs_fit=True, description="test: raises")
        register("t_nan", nan_score, needs_grad=False, description="test: one NaN per batch")


@pytest.fixture
def plugin():
    jem.register(TestPlugin(), name="ood-compare-test")
    CALLS.clear()
    yield
    jem.unregister(name="ood-compare-test")


@pytest.fixture
def jm():
    torch.manual_seed(0)
    m = TinyCNN()
    with torch.no_grad():
        m.head.weight.mul_(20.0)
    return jem.wrap(m, data_range=(0.0, 1.0), input_size=(1, 8, 8))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(1)
    x_train = torch.rand(96, 1, 8, 8, generator=g) * 0.5
    x_in = torch.rand(48, 1, 8, 8, generator=g) * 0.5
    far = 0.5 + 0.5 * torch.rand(40, 1, 8, 8, generator=g)
    mid = torch.rand(32, 1, 8, 8, generator=g)
    return x_train, x_in, {"far": DataLoader(TensorDataset(far), batch_size=16), "mid": mid}


def test_table_of_every_score_with_fit_data(plugin, jm, data, tmp_path):
    x_train, x_in, outs = data
    methods = ["logpx", "msp", "t_centre", "t_broken", "t_nan"]
    table = ood.evaluate_all(
        jm, x_in, outs, methods, fit_data=DataLoader(TensorDataset(x_train, x_train[:, 0, 0, 0]), batch_size=32)
    )
    # It is the old mapping for what was measured ...
    assert isinstance(table, dict) and set(table) == {"logpx", "msp", "t_centre"}
    assert table["logpx"]["far"] == ood.evaluate(ood.score(jm, x_in), ood.score(jm, outs["far"]))
    jm.eval()  # evaluate_all fits and scores in eval mode
    det = CentreDistance().fit(jm, x_train)
    assert table["t_centre"]["mid"] == ood.evaluate(det.score(jm, x_in), det.score(jm, outs["mid"]))
    assert json.loads(json.dumps(table)) == table
    # ... and every requested pair is a row, failures with a one-line reason.
    rows = table.rows()
    assert len(rows) == len(methods) * 2 and {r["set"] for r in rows} == {"far", "mid"}
    by = {(r["score"], r["set"]): r for r in rows}
    assert by[("t_broken", "far")]["status"] == "failed"
    assert by[("t_broken", "far")]["reason"] == "RuntimeError: detector exploded"
    assert by[("t_nan", "mid")]["status"] == "non-finite" and "NaN/inf" in by[("t_nan", "mid")]["reason"]
    assert all(r["status"] == "ok" and 0 <= r["auroc"] <= 1 for r in rows if r["score"] in table)
    assert table.timing["t_centre"]["seconds_per_1000"] > 0 and table.timing["t_centre"]["fit_seconds"] > 0
    assert table.timing["t_centre"]["n_images"] == 48 + 40 + 32
    # best per set, marked in the text table and the CSV
    best = table.best()
    for s in ("far", "mid"):
        assert table[best[s]][s]["auroc"] == max(table[m][s]["auroc"] for m in table)
    assert table.best("fpr95")["far"] in table
    text = str(table)
    lines = {line.split()[0]: line for line in text.splitlines()[2:] if line.strip()}
    assert "*" in lines[best["far"]] and "FAIL" in lines["t_broken"] and "NaN" in lines["t_nan"]
    assert "t_broken: failed: RuntimeError: detector exploded" in text
    path = table.to_csv(tmp_path / "t.csv")
    read = list(csv.DictReader(open(path)))
    assert len(read) == len(rows) and {r["status"] for r in read} == {"ok", "failed", "non-finite"}
    assert [r["best"] for r in read if r["score"] == best["mid"] and r["set"] == "mid"] == ["True"]
    assert set(table.mean()) == {"logpx", "msp", "t_centre"}


def test_all_lists_fit_able_scores_as_skipped_without_fit_data(plugin, jm, data):
    _, x_in, outs = data
    table = ood.evaluate_all(jm, x_in, {"mid": outs["mid"]}, progress=False)  # default: "all"
    names = {r["score"] for r in table.rows()}
    assert names == set(ood.available_scores())
    skipped = {r["score"] for r in table.rows() if r["status"] == "skipped"}
    assert {"t_centre", "t_broken"} <= skipped and "logpx" not in skipped
    assert table.failures()["t_centre"] == "skipped: needs fit_data (in-distribution training data) to be fitted"
    assert "skip" in str(table) and not CALLS


def test_unknown_names_fail_before_any_scoring(plugin, jm, data):
    x_train, x_in, outs = data
    with pytest.raises(UnknownNameError, match=r"unknown OOD scores 'nope', 'nada'; available: .*logpx.*t_centre"):
        ood.evaluate_all(jm, x_in, outs, ["t_centre", "nope", "nada"], fit_data=x_train)
    with pytest.raises(UnknownNameError, match="'zap'"):
        ood.evaluate_all(jm, x_in, outs, "logpx,zap")
    with pytest.raises(TypeError, match="temperature"):  # a bad option is an error too, not a failed row
        ood.evaluate_all(
            jm, x_in, outs, ["t_centre", "max_logit"], fit_data=x_train, method_kwargs={"max_logit": {"temperature": 2}}
        )
    assert not CALLS
    with pytest.raises(ValueError, match="not 'in'"):
        ood.evaluate_all(jm, x_in, {"in": x_in}, "logpx")
    with pytest.raises(InvalidInputError, match="empty"):  # bad data is not a detector's failure
        ood.evaluate_all(jm, [], outs, "logpx")


def test_detector_options_and_the_scores(plugin, jm, data):
    x_train, x_in, outs = data
    table = ood.evaluate_all(jm, x_in, outs, "t_centre", fit_data=x_train, method_kwargs={"t_centre": {"scale": 2.0}})
    det = CentreDistance(scale=2.0).fit(jm.eval(), x_train)
    torch.testing.assert_close(table.scores["t_centre"]["in"], det.score(jm, x_in))
    assert set(table.scores["t_centre"]) == {"in", "far", "mid"} and list(table) == ["t_centre"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'return_scores'"):
        ood.evaluate_all(jm, x_in, outs, "t_centre", return_scores=True)


def test_heat_map_figure(plugin, jm, data, tmp_path):
    from jem_plugin.viz import plot_ood_table

    x_train, x_in, outs = data
    table = ood.evaluate_all(
        jm, x_in, outs, ["logpx", "msp", "max_logit", "t_centre", "t_broken", "t_nan"], fit_data=x_train
    )
    path = plot_ood_table(table, str(tmp_path / "heat.png"), title="test")
    assert (tmp_path / "heat.png").stat().st_size > 2000 and path.endswith("heat.png")
    plot_ood_table(dict(table), str(tmp_path / "plain.png"))  # a plain {score: {set: metrics}} too
    plot_ood_table(table, str(tmp_path / "fpr.png"), metric="fpr95")
    with pytest.raises(ValueError, match="empty"):
        plot_ood_table({}, str(tmp_path / "none.png"))


# ----------------------------------------------------------------------------- jem ood --scores all
@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A digits-cnn trained by cross-entropy for a few hundred steps (seconds), saved as `jem train` does."""
    from jem_plugin.app.data import DIGITS_DOMAIN, load_digits
    from jem_plugin.app.model_files import model_spec, save_model_checkpoint, wrap_for_data
    from jem_plugin.app.nets import DigitsCNN

    torch.manual_seed(0)
    x, y = load_digits("train", seed=0).tensors
    net = DigitsCNN(width=8)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(3):
        for xb, yb in zip(x.split(64), y.split(64)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
    spec = model_spec("digits-cnn", "digits", 10, (1, 8, 8), DIGITS_DOMAIN, model_options={"width": 8})
    path = tmp_path_factory.mktemp("cli") / "model.pt"
    save_model_checkpoint(path, wrap_for_data(net, spec), spec)
    return path


@pytest.mark.slow
def test_jem_ood_scores_all_fits_on_the_training_data(plugin, model_file, tmp_path, capsys):
    from jem_plugin.app.cli import main

    out = tmp_path / "o" / "ood.json"
    assert main(["ood", str(model_file), "--scores", "all", "--quiet", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result == json.loads(out.read_text())
    sets = ("noise", "patches", "blends", "transposed")
    assert set(result) == {f"{m}/{s}" for m in ood.available_scores() for s in sets}
    assert 0 <= result["t_centre/noise"]["auroc"] <= 1 and result["t_centre/noise"]["seconds_per_1000"] > 0
    assert result["t_broken/blends"] == {"status": "failed", "reason": "RuntimeError: detector exploded"}
    assert "logpx" in captured.err and "*" in captured.err and "figure:" in captured.err
    assert (out.parent / "ood.png").stat().st_size > 2000
    rows = list(csv.DictReader(open(out.parent / "ood.csv")))
    assert len(rows) == len(result) and sum(r["best"] == "True" for r in rows) >= len(sets)
    # --fit-data overrides the training data; no --out: the files go next to the model
    assert main(["ood", str(model_file), "--scores", "t_centre,logpx", "--fit-data", "digits", "--quiet"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {f"{m}/{s}" for m in ("t_centre", "logpx") for s in sets}
    assert (model_file.parent / "model_ood.csv").is_file() and (model_file.parent / "model_ood.png").is_file()


def test_jem_ood_unknown_score_fails_before_loading_anything(plugin, tmp_path, capsys):
    from jem_plugin.app.cli import main

    assert main(["ood", str(tmp_path / "no_model.pt"), "--scores", "logpx,nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("jem: error: unknown OOD score 'nope'; available: ") and "t_centre" in err
    assert main(["ood", str(tmp_path / "m.pt"), "--openood", str(tmp_path), "--ood", "noise"]) == 2
    assert "drop --data and --ood" in capsys.readouterr().err


def test_detector_objects_are_compared_beside_named_scores(jm, data):
    """`evaluate_all(jm, x, sets, [jem.ood.detector("knn", k=5).fit(...), "msp"])` stopped with
    "unknown OOD score 'KNN(k=5, ...)'": a detector built with its own options could be scored
    by `score` but not compared."""
    x_train, x_in, outs = data
    fit = DataLoader(TensorDataset(x_train, x_train[:, 0, 0, 0].long()), batch_size=32)
    fitted = ood.detector("knn", k=5).fit(jm, x_train)
    unfitted = ood.detector("knn", k=3)
    unfitted.name = "knn_k3"  # two KNNs side by side: each has its own label
    table = ood.evaluate_all(jm, x_in, outs, [fitted, unfitted, "msp"], fit_data=fit)
    assert table.methods == ["knn", "knn_k3", "msp"] and {r["status"] for r in table.rows()} == {"ok"}
    jm.eval()
    assert table["knn"]["far"] == ood.evaluate(fitted.score(jm, x_in), ood.score(jm, outs["far"], fitted))
    assert unfitted.fitted and table.timing["knn_k3"]["fit_seconds"] > 0 == table.timing["knn"]["fit_seconds"]
    rows = ood.evaluate_all(jm, x_in, outs, [ood.detector("knn", k=5)]).rows()  # nothing to fit it on
    assert {r["status"] for r in rows} == {"skipped"}
    with pytest.raises(ValueError, match="two methods are labelled 'knn'"):
        ood.evaluate_all(jm, x_in, outs, [fitted, "knn"], fit_data=fit)
    with pytest.raises(TypeError, match="score names or detector objects"):
        ood.evaluate_all(jm, x_in, outs, [fitted, 3])
    with pytest.raises(ValueError, match="a detector object takes its options when built"):
        ood.evaluate_all(jm, x_in, outs, [fitted], method_kwargs={"knn": {"k": 2}})


def test_best_marks_a_tie_and_names_every_tied_score():
    """Issue 59: on noise 13 scores tied at an AUROC of 1.0 and best() named the first alone.
    Now the value still names the first (it indexes the table) and says who ties with it."""
    import pickle

    def rec(m, s, auroc, fpr):
        return {
            "score": m,
            "set": s,
            "status": "ok",
            "reason": "",
            "auroc": auroc,
            "aupr_in": auroc,
            "aupr_out": auroc,
            "fpr95": fpr,
        }

    records = [rec("fdbd", "noise", 1.0, 0.0), rec("msp", "noise", 1.0, 0.1), rec("knn", "noise", 1.0, 0.0)]
    records += [rec("logpx", "noise", 0.9, 0.5), rec("fdbd", "far", 0.7, 0.6), rec("msp", "far", 0.8, 0.4)]
    records += [rec("knn", "far", 0.6, 0.9), rec("logpx", "far", 0.5, 0.9)]
    table = ood.OODTable(records)
    best = table.best()
    assert best["noise"] == "fdbd" and best["noise"].tied == ("fdbd", "msp", "knn") and best["noise"].is_tie
    assert best["far"] == "msp" and best["far"].tied == ("msp",) and not best["far"].is_tie
    assert table[best["noise"]]["noise"]["auroc"] == 1.0  # still a key of the table
    assert "tied with 2: msp, knn" in repr(best) and repr(best["far"]) == "'msp'"
    assert table.best("fpr95")["noise"].tied == ("fdbd", "knn")
    assert pickle.loads(pickle.dumps(best))["noise"].tied == ("fdbd", "msp", "knn")
    assert json.loads(json.dumps(best)) == {"noise": "fdbd", "far": "msp"}
    assert "ties for best (the same auroc): 3 on noise" in table.to_text()
    lines = table.to_text().splitlines()
    assert [line.split()[0] for line in lines if "1.000*" in line] == ["fdbd", "msp", "knn"]
