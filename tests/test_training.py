"""The trainer: learns, resumes exactly, honours its time budget, and records a usable history."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import jem_plugin as jem
from jem_plugin.app import data as D
from jem_plugin.app.nets import DigitsCNN
from jem_plugin.recipes import OptimConfig
from jem_plugin.training import FitOptions, History, evaluate_classifier, fit, warmup_schedule

# fit's defaults before the warm-up was capped to a tenth of the run: Adam 1e-4, 1000 iterations uncapped.
UNCAPPED = OptimConfig(warmup_max_fraction=1.0)
QUIET = FitOptions(progress=False)


@pytest.fixture(scope="module")
def digits():
    return D.load_digits("train"), D.digits_tensors("test")


def _loader(ds, seed=0, batch_size=64, shuffle_generator=True):
    g = torch.Generator().manual_seed(seed) if shuffle_generator else None
    return DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True, generator=g)


def _model(seed=0, width=8):
    torch.manual_seed(seed)
    return jem.wrap(DigitsCNN(width=width))


def _params(jm):
    return torch.cat([p.detach().flatten() for p in jm.parameters()])


@pytest.mark.slow
def test_baseline_learns_digits_in_a_tiny_budget(digits):
    train, (xt, yt) = digits
    jm = _model(width=16)
    hist = fit(
        jm,
        _loader(train),
        epochs=4,
        optimizer=OptimConfig(lr=3e-3, warmup_iters=10, warmup_max_fraction=1.0),
        val_data=(xt, yt),
        options=QUIET,
    )
    ev = evaluate_classifier(jm, xt, yt)
    assert ev["accuracy"] > 0.8, ev
    assert hist["val_acc"][-1] == pytest.approx(ev["accuracy"])
    assert len(hist) == 4 and hist.stopped is None
    assert hist["loss"][-1] < hist["loss"][0]
    # JSON serialisable, round-trips
    again = History.from_dict(json.loads(json.dumps(hist.to_dict())))
    assert again["acc"] == hist["acc"]
    assert all(r["iterations"] == len(train) // 64 for r in hist.epochs)


def test_evaluate_classifier_matches_manual_and_restores_mode(digits):
    _, (xt, yt) = digits
    jm = _model()
    jm.train()
    ev = evaluate_classifier(jm, xt, yt, batch_size=100)
    with torch.no_grad():
        logits = jm(xt)
    assert ev["accuracy"] == pytest.approx(float((logits.argmax(1) == yt).float().mean()))
    assert ev["nll"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, yt)), rel=1e-5)
    assert jm.training
    loader = DataLoader(TensorDataset(xt, yt), batch_size=50)
    assert evaluate_classifier(jm, loader)["accuracy"] == pytest.approx(ev["accuracy"])


def test_warmup_is_linear_then_decays():
    f = warmup_schedule(10, iters_per_epoch=5, decay_epochs=[4], decay_rate=0.5)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == 1.0
    assert f(19) == 1.0 and f(20) == 0.5


class _Crash:
    """Raise at a given iteration, like a kill: nothing after the last checkpoint is saved."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, state):
        if state.iteration == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("global_shuffle", [False, True])
@pytest.mark.parametrize("every_iters, resumed_at", [(3, 6), (None, 5)])
def test_resume_is_exact(digits, tmp_path, global_shuffle, every_iters, resumed_at):
    """Killed after iteration 8; resumes from iteration 6 (mid epoch 2) or 5 (end of epoch 1)."""
    train, (xt, yt) = digits
    sub = TensorDataset(*[t[:320] for t in train.tensors])  # 5 batches per epoch

    def run(ckpt_dir=None, callbacks=None):
        torch.manual_seed(123)  # the global RNG drives data order when the loader has no generator
        jm = _model(width=4)
        dl = _loader(sub, shuffle_generator=not global_shuffle)  # a fresh loader, as after a restart
        h = fit(
            jm,
            dl,
            epochs=3,
            optimizer=OptimConfig(lr=1e-3, warmup_iters=4, warmup_max_fraction=1.0),
            callbacks=callbacks,
            options=FitOptions(checkpoint_dir=ckpt_dir, checkpoint_every=every_iters, progress=False),
        )
        return jm, h

    ref, ref_hist = run()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, callbacks=[_Crash(at=8)])
    resumed, hist = run(tmp_path)
    assert torch.equal(_params(ref), _params(resumed))
    assert [r["loss"] for r in hist.epochs] == [r["loss"] for r in ref_hist.epochs]
    assert any(e["event"] == "resumed" and e["iteration"] == resumed_at for e in hist.events)


