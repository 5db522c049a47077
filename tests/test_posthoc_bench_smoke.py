"""Smoke test of benchmarks/bench_posthoc.py at tiny sizes: it runs ours and pytorch-ood's detectors
on the same model, writes its JSON, Markdown and heat maps, and judges the issue's targets right."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("pytorch_ood")
pytest.importorskip("timm")

import jem_plugin as jem  # noqa: E402 (after the skips above, with the benchmark)
from benchmarks import bench_posthoc as B  # noqa: E402 (it imports pytorch_ood and timm: skipped above without them)
from jem_plugin import ood  # noqa: E402 (after the skips above, with the benchmark)


def test_ood_sets_are_the_issues_six():
    D = B.load_data(n_train=64, n_eval=20)
    assert set(D["sets"]) | {"held_out"} == set(B.SETS)
    assert all(v.shape == (20, 3, 32, 32) for v in D["sets"].values())
    assert int(D["y07"].max()) == 7 and len(D["xt07"]) + len(D["xt89"]) == 20
    lo = (0 - torch.tensor(B.IMAGENET_MEAN)) / torch.tensor(B.IMAGENET_STD)  # pixels clipped to [0, 1]
    assert bool((D["sets"]["gaussian"].amin(dim=(0, 2, 3)) >= lo - 1e-6).all())


@pytest.mark.slow
def test_tiny_run_writes_results_and_judges_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(B, "MIN_TRAIN_ACCURACY", 0.0)  # one run per model (reruns: test_a_model_that_did_not_train_...)
    res = B.run(
        networks=["lcnet_050"],
        epochs=1,
        n_train=96,
        n_eval=24,
        methods=["logpx", "msp", "grad_norm", "mahalanobis", "knn", "ash", "gram", "vra", "weighted_ebo", "mcd"],
        theirs=[
            "EnergyBased",
            "MaxSoftmax",
            "Mahalanobis",
            "KNN",
            "ASH",
            "Entropy",
            "Gram",
            "VRA",
            "WeightedEBO",
            "MCD",
        ],
        timing_n=32,
        timing_repeats=1,
        jem_recipes=["fast"],
    )
    net = res["networks"]["lcnet_050"]
    assert {r["set"] for r in net["ours"]} == set(B.SETS) and {r["set"] for r in net["pytorch_ood"]} == set(B.SETS)
    # the detectors both libraries have: identical where the method is the same computation
    assert net["equality"]["logpx"]["max_abs_diff"] == 0.0 and net["equality"]["logpx"]["equal"]
    assert net["equality"]["msp"]["equal"] and net["equality"]["ash"]["pytorch_ood"] == "ASH (matched settings)"
    assert net["equality"]["gram"]["pytorch_ood"] == "Gram (matched settings)" and net["equality"]["gram"]["equal"]
    # pytorch-ood 0.4's VRA at our percentiles on our features, ours per unit; WeightedEBO at ones
    assert net["equality"]["vra"]["pytorch_ood"] == "VRA (matched settings)" and net["equality"]["vra"]["equal"]
    assert net["equality"]["vra"]["ours_settings"] == B.OURS_MATCHED["vra"] and net["equality"]["weighted_ebo"]["equal"]
    # MC dropout on a network without dropout: both rows say so, neither is a score
    mcd = {r["score"]: r for r in net["ours"] + net["pytorch_ood"] if r["score"] in ("mcd", "MCD")}
    assert {r["status"] for r in mcd.values()} == {"failed"} and all("dropout" in r["reason"] for r in mcd.values())
    assert set(net["throughput"]) == {"logpx", "msp", "mahalanobis", "knn", "ash", "gram", "vra", "weighted_ebo"}
    assert all(v["ratio"] > 0 for v in net["throughput"].values())
    tg = net["targets"]
    assert set(tg["best_per_set"]) == set(B.SETS) and "jem_ok" in tg  # the run's only network has the JEM twin
    assert set(tg["jem"]) == {"fast"} and res["jem_twins"]["fast"]["mean_auroc"].keys() >= {"logpx", "grad_norm"}
    md = B.write(res, str(tmp_path))
    assert "jem logpx" in md and "pytorch-ood EnergyBased" in md and "JEM-trained twin" in md and "**" in md
    saved = json.loads((tmp_path / "posthoc.json").read_text())["posthoc"]
    # as JSON (mcd's failed rows hold NaN, never equal to itself)
    assert json.dumps(saved["networks"]["lcnet_050"]["ours"]) == json.dumps(net["ours"])
    assert saved["settings"]["sets"] == list(B.SETS)
    assert (tmp_path / "posthoc_lcnet_050.png").stat().st_size > 5000 and (tmp_path / "posthoc.md").is_file()
    # the Markdown and figures are re-rendered from the JSON alone
    (tmp_path / "posthoc.md").unlink()
    assert B.main(["--render", "--out", str(tmp_path)])["settings"] == saved["settings"]
    assert (tmp_path / "posthoc.md").read_text().count("*JEM-trained twin (`fast`): jem logpx*") == 1


def _net(ours, theirs, eq=True, ratio=1.2):
    rows = lambda prefix, vals: [{"score": prefix, "set": s, "status": "ok", "auroc": v} for s, v in zip(B.SETS, vals)]
    return {
        "ours": rows("logpx", ours),
        "pytorch_ood": rows("EnergyBased", theirs),
        "equality": {"logpx": {"equal": eq}},
        "throughput": {"logpx": {"ratio": ratio}},
    }


def test_targets():
    t = B.targets(_net([0.9] * 6, [0.904] * 6))
    assert t["best_ok"] and t["equal_ok"] and t["throughput_ok"] and "jem_ok" not in t
    t = B.targets(_net([0.9] * 6, [0.9] * 5 + [0.95], eq=False, ratio=0.5))
    assert not t["best_ok"] and t["best_per_set"]["held_out"]["ok"] is False
    assert t["equal_ok"] is False and t["throughput_ok"] is False
    twins = {"fast": {"mean_auroc": {"logpx": 0.97}}, "generative": {"mean_auroc": {"logpx": 0.9}}}
    t = B.targets(_net([0.9] * 6, [0.95] * 6), twins)
    assert t["jem_ok"] is True and t["jem"]["generative"]["ok"] is False
    assert t["best_posthoc_on_twin"] == ("pytorch-ood EnergyBased", pytest.approx(0.95))
    assert B.targets(_net([0.99] * 6, [0.95] * 6), twins)["jem_ok"] is False


def _saved(path, networks, cpu_s, twins=None):
    settings = {"networks": list(networks), "epochs": {n: 3 for n in networks}, "lr": {n: 1e-3 for n in networks}}
    settings |= {"sets": list(B.SETS), "n_train": 9, "n_test": 9, "n_ood": 9, "batch_size": 32}
    settings |= {"jem_twin": None, "jem_recipes": {}, "jem_batch_size": 64}
    res = {"settings": settings, "networks": networks, "cpu_s": cpu_s, "wall_s": cpu_s}
    if twins:
        res["jem_twins"] = twins
        settings |= {"jem_twin": "b", "jem_recipes": {r: 3 for r in twins}}
    machine = {"cpu": "x", "cores": 2, "torch": "2", "torch_threads": 1, "python": "3"}
    path.write_text(json.dumps({"machine": machine, "posthoc": res}))
    return str(path)


def test_merge_puts_one_network_runs_together_with_earlier_twins(tmp_path):
    """Runs of one network each (side by side on a shared machine) merge into one result: every
    network, CPU times added, the JEM twins taken from an earlier run and the twin network's JEM
    target judged against them again; the Markdown says where the parts come from."""
    twin = {"network": "b", "epochs": 3, "accuracy": 1.0, "accuracy_0_7": 1.0, "mean_auroc": {"logpx": 0.97}}
    twin |= {"cost": {"train_cpu_s": 60}, "cost_0_7": {"train_cpu_s": 60}, "scores": []}
    net = lambda v: {**_net([v] * 6, [0.9] * 6), "kind": "k", "accuracy": 1.0, "accuracy_0_7": 1.0}
    net_ = lambda v: net(v) | {"cost": {"train_cpu_s": 6}, "cost_0_7": {"train_cpu_s": 6}, "ours_timing": {}}
    eq = {"pytorch_ood": "EnergyBased", "max_abs_diff": 0.0, "max_abs_score": 1.0, "equal": True, "max_auroc_diff": 0.0}
    thr = {"ratio": 1.2, "ours_ms_per_1000": 1.0, "theirs_ms_per_1000": 1.2}
    full = lambda v: net_(v) | {"pytorch_ood_timing": {}, "equality": {"logpx": eq}, "throughput": {"logpx": thr}}
    a = _saved(tmp_path / "a.json", {"a": full(0.95)}, 10.0)
    b = _saved(tmp_path / "b.json", {"b": full(0.8)}, 20.0)
    old = _saved(tmp_path / "old.json", {"b": full(0.5)}, 99.0, twins={"fast": twin})
    res = B.main(["--merge", a, b, "--twins-from", old, "--note", "parts: a, b", "--out", str(tmp_path / "m")])
    assert list(res["networks"]) == ["a", "b"] and res["cpu_s"] == 30.0 and res["settings"]["jem_twin"] == "b"
    assert res["networks"]["a"]["targets"]["best_ok"] and not res["networks"]["b"]["targets"]["best_ok"]
    assert res["networks"]["b"]["targets"]["jem_ok"] is True and "jem_ok" not in res["networks"]["a"]["targets"]
    saved = json.loads((tmp_path / "m" / "posthoc.json").read_text())
    assert saved["machine"]["cpu"] == "x" and saved["posthoc"]["networks"]["b"]["ours"][0]["auroc"] == 0.8
    md = (tmp_path / "m" / "posthoc.md").read_text()
    assert "parts: a, b" in md and "*JEM-trained twin (`fast`): jem logpx*" in md
    assert (tmp_path / "m" / "posthoc_a.png").is_file() and (tmp_path / "m" / "posthoc_b.png").is_file()


@pytest.mark.slow
def test_a_detector_option_is_chosen_on_the_tune_network_alone(tmp_path, monkeypatch, capsys):
    """benchmarks/tune_posthoc_option.py: every setting on every network, six sets each, and the
    choice read from the tune network's mean AUROC only (the others are judged, never read); the
    default kept unless a setting beats it by more than the study's margin."""
    from benchmarks import tune_posthoc_option as T

    monkeypatch.setitem(B.NETWORKS, "tune_net", ("BatchNorm", "test_resnet", 1e-3, 1))
    monkeypatch.setitem(B.NETWORKS, "judged_net", ("BatchNorm", "test_resnet", 3e-3, 1))
    monkeypatch.setattr(B, "MIN_TRAIN_ACCURACY", 0.0)  # one run per model at one epoch
    nets = ["--tune", "tune_net", "--networks", "judged_net", "tune_net", "--quick"]
    study = T.STUDIES["vra_percentiles"]
    out = tmp_path / "vra.json"
    res = T.main(["--study", "vra_percentiles", *nets, "--out", str(out)])
    assert list(res["auroc"]) == ["tune_net", "judged_net"]  # the tune network first
    for net in res["auroc"].values():
        assert list(net) == [T.label(s) for s in study.grid] and all(set(r) == set(B.SETS) for r in net.values())
    means = {k: sum(v.values()) / len(v) for k, v in res["auroc"]["tune_net"].items()}
    best, default = max(means.values()), means["lower=10,upper=90"]
    assert res["chosen"] == "lower=10,upper=90" if best - default <= 0.002 else means[res["chosen"]] == best
    assert json.loads(out.read_text())["chosen"] == res["chosen"] and res["fixed"] == {"per_unit": False}
    # at one epoch the 50th percentile of the activations is 0, as the 10th: vra refuses that fit (every
    # input would score the same), and the study counts it as the chance it would have scored
    assert set(res["auroc"]["tune_net"]["lower=10,upper=50"].values()) == {0.5}
    assert "lower=10,upper=50: refused, counted as AUROC 0.5" in capsys.readouterr().out
    # a grid of any detector from the command line; a wide margin keeps the default
    res = T.main(
        ["--detector", "openmax", "--grid", "alpha=1", "alpha=10", "--default", "alpha=10"]
        + ["--margin", "1", *nets[:3], "--quick", "--out", str(tmp_path / "om.json")]
    )
    assert res["chosen"] == "alpha=10" and list(res["auroc"]["tune_net"]) == ["alpha=1", "alpha=10"]


