"""A single self-contained HTML report from an experiment directory.

Reads the experiment's result dict (what :mod:`jem_plugin.app.experiments` returns and writes as
``metrics.json``) and every PNG in the directory, and writes ``report.html`` with the figures
embedded (base64), so the file can be mailed or attached to an issue as it is.

The report reads as a result: a warning first when a run was cut short, then a few sentences
computed from the numbers (what JEM gained, what it cost), a table of the runs side by side with
readable metric names and a one-line meaning each, and the figures, each with a caption that
says what to look at, baseline and JEM next to each other.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "write_report",
    "flatten_metrics",
    "summary_sentences",
    "metric_label",
    "post_training_rows",
    "sample_quality_line",
    "fd_sample_size_note",
]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:1em 0;font-size:.92em}
th,td{border:1px solid #ccc;padding:.3em .7em;text-align:right}th{background:#f4f4f4}
td.name,th.name{text-align:left}td.sub{padding-left:2em;color:#444}td.meaning{text-align:left;color:#555;font-size:.9em}
tr.section td{background:#fafafa;font-weight:bold;text-align:left}
.better{font-weight:bold;color:#0a5d00}
.warning{border:2px solid #b00;background:#fff3f3;padding:.7em 1em;font-weight:bold;color:#900}
.summary li{margin:.3em 0}
.row{display:grid;grid-template-columns:repeat(var(--n),1fr);gap:1em;margin:1em 0;align-items:start}
figure{margin:0;text-align:center}figure img{width:100%;border:1px solid #eee;image-rendering:pixelated}
figure.wide img{max-width:1100px}figcaption{font-size:.88em;color:#444;text-align:left;margin-top:.3em}
.caption{font-size:.92em;color:#333;margin:.2em 0 .4em}
.note{color:#555;font-size:.9em}
"""

#: What a fitted temperature says (the report's table and its summary).
TEMPERATURE_MEANING = (
    "probabilities are softmax(logits / T); 1 = already calibrated; above 1: the model was over-confident, "
    "its logits are softened; below 1: the model was under-confident, its logits are sharpened"
)
#: The one cost ratio the report gives, named the same in the table and the summary.
COST_RATIO = "CPU time ratio to the baseline"

# Readable names: key -> (name, one-line meaning, higher is better: True/False/None); a name that
# starts with two spaces is a reference point, shown indented under the figure above it.
METRICS: dict[str, tuple[str, str, bool | None]] = {
    "accuracy": ("Test accuracy", "share of held-out images classified correctly", True),
    "nll": ("Test NLL", "negative log-likelihood of the true class (lower: confident and right)", False),
    "ece": ("Calibration error (ECE)", "gap between confidence and accuracy; 0 = calibrated", False),
    "ece_temp_scaled": ("ECE after temperature scaling", "the same, after fitting one temperature", False),
    "temperature": ("Fitted temperature", TEMPERATURE_MEANING, None),
    # Sample quality by an independent judge CNN (jem_plugin.sample_quality), references beside it.
    "fd_buffer": (
        "Sample distance: replay buffer (FD)",
        "Fréchet distance of buffer samples to held-out images in the judge's features; lower = more like real images",
        False,
    ),
    "fd_init": (
        "  reference: initial distribution (FD)",
        "the same for draws the chains started from, before any learning: the buffer should fall well below it",
        None,
    ),
    "fd_heldout_floor": (
        "  reference: the data's own held-out FD",
        "two halves of real held-out images, as many as above: a reference, not a floor (samples less varied "
        "than the data can score below it)",
        None,
    ),
    "fd_n_samples": (
        "  images per distance",
        "every distance above compares this many images with as many held-out ones (FD depends on it)",
        None,
    ),
    "judge_acc_samples": (
        "Judge accuracy on class samples",
        "share of class-conditional samples an independent CNN (not the JEM) puts in the class they were drawn for",
        True,
    ),
    "judge_acc_init": (
        "  reference: judge on init draws",
        "the same for per-class draws of the initial "
        "distribution, no SGLD (chance for uniform noise, high for a per-class Gaussian)",
        None,
    ),
    "judge_acc_heldout": (
        "  reference: judge on test images",
        "the judge's accuracy on real held-out images: the ceiling",
        None,
    ),
    "epochs": ("Epochs trained", "full passes over the training set", None),
    "seconds_per_epoch": ("Seconds per epoch", "wall-clock time of one epoch", False),
    "cpu_seconds_per_epoch": ("CPU seconds per epoch", "processor time of one epoch (fair on a busy machine)", False),
    "train_seconds": ("Training time (s)", "wall-clock seconds spent training", False),
    "train_cpu_seconds": ("Training CPU time (s)", "processor seconds spent training", False),
    "wall_seconds": ("Wall time incl. saving (s)", "training plus writing checkpoints", False),
    "cpu_time_ratio": (
        COST_RATIO,
        "CPU seconds per epoch divided by the baseline's (per epoch: a run cut short is not cheaper)",
        False,
    ),
}
# Ratios metrics.json also holds, left out of the report: it gives one cost ratio (cpu_time_ratio).
_OTHER_RATIOS = ("cost_vs_baseline", "wall_cost_vs_baseline")
#: How to read the sample-quality figures (report section title and summary).
QUALITY_HOW_TO_READ = (
    "Read each figure against its reference: the buffer's distance should fall well below its "
    "initial distribution's; the data's own held-out distance (real images against real ones, as many) "
    "is a reference, not a floor: samples less varied than the data can fall below it. Judge accuracy "
    "on samples counts only above its init's (a per-class Gaussian init scores high without any learning)."
)


