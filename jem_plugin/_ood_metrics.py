"""Separation metrics of in- and out-of-distribution scores (:func:`evaluate`, from
scikit-learn) and the table that compares many scores (:class:`OODTable`, what
:func:`jem_plugin.ood.evaluate_all` returns). Public through :mod:`jem_plugin.ood`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import Tensor

from .errors import InvalidScoresError


def _as_scores(s: Any, what: str) -> np.ndarray:
    if isinstance(s, Tensor):
        s = s.detach().cpu().double().numpy()
    try:
        a = np.asarray(s, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidScoresError(f"{what} must be a 1-D array of numbers: {exc}") from exc
    if a.ndim != 1:
        raise InvalidScoresError(
            f"{what} must be 1-D (one score per input), got shape {a.shape}"
            + ("; flatten it with .reshape(-1)" if a.size and max(a.shape) == a.size else "")
        )
    if a.size == 0:
        raise InvalidScoresError(f"{what} is empty: need at least one score on each side")
    bad = ~np.isfinite(a)
    if bad.any():
        raise InvalidScoresError(
            f"{what} contains {int(bad.sum())} non-finite value(s) (NaN/inf) out of {a.size}; "
            "check the model's logits on those inputs (jm.logits raises on non-finite logits)"
        )
    return a


def _fpr_at_tpr(y_true: np.ndarray, y_score: np.ndarray, level: float) -> float:
    from sklearn.metrics import roc_curve

    # drop_intermediate=False: every distinct threshold is a point, so "the first point with
    # TPR >= level" is the same one pytorch-ood's fpr_at_tpr picks (dropping collinear points
    # could skip it on a diagonal tie segment).
    fpr, tpr, _ = roc_curve(y_true, y_score, drop_intermediate=False)
    return float(fpr[np.searchsorted(tpr, level, side="left")])


def evaluate(
    scores_in: Any, scores_out: Any, *, positive: str = "in", aupr: str = "average_precision"
) -> dict[str, float]:
    """Separation of in- and out-of-distribution scores (higher score = more in-distribution).

    Returns ``{"auroc", "aupr_in", "aupr_out", "fpr95"}``:

    - ``auroc``: area under the ROC curve (the same for either positive class).
    - ``aupr_in`` / ``aupr_out``: area under the precision-recall curve with in- / out-of-
      distribution as the positive class. ``aupr="average_precision"`` (default) is
      scikit-learn's ``average_precision_score``, as in the reference code of Hendrycks et al.
      and Liu et al.; ``aupr="trapezoid"`` is the trapezoidal area of the PR curve, as
      pytorch-ood's ``OODMetrics`` computes it.
    - ``fpr95``: false positive rate at 95% true positive rate. With ``positive="in"``
      (default; Liu et al.'s convention) the threshold keeps 95% of in-distribution inputs and
      ``fpr95`` is the fraction of OOD inputs still accepted. With ``positive="out"`` the
      threshold catches 95% of OOD inputs and ``fpr95`` is the fraction of in-distribution
      inputs rejected (pytorch-ood's convention).

    Scores may be tensors, arrays or lists; the two sets may differ in size. Empty, non-1-D
    or non-finite scores raise :class:`jem_plugin.errors.InvalidScoresError`.
    """
    from sklearn.metrics import auc, average_precision_score, precision_recall_curve, roc_auc_score

    if positive not in ("in", "out"):
        raise ValueError(f"positive must be 'in' or 'out', got {positive!r}")
    if aupr not in ("average_precision", "trapezoid"):
        raise ValueError(f"aupr must be 'average_precision' or 'trapezoid', got {aupr!r}")
    s_in = _as_scores(scores_in, "scores_in")
    s_out = _as_scores(scores_out, "scores_out")
    s = np.concatenate([s_in, s_out])
    is_in = np.concatenate([np.ones(s_in.size, dtype=np.int64), np.zeros(s_out.size, dtype=np.int64)])

    def area_pr(y: np.ndarray, v: np.ndarray) -> float:
        if aupr == "average_precision":
            return float(average_precision_score(y, v))
        precision, recall, _ = precision_recall_curve(y, v, drop_intermediate=False)
        return float(auc(recall, precision))

    if positive == "in":
        fpr95 = _fpr_at_tpr(is_in, s, 0.95)
    else:
        fpr95 = _fpr_at_tpr(1 - is_in, -s, 0.95)
    return {
        "auroc": float(roc_auc_score(is_in, s)),
        "aupr_in": area_pr(is_in, s),
        "aupr_out": area_pr(1 - is_in, -s),
        "fpr95": fpr95,
    }


class Best(str):
    """One set's best score name in :meth:`OODTable.best`, the first in table order, which says
    whether others tie with it: :attr:`tied` holds every score at the best value (itself first),
    ``len(tied) > 1`` on a tie. A ``str``: it indexes the table and compares as the name; its
    ``repr`` marks a tie (``'fdbd' (tied with 12: msp, ...)``), so a printed ``best()`` shows it."""

    tied: tuple[str, ...]

    def __new__(cls, tied: Sequence[str]) -> Best:
        if not tied:
            raise ValueError("Best needs at least one score name")
        self = super().__new__(cls, tied[0])
        self.tied = tuple(tied)
        return self

    @property
    def is_tie(self) -> bool:
        """Whether other scores share the best value."""
        return len(self.tied) > 1

    def __repr__(self) -> str:
        if not self.is_tie:
            return super().__repr__()
        others = self.tied[1:]
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return f"{super().__repr__()} (tied with {len(others)}: {shown})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Best, (self.tied,))


_METRICS = ("auroc", "aupr_in", "aupr_out", "fpr95")
_LOWER_IS_BETTER = {"fpr95"}
_STATUS_WORD = {"skipped": "skip", "failed": "FAIL", "non-finite": "NaN"}


class OODTable(dict):
    """The result of :func:`evaluate_all`: every score against every OOD set.

    It *is* the mapping ``{score: {set: {"auroc", "aupr_in", "aupr_out", "fpr95"}}}`` that
    :func:`evaluate_all` always returned (a ``dict``: indexing, iteration, ``json.dumps`` and
    comparison with a plain dict work as before), holding the rows that were measured. On top:

    - :meth:`rows`: one record per (score, set), *every* requested pair, with ``status``
      (``"ok"``, ``"skipped"``, ``"failed"``, ``"non-finite"``), a one-line ``reason`` and the
      scoring time per 1000 images; skipped and failed pairs are there, not in the mapping;
    - :meth:`best`: the best score per set; :meth:`to_text` (also ``str(table)``): a printable
      table marking it with ``*``; :meth:`to_csv`; :func:`jem_plugin.viz.plot_ood_table` draws it;
    - ``scores``: the raw scores, ``{score: {"in": Tensor, set: Tensor, ...}}`` for every score
      that ran, ready for :func:`jem_plugin.viz.plot_histograms` / ``plot_roc``.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]] = (),
        methods: Sequence[str] = (),
        sets: Sequence[str] = (),
        timing: Mapping[str, Mapping[str, float]] | None = None,
        scores: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = [dict(r) for r in records]
        self.methods: list[str] = list(methods) or list(dict.fromkeys(r["score"] for r in self.records))
        self.sets: list[str] = list(sets) or list(dict.fromkeys(r["set"] for r in self.records))
        #: ``{score: {"seconds_per_1000", "fit_seconds", "n_images"}}`` of the scores that ran.
        self.timing: dict[str, dict[str, float]] = {k: dict(v) for k, v in (timing or {}).items()}
        #: ``{score: {"in": Tensor, set name: Tensor, ...}}``: the scores behind the table.
        self.scores: dict[str, dict[str, Tensor]] = {k: dict(v) for k, v in (scores or {}).items()}
        for r in self.records:
            if r["status"] == "ok":
                self.setdefault(r["score"], {})[r["set"]] = {m: r[m] for m in _METRICS}

    def rows(self) -> list[dict[str, Any]]:
        """One record per (score, set), in table order: ``score``, ``set``, ``status``,
        ``reason``, the four metrics (NaN unless ``status == "ok"``), ``seconds_per_1000``
        (scoring time of that score per 1000 images, the in-distribution and every OOD set
        together; fitting excluded), ``fit_seconds`` and ``best`` (best AUROC of its set)."""
        best = {s: set(v) for s, v in self._best_sets("auroc").items()}
        return [{**r, "best": r["score"] in best.get(r["set"], set())} for r in self.records]

    def _best_sets(self, metric: str) -> dict[str, list[str]]:
        if metric not in _METRICS:
            raise ValueError(f"metric must be one of {', '.join(_METRICS)}, got {metric!r}")
        sign = -1.0 if metric in _LOWER_IS_BETTER else 1.0
        out: dict[str, list[str]] = {}
        for name in self.sets:
            values = {m: sign * v[name][metric] for m, v in self.items() if name in v}
            if values:
                top = max(values.values())
                out[name] = [m for m, v in values.items() if v == top]
        return out

    def best(self, metric: str = "auroc") -> dict[str, Best]:
        """``{set: score}``: the best score on each OOD set by ``metric`` (highest AUROC / AUPR,
        lowest FPR95). Each value is a :class:`Best`, a ``str`` naming the first best score in
        table order, whose ``tied`` lists every score at exactly that value: on a set where 13
        scores reach an AUROC of 1.0, ``best()["noise"].tied`` names all 13 and its ``repr``
        says so. Sets no score measured are left out."""
        return {name: Best(tops) for name, tops in self._best_sets(metric).items()}

    def mean(self, metric: str = "auroc") -> dict[str, float]:
        """``{score: mean of metric over the OOD sets}`` for the scores measured on every set."""
        return {
            m: float(np.mean([v[s][metric] for s in self.sets]))
            for m, v in self.items()
            if all(s in v for s in self.sets)
        }

    def failures(self) -> dict[str, str]:
        """``{score: "status: reason"}`` of every score with a pair not measured (skipped,
        failed or non-finite); one line each, the first set's reason."""
        out: dict[str, str] = {}
        for r in self.records:
            if r["status"] != "ok" and r["score"] not in out:
                out[r["score"]] = f"{r['status']}: {r['reason']}"
        return out

    def to_csv(self, path: str | Any) -> str:
        """Write :meth:`rows` as CSV (one line per score and set, every metric); returns the path."""
        import csv
        from pathlib import Path

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fields = ["score", "set", "status", *_METRICS, "seconds_per_1000", "fit_seconds", "best", "reason"]
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            for r in self.rows():
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
        return str(p)

    def to_text(self, metric: str = "auroc") -> str:
        """A plain-text table: one line per score, ``metric`` per OOD set, its mean over the
        sets and the scoring time per 1000 images; ``*`` marks the best score of each set,
        unmeasured cells say why in one word (``skip``, ``FAIL``, ``NaN``) with the reasons below."""
        best = self._best_sets(metric)
        by_pair = {(r["score"], r["set"]): r for r in self.records}
        means = self.mean(metric)
        width = max([len("score"), *map(len, self.methods)])
        cols = [max(7, len(s)) for s in self.sets]
        header = (
            f"{'score':<{width}}  "
            + "  ".join(f"{s:>{c}}" for s, c in zip(self.sets, cols))
            + f"  {'mean':>6}  {'s/1000':>7}"
        )
        lines = [header, "-" * len(header)]
        for m in self.methods:
            cells = []
            for s, c in zip(self.sets, cols):
                r = by_pair.get((m, s))
                if r is None:
                    cell = "-"
                elif r["status"] == "ok":
                    cell = f"{r[metric]:.3f}" + ("*" if m in best.get(s, ()) else " ")
                else:
                    cell = _STATUS_WORD.get(r["status"], r["status"]) + " "
                cells.append(f"{cell:>{c}}")
            t = self.timing.get(m, {}).get("seconds_per_1000")
            mean = f"{means[m]:.3f}" if m in means else "-"
            lines.append(f"{m:<{width}}  " + "  ".join(cells) + f"  {mean:>6}  {'-' if t is None else f'{t:.3g}':>7}")
        direction = "lower is better" if metric in _LOWER_IS_BETTER else "in-distribution positive"
        lines.append(f"{metric} ({direction}); * best per set; s/1000: scoring seconds per 1000 images")
        ties = [f"{len(tops)} on {s}" for s, tops in best.items() if len(tops) > 1]
        if ties:
            lines.append(f"  * ties for best (the same {metric}): {', '.join(ties)}")
        lines += [f"  {m}: {why}" for m, why in self.failures().items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()