def test_the_option_choice_keeps_the_default_within_the_margin():
    """A setting replaces the default only where it beats it on the tune network by more than
    the study's margin; ties to 4 decimals go to the default."""
    from benchmarks import tune_posthoc_option as T

    study = T.Study("vra", ({"lower": 1}, {"lower": 10}), {"lower": 10}, margin=0.002)
    assert T.choose({"lower=1": 0.9515, "lower=10": 0.9500}, study) == "lower=10"  # 0.0015 better: kept
    assert T.choose({"lower=1": 0.9525, "lower=10": 0.9500}, study) == "lower=1"
    no_margin = T.Study("vra", study.grid, {"lower": 10})
    assert T.choose({"lower=1": 0.95004, "lower=10": 0.95001}, no_margin) == "lower=10"  # a tie to 4 decimals
    assert T.choose({"lower=1": 0.9502, "lower=10": 0.9500}, no_margin) == "lower=1"
    # among settings tied to 4 decimals, the one nearest the default (not the grid's first)
    tied = T.Study("vra", ({"upper": 70}, {"upper": 80}, {"upper": 90}), {"upper": 90})
    assert T.choose({"upper=70": 0.96001, "upper=80": 0.96002, "upper=90": 0.9}, tied) == "upper=80"
    assert T.parse_setting("lower=1,upper=99.5,per_unit=False") == {"lower": 1, "upper": 99.5, "per_unit": False}