def fd_sample_size_note(n: int) -> str:
    """What Fréchet distances of ``n`` images can and cannot tell (one sentence)."""
    return (
        f"{n} images tell a buffer that left its init from one that did not; they cannot rank two close models "
        "(at so few images FD is mostly its own small-sample bias), nor compare with published FIDs "
        "(Inception features, 10 000+ images)."
    )


def _fd_verdict(buffer: float, init: float) -> str:
    if buffer < 0.5 * init:
        return "well below its init's: the chains moved towards the data"
    if buffer < init:
        return "below its init's, not far: the chains moved a little"
    return "not below its init's: the chains have not moved towards the data"


def sample_quality_line(q: Mapping[str, Any]) -> str:
    """``jem train``'s sample-quality line: the buffer's Fréchet distance with its references named
    (the chains' init, the data's own held-out halves), the judge's accuracy with its, and what
    the number of images can tell."""
    if "skipped" in q:
        return f"sample quality: {q['skipped']}"
    n = int(q["fd_n_samples"])
    text = (
        f"sample quality ({n} images per Fréchet distance, in an independent judge CNN's features; lower = "
        f"closer to real images): replay buffer FD {q['fd_buffer']:.3g}, {_fd_verdict(q['fd_buffer'], q['fd_init'])}. "
        f"References: the chains' init {q['fd_init']:.3g}; the data's own held-out FD {q['fd_heldout_floor']:.3g} "
        "(real images against real ones: a reference, not a floor; samples less varied than the data can fall "
        "below it)."
    )
    if "judge_acc_samples" in q:
        text += (
            f" Judge accuracy on class samples {q['judge_acc_samples']:.2f}, against its init draws' "
            f"{q['judge_acc_init']:.2f} (it counts only above that) and real test images' {q['judge_acc_heldout']:.2f}."
        )
    return f"{text} {fd_sample_size_note(n)}"


SCORES = {
    "logpx": "log p(x)",
    "msp": "max softmax",
    "grad_norm": "gradient norm",
    "grad_norm_projected": "gradient norm (projected)",
}
OOD_SETS = {
    "noise": "uniform noise",
    "patches": "photo patches",
    "blends": "blends of two digits",
    "transposed": "transposed digits",
}
_SET_MEANING = {
    "noise": "random pixels: the easiest set",
    "patches": "crops of two photos, shrunk to the image size",
    "blends": "the average of two digits of different classes: the hardest set",
    "transposed": "digits mirrored about the diagonal: digit-like strokes, wrong shapes",
}
_SECTIONS = (
    ("Classification", ("accuracy", "nll")),
    ("Calibration", ("ece", "ece_temp_scaled", "temperature")),
    (
        "Out-of-distribution detection: AUROC (0.5 = chance, 1 = every OOD input scores below every test image)",
        ("auroc_",),
    ),
    (
        f"Sample quality, by an independent judge CNN. {QUALITY_HOW_TO_READ}",
        (
            "fd_buffer",
            "fd_init",
            "fd_heldout_floor",
            "fd_n_samples",
            "judge_acc_samples",
            "judge_acc_init",
            "judge_acc_heldout",
        ),
    ),
    (
        "Cost",
        (
            "epochs",
            "seconds_per_epoch",
            "cpu_seconds_per_epoch",
            "train_seconds",
            "train_cpu_seconds",
            "wall_seconds",
            "cpu_time_ratio",
        ),
    ),
)

