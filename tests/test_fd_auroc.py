"""benchmarks/check_fd_auroc.py: the long row's points split by the FD target, each OOD set's gap
read apart (the worst set alone cannot say which set a moved buffer loses)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_long_row as L
from benchmarks import check_fd_auroc as C


def _row(role: str, seed: int, acc: float, auroc: dict[str, float], fds: list[float]) -> dict:
    """A textures/resnet10t cell of ``role``: a point per FD ratio in ``fds``, at 300, 600, ..."""
    c = L.cell("textures", "resnet10t", role, seed, 1, **({"px_weight": 0.3} if role == "weight" else {}))
    points = [
        {
            "iteration": 300 * (i + 1),
            "accuracy": acc,
            "auroc": {"logpx": dict(auroc)},
            "ece": 0.1,
            "ece_ts": 0.05,
            "init_fd": 10.0,
            "buffer": {"fd": fd * 10.0},
            "train_cpu_s": 1.0,
        }
        for i, fd in enumerate(fds)
    ]
    return {**c, "points": points, "iterations": 300 * len(fds)}


BASE = {"noise": 0.9, "photos": 0.8, "near": 0.6, "other": 0.9}


def _rows() -> list[dict]:
    # seed 0: the buffer moves and the digits (other) fall below the baseline; seed 1: the same cell,
    # the buffer stays and every set is above it. The points are the seeds' mean.
    moved = {**BASE, "noise": 1.0, "other": 0.5}
    still = {k: v + 0.02 for k, v in BASE.items()}
    return [
        _row("baseline", 0, 0.8, BASE, [1.0, 1.0, 1.0]),
        _row("weight", 0, 0.8, moved, [0.3, 0.3, 0.3]),
        _row("default", 0, 0.8, still, [0.9, 0.8, 1.0]),
    ]


def test_every_sets_gap_is_kept_per_point_and_averaged_over_seeds():
    rows = _rows()
    seed1 = [_row("baseline", 1, 0.8, BASE, [1.0]), _row("weight", 1, 0.8, BASE, [0.5])]
    entries = L.curves(rows + seed1)
    weight = next(e for e in entries if e["role"] == "weight")
    first = weight["points"][0]
    assert first["seeds"] == 2
    assert first["auroc_gap_other"] == pytest.approx((-0.4 + 0.0) / 2)
    assert first["auroc_gap_noise"] == pytest.approx((0.1 + 0.0) / 2)
    assert first["auroc_gap"] == pytest.approx(-0.4 / 2)  # the worst set's, as before
    assert weight["points"][1]["seeds"] == 1 and weight["points"][1]["auroc_gap_other"] == pytest.approx(-0.4)


def test_the_points_are_split_by_the_fd_target_and_each_set_counted(tmp_path):
    (tmp_path / "cells").mkdir()
    for r in _rows():
        (tmp_path / "cells" / f"{L.GB.cell_name(r)}.json").write_text(json.dumps(r))
    summaries = C.check(str(tmp_path), docs=None)
    s = summaries["textures"]
    assert (s["moved"]["n"], s["moved"]["auroc_met"], s["moved"]["all_met"]) == (3, 0, 0)
    assert s["moved"]["below"] == {"noise": 0, "photos": 0, "near": 0, "other": 3}
    assert s["moved"]["median_gap"]["other"] == pytest.approx(-0.4)
    assert (s["not_moved"]["n"], s["not_moved"]["auroc_met"]) == (3, 3)
    # the further the buffer moved, the lower the digits' gap: a positive rank correlation
    assert s["spearman_fd"]["other"] == pytest.approx(
        13.5 / (15.5 * 13.5) ** 0.5
    )  # ranks (2,2,2,5,4,6) and (2,2,2,5,5,5)
    assert s["cells_moved"] == ["resnet10t generative[px_weight=0.3]"]
    assert summaries["digits32"]["moved"]["n"] == 0  # no cell: counted as nothing, no error

    md = (tmp_path / "fd_auroc.md").read_text()
    assert "| FD <= half the init's | 3 | 0 | 0 | 0 / +0.10 | 0 / +0.00 | 0 / +0.00 | 3 / -0.40 |" in md
    assert "The paper's log p(x) is below its baseline's score on 3 of 4 sets (SVHN, CIFAR10 interp, CIFAR100)" in md
    assert (tmp_path / "long-row-fd-auroc.png").stat().st_size > 0


def test_no_rank_correlation_from_too_few_or_constant_points():
    assert C._spearman([0.3, 0.4], [0.1, 0.2]) is None
    assert C._spearman([0.3, 0.3, 0.3], [0.1, 0.2, 0.3]) is None
    assert C._spearman([0.1, 0.2, 0.3], [0.3, 0.2, 0.1]) == pytest.approx(-1.0)
