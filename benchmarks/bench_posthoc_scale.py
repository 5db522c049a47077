"""Post-hoc detectors at ImageNet size (issue 46, item 2): every fitted detector fitted on a stream
of 1.28M x 2048 float32 features in 1000 classes (OpenOOD v1.5's ImageNet-1K on a ResNet-50),
through the feature-level API (``begin_fit`` / ``add_outputs`` / ``end_fit``, then
``score_outputs``), with no data set: a stand-in network emits them.

**The stand-in.** Class ``c`` has a random mean ``mu_c`` (``[D]``); a batch's features are
``relu(mu_y + noise)`` (post-ReLU, as a ResNet's pooled features), drawn from a seeded generator
per batch, so the stream repeats (openmax reads it twice) and is never held. Its logits come
from a fixed random linear head, ``W = mu / |mu|`` rows and zero bias, so that it classifies
its own classes (SHE and DICE read the correctly classified inputs). For the detectors that
read **several layers** (``multi_mahalanobis``, ``gram``) it emits four layers of ResNet-50's
stage widths (256, 512, 1024, 2048 channels), each with ``--positions`` spatial positions
(default 1, the pooled outputs): their state (``K x sum C_l`` bounds, ``C_l x C_l``
covariances) is the real network's; the per-batch time and scratch of ``gram`` grow with the
positions (ResNet-50's stages have 56^2 ... 7^2), which this run does not pay. The two detectors
with an **input gradient** (``mahalanobis_odin``, ``adascale``) fit and score through the
stand-in as a network (``jem.wrap``: its input is the feature vector, its backbone the
identity, so the gradient is the head's). No fitted detector reads feature maps.

**Measured per detector**, each in a fresh subprocess (``--child``): the peak resident memory
above the process's baseline (``VmHWM`` after resetting it with ``/proc/self/clear_refs`` once
the stand-in is built) during the fit, and during scoring (the fitted state and the scoring
scratch); the fit's time (the detector's own calls: the stand-in's draws are not counted); the
scoring throughput (rows/s of ``score_outputs`` on ``--score-rows`` rows, batches of
``--score-batch``); and the estimate the detector makes (``memory_estimate``), at the
measured size and at full size. The fit is told the full size (``begin_fit(jm,
rows=1_281_167)``), so a detector that cannot fit ImageNet under ``--limit`` (default 2 GiB, the
library's default ``memory_limit``) is refused as it would be there, before it allocates; then
the setting its refusal names runs as a row of its own. On the CPU each detector is then fitted a
second time under :func:`benchmarks._memprobe.tensor_peak`: the peak of the bytes torch holds in
tensors during the detector's own calls (the batch the caller passes left out), which is what the
estimate counts and must stay under (``tests/test_posthoc_memory.py`` asserts it at small sizes);
the resident peak adds the stand-in's draws and the C allocator's pages.

``--rows`` streams fewer rows (this machine: 2 shared cores); memory does not depend on the rows
for the detectors whose fit keeps moments, bounds or bounded samples (once the sample is full:
vim 10k rows, weiper 10k, react 1M values, vra 10M values); it grows with them for the banks
(``knn``, ``nnguide``: ``N x D`` floats, or ``2 max_fit x D`` while sampling) and ``adascale``
(one float64 per row). Fit time grows linearly with the rows. The table says which numbers are
measured and which are extrapolated (fit time x full rows / measured rows; memory: measured plus
the estimate's growth from the measured rows to full size).

    nice -n 19 env OMP_NUM_THREADS=1 python -m benchmarks.bench_posthoc_scale --rows 20000
    python -m benchmarks.bench_posthoc_scale --knn-study --rows 100000    # KNN: faiss, max_fit, recall
    python -m benchmarks.bench_posthoc_scale --device cuda --out $OUT     # GPU: peak GPU memory, all in one process

``--device cuda`` runs every detector in one process (a CUDA start per subprocess would cost
more than the fits) and reports ``torch.cuda.max_memory_allocated`` above the stand-in's, reset
between detectors, for the fit and for scoring; CPU memory is not measured there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FULL_ROWS = 1_281_167  # ImageNet-1K's training set
DIM, CLASSES = 2048, 1000  # ResNet-50's penultimate features, ImageNet's classes
LAYERS = {"layer1": 256, "layer2": 512, "layer3": 1024, "layer4": 2048}
RESULTS = Path(__file__).resolve().parent / "results"

#: Every fitted detector (registered name, options), then the settings the refusals name.
DETECTORS: list[tuple[str, str, dict[str, Any]]] = [
    ("mahalanobis", "mahalanobis", {}),
    ("relative_mahalanobis", "relative_mahalanobis", {}),
    ("mahalanobis_odin", "mahalanobis_odin", {}),
    ("multi_mahalanobis", "multi_mahalanobis", {"layers": list(LAYERS)}),
    ("gram", "gram", {"layers": list(LAYERS)}),
    ("gram (batches of 256)", "gram", {"layers": list(LAYERS), "_batch": 256}),
    ("gmm", "gmm", {}),
    ("gmm (covariance='tied')", "gmm", {"covariance": "tied"}),
    ("gmm (covariance='diag')", "gmm", {"covariance": "diag"}),
    ("vim", "vim", {}),
    ("knn", "knn", {}),
    ("knn (max_fit=12811: 1%)", "knn", {"max_fit": 12811}),
    ("knn (max_fit=58982)", "knn", {"max_fit": 58982}),
    ("knn (max_fit=74274)", "knn", {"max_fit": 74274}),
    ("react", "react", {}),
    ("openmax", "openmax", {}),
    ("kl_matching", "kl_matching", {}),
    ("dice", "dice", {}),
    ("she", "she", {}),
    ("nnguide", "nnguide", {}),
    ("nnguide (max_fit=12811: 1%)", "nnguide", {"max_fit": 12811}),
    ("fdbd", "fdbd", {}),
    ("nci", "nci", {}),
    ("pnml", "pnml", {}),
    ("vra", "vra", {}),
    ("adascale", "adascale", {}),
    ("weiper", "weiper", {}),
    ("weiper (batches of 256)", "weiper", {"_batch": 256}),
]


def _layers(dim: int) -> dict[str, int]:
    """The emitted layers' widths: ResNet-50's stages, none wider than the features."""
    return {name: min(c, dim) for name, c in LAYERS.items()}


class StandIn(nn.Module):
    """The stand-in network: its input is the feature vector, its head a fixed linear layer."""

    def __init__(self, means: Tensor) -> None:
        super().__init__()
        self.fc = nn.Linear(means.shape[1], means.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(means / means.norm(dim=1, keepdim=True))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


class Stream:
    """The seeded stream of ``rows`` feature rows (and labels, logits, layers) in batches."""

    def __init__(
        self, rows: int, batch: int, device: str, positions: int, seed: int = 0, dim: int = DIM, classes: int = CLASSES
    ) -> None:
        self.rows, self.batch, self.device, self.positions, self.seed = (
            rows,
            batch,
            torch.device(device),
            positions,
            seed,
        )
        self.dim, self.classes = dim, classes
        g = torch.Generator().manual_seed(0)
        self.means = (torch.rand(classes, dim, generator=g) * 2.0).to(self.device)
        self.net = StandIn(self.means.cpu()).to(self.device).eval()
        self.draw_s = 0.0

    def batches(self, layers: bool = False, shift: float = 0.0, start: int = 0) -> Any:
        """``(features, labels, layers or None)`` of each batch; ``shift``: a far set's offset."""
        for lo in range(start, start + self.rows, self.batch):
            t0 = _clock()
            n = min(self.batch, start + self.rows - lo)
            g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + lo + 1)
            y = torch.randint(0, self.classes, (n,), generator=g, device=self.device)
            noise = torch.randn(n, self.dim, generator=g, device=self.device)
            z = (self.means[y] + noise + shift).relu_()
            del noise  # the batch alone is held while a detector takes it
            maps = None
            if layers:  # each stage: the features' first C_l units with noise over P positions
                maps = {}
                for name, c in _layers(self.dim).items():
                    eps = torch.randn(n, c, self.positions, generator=g, device=self.device) * 0.5
                    maps[name] = (z[:, :c].unsqueeze(2) + eps).relu_()
            self.draw_s += _clock() - t0
            yield z, y, maps