# Figure captions: (file-stem pattern, caption). ``{run}`` is the run the figure belongs to.
CAPTIONS: tuple[tuple[str, str], ...] = (
    (
        r"samples_per_class",
        "Class-conditional samples, one row per class: each row should show its class. "
        "Rows of noise mean the generative side has not learned yet.",
    ),
    (
        r"samples_buffer|^buffer",
        "Unconditional samples from the JEM replay buffer: they should look like the "
        "training images (blurry is fine); pure noise means too short a run.",
    ),
    (r"samples", "Samples drawn from the model with SGLD, labelled by class."),
    (
        r"curves",
        "Training curves, all runs on shared axes: test accuracy should reach the same level for "
        "each run; an energy gap that swings far from 0 signals unstable JEM training.",
    ),
    (
        r"reliability_(?P<run>.+)",
        "{run}: reliability diagram. Bars on the diagonal = calibrated; below it = "
        "over-confident, above it = under-confident.",
    ),
    (
        r"hist_logpx_(?P<run>.+)",
        "{run}: log p(x) of test images vs each OOD set. Test images should sit to "
        "the right (higher), well apart from the OOD sets.",
    ),
    (
        r"hist_grad_norm_(?P<run>.+)",
        "{run}: gradient-norm score. Test images to the right, OOD sets apart. It reads log p(x) as a "
        "trained density: on a model trained without the JEM loss (the baseline) it can rank OOD images higher.",
    ),
    (
        r"roc_logpx_(?P<run>.+)",
        "{run}: ROC curves of log p(x). Curves hugging the top-left corner = OOD set told apart from test images.",
    ),
)


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


def metric_label(key: str) -> tuple[str, str, bool | None]:
    """``(readable name, one-line meaning, higher is better)`` of a summary key."""
    if key in METRICS:
        return METRICS[key]
    m = re.fullmatch(r"auroc_(.+)_([^_]+)", key)
    if m and m.group(1) in SCORES:
        score, ood_set = m.group(1), m.group(2)
        return (
            f"{SCORES[score]} vs {OOD_SETS.get(ood_set, ood_set)}",
            _SET_MEANING.get(ood_set, f"the OOD set {ood_set!r} against test images"),
            True,
        )
    return key.replace("_", " "), "", None


def _order(key: str) -> tuple[int, int]:
    """``(section, place in the section's list)``: a figure's reference points follow it."""
    s = _section_of(key)
    keys = _SECTIONS[s][1] if s < len(_SECTIONS) else ()
    return s, keys.index(key) if key in keys else len(keys)


def _section_of(key: str) -> int:
    for i, (_, keys) in enumerate(_SECTIONS):
        if key in keys or any(key.startswith(k) for k in keys if k.endswith("_")):
            return i
    return len(_SECTIONS)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    names = list(runs)
    flat = {n: flatten_metrics(runs[n]) for n in names}
    keys: list[str] = []
    for n in names:
        keys += [k for k in flat[n] if k not in keys]
    keys.sort(key=_order)  # stable: keys a section does not list keep the run's order
    rows, section = [], None
    for k in keys:
        s = _section_of(k)
        if s != section:
            section = s
            title = _SECTIONS[s][0] if s < len(_SECTIONS) else "Other"
            rows.append(f"<tr class='section'><td colspan='{len(names) + 2}'>{html.escape(title)}</td></tr>")
        name, meaning, hib = metric_label(k)
        vals = [flat[n].get(k) for n in names]
        present = [v for v in vals if v is not None]
        best = None
        if hib is not None and len(present) > 1 and len(set(present)) > 1:
            best = max(present) if hib else min(present)
        cells = "".join(
            "<td></td>" if v is None else f'<td class="{"better" if v == best else ""}">{_fmt(v)}</td>' for v in vals
        )
        sub = " sub" if name.startswith("  ") else ""  # a reference point, indented under its figure
        rows.append(
            f"<tr><td class='name{sub}'>{html.escape(name.strip())}</td>{cells}"
            f"<td class='meaning'>{html.escape(meaning)}</td></tr>"
        )
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    return (
        f"<table><tr><th class='name'>metric</th>{head}<th class='name'>what it means</th></tr>{''.join(rows)}</table>"
    )


