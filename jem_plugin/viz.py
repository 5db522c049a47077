"""Every figure of jem-plugin: sample grids, training curves, 2D densities, OOD score histograms
and ROC curves, reliability diagrams, robust accuracy.

Each figure is drawn on its own ``matplotlib.figure.Figure`` (no pyplot, no global figure
state, and the matplotlib backend is never changed: a notebook keeps its own). Every function
writes a PNG to ``path`` and returns the path; nothing opens a window. The science modules
(:mod:`~jem_plugin.ood`, :mod:`~jem_plugin.calibration`, :mod:`~jem_plugin.robustness`)
compute the numbers; this module only draws them. Importing :mod:`jem_plugin` does not import
this module, matplotlib or torchvision.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import matplotlib.ticker
import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from ._train_state import History
from .adapter import InputDomain
from .errors import InvalidInputError
from .ood import OODTable

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

__all__ = [
    "save_image_grid",
    "save_samples",
    "image_grid",
    "plot_training_curves",
    "plot_density_2d",
    "density_grid",
    "plot_histograms",
    "plot_roc",
    "plot_ood_table",
    "reliability_diagram",
    "plot_robust_accuracy",
    "STYLE",
]

#: Readable defaults used by every figure here.
STYLE: dict[RcKeyType, Any] = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.formatter.useoffset": False,
}

# Curve metrics, in display order, with axis labels. Others present in the history are appended.
_CURVES = {
    "loss": "training loss",
    "ce": "cross-entropy",
    "acc": "train accuracy",
    "val_acc": "test accuracy",
    "val_nll": "test NLL",
    "energy_gap": "energy gap E(sample) - E(data)",
    "energy_data": "mean energy of data",
    "energy_sample": "mean energy of samples",
    "time": "seconds per epoch",
    "cpu_time": "CPU seconds per epoch",
}


def _wrap_title(text: str, width_inches: float, fontsize: float = 12.0) -> str:
    """``text`` wrapped, line by line, to about ``width_inches`` at ``fontsize`` points: a title
    longer than its figure (a long checkpoint or data name) is otherwise clipped at the edge."""
    chars = max(16, int(width_inches * 120 / fontsize))
    return "\n".join(textwrap.fill(line, chars) for line in text.splitlines())


def _axes_width(ax: Any) -> float:
    """The width of ``ax`` in inches."""
    return float(ax.figure.get_figwidth() * ax.get_position().width)


def _to_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def image_grid(
    x: Tensor, domain: InputDomain | None = None, nrow: int = 8, padding: int = 1, pad_value: float = 1.0
) -> Tensor:
    """A ``[C, H, W]`` grid in ``[0, 1]`` of images ``x [B, C, H, W]`` (``domain.to_unit`` for
    display; ``[-1, 1]`` assumed when ``domain`` is ``None``)."""
    from torchvision.utils import make_grid

    x = x.detach().float().cpu()
    if x.dim() != 4:
        raise ValueError(f"expected images of shape [B, C, H, W], got {tuple(x.shape)}")
    unit = (domain or InputDomain()).to_unit(x)
    return make_grid(unit, nrow=nrow, padding=padding, pad_value=pad_value)


def save_image_grid(
    x: Tensor,
    path: str | Path,
    domain: InputDomain | None = None,
    nrow: int = 8,
    title: str | None = None,
    row_labels: Sequence[str] | None = None,
    scale: float = 0.5,
) -> Path:
    """Save images ``x [B, C, H, W]`` as a grid PNG (``nrow`` images per row).

    ``domain`` maps samples back to pixels (default ``[-1, 1]``); ``row_labels`` names each row
    (e.g. the class of class-conditional samples). ``scale`` is inches per image.
    Small images (8x8 digits) are upscaled without smoothing so pixels stay visible.
    """
    path = _to_path(path)
    grid = image_grid(x, domain, nrow=nrow)
    img = grid.permute(1, 2, 0).numpy()
    if img.shape[2] == 1:
        img = img[..., 0]
    ncols = min(nrow, x.shape[0])
    nrows = math.ceil(x.shape[0] / nrow)
    with matplotlib.rc_context(STYLE):
        fig_w = max(3.0, ncols * scale + (0.6 if row_labels else 0.0))
        fig_h = max(1.5, nrows * scale + (0.5 if title else 0.1))
        fig = Figure(figsize=(fig_w, fig_h))
        ax = fig.subplots()
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=1, interpolation="nearest")
        ax.grid(False)
        ax.set_xticks([])
        if row_labels:
            h = x.shape[-2] + 1
            ax.set_yticks([1 + h * i + (h - 1) / 2 for i in range(len(row_labels))])
            ax.set_yticklabels(list(row_labels))
            ax.tick_params(length=0)
        else:
            ax.set_yticks([])
        for s in ax.spines.values():
            s.set_visible(False)
        if title:
            ax.set_title(_wrap_title(title, _axes_width(ax)))
        fig.tight_layout()
        fig.savefig(path)
    return path


def _series(h) -> dict[str, tuple[list[float], list[float]]]:
    """One run as ``{metric: (epochs, values)}``. Records (``History``) keep each value's own
    epoch, so metrics logged every few epochs (validation) sit at the right x."""
    if isinstance(h, History):
        h = h.to_dict()
    out: dict[str, tuple[list[float], list[float]]] = {}
    if isinstance(h, Mapping) and isinstance(h.get("epochs"), list):
        for i, rec in enumerate(h["epochs"]):
            ep = float(rec.get("epoch", i + 1))
            for k, v in rec.items():
                if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    xs, ys = out.setdefault(k, ([], []))
                    xs.append(ep)
                    ys.append(float(v))
        return out
    epochs = list(h.get("epoch", [])) if isinstance(h, Mapping) else []
    for k, v in h.items():
        if k == "epoch" or not len(v) or not all(isinstance(a, (int, float)) for a in v):
            continue
        xs = [float(e) for e in epochs] if len(epochs) == len(v) else [float(i + 1) for i in range(len(v))]
        out[k] = (xs, [float(a) for a in v])
    return out


def _as_runs(history) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Accept one history (``{metric: [values]}`` or a History), or ``{run: history}``."""

    def is_run(v) -> bool:
        return isinstance(v, History) or (
            isinstance(v, Mapping)
            and (isinstance(v.get("epochs"), list) or all(isinstance(a, (list, tuple)) for a in v.values()))
        )

    if (
        isinstance(history, Mapping)
        and history
        and not isinstance(history.get("epochs"), list)
        and all(is_run(v) for v in history.values())
        and not all(isinstance(v, (list, tuple)) for v in history.values())
    ):
        return {name: _series(v) for name, v in history.items()}
    return {"": _series(history)}