def _clock() -> float:
    """Seconds of this process's CPU time (one thread: the time on an idle core, whatever the
    machine's load), or of the wall clock where a GPU computes."""
    return time.perf_counter() if _CUDA else time.process_time()


_CUDA = False


def _vm(key: str) -> int:
    """A ``/proc/self/status`` memory line in bytes (Linux); 0 elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> int:
    """Reset the resident high-water mark to the current RSS (``clear_refs`` 5); the RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _vm("VmRSS")


class Peak:
    """The peak above a baseline: resident memory on the CPU (VmHWM), allocated on CUDA."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _reset_peak()

    def above(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return max(0, _vm("VmHWM") - self.base)


def _outputs(jem: Any, stream: Stream, z: Tensor, maps: Any) -> Any:
    with torch.no_grad():  # the stand-in's logits, no autograd graph
        return jem.ood.Outputs(stream.net(z), features=z, layers=maps)


def tensor_fit_peak(det: Any, jm: Any, stream: Stream, rows_told: int | None) -> tuple[int, int]:
    """Fit ``det`` on ``stream`` (``begin_fit(jm, rows=rows_told)``, the batches' outputs, the
    ends of the passes; ``.fit`` for a detector with an input gradient) under
    :func:`benchmarks._memprobe.tensor_peak`: ``(peak tensor bytes of the detector's own calls
    above the start, less the batch the caller holds; rows fitted)``. Each batch is drawn before
    the call that takes it and dropped after, as a streaming caller does, so a detector that
    keeps a reference to a batch is charged for it."""
    import jem_plugin as jem

    from ._memprobe import tensor_peak, tensors_bytes

    layers = "layers" in det.reads
    with tensor_peak() as probe:
        if not det.shares_forward:  # an input gradient: the data is the caller's, the fit one call
            data = [(z, y) for z, y, _ in stream.batches()]
            with probe.call(tensors_bytes(data)):
                det.fit(jm, data, batch_size=stream.batch)
            del data
        else:
            with probe.call():
                det.begin_fit(jm, rows=rows_told)
        done = not det.shares_forward
        while not done:
            for z, y, maps in stream.batches(layers):
                out = _outputs(jem, stream, z, maps)
                with probe.call(tensors_bytes(out, y)):
                    det.add_outputs(out, y)
                del z, y, maps, out
            with probe.call():
                done = det.end_fit(jm)
    return probe.bytes, stream.rows


def run_one(label: str, name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Fit and score one detector at ``args``' size in this process; what was measured."""
    import jem_plugin as jem
    from jem_plugin.errors import MemoryLimitError

    torch.manual_seed(0)
    options = dict(options)
    if "_batch" in options:  # a row's own fit batch size
        args = argparse.Namespace(**{**vars(args), "batch": options.pop("_batch")})
    stream = Stream(args.rows, args.batch, args.device, args.positions, dim=args.dim, classes=args.classes)
    jm = jem.wrap(stream.net, features="fc", data_range=(-50.0, 50.0))
    det = jem.ood.detector(name, memory_limit=args.limit, **options)
    layers = "layers" in det.reads
    shape = dict(
        dim=args.dim,
        classes=args.classes,
        layers=tuple((c, args.positions) for c in _layers(args.dim).values()) if layers else None,
        batch=args.batch,
    )
    est_n = det.memory_estimate(jem.ood.FitShape(rows=args.rows, **shape))  # type: ignore[arg-type]
    est_full = det.memory_estimate(jem.ood.FitShape(rows=args.full_rows, **shape))  # type: ignore[arg-type]
    row: dict[str, Any] = {
        "detector": label,
        "name": name,
        "options": options,
        "batch": args.batch,
        "rows": args.rows,
        "estimate_mb": None if est_n is None else est_n.bytes / 2**20,
        "estimate_full_mb": None if est_full is None else est_full.bytes / 2**20,
    }
    peak = Peak(args.device)
    # warm the stand-in (allocator pools, lazy imports) before the baseline
    for z, _, maps in stream.batches(layers):
        _outputs(jem, stream, z, maps)
        break
    stream.draw_s = 0.0
    peak.start()
    t_fit = t_end = 0.0  # the streaming calls; the start and the ends of the passes (not per row)
    try:
        if det.shares_forward:
            t0 = _clock()
            det.begin_fit(jm, rows=args.full_rows)
            t_end += _clock() - t0  # not per row: counted with the ends
            done = False
            while not done:
                for z, y, maps in stream.batches(layers):
                    out = _outputs(jem, stream, z, maps)
                    t0 = _clock()
                    det.add_outputs(out, y)
                    t_fit += _clock() - t0
                t0 = _clock()
                done = det.end_fit(jm)
                t_end += _clock() - t0
        else:  # an input gradient: fitted through the stand-in as a network (x = the features)
            data = [(z, y) for z, y, _ in stream.batches()] if args.rows <= 50_000 else None
            t0 = _clock()
            det.fit(jm, data if data is not None else ((z, y) for z, y, _ in stream.batches()), batch_size=args.batch)
            t_fit = _clock() - t0 - (0.0 if data is not None else stream.draw_s)
            del data
    except MemoryLimitError as exc:
        row.update(status="refused", reason=str(exc), fit_peak_mb=peak.above() / 2**20, fit_s=t_fit + t_end)
        return row
    row.update(status="fitted", fit_peak_mb=peak.above() / 2**20, fit_s=t_fit + t_end, fit_end_s=t_end)
    # scoring: a fresh peak above the fitted state
    peak.start()
    scored, t_score = 0, 0.0
    score_stream = Stream(
        args.score_rows, args.score_batch, args.device, args.positions, seed=1, dim=args.dim, classes=args.classes
    )
    score_stream.means, score_stream.net = stream.means, stream.net
    for z, _, maps in score_stream.batches(layers):
        out = _outputs(jem, stream, z, maps)
        t0 = _clock()
        s = det.score_outputs(jm, out) if det.shares_forward else det.score(jm, z)
        if s.is_cuda:
            torch.cuda.synchronize()
        t_score += _clock() - t0
        scored += s.shape[0]
    row.update(score_peak_mb=peak.above() / 2**20, score_rows_per_s=scored / t_score)
    if not args.device.startswith("cuda") and args.tensor_peak:
        # the fit again, on a fresh detector, measured as the estimate counts: tensor bytes
        again = jem.ood.detector(name, memory_limit=args.limit, **options)
        stream = Stream(args.rows, args.batch, args.device, args.positions, dim=args.dim, classes=args.classes)
        tensor_bytes, _ = tensor_fit_peak(again, jm, stream, args.full_rows)
        row["fit_tensor_peak_mb"] = tensor_bytes / 2**20
    row["fit_s_full"] = t_fit * args.full_rows / args.rows + t_end  # the streaming part grows with the rows
    if est_n is not None and est_full is not None:
        row["fit_peak_full_mb"] = row["fit_peak_mb"] + (est_full.bytes - est_n.bytes) / 2**20
    return row