def test_resume_with_jem_loss_restores_buffer_and_sampler(digits, tmp_path):
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.losses import JEMLoss
    from jem_plugin.sampling import SGLD

    train, _ = digits
    sub = TensorDataset(*[t[:192] for t in train.tensors])  # 3 batches per epoch

    def run(ckpt_dir=None, callbacks=None):
        torch.manual_seed(7)
        jm = _model(width=4)
        loss_fn = JEMLoss(SGLD(steps=2), ReplayBuffer(200, (1, 8, 8), init="uniform"), l2_weight=0.1)
        h = fit(
            jm,
            _loader(sub, seed=1),
            epochs=2,
            optimizer=OptimConfig(lr=1e-3, warmup_iters=2, warmup_max_fraction=1.0),
            loss_fn=loss_fn,
            callbacks=callbacks,
            options=FitOptions(checkpoint_dir=ckpt_dir, checkpoint_every=2, progress=False),
        )
        return jm, loss_fn, h

    ref, ref_loss, ref_hist = run()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, callbacks=[_Crash(at=5)])  # checkpoint at iteration 4 (epoch 2, batch 1)
    jm, loss_fn, hist = run(tmp_path)
    assert torch.equal(_params(ref), _params(jm))
    assert torch.equal(ref_loss.buffer.data, loss_fn.buffer.data)
    assert "energy_gap" in hist.last and hist["energy_gap"] == ref_hist["energy_gap"]


def test_max_seconds_stops_cleanly_and_resume_finishes_the_run(digits, tmp_path):
    train, _ = digits
    sub = TensorDataset(*[t[:320] for t in train.tensors])

    def slow(state):  # make each step take a while so the budget ends mid-run
        import time

        time.sleep(0.05)

    class Slow:
        on_step_end = staticmethod(slow)

    torch.manual_seed(0)
    ref = _model(width=4)
    optim = OptimConfig(lr=1e-3, warmup_iters=4, warmup_max_fraction=1.0)
    fit(ref, _loader(sub), epochs=3, optimizer=optim, options=QUIET)

    torch.manual_seed(0)
    jm = _model(width=4)
    import time

    t0 = time.perf_counter()
    h = fit(
        jm,
        _loader(sub),
        epochs=3,
        optimizer=optim,
        callbacks=[Slow()],
        options=FitOptions(checkpoint_dir=tmp_path, max_seconds=0.3, progress=False),
    )
    elapsed = time.perf_counter() - t0
    assert h.stopped == "max_seconds" and len(h) < 3
    assert elapsed < 0.3 + 1.0  # stops within about one step of the budget (+ the checkpoint)
    assert any(e["event"] == "stopped" for e in h.events)

    torch.manual_seed(0)
    jm2 = _model(width=4)
    h2 = fit(jm2, _loader(sub), epochs=3, optimizer=optim, options=FitOptions(checkpoint_dir=tmp_path, progress=False))
    assert h2.stopped is None and len(h2) == 3
    assert torch.equal(_params(ref), _params(jm2))


def test_bad_arguments_are_clear(digits):
    train, _ = digits
    jm = _model()
    with pytest.raises(ValueError, match="guard_policy"):
        fit(jm, _loader(train), epochs=1, options=FitOptions(guard_policy="ignore", progress=False))
    with pytest.raises(ValueError, match="empty"):
        fit(jm, [], epochs=1, options=QUIET)


class _Poisoned(torch.nn.Module):
    """A classifier whose training forward returns NaN logits once, at call ``at``."""

    def __init__(self, net, at):
        super().__init__()
        self.net, self.at, self.calls = net, at, 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                out = out * float("nan")
        return out


@pytest.mark.parametrize("policy", [{"guard_policy": "raise"}, {}], ids=["explicit", "default"])
def test_guard_raise_names_the_remedies(digits, policy):
    train, _ = digits
    torch.manual_seed(0)
    jm = jem.wrap(_Poisoned(DigitsCNN(width=4), at=3))
    with pytest.raises(jem.DivergenceError, match="l2_weight") as exc:
        fit(jm, _loader(train), epochs=1, optimizer=UNCAPPED, options=FitOptions(progress=False, **policy))
    assert "iteration 2" in str(exc.value)


def test_guard_off_lets_a_non_finite_loss_through(digits):
    train, _ = digits
    torch.manual_seed(0)
    jm = jem.wrap(_Poisoned(DigitsCNN(width=4), at=3))
    hist = fit(jm, _loader(train), epochs=1, optimizer=UNCAPPED, options=FitOptions(progress=False, guard_policy=None))
    assert len(hist) == 1