def plot_training_curves(
    history, path: str | Path, metrics: Sequence[str] | None = None, title: str | None = None
) -> Path:
    """Plot per-epoch metrics, one panel per metric, several runs overlaid (e.g. baseline vs JEM).

    ``history``: ``{metric: [per-epoch values]}``, a :class:`~jem_plugin.training.History`, or
    ``{run_name: history}`` for several runs. ``metrics`` picks panels (default: the known
    ones present: loss, cross-entropy, accuracies, energy gap, time per epoch).
    """
    path = _to_path(path)
    runs = _as_runs(history)
    present: list[str] = []
    for h in runs.values():
        present += [k for k in h if k not in present]
    if metrics is None:
        metrics = [k for k in _CURVES if k in present]
        if not metrics:
            metrics = present
    metrics = list(metrics)
    if not metrics:
        raise ValueError("the history holds no per-epoch numeric metrics to plot")
    ncol = min(3, len(metrics))
    nrow = math.ceil(len(metrics) / ncol)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.2 * ncol, 3.2 * nrow))
        axes = fig.subplots(nrow, ncol, squeeze=False)
        for ax, m in zip(axes.flat, metrics):
            for i, (name, h) in enumerate(runs.items()):
                if m in h and len(h[m][1]):
                    xs, ys = np.asarray(h[m][0]), np.asarray(h[m][1])
                    ax.plot(
                        xs,
                        ys,
                        label=name or None,
                        color=colors[i % len(colors)],
                        marker="o" if len(ys) <= 12 else None,
                        ms=3,
                    )
            ax.set_title(_CURVES.get(m, m))
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_ylabel(m)
            if m == "energy_gap":
                ax.axhline(0.0, color="0.4", lw=0.8, ls="--")
        for ax in list(axes.flat)[len(metrics) :]:
            ax.set_visible(False)
        if len(runs) > 1:
            handles, labels = axes.flat[0].get_legend_handles_labels()
            if not handles:
                for ax in axes.flat:
                    handles, labels = ax.get_legend_handles_labels()
                    if handles:
                        break
        fig.tight_layout()
        # Room above the panels for the title and the legend (inches -> figure fraction).
        fig_h = fig.get_figheight()
        head = (0.3 if title else 0.0) + (0.3 if len(runs) > 1 else 0.0)
        if head:
            top = fig.subplotpars.top
            fig.subplots_adjust(top=top - head / fig_h)
            y = 1.0 - 0.05 / fig_h
            if title:
                fig.suptitle(title, y=y, va="top")
                y -= 0.3 / fig_h
            if len(runs) > 1:
                fig.legend(handles, labels, loc="upper center", ncol=len(runs), frameon=False, bbox_to_anchor=(0.5, y))
        fig.savefig(path, bbox_inches="tight")
    return path