def knn_study(args: argparse.Namespace) -> dict[str, Any]:
    """KNN's trade on ``args.rows`` fit rows: exact chunked search over the whole bank (the
    reference), faiss's exact index over it, and subsampled banks (``max_fit``): memory, fit and
    search time, recall@k of the neighbours against the reference (same bank), and for the
    subsamples the rank correlation of their scores with the reference's and the AUROC against
    a set of unseen classes (new random class means)."""
    import jem_plugin as jem
    from jem_plugin.builtins.posthoc.knn import _faiss

    size = {"dim": args.dim, "classes": args.classes}
    stream = Stream(args.rows, args.batch, "cpu", 1, **size)
    jm = jem.wrap(stream.net, features="fc", data_range=(-50.0, 50.0))
    q_in = Stream(args.score_rows, args.score_batch, "cpu", 1, seed=1, **size)
    q_out = Stream(args.score_rows, args.score_batch, "cpu", 1, seed=2, **size)
    q_in.means = stream.means
    q_out.means = torch.rand(args.classes, args.dim, generator=torch.Generator().manual_seed(3)) * 2.0  # unseen classes
    queries = torch.cat([z for z, _, _ in q_in.batches()])
    far = torch.cat([z for z, _, _ in q_out.batches()])
    k = 50
    results: dict[str, Any] = {"rows": args.rows, "queries": queries.shape[0], "k": k, "faiss": _faiss() is not None}

    def fit(max_fit: int | None) -> Any:
        det = jem.ood.detector("knn", k=k, max_fit=max_fit, memory_limit=None, search="torch")
        base = _reset_peak()
        t0 = _clock()
        det.begin_fit(jm, rows=args.rows)
        for z, y, _ in stream.batches():
            det.add_outputs(jem.ood.Outputs(stream.net(z), features=z), y)
        det.end_fit(jm)
        return det, _clock() - t0, (_vm("VmHWM") - base) / 2**20

    def search(det: Any, how: str) -> tuple[Tensor, Tensor, float, float]:
        det.search = how
        z = torch.nn.functional.normalize(queries, dim=1)
        base = _reset_peak()
        if how == "faiss":
            t0 = _clock()
            det._faiss_index()
            results["faiss_index_build_s"] = _clock() - t0
        t0 = _clock()
        if how == "faiss":
            _, idx = det._faiss_index().search(z.numpy(), k)
            idx = torch.from_numpy(idx)
        else:
            sims = torch.cat([(zb @ det.bank.T).topk(k, dim=1).indices for zb in z.split(args.score_batch)])
            idx = sims
        dt = _clock() - t0
        scores = torch.cat([det.score_outputs(jm, jem.ood.Outputs(stream.net(x), features=x)) for x in (queries, far)])
        return idx, scores, dt, (_vm("VmHWM") - base) / 2**20

    def auroc(s: Tensor) -> float:
        n = queries.shape[0]
        return float(jem.ood.evaluate(s[:n], s[n:])["auroc"])

    def spearman(a: Tensor, b: Tensor) -> float:
        ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
        return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])

    det, fit_s, fit_mb = fit(None)
    ref_idx, ref_scores, ref_s, ref_mb = search(det, "torch")
    bank_mb = det.bank.numel() * 4 / 2**20
    results["exact_torch"] = dict(
        bank_mb=bank_mb,
        fit_peak_mb=fit_mb,
        fit_s=fit_s,
        search_s=ref_s,
        search_peak_mb=ref_mb,
        queries_per_s=queries.shape[0] / ref_s,
        auroc=auroc(ref_scores),
    )
    if _faiss() is not None:
        idx, scores, s, mb = search(det, "faiss")
        hit = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(idx, ref_idx)) / idx.numel()
        results["exact_faiss"] = dict(
            bank_mb=bank_mb,
            search_s=s,
            search_peak_mb=mb,
            queries_per_s=queries.shape[0] / s,
            recall_at_k=hit,
            max_score_diff=float((scores - ref_scores).abs().max()),
            auroc=auroc(scores),
        )
    del det
    for frac in (10, 100):
        m = args.rows // frac
        det, fit_s, fit_mb = fit(m)
        _, scores, s, mb = search(det, "faiss" if _faiss() is not None else "torch")
        results[f"max_fit={m} (1/{frac})"] = dict(
            bank_mb=det.bank.numel() * 4 / 2**20,
            fit_peak_mb=fit_mb,
            fit_s=fit_s,
            search_s=s,
            queries_per_s=queries.shape[0] / s,
            score_spearman_vs_exact=spearman(scores, ref_scores),
            auroc=auroc(scores),
        )
        del det
    return results