def test_guard_rollback_continues_with_safer_settings(digits, tmp_path):
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.losses import JEMLoss
    from jem_plugin.sampling import SGLD

    train, _ = digits
    sub = TensorDataset(*[t[:256] for t in train.tensors])  # 4 batches per epoch
    torch.manual_seed(0)
    jm = jem.wrap(_Poisoned(DigitsCNN(width=4), at=6))
    loss_fn = JEMLoss(SGLD(steps=1), ReplayBuffer(100, (1, 8, 8)))
    with pytest.warns(RuntimeWarning, match="Rolled back"):
        hist = fit(
            jm,
            _loader(sub),
            epochs=2,
            optimizer=OptimConfig(lr=1e-3, warmup_iters=0),
            loss_fn=loss_fn,
            options=FitOptions(
                guard_policy="rollback", guard_options={"snapshot_every": 2}, checkpoint_dir=tmp_path, progress=False
            ),
        )
    events = [e for e in hist.events if e["event"] == "rollback"]
    assert len(events) == 1 and events[0]["iteration"] == 5
    assert loss_fn.l2_weight == pytest.approx(0.1)  # the authors' remedy was applied
    assert all(torch.isfinite(p).all() for p in jm.parameters())
    assert len(hist) == 2 and all(r["iterations"] >= 3 for r in hist.epochs)
    # the remedy survives a resume: the guard's state is in the checkpoint
    loss2 = JEMLoss(SGLD(steps=1), ReplayBuffer(100, (1, 8, 8)))
    jm2 = jem.wrap(_Poisoned(DigitsCNN(width=4), at=-1))
    fit(
        jm2,
        _loader(sub),
        epochs=2,
        optimizer=UNCAPPED,
        loss_fn=loss2,
        options=FitOptions(guard_policy="rollback", checkpoint_dir=tmp_path, progress=False),
    )
    assert loss2.l2_weight == pytest.approx(0.1)


# run_digits_demo (jem demo's entry point), its metrics and figures: test_cli.py's
# test_demo_smoke_writes_report, on the same demo run as its report.