def summary_sentences(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A few sentences computed from the numbers: what JEM gained over the baseline, what it cost."""
    if "baseline" not in runs or len(runs) < 2:
        return []
    b = runs["baseline"].get("summary", runs["baseline"])
    name = next(n for n in runs if n != "baseline")
    j = runs[name].get("summary", runs[name])
    out = []
    if "accuracy" in b and "accuracy" in j:
        d = 100 * (j["accuracy"] - b["accuracy"])
        verdict = "within half a point" if abs(d) < 0.5 else f"{abs(d):.1f} points {'more' if d > 0 else 'less'}"
        out.append(
            f"Accuracy: {name} classifies {100 * j['accuracy']:.1f}% of the test images correctly, the "
            f"baseline {100 * b['accuracy']:.1f}% ({verdict})."
        )
    sets = [k[len("auroc_logpx_") :] for k in j if k.startswith("auroc_logpx_")]
    if sets and all(f"auroc_logpx_{s}" in b for s in sets):
        mj = sum(j[f"auroc_logpx_{s}"] for s in sets) / len(sets)
        mb = sum(b[f"auroc_logpx_{s}"] for s in sets) / len(sets)
        worst = min(sets, key=lambda s: j[f"auroc_logpx_{s}"])
        out.append(
            f"Out-of-distribution detection with log p(x): mean AUROC {mj:.2f} for {name} vs {mb:.2f} for "
            f"the baseline over {len(sets)} OOD sets ({'gain' if mj > mb else 'no gain'}); hardest for "
            f"{name}: {OOD_SETS.get(worst, worst)} ({j[f'auroc_logpx_{worst}']:.2f})."
        )
    if "ece" in b and "ece" in j:
        verdict = "about the same" if abs(j["ece"] - b["ece"]) < 0.005 else "better" if j["ece"] < b["ece"] else "worse"
        out.append(
            f"Calibration error (ECE): {j['ece']:.3f} for {name} vs {b['ece']:.3f} for the baseline "
            f"({verdict} before temperature scaling"
            + (
                f"; {j['ece_temp_scaled']:.3f} vs {b['ece_temp_scaled']:.3f} after it)."
                if "ece_temp_scaled" in j and "ece_temp_scaled" in b
                else ")."
            )
        )
    if "fd_buffer" in j and "fd_init" in j:
        text = (
            f"Sample quality (an independent judge CNN): {name}'s replay buffer lies at Fréchet distance "
            f"{_fmt(j['fd_buffer'])} from held-out images, its initial distribution at {_fmt(j['fd_init'])}"
            + (
                f", the data's own held-out halves at {_fmt(j['fd_heldout_floor'])} (a reference, not a floor)"
                if "fd_heldout_floor" in j
                else ""
            )
            + (f" ({int(j['fd_n_samples'])} images each)" if "fd_n_samples" in j else "")
            + "."
            + (f" {fd_sample_size_note(int(j['fd_n_samples']))}" if "fd_n_samples" in j else "")
        )
        if "judge_acc_samples" in j:
            refs = [
                f"{100 * j[k]:.0f}% of {what}"
                for k, what in (("judge_acc_init", "init draws"), ("judge_acc_heldout", "test images"))
                if k in j
            ]
            text += (
                f" The judge puts {100 * j['judge_acc_samples']:.0f}% of the class-conditional samples in "
                f"their class" + (f" ({', '.join(refs)})" if refs else "") + "."
            )
        out.append(text + " " + QUALITY_HOW_TO_READ)
    temps = {n: r.get("summary", r).get("temperature") for n, r in runs.items()}
    below = [n for n, t in temps.items() if isinstance(t, (int, float)) and t < 1]
    if below:
        which = " and ".join(f"{n} ({temps[n]:.2f})" for n in below)
        out.append(
            f"Fitted temperature below 1 for {which}: the model was under-confident, so temperature scaling "
            "sharpens its logits (divides them by T < 1)."
        )
    ratio = cpu_time_ratio(j, b)
    if ratio is not None:
        # per epoch: a run the budget cut short must not look cheaper than it is
        out.append(
            f"Cost: {COST_RATIO} {ratio:.1f} (an epoch of {name} took {_fmt(j['cpu_seconds_per_epoch'])} s of CPU "
            f"time, one of the baseline {_fmt(b['cpu_seconds_per_epoch'])} s)."
        )
    return out


def _steps(run: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A run's post-training steps (``jem train``'s ``post_training`` list of decisions) by step name."""
    return {d["step"]: d for d in run.get("post_training", ()) if isinstance(d, Mapping) and "step" in d}


def _step_cell(d: Mapping[str, Any] | None) -> str:
    if d is None:
        return "not run"
    numbers = (
        f" (held-out {d['before']:.3f} -> {d['after']:.3f})"
        if d.get("before") is not None and d.get("after") is not None
        else ""
    )
    return ("kept" if d.get("kept") else "not kept") + numbers


def post_training_rows(runs: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """The runs' post-training steps side by side: ``(step title, one cell per run)`` for every step
    any run took (``"kept (held-out 0.200 -> 0.975)"``, ``"not kept"``, ``"not run"``)."""
    from .post_training import TITLES

    per_run = [_steps(r) for r in runs.values()]
    names: list[str] = []
    for steps in per_run:
        names += [n for n in steps if n not in names]
    return [(TITLES.get(n, n), [_step_cell(steps.get(n)) for steps in per_run]) for n in names]


def _post_training_table(runs: Mapping[str, Mapping[str, Any]]) -> str:
    rows = post_training_rows(runs)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(n)}</th>" for n in runs)
    body = "".join(
        f"<tr><td class='name'>{html.escape(t)}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
        for t, cells in rows
    )
    return (
        "<h2>Steps after training</h2><p class='note'>Each step is measured on the held-out split before and "
        "after, and kept only when the held-out data show it is not worse; the numbers above are the saved "
        f"models', after these steps.</p><table><tr><th class='name'>step</th>{head}</tr>{body}</table>"
    )


def _unequal_steps(runs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """A sentence when the runs did not get the same post-training steps (the comparison is then not
    like for like), else None."""
    rows = [(t, cells) for t, cells in post_training_rows(runs) if len({c == "not run" for c in cells}) > 1]
    if not rows:
        return None
    names = list(runs)
    parts = [
        f"{' and '.join(n for n, c in zip(names, cells) if c != 'not run')} had {title[0].lower() + title[1:]}, "
        f"{' and '.join(n for n, c in zip(names, cells) if c == 'not run')} did not"
        for title, cells in rows
    ]
    return (
        f"The runs did not get the same steps after training ({'; '.join(parts)}): the comparison is not like "
        "for like (jem train --baseline runs the recipe's steps too)."
    )


def cpu_time_ratio(run: Mapping[str, Any], baseline: Mapping[str, Any]) -> float | None:
    """The report's one cost figure: a run's CPU seconds per epoch over the baseline's (per epoch,
    so a run cut short does not look cheaper), or None without both."""
    pj, pb = run.get("cpu_seconds_per_epoch"), baseline.get("cpu_seconds_per_epoch")
    return float(pj) / float(pb) if pj and pb else None


def _caption(stem: str, runs: list[str]) -> tuple[str, str | None, str]:
    """``(group, run or None, caption)`` of a figure file stem."""
    for pattern, text in CAPTIONS:
        m = re.search(pattern, stem)
        if m:
            run = m.groupdict().get("run")
            if run is not None and run not in runs:
                run = None
            group = stem[: m.start("run") - 1] if run else stem
            return group, run, text.replace("{run}", run or stem)
    return stem, None, stem.replace("_", " ")


def _figures(out: Path, runs: list[str]) -> str:
    """Figures in caption order; per-run figures of one kind in one row, the runs' order left to right."""
    groups: dict[str, dict[str | None, tuple[Path, str]]] = {}
    order: dict[str, int] = {}
    for p in sorted(out.rglob("*.png")):
        stem = str(p.relative_to(out).with_suffix(""))
        group, run, caption = _caption(stem, runs)
        groups.setdefault(group, {})[run] = (p, caption)
        order[group] = next((i for i, (pat, _) in enumerate(CAPTIONS) if re.search(pat, stem)), len(CAPTIONS))
    parts: list[str] = []
    singles: list[str] = []

    def flush() -> None:
        if singles:
            parts.append(f"<div class='row' style='--n:2'>{''.join(singles)}</div>")
            singles.clear()

    for group in sorted(groups, key=lambda g: (order[g], g)):
        members = groups[group]
        keys = [r for r in runs if r in members] + [k for k in members if k not in runs]
        cells = []
        for k in keys:
            p, caption = members[k]
            data = base64.b64encode(p.read_bytes()).decode("ascii")
            label = html.escape(k if len(keys) > 1 and k else caption)
            cells.append(
                f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>"
                f"<figcaption>{label}</figcaption></figure>"
            )
        if len(keys) == 1 and "curves" not in group:  # single figures two to a row
            singles.append(cells[0])
            if len(singles) == 2:
                flush()
            continue
        flush()
        if len(keys) > 1:  # side by side: one shared caption, one column per run
            caption = CAPTIONS[order[group]][1].replace("{run}: ", "").replace("{run}", "each run")
            parts.append(f"<p class='caption'>{html.escape(caption[0].upper() + caption[1:])}</p>")
        parts.append(f"<div class='row' style='--n:{len(cells)}'>{''.join(cells)}</div>")
    flush()
    return "\n".join(parts)


def headline(result: Mapping[str, Any]) -> str | None:
    """The sentence a report (and ``jem demo``) leads with when its runs were cut short by the
    time budget (``result["truncated"]``), in place of numbers that would compare half-trained
    models; None when the runs finished."""
    if not result.get("truncated"):
        return None
    return (
        "The comparison is not meaningful yet: the time budget stopped training early ("
        + str(result.get("warning") or "runs cut short")
        + "). The numbers below show that the pipeline runs, not what JEM does."
    )


def write_report(
    out_dir: str | Path, result: Mapping[str, Any] | None = None, title: str = "jem-plugin report"
) -> Path:
    """Write ``out_dir/report.html`` and return its path.

    ``result`` defaults to ``out_dir/metrics.json``. A ``"warning"`` entry (a run cut short) is shown
    first; ``"runs"`` (``{run_name: {"summary": metrics}}``) becomes a few summary sentences and a
    side-by-side table (best value per row in bold); other entries are listed as settings. Every PNG
    under ``out_dir`` is embedded with a caption.
    """
    out = Path(out_dir)
    if result is None:
        result = json.loads((out / "metrics.json").read_text())
    runs = result.get("runs", {})
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
    ]
    lead = headline(result)
    if lead:
        parts.append(f"<p class='warning'><b>{html.escape(lead)}</b></p>")
    elif result.get("warning"):
        parts.append(f"<p class='warning'>Warning: {html.escape(str(result['warning']))}.</p>")
    if result.get("description"):
        parts.append(f"<p>{html.escape(str(result['description']))}</p>")
    summaries = {n: {k: v for k, v in r.get("summary", r).items() if k not in _OTHER_RATIOS} for n, r in runs.items()}
    base = summaries.get("baseline")
    for n, summary in summaries.items():
        ratio = cpu_time_ratio(summary, base) if base is not None and n != "baseline" else None
        if ratio is not None:
            summary["cpu_time_ratio"] = ratio
    sentences = summary_sentences(runs)
    unequal = _unequal_steps(runs)
    if unequal:
        sentences.insert(0, unequal)
    if sentences:
        items = "".join(f"<li>{html.escape(s)}</li>" for s in sentences)
        heading = "Summary of the cut-short runs (a check that the pipeline runs)" if lead else "Summary"
        parts.append(f"<h2>{heading}</h2><ul class='summary'>{items}</ul>")
    if runs:
        parts.append(
            "<h2>Results</h2><p class='note'>Best value per row in bold. OOD scores rank inputs by "
            "how in-distribution they look; the OOD sets are uniform noise, patches of photos, "
            "blends of two digits of different classes and transposed digits.</p>"
        )
        parts.append(_table(summaries))
        parts.append(_post_training_table(runs))
    figures = _figures(out, list(runs))
    if figures:
        parts.append("<h2>Figures</h2>" + figures)
    settings = {k: v for k, v in result.items() if k not in ("runs", "description", "targets", "warning", "truncated")}
    if settings:
        parts.append(
            "<h2>Settings</h2><details><summary>every setting of this run</summary><pre>"
            + html.escape(json.dumps(settings, indent=2, default=str))
            + "</pre></details>"
        )
    parts.append("</body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
