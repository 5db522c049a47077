"""Post-hoc detectors fitted across ranks: 2 processes, gloo backend, CPU.

One ``torchrun`` launch of THIS file as a script (process launches dominate the cost) fits every
fitted detector on each rank's shard of the fit data (uneven: 70 and 45 inputs), combined across
the ranks, and in the same process once more on the union of the shards with
``distributed=False``; each rank writes how far its fitted state and its scores are from the
union's. The tests below assert on that: every rank holds the single-process fit of the union.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
SIZES = (70, 45)  # the ranks' shards: uneven, and rank 1's smaller than a batch of 64
K = 4

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)


class ShardNet(nn.Module):
    """A small CNN of three named stages and a linear head (its layers for the multi-layer
    detectors: ``stem``, ``stage1``, ``stage2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU())
        self.stage1 = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1, stride=2), nn.ReLU())
        self.stage2 = nn.Sequential(nn.Conv2d(8, 12, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(12, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage2(self.stage1(self.stem(x))).mean(dim=(2, 3)))


def _setup() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The network (its head least-squares fitted to the labels, so it classifies), the union of
    the fit data (class patterns plus noise) and test inputs (held-out data and noise)."""
    import jem_plugin as jem

    torch.manual_seed(0)
    net = ShardNet()
    g = torch.Generator().manual_seed(1)
    n = sum(SIZES)
    y = torch.randint(0, K, (n + 16,), generator=g)
    patterns = torch.rand(K, 1, 8, 8, generator=g)
    x = 0.4 * torch.rand(n + 16, 1, 8, 8, generator=g) + 0.6 * patterns[y]
    jm = jem.wrap(net, data_range=(0.0, 1.0))
    with torch.no_grad():
        feats, _ = jm.features(x[:n])
        solution = torch.linalg.lstsq(feats, 10.0 * nn.functional.one_hot(y[:n], K).float()).solution
        net.head.weight.copy_(solution.T)
        net.head.bias.zero_()  # ViM's origin -pinv(W) b at 0, not far out where its moment is one direction
    x_test = torch.cat([x[n:], torch.rand(16, 1, 8, 8, generator=g)])
    return jm, x[:n], y[:n], x_test


def _cases() -> dict[str, Any]:
    """Every fitted detector of the package, with options that keep the spawn fast; a few twice."""
    from jem_plugin.builtins.posthoc import DETECTORS

    layers = ["stem", "stage1", "stage2"]
    options: dict[str, dict[str, Any]] = {
        "knn": {"k": 5},
        "nnguide": {"k": 5},
        "weiper": {"repeats": 4},
        "multi_mahalanobis": {"layers": layers},
        "gram": {"layers": layers, "powers": 3},
    }
    cases = {d.name: (d, options.get(d.name, {})) for d in DETECTORS if d.needs_fit}
    by_name = {d.name: d for d in DETECTORS}
    cases["multi_mahalanobis_adversarial"] = (
        by_name["multi_mahalanobis"],
        {"layers": layers, "weights": "adversarial", "adversarial_images": 40},
    )
    cases["vra_per_unit"] = (by_name["vra"], {"per_unit": True})
    cases["gmm_tied"] = (by_name["gmm"], {"covariance": "tied"})
    cases["gmm_diag"] = (by_name["gmm"], {"covariance": "diag"})
    return cases


def _state_gaps(a: Any, b: Any, path: str, out: dict[str, Any]) -> None:
    """Where the fitted state ``a`` differs from ``b`` by more than 1e-6 (relative above 1):
    ``out[path]`` the largest gap, or a line saying how they differ."""
    if path.endswith("._residual"):
        # ViM's residual directions: eigenvectors of a moment whose smallest eigenvalue repeats
        # (dead ReLU units), a basis unique up to rotation; the subspace R R^T is what it fitted
        a, b = a @ a.T, b @ b.T
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            out[path] = f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        elif a.numel() and not torch.isclose(a.double(), b.double(), rtol=1e-6, atol=1e-6, equal_nan=True).all():
            out[path] = float((a.double() - b.double()).abs().nan_to_num(math.inf).max())
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (u, v) in enumerate(zip(a, b)):
            _state_gaps(u, v, f"{path}[{i}]", out)
    elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            _state_gaps(a[k], b[k], f"{path}.{k}", out)
    elif hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, nn.Module):
        skip = {"_fitted_on", "_warned_other_model"}
        keys = (set(vars(a)) | set(vars(b))) - skip
        for k in sorted(keys):
            if k not in vars(a) or k not in vars(b):
                out[f"{path}.{k}"] = "held by one fit only"
            else:
                _state_gaps(vars(a)[k], vars(b)[k], f"{path}.{k}", out)
    elif isinstance(a, float) and isinstance(b, float):
        if not (math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))):
            out[path] = abs(a - b)
    elif a != b:
        out[path] = f"{a!r} vs {b!r}"


# =============================================================================== worker side
def _worker(out_dir: str) -> None:  # pragma: no cover - runs in the torchrun children
    import warnings

    from jem_plugin import distributed as jdist

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the fits' warnings (few images per feature) are not the point here
    info = jdist.init_distributed()
    rank = info.rank
    jm, x, y, x_test = _setup()
    start = sum(SIZES[:rank])
    shard = (x[start : start + SIZES[rank]], y[start : start + SIZES[rank]])
    res: dict[str, Any] = {}
    for label, (cls, kw) in _cases().items():
        try:
            det = cls(**kw).fit(jm, shard, batch_size=32)
            union = cls(**kw).fit(jm, (x, y), batch_size=32, distributed=False)
            gaps: dict[str, Any] = {}
            _state_gaps(det, union, label, gaps)
            s, s_union = det.score(jm, x_test), union.score(jm, x_test)
            res[label] = {
                "state_gaps": {k: str(v) for k, v in gaps.items()},
                "score_gap": float((s - s_union).abs().max() / (1.0 + s_union.abs().max())),
                "scores": s.tolist(),
            }
        except Exception as exc:  # a row of the findings, not the end of the run
            res[label] = {"error": f"{type(exc).__name__}: {exc}"}
    # a capped sample across ranks: uniform over the union, so not the single fit's draw, but the
    # same bank on every rank, of rows of the union
    from jem_plugin.builtins.posthoc import KNN

    capped = KNN(k=3, max_fit=20).fit(jm, shard, batch_size=32)
    union_rows = KNN(k=3).fit(jm, (x, y), distributed=False).bank
    nearest = torch.cdist(capped.bank, union_rows, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1)
    res["capped_knn"] = {
        "bank_sum": float(capped.bank.double().sum()),
        "rows": capped.bank.shape[0],
        "rows_of_union": bool((nearest.values < 1e-6).all()),
        "ranks_in_bank": sorted({int(i >= SIZES[0]) for i in nearest.indices}),
    }
    # gram with a fraction held out: the bounds are the union's; E_l comes from each rank's own draw
    from jem_plugin.builtins.posthoc import Gram

    held = Gram(layers=["stem", "stage2"], powers=2, held_out=0.3).fit(jm, shard, batch_size=32)
    held_union = Gram(layers=["stem", "stage2"], powers=2, held_out=0.3).fit(jm, (x, y), distributed=False)
    gaps = {}
    _state_gaps(held, held_union, "gram", gaps)
    res["gram_held_out"] = {"gaps": sorted(gaps), "scores": held.score(jm, x_test).tolist()}
    import jem_plugin as jem
    from jem_plugin.builtins.posthoc import Mahalanobis

    # from outputs already computed (the one-forward path of evaluate_all): combined alike
    res["from_outputs"] = {}
    for label in ("openmax", "gmm", "knn"):
        cls, kw = _cases()[label]
        det, union = cls(**kw), cls(**kw)
        # in batches of 32, so that the union's first batch (its moments' centre) is rank 0's
        det.fit_outputs(jm, [(jem.ood.outputs(jm, a, det.reads), b) for a, b in zip(*(t.split(32) for t in shard))])
        union.fit_outputs(
            jm, [(jem.ood.outputs(jm, a, det.reads), b) for a, b in zip(x.split(32), y.split(32))], distributed=False
        )
        gaps = {}
        _state_gaps(det, union, label, gaps)
        res["from_outputs"][label] = sorted(gaps)

    # a rank without fit data: the same one-line error on every rank, not a hang
    lonely = Mahalanobis()
    lonely.begin_fit(jm)
    if rank == 0:
        lonely.add_outputs(jem.ood.outputs(jm, x[:20], lonely.reads), y[:20])
    try:
        lonely.end_fit(jm)
        res["empty_rank"] = "fitted"
    except Exception as exc:  # any error is a finding here: the test names the one wanted
        res["empty_rank"] = f"{type(exc).__name__}: {exc}"
    # opting out: each rank its own shard
    alone = KNN(k=3).fit(jm, shard, distributed=False)
    res["opt_out_rows"] = alone.bank.shape[0]
    Path(out_dir, f"posthoc-rank{rank}.json").write_text(json.dumps(res))
    jdist.cleanup()


# =============================================================================== tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("posthoc-ranks")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(Path(out, f"posthoc-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_every_rank_holds_the_single_process_fit_of_the_union(ranks):
    """For every fitted detector, each rank's fitted state equals (to 1e-6) a fit of the union of
    the shards in one process, and so do its scores; both ranks score alike."""
    labels = set(_cases())
    for r, res in enumerate(ranks):
        assert labels <= set(res), f"rank {r} did not fit {sorted(labels - set(res))}"
        errors = {k: v["error"] for k, v in res.items() if k in labels and "error" in v}
        assert not errors, f"rank {r}: {errors}"
        gaps = {k: v["state_gaps"] for k, v in res.items() if k in labels and v["state_gaps"]}
        assert not gaps, f"rank {r}: fitted state differs from the union's fit: {gaps}"
        scores = {k: v["score_gap"] for k, v in res.items() if k in labels and v["score_gap"] > 1e-6}
        assert not scores, f"rank {r}: scores differ from the union's fit: {scores}"
    for label in labels:
        assert ranks[0][label]["scores"] == ranks[1][label]["scores"], label


@pytest.mark.slow
def test_a_capped_sample_is_one_uniform_sample_of_the_union_on_every_rank(ranks):
    a, b = ranks[0]["capped_knn"], ranks[1]["capped_knn"]
    assert a == b  # the same bank on both ranks
    assert a["rows"] == 20 and a["rows_of_union"]
    assert a["ranks_in_bank"] == [0, 1]  # drawn from both shards


@pytest.mark.slow
def test_gram_with_a_held_out_fraction_has_the_unions_bounds_on_every_rank(ranks):
    a, b = ranks[0]["gram_held_out"], ranks[1]["gram_held_out"]
    assert a == b
    assert set(a["gaps"]) <= {"gram.layer_norm"}  # E_l: from the held-out draw, each rank its own


@pytest.mark.slow
def test_fits_from_outputs_combine_across_ranks_too(ranks):
    for r in ranks:
        assert r["from_outputs"] == {"openmax": [], "gmm": [], "knn": []}


@pytest.mark.slow
def test_a_rank_without_fit_data_raises_on_every_rank(ranks):
    assert ranks[0]["empty_rank"] == ranks[1]["empty_rank"]
    assert ranks[0]["empty_rank"].startswith("InvalidInputError: ")
    assert "rank(s) [1] saw no fit data" in ranks[0]["empty_rank"]


@pytest.mark.slow
def test_distributed_false_fits_each_rank_alone(ranks):
    assert [r["opt_out_rows"] for r in ranks] == list(SIZES)


def test_every_fitted_detector_says_how_it_combines_across_ranks():
    """A fitted detector added without saying what its fit accumulates would fit each rank
    alone under torchrun: each says it, in the ways :mod:`jem_plugin.distributed._detectors` knows."""
    import jem_plugin as jem
    from jem_plugin.builtins.posthoc import DETECTORS
    from jem_plugin.builtins.posthoc._base import _FittedDetector
    from jem_plugin.distributed._detectors import KINDS

    for d in DETECTORS:
        if not d.needs_fit:
            continue
        dynamic = d._rank_statistics is not _FittedDetector._rank_statistics
        assert d._rank_stats is not None or dynamic, d.name
        assert all(how in KINDS for _, how in d._rank_stats or ()), d.name
        # what score_info says: rows gathered where the fit keeps rows of the data
        keeps_rows = any(how in ("sample", "gather") for _, how in d._rank_stats or ())
        assert jem.ood.score_info(d.name)["across_ranks"] == ("gather" if keeps_rows else "reduce"), d.name
    assert jem.ood.score_info("knn")["across_ranks"] == "gather"
    assert jem.ood.score_info("mahalanobis")["across_ranks"] == "reduce"
    assert jem.ood.score_info("msp")["across_ranks"] is None


def test_without_a_process_group_a_fit_imports_nothing_more():
    """One process: nothing changes, and the cross-rank code is not even imported."""
    import jem_plugin as jem

    name = "jem_plugin.distributed._detectors"
    held = sys.modules.pop(name, None)
    try:
        jm, x, y, _ = _setup()
        jem.ood.detector("mahalanobis").fit(jm, (x, y))
        jem.ood.detector("openmax").fit(jm, (x, y))
        assert name not in sys.modules
    finally:
        if held is not None:
            sys.modules[name] = held


if __name__ == "__main__":  # the torchrun children
    _worker(sys.argv[1])