@pytest.mark.slow
def test_the_jem_fine_tune_check_scores_the_ce_twin_and_its_fine_tune(tmp_path, monkeypatch):
    """benchmarks/check_jem_finetune_twin.py: the CE twin as bench_posthoc trains it, the scores on
    it, then the fine-tune from its weights (not from scratch) and the same scores on that (every
    registered one by default; three here, a fitted one among them, for time)."""
    from benchmarks import check_jem_finetune_twin as C

    small = B.load_data(n_train=120, n_eval=60, n_ood=20)
    monkeypatch.setattr(B, "load_data", lambda *a, **k: small)
    monkeypatch.setitem(B.NETWORKS, "tiny", ("BatchNorm", "test_resnet", 1e-3, 2))
    starts = []
    train = B.train
    monkeypatch.setattr(B, "train", lambda *a, **k: (starts.append(k.get("init")), train(*a, **k))[1])
    monkeypatch.setattr(B, "MIN_TRAIN_ACCURACY", 0.0)  # one run per model: what starts from what
    out = tmp_path / "ft.json"
    res = C.main(["--network", "tiny", "--scores", "msp", "gmm", "--out", str(out)])
    assert starts[:2] == [None, None] and all(s is not None for s in starts[2:]) and len(starts) == 4
    ce, ft = res["ce_twin"], res["finetuned"]
    assert ce["epochs"] == 2 and ft["epochs"] == 1  # half the CE run's
    scores = {"logpx", "msp", "gmm"}  # those asked for and logpx, the target's
    assert set(ce["mean_auroc"]) == set(ft["mean_auroc"]) == scores and ce["best_posthoc"] in scores
    assert res["target_met"] == (ft["mean_auroc"]["logpx"] > ce["mean_auroc"][ce["best_posthoc"]])
    assert json.loads(out.read_text())["check"]["network"] == "tiny"
    ce_only = ["--epochs", "0", "--ce-epochs", "1", "--scores", "msp", "--out", str(tmp_path / "ce.json")]
    alone = C.main(["--network", "tiny", *ce_only])
    assert "finetuned" not in alone and alone["ce_twin"]["epochs"] == 1