def _child(args: argparse.Namespace) -> None:
    global _CUDA
    _CUDA = args.device.startswith("cuda")
    if args.knn_study:
        print(json.dumps(knn_study(args)))
        return
    label = args.child
    label, name, options = next(d for d in DETECTORS if d[0] == label)
    print(json.dumps(run_one(label, name, options, args)))


def _bound_line(rows: list[dict[str, Any]]) -> str:
    """Whether every fitted row's tensor peak is within its estimate, in words."""
    pairs = [
        (r["detector"], r["fit_tensor_peak_mb"] / r["estimate_mb"])
        for r in rows
        if r.get("status") == "fitted" and r.get("fit_tensor_peak_mb") is not None and r.get("estimate_mb")
    ]
    over = [f"{d} ({q:.2f}x)" for d, q in pairs if q > 1.0]
    if not pairs:
        return "not measured."
    most = max(q for _, q in pairs)
    return (
        f"over it in {len(over)} of {len(pairs)} rows: {', '.join(over)}."
        if over
        else f"every one of the {len(pairs)} fitted rows is at or under it (at most {most:.2f}x)."
    )


def _mb(v: Any) -> str:
    return "" if v is None else f"{v:,.0f}"


def _table(rows: list[dict[str, Any]], args: argparse.Namespace, cuda: bool) -> str:
    what = "GPU memory (max_memory_allocated)" if cuda else "resident memory (VmHWM)"
    lines = [
        f"| detector | status | fit peak MB ({'measured' if args.rows == args.full_rows else f'{args.rows:,} rows'}) "
        "| fit tensor peak MB | estimate MB (rows fitted) "
        "| full-size fit peak MB | estimate at full size MB | score peak MB | fit s (of which the end) "
        f"| fit s at {args.full_rows:,} rows | score rows/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("status") == "refused":
            lines.append(
                f"| {r['detector']} | refused before allocating | {_mb(r.get('fit_peak_mb'))} | | | | "
                f"{_mb(r.get('estimate_full_mb'))} | | | | |"
            )
            continue
        if r.get("status") != "fitted":
            lines.append(
                f"| {r['detector']} | {r.get('status', 'failed')}: {r.get('reason', '')[:120]} | | | | | | | | | |"
            )
            continue
        full = r.get("fit_peak_full_mb")
        own = "" if r.get("rows", args.rows) == args.rows else f" ({r['rows']:,} rows, batches of {r.get('batch')})"
        extra = "" if r.get("rows", args.rows) == args.full_rows else " (extrapolated)"
        lines.append(
            f"| {r['detector']} | fitted | {_mb(r['fit_peak_mb'])}{own} | "
            f"{_mb(r.get('fit_tensor_peak_mb'))} | {_mb(r.get('estimate_mb'))} | "
            f"{_mb(full)}{extra} | {_mb(r.get('estimate_full_mb'))} | "
            f"{_mb(r['score_peak_mb'])} | {r['fit_s']:.1f} ({r.get('fit_end_s', 0.0):.1f}) | {r['fit_s_full']:,.0f}"
            f"{extra} | {r['score_rows_per_s']:,.0f} |"
        )
    refusals = [f"- `{r['detector']}`: {r['reason']}" for r in rows if r.get("status") == "refused"]
    return "\n".join(
        [
            f"# Post-hoc detectors at ImageNet size ({args.full_rows:,} x {args.dim} features, {args.classes} classes)",
            "",
            f"Peak {what} above the baseline, memory_limit {args.limit / 2**30:.1f} GiB. Fit on {args.rows:,} "
            f"rows (batches of {args.batch}), told the full size; scoring {args.score_rows:,} rows in batches "
            f"of {args.score_batch}; layers at {args.positions} position(s). Device {args.device}; "
            f"{platform.processor() or platform.machine()}, OMP_NUM_THREADS={args.omp_num_threads}; "
            f"load average at the start {args.load}. Times: "
            + (
                "wall seconds (the GPU computes)."
                if cuda
                else "CPU seconds of the process's one thread (process_time: "
                "what an idle core would take, whatever the load)."
            )
            + " Extrapolated fit time: the streaming calls' time x full rows / rows, plus the start and the ends "
            "of the passes (solves, sorts; not per row; the detectors with an input gradient fit through .fit, whose "
            "end is scaled with the rows: an overestimate). Extrapolated memory: measured plus the estimate's growth from "
            f"{args.rows:,} rows to full size (banks, samples not yet full)."
            + (
                ""
                if cuda
                else " Fit tensor peak: the fit again, the peak of the bytes torch holds in tensors during the "
                "detector's own calls, less the batch the caller passes (benchmarks/_memprobe.tensor_peak): what the "
                "estimate counts, and what max_memory_allocated reports on a GPU; the resident peak adds the stand-in's "
                "own draws and the C allocator's pages. The estimate is an upper bound of it: " + _bound_line(rows)
            ),
            "",
            *lines,
            "",
            "Refusals (one line each, before the detector allocates):",
            "",
            *refusals,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=FULL_ROWS, help="fit rows streamed (default: ImageNet's)")
    p.add_argument("--full-rows", type=int, default=FULL_ROWS, help="the size the fit is told and extrapolated to")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dim", type=int, default=DIM, help="feature width (default ResNet-50's 2048)")
    p.add_argument("--classes", type=int, default=CLASSES, help="classes (default ImageNet's 1000)")
    p.add_argument("--score-rows", type=int, default=20_000)
    p.add_argument("--score-batch", type=int, default=256)
    p.add_argument("--positions", type=int, default=1, help="spatial positions of each emitted layer")
    p.add_argument("--limit", type=float, default=float(2 << 30), help="memory_limit in bytes (default 2 GiB)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--detectors", default="", help="comma-separated labels or names (default: all)")
    p.add_argument("--skip", default="", help="comma-separated names not to run")
    p.add_argument("--out", default=str(RESULTS), help="folder of posthoc_scale.{json,md}")
    p.add_argument("--tag", default="", help="suffix of the result files (posthoc_scale<tag>.json)")
    p.add_argument("--time-limit", type=float, default=math.inf, help="skip the detectors left after this many s")
    p.add_argument("--in-process", action="store_true", help="every detector in this process (as --device cuda)")
    p.add_argument(
        "--no-tensor-peak",
        dest="tensor_peak",
        action="store_false",
        help="on the CPU, skip the second fit that measures the tensor peak (what the estimate counts)",
    )
    p.add_argument("--knn-study", action="store_true", help="KNN: exact, faiss and max_fit on --rows rows")
    p.add_argument(
        "--merge", nargs="+", default=None, help="result JSONs of partial runs: later rows replace earlier ones"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.merge:
        merge(args.merge, Path(args.out), args.tag)
        return
    args.load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    args.omp_num_threads = os.environ.get("OMP_NUM_THREADS")  # the run's, kept in its settings for --merge
    if args.child is not None or (args.knn_study and args.device == "cpu" and os.environ.get("_BENCH_CHILD")):
        _child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.knn_study:
        res = _spawn(["--knn-study"], args)
        (out / f"posthoc_scale_knn{args.tag}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    wanted = [w.strip() for w in args.detectors.split(",") if w.strip()]
    skip = {w.strip() for w in args.skip.split(",") if w.strip()}
    todo = [d for d in DETECTORS if (not wanted or d[0] in wanted or d[1] in wanted) and d[1] not in skip]
    global _CUDA
    cuda = _CUDA = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for label, name, options in todo:
        if time.perf_counter() - t_start > args.time_limit:
            rows.append({"detector": label, "status": "skipped", "reason": "--time-limit reached"})
            continue
        t0 = time.perf_counter()
        if cuda or args.in_process:  # one process: a CUDA start per detector would cost more than its fit
            try:
                row = run_one(label, name, options, args)
            except Exception as exc:  # a failure is a row of the table
                row = {"detector": label, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            if cuda:
                torch.cuda.empty_cache()
        else:
            row = _spawn(["--child", label], args)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, rows, args, cuda)
    _write(out, rows, args, cuda)


def merge(paths: list[str], out: Path, tag: str = "") -> None:
    """One table of several runs' JSONs (reruns of some detectors replacing their rows), in the
    order of :data:`DETECTORS`, written as ``posthoc_scale<tag>.{json,md}``; the rows keep the
    settings of the run that measured them (rows, batch), and the table's header the first's."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows: dict[str, dict[str, Any]] = {}
    for path, run in zip(paths, runs):
        for row in run["rows"]:
            rows[row["detector"]] = {**row, "run": Path(path).name}
    order = [d[0] for d in DETECTORS]
    merged = sorted(rows.values(), key=lambda r: order.index(r["detector"]) if r["detector"] in order else len(order))
    args = argparse.Namespace(**{"omp_num_threads": None, **runs[0]["settings"]})
    out.mkdir(parents=True, exist_ok=True)
    _write(out, merged, argparse.Namespace(**{**vars(args), "tag": tag}), args.device.startswith("cuda"))
    meta = json.loads((out / f"posthoc_scale{tag}.json").read_text())
    meta["merged_from"] = [Path(p).name for p in paths]
    (out / f"posthoc_scale{tag}.json").write_text(json.dumps(meta, indent=1))


def _spawn(extra: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Run this script's child in a fresh process (its own memory baseline); its JSON line."""
    keep = [
        "--rows",
        "--full-rows",
        "--batch",
        "--dim",
        "--classes",
        "--score-rows",
        "--score-batch",
        "--positions",
        "--limit",
        "--device",
    ]
    argv = [a for k in keep for a in (k, str(getattr(args, k.lstrip("-").replace("-", "_"))))]
    argv += [] if args.tensor_peak else ["--no-tensor-peak"]
    env = {**os.environ, "_BENCH_CHILD": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_posthoc_scale", *argv, *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"detector": extra[-1], "status": "failed", "reason": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, cuda: bool) -> None:
    meta = {k: v for k, v in vars(args).items() if k not in ("child",)}
    meta["torch"] = torch.__version__
    if cuda:
        meta["gpu"] = torch.cuda.get_device_name()
    (out / f"posthoc_scale{args.tag}.json").write_text(json.dumps({"settings": meta, "rows": rows}, indent=1))
    (out / f"posthoc_scale{args.tag}.md").write_text(_table(rows, args, cuda))


if __name__ == "__main__":
    main()