def density_grid(
    log_density: Callable[[Tensor], Tensor], lim: float = 3.0, n: int = 150
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Evaluate a log density on an ``n x n`` grid over ``[-lim, lim]^2``; returns the normalised
    density ``p [n, n]`` (sums to 1 over the grid times cell area) and the grid axes."""
    g = torch.linspace(-lim, lim, n)
    xx, yy = torch.meshgrid(g, g, indexing="xy")
    pts = torch.stack([xx.reshape(-1), yy.reshape(-1)], 1)
    with torch.no_grad():
        logp = torch.cat([log_density(c).detach().double().cpu() for c in pts.split(8192)])
    logp = logp - torch.logsumexp(logp[torch.isfinite(logp)], 0) if torch.isfinite(logp).any() else logp
    cell = (2 * lim / (n - 1)) ** 2
    p = (logp.exp() / cell).reshape(n, n).numpy()
    return p, g.numpy(), g.numpy()


def plot_density_2d(
    path: str | Path,
    *,
    learned: Callable[[Tensor], Tensor] | None = None,
    true: Callable[[Tensor], Tensor] | None = None,
    samples: Tensor | None = None,
    data: Tensor | None = None,
    lim: float = 3.0,
    n: int = 150,
    title: str | None = None,
) -> Path:
    """Side-by-side panels for a 2D EBM: true density, learned density (``exp(log_px)``
    normalised on the grid), and model samples (over the data, if given).

    ``learned`` and ``true`` are callables ``x [N, 2] -> log density [N]`` (unnormalised is
    fine); ``samples``/``data`` are ``[N, 2]`` tensors. Panels whose input is ``None`` are skipped.
    """
    path = _to_path(path)
    panels: list[tuple[str, Callable[[Tensor], Tensor] | None]] = []
    if true is not None:
        panels.append(("true density", true))
    if learned is not None:
        panels.append(("learned density  exp(log p(x))", learned))
    if samples is not None or data is not None:
        panels.append(("samples", None))
    if not panels:
        raise ValueError("give at least one of learned=, true=, samples=, data=")
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(4.0 * len(panels), 4.1))
        axes = fig.subplots(1, len(panels), squeeze=False)
        for ax, (name, fn) in zip(axes[0], panels):
            if fn is not None:
                p, gx, gy = density_grid(fn, lim, n)
                ax.imshow(p, origin="lower", extent=(-lim, lim, -lim, lim), cmap="viridis", interpolation="bilinear")
            else:
                if data is not None:
                    d = data.detach().cpu().numpy()
                    ax.scatter(d[:, 0], d[:, 1], s=2, c="0.7", alpha=0.5, label="data")
                if samples is not None:
                    s = samples.detach().cpu().numpy()
                    ax.scatter(s[:, 0], s[:, 1], s=3, c="C3", alpha=0.6, label="model samples")
                ax.set_xlim(-lim, lim)
                ax.set_ylim(-lim, lim)
                ax.legend(loc="upper right", markerscale=4, framealpha=0.9, fontsize=9)
            ax.set_title(name)
            ax.set_xlabel("$x_1$")
            ax.set_ylabel("$x_2$")
            ax.set_aspect("equal")
            ax.grid(False)
        if title:
            fig.suptitle(title, y=0.995, va="top")
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.4 / fig.get_figheight() if title else 0)))
        fig.savefig(path, bbox_inches="tight")
    return path


def save_samples(x: Tensor, path: str | os.PathLike, *, domain: InputDomain | None = None, nrow: int = 8) -> str:
    """Write images ``x [B, C, H, W]`` (C = 1 or 3) as a bare PNG grid, one pixel per pixel.

    ``domain`` maps them to pixels; without one each grid is min-max normalised. A replay
    buffer's chains: ``save_samples(buffer.samples(64), "buffer.png", domain=jm.domain)``.
    Returns ``path`` as a string.
    """
    from torchvision.utils import save_image

    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise InvalidInputError(f"save_samples needs images of shape [B, 1 or 3, H, W], got {tuple(x.shape)}")
    x = x.detach().float().cpu()
    path = str(_to_path(path))
    if domain is not None:
        save_image(domain.to_unit(x), path, nrow=nrow)
    else:
        save_image(x, path, nrow=nrow, normalize=True)
    return path


# ---------------------------------------------------------------------- OOD scores
def _scores(s: Any, what: str) -> np.ndarray:
    from .ood import _as_scores  # the same validation (and errors) as ood.evaluate

    return _as_scores(s, what)


def _out_dict(scores_out: Any) -> dict[str, np.ndarray]:
    from .errors import InvalidScoresError

    if isinstance(scores_out, Mapping):
        if not scores_out:
            raise InvalidScoresError("scores_out is an empty dict: give at least one OOD set")
        return {str(k): _scores(v, f"scores_out[{k!r}]") for k, v in scores_out.items()}
    return {"out": _scores(scores_out, "scores_out")}


def plot_histograms(
    scores_in: Any,
    scores_out: Any,
    path: str,
    title: str | None = None,
    *,
    bins: int = 50,
    label_in: str = "in-distribution",
    xlabel: str = "score (higher = more in-distribution)",
) -> str:
    """Save overlaid, density-normalised histograms of in- vs out-of-distribution scores as a PNG.

    ``scores_out`` is one set or ``{name: scores}`` for several OOD sets; each legend entry
    carries the AUROC against the in-distribution scores. Returns ``path``.
    """
    from .ood import evaluate

    s_in = _scores(scores_in, "scores_in")
    outs = _out_dict(scores_out)
    allv = np.concatenate([s_in, *outs.values()])
    lo, hi = float(allv.min()), float(allv.max())
    edges: list[float] = np.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1).tolist()
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    ax.hist(s_in, bins=edges, density=True, alpha=0.55, label=f"{label_in} (n={s_in.size})", color="C0")
    for i, (name, s) in enumerate(outs.items(), start=1):
        au = evaluate(s_in, s)["auroc"]
        ax.hist(s, bins=edges, density=True, alpha=0.45, color=f"C{i}", label=f"{name} (n={s.size}, AUROC {au:.3f})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("density")
    ax.set_title(_wrap_title(title or "OOD scores", _axes_width(ax)))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_roc(scores_in: Any, scores_out: Any, path: str, title: str | None = None) -> str:
    """Save ROC curves (in-distribution positive) for one or several OOD sets as a PNG.

    x: fraction of OOD inputs accepted (FPR); y: fraction of in-distribution inputs accepted
    (TPR). The legend gives AUROC and FPR at 95% TPR per set. Returns ``path``.
    """
    from sklearn.metrics import roc_curve

    from .ood import evaluate

    s_in = _scores(scores_in, "scores_in")
    outs = _out_dict(scores_out)
    fig = Figure(figsize=(5.0, 4.8))
    ax = fig.subplots()
    for i, (name, s) in enumerate(outs.items(), start=1):
        y = np.concatenate([np.ones(s_in.size), np.zeros(s.size)])
        fpr, tpr, _ = roc_curve(y, np.concatenate([s_in, s]))
        m = evaluate(s_in, s)
        ax.plot(fpr, tpr, color=f"C{i}", lw=1.8, label=f"{name}: AUROC {m['auroc']:.3f}, FPR95 {m['fpr95']:.3f}")
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="chance")
    ax.axhline(0.95, ls=":", color="k", lw=0.8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false positive rate (OOD accepted)")
    ax.set_ylabel("true positive rate (in-distribution accepted)")
    ax.set_title(_wrap_title(title or "ROC, in-distribution positive", _axes_width(ax)))
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _table_records(table: Any) -> list[dict[str, Any]]:
    """Rows of an :class:`~jem_plugin.ood.OODTable`, or of a plain ``{score: {set: metrics}}``."""
    if isinstance(table, OODTable):
        return list(table.rows())
    if isinstance(table, Mapping):
        return [
            {"score": str(m), "set": str(s), "status": "ok", **dict(v)}
            for m, per_set in table.items()
            for s, v in per_set.items()
        ]
    return [dict(r) for r in table]


def plot_ood_table(table: Any, path: str, title: str | None = None, *, metric: str = "auroc") -> str:
    """Save a heat map of ``metric`` (default AUROC) per score (rows) and OOD set (columns) as a PNG.

    ``table`` is what :func:`jem_plugin.ood.evaluate_all` returns (or its rows, or a plain
    ``{score: {set: metrics}}``). Each cell shows its value (red below chance, green towards
    1); the best score of each set is outlined in black; pairs not measured are grey and say
    why (``skip``: a detector without fit data, ``fail``: it raised, ``NaN``: non-finite
    scores). Row labels carry the mean over the sets. Returns ``path``.
    """
    from matplotlib.patches import Rectangle

    lower_better = metric == "fpr95"
    records = _table_records(table)
    if not records:
        raise ValueError("the table is empty: nothing to draw")
    scores = list(dict.fromkeys(r["score"] for r in records))
    sets = list(dict.fromkeys(r["set"] for r in records))
    values = np.full((len(scores), len(sets)), np.nan)
    status: dict[tuple[int, int], str] = {}
    for r in records:
        i, j = scores.index(r["score"]), sets.index(r["set"])
        if r.get("status", "ok") == "ok":
            values[i, j] = float(r[metric])
        else:
            status[(i, j)] = {"skipped": "skip", "failed": "fail", "non-finite": "NaN"}.get(r["status"], r["status"])
    cmap = matplotlib.colormaps["RdYlGn_r" if lower_better else "RdYlGn"].with_extremes(bad="#d9d9d9")
    with matplotlib.rc_context({**STYLE, "axes.grid": False}):
        fig = Figure(figsize=(1.6 + 0.95 * len(sets) + 1.6, 1.3 + 0.36 * len(scores)))
        ax = fig.subplots()
        im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        for i in range(len(scores)):
            for j in range(len(sets)):
                v = values[i, j]
                if np.isnan(v):
                    ax.text(j, i, status.get((i, j), "-"), ha="center", va="center", fontsize=8, color="#555555")
                    continue
                red, green, blue, _ = cmap(float(v))
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
        for j in range(len(sets)):
            col = values[:, j]
            if np.all(np.isnan(col)):
                continue
            top = np.nanmin(col) if lower_better else np.nanmax(col)
            for k in np.flatnonzero(col == top).tolist():
                ax.add_patch(Rectangle((j - 0.5, k - 0.5), 1, 1, fill=False, edgecolor="black", lw=2.2))
        means = [np.mean(row) if not np.any(np.isnan(row)) else np.nan for row in values]
        ax.set_yticks(range(len(scores)))
        ax.set_yticklabels([f"{m}  ({mu:.3f})" if not np.isnan(mu) else m for m, mu in zip(scores, means)])
        ax.set_xticks(range(len(sets)))
        ax.set_xticklabels(sets, rotation=30, ha="right")
        ax.tick_params(length=0)
        label = {"auroc": "AUROC", "aupr_in": "AUPR-in", "aupr_out": "AUPR-out", "fpr95": "FPR at 95% TPR"}
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label=label.get(metric, metric))
        text = (
            title
            or f"OOD detection: {label.get(metric, metric)} per score and OOD set\n"
            "(best per set outlined; row label: mean over the sets)"
        )
        # Over the whole figure, wrapped to its width: a table of one or two sets is narrower than
        # its title, which an axes title would clip at the edge.
        wrapped = _wrap_title(text, fig.get_figwidth(), fontsize=10)
        fig.suptitle(wrapped, fontsize=10)
        # tight_layout leaves the figure title out: keep its lines' height (and a margin) clear
        title_inches = 0.25 + 0.2 * (wrapped.count("\n") + 1)
        fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - title_inches / fig.get_figheight()))
        fig.savefig(_to_path(path), dpi=120)
    return path


# ---------------------------------------------------------------------- calibration
#: Fill colours of the reliability diagram's gaps: over-confident (light red), under-confident (light orange).
RELIABILITY_OVER, RELIABILITY_UNDER = "#f4b6b6", "#ffd59a"


def reliability_diagram(
    probs: Any, labels: Any, path: str, n_bins: int = 15, title: str | None = None, *, from_logits: bool = False
) -> str:
    """Save a reliability diagram as a PNG (Guo et al. 2017, Fig. 1 style); returns ``path``.

    Top: accuracy per confidence bin (bars), the gap to the bin's mean confidence (hatched: red
    above a bar where the bin is over-confident, orange inside it where it is under-confident;
    each colour in the legend, drawn opaque so no blend of the two appears), the diagonal of
    perfect calibration, ECE and MCE in the legend. Bottom: share of predictions per bin, with the
    mean confidence and the accuracy marked.
    """
    from .calibration import accuracy, calibration_bins, ece, mce

    b = calibration_bins(probs, labels, n_bins, from_logits=from_logits)
    e = ece(probs, labels, n_bins, from_logits=from_logits)
    m = mce(probs, labels, n_bins, from_logits=from_logits)
    acc_all = accuracy(probs, labels, from_logits=from_logits)
    edges, count = b["edges"], b["count"]
    centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
    nonempty = count > 0
    acc = np.where(nonempty, b["accuracy"], 0.0)
    conf = np.where(nonempty, b["confidence"], 0.0)
    n = count.sum()
    mean_conf = float((count[nonempty] * conf[nonempty]).sum() / n)

    fig = Figure(figsize=(5.0, 7.6))
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.bar(centers[nonempty], acc[nonempty], width=width, color="C0", edgecolor="k", lw=0.6, label="accuracy per bin")
    for mask, colour, edge, hatch, label in (
        (conf > acc, RELIABILITY_OVER, "C3", "//", "gap, over-confident (confidence > accuracy)"),
        (conf < acc, RELIABILITY_UNDER, "C1", "\\\\", "gap, under-confident (accuracy > confidence)"),
    ):
        mask = mask & nonempty
        if mask.any():  # opaque: over the bar's blue it would blend into a colour the legend lacks
            ax.bar(
                centers[mask],
                np.abs(conf - acc)[mask],
                bottom=np.minimum(acc, conf)[mask],
                width=width,
                color=colour,
                edgecolor=edge,
                hatch=hatch,
                lw=0.6,
                label=label,
            )
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="perfect calibration")
    ax.plot([], [], " ", label=f"ECE {e:.4f}   MCE {m:.4f}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title(_wrap_title(title or "Reliability diagram", _axes_width(ax)))

    ax2.bar(centers, count / n, width=width, color="C0", edgecolor="k", lw=0.6)
    ax2.axvline(acc_all, color="C2", ls="-", lw=1.5, label=f"accuracy {acc_all:.3f}")
    ax2.axvline(mean_conf, color="C3", ls="--", lw=1.5, label=f"mean confidence {mean_conf:.3f}")
    ax2.set_xlabel(f"confidence ({n_bins} equal-width bins)")
    ax2.set_ylabel("share")
    # One legend below both panels: inside either it would cover (and tint) bars.
    (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.175, 1, 1))
    fig.savefig(path, dpi=120)
    return path


# ---------------------------------------------------------------------- robustness
def plot_robust_accuracy(
    results: Mapping[str, Any],
    path: str,
    title: str | None = None,
    *,
    eps_scale: float = 1.0,
    eps_label: str | None = None,
) -> str:
    """Save robust accuracy against ``eps`` as a PNG; returns ``path``.

    ``results`` is one :func:`~jem_plugin.robustness.robust_accuracy` result or ``{label: result}``
    for several models or defences. ``eps_scale=255`` shows L-inf budgets in pixel levels.
    """
    if "eps" in results and "accuracy" in results:
        results = {results.get("attack", "model"): results}
    if not results:
        raise ValueError("results is empty: pass robust_accuracy(...) outputs")
    fig = Figure(figsize=(5.6, 4.2))
    ax = fig.subplots()
    norms = set()
    for i, (name, r) in enumerate(results.items()):
        eps = np.asarray(r["eps"], dtype=float) * eps_scale
        ax.plot(eps, r["accuracy"], marker="o", ms=4, lw=1.8, color=f"C{i}", label=f"{name} ({r.get('attack', 'pgd')})")
        norms.add(r.get("norm", "linf"))
    norm_txt = "/".join(sorted(norms))
    ax.set_xlabel(eps_label or f"eps ({norm_txt}{f', x{eps_scale:g}' if eps_scale != 1 else ''})")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(_wrap_title(title or f"Robust accuracy under PGD ({norm_txt})", _axes_width(ax)))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