def test_the_jem_tuning_split_never_reads_the_judges_test_digits(monkeypatch):
    """benchmarks/tune_jem_twin chooses settings that bench_posthoc then judges: its data must come
    from the training split alone, and its model must never see the classes it holds out."""
    from benchmarks import tune_jem_twin as T

    real = T.digits_tensors

    def train_split_only(split):
        assert split == "train", "the tuning read the judge's test split"
        return real(split)

    monkeypatch.setattr(T, "digits_tensors", train_split_only)
    F = T.fold_data((0, 1))
    x8, y = real("train")
    train_rows = {tuple(r.tolist()) for r in T.to32(x8[y >= 2]).flatten(1)}
    fit = [tuple(r.tolist()) for r in F["x"].flatten(1)]
    val = [tuple(r.tolist()) for r in F["xv"].flatten(1)]
    assert set(fit) <= train_rows and set(val) <= train_rows  # no image of a held-out class is trained on
    assert not set(fit) & set(val) and int(F["y"].max()) == 7 == int(F["yv"].max())
    assert len(F["sets"]["held_out"]) == int((y < 2).sum())  # every image of the two held-out classes
    assert set(F["sets"]) == set(B.SETS)
    assert T.candidate_recipe("pxy_only", "resnet10t", F["per_class"]).loss.px_weight == 0.0