# ---------------------------------------------------------------- amp, channels_last, logging
class _Probe(torch.nn.Module):
    """A hand-written conv net that records the dtype of its conv output and whether its input
    arrived in channels_last (what fit's amp and channels_last options must change)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 8 * 8, 10)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x):
        h = self.conv2(self.conv(x))  # 4 channels: the two layouts differ
        self.seen.append((h.dtype, h.is_contiguous(memory_format=torch.channels_last) and not h.is_contiguous()))
        return self.head(torch.relu(self.bn(h)).flatten(1))


@pytest.mark.parametrize("amp, channels_last", [("off", False), ("bf16", False), ("off", True), ("bf16", True)])
def test_amp_and_channels_last_reach_the_model(digits, amp, channels_last):
    train, _ = digits
    sub = TensorDataset(*[t[:128] for t in train.tensors])
    torch.manual_seed(0)
    net = _Probe()
    hist = fit(
        jem.wrap(net),
        _loader(sub),
        epochs=1,
        optimizer=OptimConfig(lr=1e-3, warmup_iters=0),
        options=FitOptions(amp=amp, channels_last=channels_last, progress=False),
    )
    assert len(hist) == 1 and torch.isfinite(torch.tensor(hist["loss"])).all()
    dtypes, layouts = zip(*net.seen)
    assert set(dtypes) == {torch.bfloat16 if amp == "bf16" else torch.float32}
    assert set(layouts) == {channels_last}
    assert net.conv2.weight.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert net.conv.weight.dtype == torch.float32  # autocast never changes the parameters


def test_bf16_jem_training_with_a_replay_buffer(digits):
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.losses import JEMLoss
    from jem_plugin.sampling import SGLD

    train, _ = digits
    sub = TensorDataset(*[t[:128] for t in train.tensors])
    torch.manual_seed(0)
    loss_fn = JEMLoss(SGLD(steps=2), ReplayBuffer(100, (1, 8, 8)))
    hist = fit(
        jem.wrap(_Probe()),
        _loader(sub),
        epochs=1,
        optimizer=OptimConfig(warmup_iters=0),
        loss_fn=loss_fn,
        options=FitOptions(amp="bf16", channels_last=True, progress=False),
    )
    assert "energy_gap" in hist.last and loss_fn.buffer.data.dtype == torch.float32


def test_amp_arguments_are_checked(digits):
    train, _ = digits
    with pytest.raises(ValueError, match="amp must be"):
        fit(_model(), _loader(train), epochs=1, options=FitOptions(amp="fp8", progress=False))
    with pytest.raises(ValueError, match="amp='bf16'"):  # fp16 needs a GradScaler: CUDA only
        fit(_model(), _loader(train), epochs=1, options=FitOptions(amp="fp16", progress=False))
    with pytest.raises(ValueError, match="checkpoint_every"):
        fit(_model(), _loader(train), epochs=1, options=FitOptions(checkpoint_every=0, progress=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 with a GradScaler needs a CUDA GPU")
def test_fp16_on_cuda_uses_a_grad_scaler_and_resumes_it(digits, tmp_path):
    train, _ = digits
    sub = TensorDataset(*[t[:128] for t in train.tensors])
    torch.manual_seed(0)
    net = _Probe().cuda()
    fit(
        jem.wrap(net),
        _loader(sub),
        epochs=1,
        optimizer=UNCAPPED,
        options=FitOptions(amp="fp16", checkpoint_dir=tmp_path, progress=False),
    )
    assert set(d for d, _ in net.seen) == {torch.float16}
    saved = torch.load(sorted(tmp_path.glob("*.pt"))[-1], weights_only=False)
    assert "scaler" in saved["objects"]  # the loss scale is part of an exact resume


def test_throughput_and_time_left_are_logged(digits, capsys):
    train, _ = digits
    sub = TensorDataset(*[t[:192] for t in train.tensors])  # 3 batches of 64 per epoch
    hist = fit(_model(width=4), _loader(sub), epochs=3, optimizer=OptimConfig(lr=1e-3, warmup_iters=0))
    for i, rec in enumerate(hist.epochs):
        assert rec["img_per_s"] == pytest.approx(3 * 64 / rec["time"])
        assert rec["ms_per_iter"] == pytest.approx(1000 * rec["time"] / 3)
        assert rec["remaining_s"] == pytest.approx(rec["ms_per_iter"] / 1000 * 3 * (2 - i))
    err = capsys.readouterr().err
    assert "img/s=" in err and "ms/it=" in err and "left=" in err


def test_resume_is_announced(digits, tmp_path, caplog):
    train, _ = digits
    sub = TensorDataset(*[t[:320] for t in train.tensors])  # 5 batches per epoch
    with pytest.raises(KeyboardInterrupt):
        fit(
            _model(width=4),
            _loader(sub),
            epochs=3,
            optimizer=OptimConfig(warmup_iters=0),
            callbacks=[_Crash(at=8)],
            options=FitOptions(checkpoint_dir=tmp_path, checkpoint_every=3, progress=False),
        )
    with caplog.at_level("INFO", logger="jem_plugin.training"):
        fit(
            _model(width=4),
            _loader(sub),
            epochs=3,
            optimizer=OptimConfig(warmup_iters=0),
            options=FitOptions(checkpoint_dir=tmp_path, progress=False),
        )
    assert "resuming at epoch 2, iteration 6 of 15" in caplog.text


# ---------------------------------------------------------------- fit's one spelling per setting
def test_the_optimiser_is_an_optim_config_or_a_torch_optimiser_keeping_its_lr(digits):
    train, _ = digits
    sub = TensorDataset(*[t[:192] for t in train.tensors])  # 3 batches: 6 iterations
    config = OptimConfig(lr=1e-3, warmup_iters=5, warmup_max_fraction=1.0)
    hist = fit(_model(width=4), _loader(sub), epochs=2, optimizer=config, options=QUIET)
    assert [r["lr"] for r in hist.epochs] == pytest.approx([1e-3 * 4 / 5, 1e-3])  # warming up after epoch 1
    jm = _model(width=4)
    sgd = torch.optim.SGD(jm.parameters(), lr=0.05)
    hist = fit(jm, _loader(sub), epochs=2, optimizer=sgd, options=QUIET)  # the default warm-up: none in 6 iterations
    assert [r["lr"] for r in hist.epochs] == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize("old", ["lr", "warmup_iters", "grad_clip", "progress", "checkpoint_dir", "learning_rate"])
def test_loose_keywords_are_type_errors(digits, old):
    train, _ = digits
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{old}'"):
        fit(_model(), _loader(train), epochs=1, options=QUIET, **{old: 1})


def test_history_reads_an_epoch_by_index_and_refuses_a_metric_it_never_recorded():
    """``history[-1]`` is the last epoch (it read as an empty column before), and a misspelt
    metric is an error naming the recorded ones, not an empty list read as "never measured"."""
    from jem_plugin._train_state import History

    hist = History(epochs=[{"epoch": 1, "acc": 0.5, "loss": 2.0}, {"epoch": 2, "acc": 0.75, "loss": 1.0}])
    assert hist[-1] == {"epoch": 2, "acc": 0.75, "loss": 1.0} and hist[0]["acc"] == 0.5
    hist[-1]["acc"] = 0.0  # a copy: the record stays
    assert hist["acc"] == [0.5, 0.75] and hist.last["acc"] == 0.75
    with pytest.raises(KeyError, match=r"'accuracy'; recorded: epoch, acc, loss"):
        hist["accuracy"]
    with pytest.raises(TypeError, match="metric name or an epoch index"):
        hist[1.0]  # type: ignore[call-overload]  # the wrong type, on purpose
    assert History()["acc"] == []  # before the first epoch every column is empty
