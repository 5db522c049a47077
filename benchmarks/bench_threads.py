"""Torch's default CPU threads against the ``jem`` commands' choice (issue 59), idle and beside one
busy process, in one run.

Three workloads, each a fresh subprocess so that torch starts its threads anew:

- ``jem demo`` with no flags: wall time, the JEM epochs it finished of 40, the threads it used;
- ``jem train --data digits --epochs 2 --max-seconds 60``: the median milliseconds per iteration of
  the epochs it finished (its history), and wall time;
- a README-style loop: timm's resnet10t on 32x32 inputs, batch 32, ``JEMLoss`` with 20 SGLD steps,
  the median of 3 timed iterations after one warm-up (``--loop``, this file run as a script).

"default" runs with ``OMP_NUM_THREADS`` set to torch's own default (one per core), which the
commands keep as the user's setting; "chosen" runs without it, so the commands choose
(:mod:`jem_plugin.app.threads`) and the loop calls the same helper. "busy" is beside
``python -c "while True: pass"``, started and killed here. The 1-minute load average (``uptime``)
and the cores other processes kept busy over each run are recorded beside each number: the machine
is shared.

The shared machine's long benchmark (its process group in ``/tmp/ledger.pgid``, when present) is
paused for the run and resumed at its end, or after :data:`PAUSE_LIMIT_S` at the latest.

    python -m benchmarks.bench_threads            # writes results/threads.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LEDGER = Path("/tmp/ledger.pgid")
PAUSE_LIMIT_S = 570.0  # the shared machine's rule: the long benchmark paused 10 minutes at most
TRAIN_MAX_S = 60  # jem train's --max-seconds here: the run stops cleanly after it


# ----------------------------------------------------------------------------- the README-style loop
def loop(choose: bool, iterations: int = 3) -> dict[str, Any]:
    """A user's loop as the README writes it, with a timm network: per-iteration seconds."""
    import timm
    import torch

    import jem_plugin as jem
    from jem_plugin.app.threads import use_threads

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=10)
    if choose:
        use_threads(model, (3, 32, 32), say=lambda line: None)
    jm = jem.wrap(model, data_range=(-1, 1), input_size=(3, 32, 32))
    loss_fn = jem.JEMLoss(jem.SGLD(steps=20), jem.ReplayBuffer(10000, sample_shape=(3, 32, 32)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.rand(32, 3, 32, 32) * 2 - 1, torch.randint(0, 10, (32,))
    times = []
    for _ in range(iterations + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        out = loss_fn(jm, x, y)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return {"threads": torch.get_num_threads(), "seconds_per_iteration": times[1:]}


# ----------------------------------------------------------------------------- measuring
def _cpu_jiffies() -> tuple[float, float]:
    fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _run(cmd: list[str], threads: int | None, timeout: float = 480.0) -> dict[str, Any]:
    """``cmd`` in a fresh process (``OMP_NUM_THREADS=threads``, or unset): wall time, the load
    average before it, and how many cores the machine kept busy over it (this run included)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    load = os.getloadavg()[0]
    b0, t0_j = _cpu_jiffies()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    b1, t1_j = _cpu_jiffies()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return {
        "wall_s": wall,
        "load_1min_before": load,
        "busy_cores_during": (os.cpu_count() or 1) * (b1 - b0) / max(1.0, t1_j - t0_j),
        "stdout": done.stdout,
        "stderr": done.stderr,
    }


def demo(threads: int | None, tmp: Path) -> dict[str, Any]:
    out = tmp / "demo"
    r = _run([sys.executable, "-m", "jem_plugin.app.cli", "demo", "--quiet", "--force", "--out", str(out)], threads)
    m = json.loads((out / "metrics.json").read_text())
    jem_run = m["runs"]["JEM"]
    thread_line = [ln for ln in r["stderr"].splitlines() if "CPU thread" in ln]
    return {
        **{k: r[k] for k in ("wall_s", "load_1min_before", "busy_cores_during")},
        "threads": m["torch_threads"],
        "jem_epochs": f"{int(jem_run['summary']['epochs'])} of {jem_run['planned_epochs']}",
        "thread_line": thread_line[0] if thread_line else None,
        "warning": m.get("warning"),
    }


def train(threads: int | None, tmp: Path) -> dict[str, Any]:
    out = tmp / "train"
    cmd = [sys.executable, "-m", "jem_plugin.app.cli", "train", "--data", "digits", "--epochs", "2"]
    r = _run([*cmd, "--max-seconds", str(TRAIN_MAX_S), "--quiet", "--no-resume", "--out", str(out)], threads)
    epochs = json.loads((out / "history.json").read_text())["epochs"]
    return {
        **{k: r[k] for k in ("wall_s", "load_1min_before", "busy_cores_during")},
        "epochs_done": len(epochs),
        "median_ms_per_iteration": statistics.median(e["ms_per_iter"] for e in epochs) if epochs else None,
    }


def readme_loop(threads: int | None, tmp: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--loop"] + (["--choose"] if threads is None else [])
    r = _run(cmd, threads)
    got = json.loads(r["stdout"].strip().splitlines()[-1])
    return {
        **{k: r[k] for k in ("wall_s", "load_1min_before", "busy_cores_during")},
        "threads": got["threads"],
        "median_s_per_iteration": statistics.median(got["seconds_per_iteration"]),
    }


WORKLOADS = {
    "jem demo": demo,
    "README-style loop (resnet10t 32x32)": readme_loop,
    "jem train (digits, 2 epochs, --max-seconds 60)": train,
}


class Ledger:
    """The shared machine's long benchmark, paused while this runs and resumed at the end, on a
    signal, or after :data:`PAUSE_LIMIT_S` (whichever comes first)."""

    def __init__(self) -> None:
        self.pgid = int(LEDGER.read_text().strip()) if LEDGER.exists() else None
        self.resumed_at: float | None = None
        self.t0 = time.perf_counter()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Ledger:
        if self.pgid is not None:
            os.killpg(self.pgid, signal.SIGSTOP)
            self._timer = threading.Timer(PAUSE_LIMIT_S, self.resume)
            self._timer.daemon = True
            self._timer.start()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.resume()
        raise SystemExit(128 + signum)

    def resume(self) -> None:
        if self.pgid is not None and self.resumed_at is None:
            try:
                os.killpg(self.pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.resumed_at = time.perf_counter() - self.t0

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.resume()


def _phase(condition: str, default: int, tmp: Path, t0: float, ledger: Ledger | None) -> list[dict[str, Any]]:
    """Each workload at torch's default and as the commands choose, side by side."""
    rows = []
    for name, fn in WORKLOADS.items():
        for setting in ("default", "chosen"):
            started = time.perf_counter() - t0
            try:
                row = fn(default if setting == "default" else None, tmp)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                row = {"error": str(exc)[-300:]}
            row.update(workload=name, condition=condition, setting=setting, started_s=round(started, 1))
            row["ledger_paused"] = ledger is not None and ledger.pgid is not None and ledger.resumed_at is None
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def measure() -> dict[str, Any]:
    """Idle (the shared machine's long benchmark paused), then beside one busy process of our own
    (the long benchmark running again, as it must)."""
    import torch

    default = torch.get_num_threads()  # torch's default here: one per core
    results: dict[str, Any] = {"cpus": os.cpu_count(), "torch_default_threads": default, "rows": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        with Ledger() as ledger:
            results["rows"] += _phase("idle", default, Path(tmp), t0, ledger)
        results["ledger"] = {"paused": ledger.pgid is not None, "resumed_after_s": ledger.resumed_at}
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2)
            results["rows"] += _phase("busy", default, Path(tmp), t0, None)
        finally:
            spinner.kill()
            spinner.wait()
    return results


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        timed_out = re.search(r"timed out after (\d+)", row["error"])
        return f"not finished in {timed_out.group(1)} s (stopped)" if timed_out else f"failed: {row['error']}"
    if "jem_epochs" in row:
        main = f"{row['wall_s']:.0f} s wall, JEM {row['jem_epochs']} epochs, {_threads(row['threads'])}"
    elif "epochs_done" in row:
        per = row["median_ms_per_iteration"]
        main = (
            f"{per:.0f} ms/iteration ({row['epochs_done']} epochs in {row['wall_s']:.0f} s wall)"
            if per is not None
            else f"no epoch finished in {TRAIN_MAX_S} s ({row['wall_s']:.0f} s wall)"
        )
    else:
        main = f"{row['median_s_per_iteration']:.2f} s/iteration, {_threads(row['threads'])}"
    paused = "" if row.get("ledger_paused", True) or row["condition"] == "busy" else ", long benchmark running"
    return f"{main}; load {row['load_1min_before']:.2f}, busy {row['busy_cores_during']:.1f}{paused}"


def write(results: dict[str, Any]) -> None:
    from benchmarks.common import md_table, write_json

    write_json(str(RESULTS / "threads.json"), results)
    rows = []
    for name in WORKLOADS:
        for condition in ("idle", "busy"):
            cells = {
                r["setting"]: _cell(r) for r in results["rows"] if r["workload"] == name and r["condition"] == condition
            }
            rows.append([name, condition, cells.get("default", "-"), cells.get("chosen", "-")])
    busy = 'beside `python -c "while True: pass"`'
    text = (
        "# CPU threads: torch's default against the jem commands' choice\n\n"
        f"`python -m benchmarks.bench_threads`, {results['cpus']} cores (torch's default: "
        f"{results['torch_default_threads']} threads), in one run. idle: nothing of this run's beside it, and "
        f"the shared machine's long benchmark paused; busy: {busy}, the long benchmark running again. "
        "load: `uptime`'s 1-minute load average before each run; busy: the cores the whole machine kept busy "
        "during it (this run included). Other processes of the shared machine ran throughout: read each "
        "number with its load. Medians of the timed epochs/iterations.\n\n"
        + md_table(["workload", "machine", "torch's default", "chosen (jem_plugin.app.threads)"], rows)
        + "\n"
    )
    (RESULTS / "threads.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", action="store_true", help="(internal) run the README-style loop, print JSON")
    p.add_argument("--choose", action="store_true", help="(internal) with --loop: threads chosen by jem")
    p.add_argument("--table-only", action="store_true", help="rewrite results/threads.md from threads.json")
    args = p.parse_args(argv)
    if args.loop:
        print(json.dumps(loop(args.choose)))
        return 0
    write(json.loads((RESULTS / "threads.json").read_text()) if args.table_only else measure())
    print((RESULTS / "threads.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