def _small_folds(T, monkeypatch):
    """The tuning split's folds cut to a few images each (each fold built once), for a tiny network."""
    real, built = T.fold_data, {}

    def small(held_out):
        if held_out not in built:
            F = real(held_out)
            sets = {k: v[:16] for k, v in F["sets"].items()}
            built[held_out] = {**F, "x": F["x"][:120], "y": F["y"][:120], "xv": F["xv"][:32], "yv": F["yv"][:32]}
            built[held_out]["sets"] = sets
        return dict(built[held_out])

    monkeypatch.setattr(T, "fold_data", small)
    monkeypatch.setitem(B.NETWORKS, "tiny", ("BatchNorm", "test_resnet", 1e-3, 1))


def test_multi_mahalanobis_weights_are_chosen_on_the_tuning_split(tmp_path, monkeypatch):
    """benchmarks/tune_multi_mahalanobis.py: both weightings and the penultimate Mahalanobis on
    every fold's six sets, the choice the higher mean."""
    from benchmarks import tune_multi_mahalanobis as T

    _small_folds(T, monkeypatch)
    monkeypatch.setattr(T, "TUNE_NETWORKS", ("tiny",))
    monkeypatch.setattr(T, "OUT", str(tmp_path / "mm.json"))
    res = T.main([])
    assert set(res["folds"]) == {"tiny 01", "tiny 56"}
    for fold in res["folds"].values():
        assert set(fold["auroc"]) == {"mahalanobis", "multi_mahalanobis[uniform]", "multi_mahalanobis[dof]"}
        assert all(set(v) == set(B.SETS) for v in fold["auroc"].values())
    mean = {c: sum(f["mean_auroc"][f"multi_mahalanobis[{c}]"] for f in res["folds"].values()) for c in T.CANDIDATES}
    assert mean[res["chosen"]] == max(mean.values())
    assert json.loads((tmp_path / "mm.json").read_text())["folds"] == res["folds"]


