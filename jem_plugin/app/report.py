"""A single self-contained HTML report from an experiment directory.

Reads the experiment's result dict (what :mod:`jem_plugin.app.experiments` returns and writes as
``metrics.json``) and every PNG in the directory, and writes ``report.html`` with the figures
embedded (base64), so the file can be mailed or attached to an issue as it is.
"""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["write_report", "flatten_metrics"]

# Figures are shown in this order when present (file stem prefixes); others follow alphabetically.
FIGURE_ORDER = ("samples", "buffer", "class", "curves", "training", "reliability", "hist", "roc", "robust")

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}
.better{font-weight:bold;color:#0a5d00}
figure{display:inline-block;margin:.6em;vertical-align:top;text-align:center}
figure img{max-width:500px;border:1px solid #eee}figcaption{font-size:.85em;color:#555}
.note{color:#555;font-size:.9em}
.missed{font-weight:bold;color:#a00}
"""


def flatten_metrics(d: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"ood": {"logpx": {"noise": 0.9}}}`` -> ``{"ood/logpx/noise": 0.9}`` (numbers only)."""
    flat: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(flatten_metrics(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[key] = float(v)
    return flat


def _higher_is_better(key: str) -> bool | None:
    k = key.lower()
    if any(s in k for s in ("ece", "mce", "nll", "brier", "fpr", "seconds", "time", "loss")):
        return False
    if any(s in k for s in ("acc", "auroc", "aupr")):
        return True
    return None


def _table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    names = list(runs)
    flat = {n: flatten_metrics(runs[n]) for n in names}
    keys: list[str] = []
    for n in names:
        keys += [k for k in flat[n] if k not in keys]
    rows = []
    for k in keys:
        vals = [flat[n].get(k) for n in names]
        present = [v for v in vals if v is not None]
        hib = _higher_is_better(k)
        best = None
        if hib is not None and len(present) > 1 and len(set(present)) > 1:
            best = max(present) if hib else min(present)
        cells = "".join(
            "<td></td>" if v is None else
            f"<td class=\"{'better' if v == best else ''}\">{v:.4g}</td>" for v in vals)
        rows.append(f"<tr><td>{html.escape(k)}</td>{cells}</tr>")
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"


def _figure_key(p: Path) -> tuple[int, str]:
    stem = p.stem.lower()
    for i, prefix in enumerate(FIGURE_ORDER):
        if prefix in stem:
            return (i, stem)
    return (len(FIGURE_ORDER), stem)


def write_report(out_dir: str | Path, result: Mapping[str, Any] | None = None,
                 title: str = "jem-plugin report") -> Path:
    """Write ``out_dir/report.html`` and return its path.

    ``result`` defaults to ``out_dir/metrics.json``. Its ``"runs"`` entry (``{run_name: metrics}``)
    becomes a side-by-side table (best value per row in bold); a ``"targets"`` entry
    (``{name: bool}``) a list of met/missed targets; any other top-level entries are listed as
    settings. Every PNG under ``out_dir`` is embedded.
    """
    out = Path(out_dir)
    if result is None:
        result = json.loads((out / "metrics.json").read_text())
    runs = result.get("runs", {})
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if result.get("description"):
        parts.append(f"<p>{html.escape(str(result['description']))}</p>")
    if runs:
        parts.append("<h2>Results</h2>")
        parts.append("<p class='note'>Best value per row in bold (higher is better for accuracy and AUROC/AUPR; "
                     "lower for ECE, NLL, Brier, FPR at 95% TPR and time). OOD scores: higher = more "
                     "in-distribution; OOD sets: uniform noise, 8x8 patches of photos, blends of two digits "
                     "of different classes, transposed digits.</p>")
        parts.append(_table({n: r.get("summary", r) for n, r in runs.items()}))
    targets = result.get("targets")
    if isinstance(targets, Mapping) and targets:
        items = "".join(f"<li class='{'better' if ok else 'missed'}'>{'met' if ok else 'MISSED'}: "
                        f"{html.escape(str(name).replace('_', ' '))}</li>" for name, ok in targets.items())
        parts.append(f"<h2>Targets</h2><ul>{items}</ul>")
    settings = {k: v for k, v in result.items() if k not in ("runs", "description", "targets")}
    if settings:
        parts.append("<h2>Settings</h2><pre>" + html.escape(json.dumps(settings, indent=2, default=str)) + "</pre>")
    pngs = sorted(out.rglob("*.png"), key=_figure_key)
    if pngs:
        parts.append("<h2>Figures</h2>")
        for p in pngs:
            data = base64.b64encode(p.read_bytes()).decode("ascii")
            caption = html.escape(str(p.relative_to(out).with_suffix("")).replace("_", " "))
            parts.append(f"<figure><img alt='{caption}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{caption}</figcaption></figure>")
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
