"""Shared matplotlib helpers: sample grids, training curves, 2D densities. Files only (Agg).

Every function writes a PNG and returns its path; nothing opens a window.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from .adapter import InputDomain  # noqa: E402

__all__ = ["save_image_grid", "image_grid", "plot_training_curves", "plot_density_2d",
           "density_grid", "STYLE"]

#: Readable defaults used by every figure here.
STYLE = {"font.size": 11, "axes.titlesize": 12, "axes.labelsize": 11, "legend.fontsize": 10,
         "figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3, "axes.formatter.useoffset": False}

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


def _to_path(path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def image_grid(x: Tensor, domain: InputDomain | None = None, nrow: int = 8, padding: int = 1,
               pad_value: float = 1.0) -> Tensor:
    """A ``[C, H, W]`` grid in ``[0, 1]`` of images ``x [B, C, H, W]`` (``domain.to_unit`` for
    display; ``[-1, 1]`` assumed when ``domain`` is ``None``)."""
    from torchvision.utils import make_grid

    x = x.detach().float().cpu()
    if x.dim() != 4:
        raise ValueError(f"expected images of shape [B, C, H, W], got {tuple(x.shape)}")
    unit = (domain or InputDomain()).to_unit(x)
    return make_grid(unit, nrow=nrow, padding=padding, pad_value=pad_value)


def save_image_grid(x: Tensor, path: str | Path, domain: InputDomain | None = None, nrow: int = 8,
                    title: str | None = None, row_labels: Sequence[str] | None = None,
                    scale: float = 0.5) -> Path:
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
    with plt.rc_context(STYLE):
        fig_w = max(3.0, ncols * scale + (0.6 if row_labels else 0.0))
        fig_h = max(1.5, nrows * scale + (0.5 if title else 0.1))
        fig, ax = plt.subplots(figsize=(fig_w, fig_h))
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=1,
                  interpolation="nearest")
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
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
    return path


def _series(h) -> dict[str, tuple[list[float], list[float]]]:
    """One run as ``{metric: (epochs, values)}``. Records (``History``) keep each value's own
    epoch, so metrics logged every few epochs (validation) sit at the right x."""
    if hasattr(h, "to_dict"):
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
        return hasattr(v, "to_dict") or (isinstance(v, Mapping) and (
            isinstance(v.get("epochs"), list) or all(isinstance(a, (list, tuple)) for a in v.values())))

    if isinstance(history, Mapping) and history and not isinstance(history.get("epochs"), list) \
            and all(is_run(v) for v in history.values()) \
            and not all(isinstance(v, (list, tuple)) for v in history.values()):
        return {name: _series(v) for name, v in history.items()}
    return {"": _series(history)}


def plot_training_curves(history, path: str | Path,
                         metrics: Sequence[str] | None = None, title: str | None = None) -> Path:
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
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
        for ax, m in zip(axes.flat, metrics):
            for i, (name, h) in enumerate(runs.items()):
                if m in h and len(h[m][1]):
                    xs, ys = np.asarray(h[m][0]), np.asarray(h[m][1])
                    ax.plot(xs, ys, label=name or None, color=colors[i % len(colors)],
                            marker="o" if len(ys) <= 12 else None, ms=3)
            ax.set_title(_CURVES.get(m, m))
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_ylabel(m)
            if m == "energy_gap":
                ax.axhline(0.0, color="0.4", lw=0.8, ls="--")
        for ax in list(axes.flat)[len(metrics):]:
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
        h = fig.get_figheight()
        head = (0.3 if title else 0.0) + (0.3 if len(runs) > 1 else 0.0)
        if head:
            top = fig.subplotpars.top
            fig.subplots_adjust(top=top - head / h)
            y = 1.0 - 0.05 / h
            if title:
                fig.suptitle(title, y=y, va="top")
                y -= 0.3 / h
            if len(runs) > 1:
                fig.legend(handles, labels, loc="upper center", ncol=len(runs), frameon=False,
                           bbox_to_anchor=(0.5, y))
        fig.savefig(path, bbox_inches="tight")
        plt.close(fig)
    return path


def density_grid(log_density: Callable[[Tensor], Tensor], lim: float = 3.0, n: int = 150
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


def plot_density_2d(path: str | Path, *, learned: Callable[[Tensor], Tensor] | None = None,
                    true: Callable[[Tensor], Tensor] | None = None, samples: Tensor | None = None,
                    data: Tensor | None = None, lim: float = 3.0, n: int = 150,
                    title: str | None = None) -> Path:
    """Side-by-side panels for a 2D EBM: true density, learned density (``exp(log_px)``
    normalised on the grid), and model samples (over the data, if given).

    ``learned`` and ``true`` are callables ``x [N, 2] -> log density [N]`` (unnormalised is
    fine); ``samples``/``data`` are ``[N, 2]`` tensors. Panels whose input is ``None`` are skipped.
    """
    path = _to_path(path)
    panels: list[tuple[str, object]] = []
    if true is not None:
        panels.append(("true density", true))
    if learned is not None:
        panels.append(("learned density  exp(log p(x))", learned))
    if samples is not None or data is not None:
        panels.append(("samples", None))
    if not panels:
        raise ValueError("give at least one of learned=, true=, samples=, data=")
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 4.1), squeeze=False)
        for ax, (name, fn) in zip(axes[0], panels):
            if fn is not None:
                p, gx, gy = density_grid(fn, lim, n)
                ax.imshow(p, origin="lower", extent=(-lim, lim, -lim, lim), cmap="viridis",
                          interpolation="bilinear")
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
        plt.close(fig)
    return path