def test_posthoc_learning_rate_is_chosen_by_worst_validation_accuracy(tmp_path, monkeypatch):
    """benchmarks/tune_posthoc_lr.py: every rate on every fold and seed, the choice the rate whose
    worst validation accuracy is highest (accuracy only: no OOD metric is read)."""
    from benchmarks import tune_posthoc_lr as T

    _small_folds(T, monkeypatch)
    monkeypatch.setattr(T, "SEEDS", (0,))  # every fold still; one seed each, for time
    res = T.main(["--network", "tiny", "--lrs", "0.0001", "0.003", "--out", str(tmp_path)])
    acc = res["validation_accuracy"]
    assert set(acc) == {"0.0001", "0.003"} and all(len(v) == 2 * len(T.SEEDS) for v in acc.values())
    assert min(acc[str(res["chosen_lr"])].values()) == max(min(v.values()) for v in acc.values())
    assert (tmp_path / "posthoc_lr_tiny.json").exists()


def test_a_model_that_did_not_train_is_rerun_with_the_next_seed(monkeypatch):
    """bench_posthoc.train_until_fit: seeds 0, 1, 2 until the training accuracy reaches the bar,
    read on the training images alone; the cost says which seed was kept and what each reached."""
    reached = {0: 0.3, 1: 0.95, 2: 1.0}
    monkeypatch.setattr(B, "train", lambda *a, seed, **k: (seed, {"seed_run": seed}))
    monkeypatch.setattr(B, "accuracy", lambda model, x, y: reached[model])
    model, cost = B.train_until_fit("net", torch.zeros(4, 1), torch.zeros(4), 2, 1, lr=1e-3)
    assert model == 1 and cost["seed"] == 1 and cost["train_accuracy"] == [0.3, 0.95]
    reached.update({1: 0.5, 2: 0.6})
    model, cost = B.train_until_fit("net", torch.zeros(4, 1), torch.zeros(4), 2, 1, lr=1e-3)
    assert model == 2 and cost["train_accuracy"] == [0.3, 0.5, 0.6]  # none fits: the last is kept
    net = {"cost": {"train_accuracy": [1.0]}, "cost_0_7": cost}
    assert B._reruns(net) == "; the 0-7 model kept seed 2 (training accuracy by seed: 0.30, 0.50, 0.60)"


def test_posthoc_clipping_is_chosen_with_the_rate_and_applied_before_each_step(tmp_path, monkeypatch):
    """``--clips`` makes the choice one of (rate, clipping) pairs by the same worst validation
    accuracy; ``train(clip=c)`` hands the optimiser gradients of global norm at most ``c``, and the
    cost records it."""
    from benchmarks import tune_posthoc_lr as T

    _small_folds(T, monkeypatch)
    monkeypatch.setattr(T, "SEEDS", (0,))  # every fold still; one seed each, for time
    res = T.main(["--network", "tiny", "--lrs", "0.003", "--clips", "none", "0.5", "--out", str(tmp_path)])
    acc = res["validation_accuracy"]
    assert set(acc) == {"lr 0.003 clip None", "lr 0.003 clip 0.5"}
    chosen = f"lr {res['chosen_lr']} clip {res['chosen_clip']}"
    assert min(acc[chosen].values()) == max(min(v.values()) for v in acc.values())
    assert (tmp_path / "posthoc_clip_tiny.json").exists()

    norms: list[float] = []
    step = torch.optim.Adam.step

    def recording_step(self, *a, **k):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    x, y = torch.rand(64, 3, 32, 32) * 2 - 1, torch.arange(64) % 4
    _, cost = B.train("test_resnet", x, y, 4, 1, lr=1e-3)
    assert max(norms) > 0.05 and cost["clip_grad_norm"] is None  # unclipped, the norms exceed the bar below
    norms.clear()
    _, cost = B.train("test_resnet", x, y, 4, 1, lr=1e-3, clip=0.05)
    assert max(norms) <= 0.05 * (1 + 1e-5) and cost["clip_grad_norm"] == 0.05


