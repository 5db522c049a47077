"""CPU threads that suit the machine (issue 59, item 1): on 2 cores beside one busy process, torch's
default 2 threads made `jem demo` take 5 min 30 s (cut short at 11 of 40 epochs) where one thread
took 29 s, `jem doctor` said "all good" at 10.1x its FLOP floor, and the demo's advice was a longer
budget. The commands now choose their threads (one helper), a user's setting wins, the doctor times
both counts, and the demo names the cause it sees. No test here times anything: the load, the
timings and the model sizes are injected."""

from __future__ import annotations

import types

import pytest
import torch

from jem_plugin.app import doctor, experiments, threads
from jem_plugin.app.cli import main
from jem_plugin.app.commands import demo
from jem_plugin.nets import build_model


@pytest.fixture
def machine(monkeypatch):
    """A 2-core machine whose torch default is 2 threads, no user setting, and a load to inject:
    ``machine(busy)``. Torch's thread count is restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_AT_IMPORT", 2)
    monkeypatch.setattr(threads, "_SET_HERE", None)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    torch.set_num_threads(2)

    def use(busy: float) -> None:
        monkeypatch.setattr(threads, "others_load", lambda window=0.0: (busy, "now"))

    yield use
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the rule
def test_a_busy_core_means_one_thread_fewer():
    assert threads.choose_threads(2, 1.0, 2).threads == 1
    assert threads.choose_threads(2, 0.1, 2).threads == 2
    assert threads.choose_threads(16, 3.0, 8).threads == 8  # never more than torch's own default
    assert threads.choose_threads(2, 5.0, 2).threads == 1  # at least one


def test_a_small_model_gets_one_thread_on_an_idle_machine():
    mlp = threads.forward_flops(build_model("toy-mlp", 8, 1), (2,))
    cnn = threads.forward_flops(build_model("digits-cnn", 10, 1), (1, 8, 8))
    assert mlp is not None and cnn is not None and mlp < threads.SMALL_FORWARD_FLOPS < cnn
    small = threads.choose_threads(2, 0.0, 2, mlp)
    assert small.threads == 1 and "(small)" in small.reason
    assert threads.choose_threads(2, 0.0, 2, cnn).threads == 2


def test_the_choice_is_set_and_said_in_one_line(machine):
    machine(1.0)
    said: list[str] = []
    choice = threads.use_threads(say=said.append)
    assert choice.threads == 1 and torch.get_num_threads() == 1
    (line,) = said
    assert line.startswith("jem: 1 CPU thread (2 cores, 1.0 in use by other processes") and "OMP_NUM_THREADS" in line
    # the helper's own setting is not mistaken for the user's on the next command in this process
    machine(0.0)
    assert threads.use_threads(say=said.append).threads == 2


def test_omp_num_threads_wins(machine, monkeypatch):
    machine(1.0)  # the rule would say 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    said: list[str] = []
    choice = threads.use_threads(say=said.append)
    assert choice.source == "OMP_NUM_THREADS" and torch.get_num_threads() == 2 and said == []


def test_torch_set_num_threads_wins(machine):
    machine(0.0)  # the rule would say 2
    torch.set_num_threads(1)  # the user's call, before the command's work
    said: list[str] = []
    choice = threads.use_threads(say=said.append)
    assert choice.source == "torch.set_num_threads" and torch.get_num_threads() == 1 and said == []


def test_a_command_chooses_and_says_so_unless_quiet(machine, monkeypatch, tmp_path, capsys):
    machine(1.0)
    result = {"runs": {}, "description": "digits"}
    monkeypatch.setattr(demo, "run_digits_demo", lambda out, **kw: result)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main(["demo", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "jem: 1 CPU thread (2 cores, 1.0 in use by other processes" in err and torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(threads, "_SET_HERE", None)
    assert main(["demo", "--quiet", "--out", str(tmp_path / "b")]) == 0
    assert "CPU thread" not in capsys.readouterr().err and torch.get_num_threads() == 1


# ----------------------------------------------------------------------------- jem doctor
def test_the_doctor_names_the_faster_thread_count_and_how_to_set_it():
    best, line = doctor.thread_advice({2: 17300.0, 1: 970.0}, current=2)
    assert best == 1 and line is not None
    assert "17.8x faster than torch's 2" in line and "OMP_NUM_THREADS=1" in line and "torch.set_num_threads(1)" in line
    assert doctor.thread_advice({2: 500.0, 1: 900.0}, current=2) == (2, None)
    assert doctor.thread_advice({2: 500.0, 1: 520.0}, current=2) == (2, None)  # within the margin: no advice


def test_the_doctor_never_says_all_good_at_ten_times_the_floor():
    assert doctor.timing_status(10.1, None)[0] == "warning"
    assert doctor.timing_status(3.0, None) == ("ok", None)
    assert doctor.timing_status(3.0, "use 1 thread")[0] == "warning"
    timing = {"status": "warning", "detail": "..."}
    report = {"ok": True, "install": {"problems": []}, "self_test": {"generator": {"status": "ok"}, "timing": timing}}
    assert doctor.summary_line(report) != "all good" and "timing" in doctor.summary_line(report)
    report["self_test"]["timing"] = {"status": "ok"}
    assert doctor.summary_line(report) == "all good"


def test_the_timing_check_reports_both_counts_from_injected_timings(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    ms = {2: 17300.0, 1: 970.0}
    monkeypatch.setattr(doctor, "_time_iterations", lambda it, dev, s, w: (ms[torch.get_num_threads()], 1))
    monkeypatch.setattr(doctor, "matmul_tflops", lambda dev, dtype, seconds=1.0: 1e-3)
    try:
        t = doctor.check_timing(torch.device("cpu"), seconds=1.0)
        assert torch.get_num_threads() == 2  # the user's count is back
    finally:
        torch.set_num_threads(before)
    assert (
        t["threads"] == 1
        and t["ms_per_iteration"] == 970.0
        and t["ms_per_iteration_by_threads"]
        == {
            "2": 17300.0,
            "1": 970.0,
        }
    )
    assert t["status"] == "warning" and "OMP_NUM_THREADS=1" in t["detail"] and "\n" not in t["detail"]
    assert "17.3 s at 2 threads, 970 ms at 1 thread" in t["detail"]


# ----------------------------------------------------------------------------- the demo's cut-short message
def test_the_cut_short_demo_names_the_cause_before_a_longer_budget():
    cause = threads.slow_cause(2, 2, 1.0)
    assert cause is not None and "OMP_NUM_THREADS=1" in cause
    note = experiments.truncation_note({"JEM": (11, 40)}, 330.0, cause)
    assert note.index("torch ran 2 threads") < note.index("--budget-seconds 330")
    busy = threads.slow_cause(1, 2, 1.0)
    assert busy is not None and "other processes kept 1.0 of the 2 cores busy" in busy
    assert threads.slow_cause(2, 2, 0.1) is None
    assert "(or on a less busy machine)" in experiments.truncation_note({"JEM": (11, 40)}, 330.0)


def test_the_cut_short_demo_never_suggests_the_budget_that_cut_it(monkeypatch, tmp_path):
    """Beside a busy process the demo suggested `--budget-seconds 240`, its own default: the runs'
    epochs at their measured speed fit in it, but not with the evaluation that the load slowed."""
    from jem_plugin._train_state import History

    def fake_fit(jm, loader, setup, epochs, **kw):  # one 10-second epoch of each run, then stopped
        return History(epochs=[{"epoch": 0, "time": 10.0, "cpu_time": 10.0}], stopped="max_seconds")

    monkeypatch.setattr(experiments, "fit", fake_fit)
    monkeypatch.setattr(experiments, "others_load", lambda window=0.0: (1.0, "now"))
    result = experiments.run_digits_demo(tmp_path, progress=False, plots=False, judge_epochs=0, epochs=4)
    assert result["truncated"] == {"baseline": (1, 4), "JEM": (1, 4)}
    suggested = int(result["warning"].rsplit("--budget-seconds ", 1)[1].split()[0])
    assert suggested > 240  # the default budget that cut them, plus the 3 + 3 epochs left out
    assert result["warning"].index("other processes kept 1.0 of the") < result["warning"].index("--budget-seconds")


def test_every_command_that_trains_or_scores_chooses_its_threads(monkeypatch, tmp_path, capsys):
    """One helper for every command: each calls it with its network and input shape."""
    from jem_plugin.app.commands import _common

    seen: list[tuple[str, tuple]] = []

    def record(model=None, sample_shape=None, say=None):
        seen.append((type(model).__name__, tuple(sample_shape or ())))
        return threads.ThreadChoice(torch.get_num_threads(), "chosen", "recorded")

    monkeypatch.setattr(_common, "use_threads", record)
    monkeypatch.setattr(demo, "run_digits_demo", lambda out, **kw: {"runs": {}})
    cfg = experiments.DigitsConfig()
    model = tmp_path / "model.pt"
    experiments._save_model(model, experiments._build(cfg, "cpu"), cfg)
    (tmp_path / "demo").mkdir()
    runs = {
        "demo": ["demo", "--out", str(tmp_path / "demo")],
        "train": ["train", "--data", "toy2d", "--epochs", "1", "--baseline", "--out", str(tmp_path / "run")],
        "eval": ["eval", str(model)],
        "ood": ["ood", str(model), "--scores", "msp", "--out", str(tmp_path / "ood.json")],
        "sample": ["sample", str(model), "--n", "4", "--sgld-steps", "1", "--out", str(tmp_path / "s.png")],
    }
    for name, argv in runs.items():
        seen.clear()
        assert main([*argv, "--quiet"]) == 0, capsys.readouterr().err
        assert seen and seen[0][0] in ("DigitsCNN", "ToyMLP"), (name, seen)
        assert seen[0][1] == ((2,) if name == "train" else (1, 8, 8)), (name, seen)


def test_the_load_is_read_on_the_cores_this_process_may_use(monkeypatch):
    """A process pinned to cores 0-1 of a larger machine counts the load on those two alone."""
    import io

    snapshots = iter(
        [
            "cpu  0 0 0 300 0\ncpu0 0 0 0 100 0\ncpu1 0 0 0 100 0\ncpu2 0 0 0 100 0\n",
            # 100 jiffies later: cpu0 busy throughout, cpu1 idle, cpu2 (not ours) busy
            "cpu  200 0 0 400 0\ncpu0 100 0 0 100 0\ncpu1 0 0 0 200 0\ncpu2 100 0 0 100 0\n",
        ]
    )
    monkeypatch.setattr(threads, "open", lambda path: io.StringIO(next(snapshots)), raising=False)
    monkeypatch.setattr(threads, "_allowed_cores", lambda: {0, 1})
    clock = iter([0.0, 1.0])  # a second passes; this process uses 0.25 of a core in it
    cpu = iter([0.0, 0.25])
    fake_time = types.SimpleNamespace(
        perf_counter=lambda: next(clock), process_time=lambda: next(cpu), sleep=lambda s: None
    )
    monkeypatch.setattr(threads, "time", fake_time)
    busy, how = threads.others_load(window=1.0)
    assert how == "now" and busy == pytest.approx(0.75)  # cpu0's whole core, less this process's quarter