def test_multi_mahalanobis_combinations_are_compared_on_the_tuning_split(tmp_path, monkeypatch):
    """benchmarks/check_multi_mahalanobis_combine.py: every combination and every layer alone on
    each fold's six sets, ``dof`` kept unless another has the higher mean; the formulas read the
    detector's own per-layer distances (``dof`` is the detector's score)."""
    from benchmarks import check_multi_mahalanobis_combine as C

    _small_folds(C, monkeypatch)
    monkeypatch.setitem(B.CLIP_GRAD_NORM, "tiny", 1.0)
    res = C.main(["--networks", "tiny", "--out", str(tmp_path / "c.json")])
    assert set(res["folds"]) == {"tiny 01", "tiny 56"}
    fold = res["folds"]["tiny 01"]
    assert set(fold["auroc"]) == set(B.SETS)
    assert {"dof", "uniform", "max_z", "adversarial", "layer0"} <= set(fold["mean_auroc"])
    best = max(res["mean"].values())
    assert res["mean"][res["chosen"]] == best and (res["chosen"] == "dof" or res["mean"]["dof"] < best)

    torch.manual_seed(0)
    jm = jem.wrap(B.make_net("test_resnet", 3), **B._wrap_kw(3)).eval()
    x, y = torch.rand(40, 3, 32, 32) * 2 - 1, torch.arange(40) % 3
    det = ood.detector("multi_mahalanobis").fit(jm, (x, y))
    torch.testing.assert_close(
        C.combinations(det, jm, x[:8])["dof"].float(), det.score(jm, x[:8]), rtol=1e-4, atol=1e-4
    )


def test_the_adversarial_option_is_reported_beside_the_default_on_the_benchmark(tmp_path, monkeypatch):
    """benchmarks/check_multi_mahalanobis_option.py: the default and the option on every set of
    the benchmark's two models, beside pytorch-ood's best per set read from posthoc.json."""
    from benchmarks import check_multi_mahalanobis_option as O

    small = B.load_data(n_train=120, n_eval=60, n_ood=20)
    monkeypatch.setattr(B, "load_data", lambda: small)
    monkeypatch.setitem(B.NETWORKS, "tiny", ("BatchNorm", "test_resnet", 1e-3, 1))
    monkeypatch.setattr(B, "MIN_TRAIN_ACCURACY", 0.0)  # one run per model (reruns: test_a_model_that_did_not_train_...)
    best = {s: {"pytorch_ood": [0.5, "X"], "ours": [0.5, "y"], "ok": True} for s in B.SETS}
    judged = tmp_path / "posthoc.json"
    judged.write_text(json.dumps({"posthoc": {"networks": {"tiny": {"targets": {"best_per_set": best}}}}}))
    res = O.main(["--networks", "tiny", "--out", str(tmp_path / "o.json"), "--posthoc", str(judged)])
    rows = res["tiny"]
    assert set(rows) == {"multi_mahalanobis", "multi_mahalanobis[adversarial]", "pytorch-ood best"}
    assert all(set(v) == set(B.SETS) for v in rows.values())
    assert (tmp_path / "o.json").exists()


@pytest.mark.slow
def test_grams_held_out_draws_are_scored_for_both_libraries(tmp_path, monkeypatch):
    """benchmarks/check_gram_seeds.py: ours and pytorch-ood's Gram at each held-out draw, every
    set of the benchmark's two models; the same draw twice gives the same AUROC."""
    from benchmarks import check_gram_seeds as G

    small = B.load_data(n_train=120, n_eval=60, n_ood=20)
    monkeypatch.setattr(B, "load_data", lambda: small)
    monkeypatch.setitem(B.NETWORKS, "tiny", ("BatchNorm", "test_resnet", 1e-3, 1))
    monkeypatch.setattr(B, "MIN_TRAIN_ACCURACY", 0.0)  # one run per model (reruns: test_a_model_that_did_not_train_...)
    res = G.main(["--networks", "tiny", "--seeds", "2", "--out", str(tmp_path / "g.json")])
    libs = res["tiny"]
    assert set(libs) == {"ours", "pytorch-ood"}
    assert all(set(v) == set(B.SETS) and all(len(a) == 2 for a in v.values()) for v in libs.values())
    assert json.loads((tmp_path / "g.json").read_text())["networks"] == res
    again = G.main(["--networks", "tiny", "--seeds", "1", "--out", str(tmp_path / "g1.json")])
    assert all(again["tiny"]["ours"][s] == libs["ours"][s][:1] for s in B.SETS)


def test_grams_scoring_bounds_are_compared_on_the_tuning_split(tmp_path, monkeypatch):
    """benchmarks/check_gram_held_out.py: the default (bounds on every fit image) against bounds
    without the held-out images and against leave-one-out typical deviations, at each draw of
    each fold; the default kept unless another has the higher mean. The second differs only in its
    bounds (it scores lower or equal); the third's E_l is the leave-one-out mean, with no draw."""
    from benchmarks import check_gram_held_out as G

    _small_folds(G, monkeypatch)
    res = G.main(["--networks", "tiny", "--seeds", "2", "--out", str(tmp_path / "g.json")])
    assert set(res["folds"]) == {"tiny 01", "tiny 56"}
    fold = res["folds"]["tiny 01"]
    assert all(len(v) == 2 for v in fold["mean_auroc_per_draw"].values())
    best = max(res["mean"].values())
    assert res["mean"][res["chosen"]] == best
    torch.manual_seed(0)
    jm = jem.wrap(B.make_net("test_resnet", 3), **B._wrap_kw(3)).eval()
    x, y = torch.rand(60, 3, 32, 32) * 2 - 1, torch.arange(60) % 3
    every, without = (
        ood.detector("gram", held_out=0.3).fit(jm, (x, y)),
        G.BoundsWithoutHeldOut(held_out=0.3).fit(jm, (x, y)),
    )
    torch.testing.assert_close(every.layer_norm, without.layer_norm)  # the same draw, the same E_l
    assert (without.score(jm, x) <= every.score(jm, x) + 1e-6).all()  # narrower bounds: larger deviations
    assert (without.score(jm, x) < every.score(jm, x) - 1e-6).any()


@pytest.mark.slow
def test_one_forward_mode_times_the_shared_forward_beside_the_per_detector_loop(tmp_path):
    """``--one-forward`` (issue 46): the gradient-free scores, one forward per batch against the
    loop of one pass per detector, on the same model; same scores both ways. Four scores, one of
    each kind of output they read (every score's equality is tests/test_ood_one_forward.py's)."""
    assert len(B.gradient_free_scores()) == 28  # the 36 scores less mcd and the 7 with an input gradient
    methods = ["msp", "knn", "ash", "multi_mahalanobis"]  # logits; features; feature maps; layers
    assert set(methods) <= set(B.gradient_free_scores())
    res = B.run_one_forward(
        networks=["lcnet_050"], epochs=1, repeats=1, n_train=64, n_eval=16, n_ood=16, methods=methods
    )
    net = res["networks"]["lcnet_050"]
    assert net["methods"] == methods
    assert not net["failures"] and net["max_rel_score_diff"] < 1e-5
    batches = {"fit": 1, "scored": 6}  # 64 fit images and 6 sets of 16, all under one batch of 256
    assert net["forwards"]["shared"] == 1 + batches["fit"] + batches["scored"]  # and a warm-up batch
    # the loop: a pass per fitted detector over the fit data, and one per score and scored set
    fitted = [m for m in methods if ood.score_info(m)["needs_fit"]]
    assert len(fitted) == 2
    assert net["forwards"]["loop"] == len(fitted) * batches["fit"] + len(methods) * batches["scored"]
    assert net["ratio"] > 0 and len(net["shared_s"]) == len(net["loop_s"]) == 1
    # CPU seconds beside wall seconds: the figure a shared machine's load leaves nearly alone
    assert net["cpu_ratio"] > 0 and len(net["shared_cpu_s"]) == len(net["loop_cpu_s"]) == 1
    md = B.write_one_forward(res, str(tmp_path))
    assert "lcnet_050" in md and "CPU-time ratio" in md
    saved = json.loads((tmp_path / "posthoc_one_forward.json").read_text())["posthoc_one_forward"]
    assert saved["networks"]["lcnet_050"]["forwards"] == net["forwards"]
