"""JEM under DistributedDataParallel: 2 processes, gloo backend, CPU.

Process launches dominate the cost (importing torch twice per launch), so one ``torchrun`` launch
of THIS file as a script runs every in-process check and writes each rank's findings to JSON;
the tests below assert on them. Two more launches of ``examples/train_ddp.py`` (interrupted, then
resumed) check that a real restart continues bit for bit like the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
SMOKE = ["--smoke", "--ckpt-every", "2"]  # 8 optimizer steps, checkpoints at 2, 4, 6, 8

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)


def _torchrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


# =============================================================================== worker side
def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _checksum(t: torch.Tensor) -> float:
    return float(t.double().sum()) + float((t.double() ** 2).sum())


def _batch(g: torch.Generator, n: int = 16):
    return torch.rand(n, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (n,), generator=g)


def _setup(model_cls, rank: int, steps: int = 3, buffer_size: int = 64):
    import jem_plugin as jem
    from jem_plugin import distributed as jdist

    torch.manual_seed(0)
    jm = jem.wrap(model_cls(), data_range=(-1.0, 1.0), input_size=(1, 8, 8))
    sampler = jem.SGLD(steps=steps, generator=jdist.rank_generator(0))
    loss_fn = jem.JEMLoss(sampler, jem.ReplayBuffer(buffer_size, (1, 8, 8)))
    return jm, loss_fn, torch.Generator().manual_seed(100 + rank)


def _worker(out_dir: str) -> None:  # pragma: no cover - runs in the torchrun children
    import torch.distributed as dist

    import jem_plugin as jem
    from jem_plugin import distributed as jdist
    from jem_plugin.app.nets import DigitsCNN

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import TinyCNN  # BatchNorm + Dropout: the layers that break naive code

    torch.set_num_threads(1)
    info = jdist.init_distributed()
    rank = info.rank
    res: dict = {"rank": rank, "world_size": info.world_size}

    # 1. DDP + JEMLoss on a BatchNorm model with static_graph=True (where sampling through the
    #    wrapper would desynchronise the ranks): parameters identical, buffers per rank.
    jm, loss_fn, g = _setup(TinyCNN, rank)
    ddp = jdist.wrap_ddp(jm, static_graph=True)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    start = [p.detach().clone() for p in jm.parameters()]
    for _ in range(3):
        x, y = _batch(g)
        out = loss_fn(ddp, x, y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    res["ddp_in_sync"] = jdist.params_in_sync(ddp)
    res["ddp_params_moved"] = any(not torch.equal(a, b) for a, b in zip(start, jm.parameters()))
    res["ddp_buffer_sums"] = _gather(_checksum(loss_fn.buffer.data))
    res["ddp_loss_finite"] = bool(torch.isfinite(out.loss))
    res["ddp_module_mode_restored"] = jm.training and all(m.training for m in jm.modules())

    # 2. Gradient accumulation: no all-reduce under no_sync, one on the last micro-batch.
    jm, loss_fn, g = _setup(DigitsCNN, rank)
    ddp = jdist.wrap_ddp(jm)
    x1, y1 = _batch(g)
    x2, y2 = _batch(g)
    with jdist.maybe_no_sync(ddp, sync=False):
        loss_fn(ddp, x1, y1).loss.backward()
    g_first = torch.cat([p.grad.flatten() for p in jm.parameters()])
    with jdist.maybe_no_sync(ddp, sync=True):
        loss_fn(ddp, x2, y2).loss.backward()
    g_final = torch.cat([p.grad.flatten() for p in jm.parameters()])
    res["nosync_grads_differ"] = _gather(_checksum(g_first))
    res["sync_grads"] = _gather(_checksum(g_final))

    # 3. A replay buffer inside the DDP-wrapped module (the mixin pattern) keeps its own chains.
    from torch import nn

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = DigitsCNN(width=4)
            self.buffer = jem.ReplayBuffer(8, (1, 8, 8))

        def forward(self, x):
            return self.net(x)

    holder = WithBuffer()
    holder.buffer.data.fill_(float(rank + 1))
    ignored = jdist.ignore_replay_buffers(holder)
    wrapped = torch.nn.parallel.DistributedDataParallel(holder)  # broadcast_buffers=True (default)
    wrapped(torch.zeros(2, 1, 8, 8)).sum().backward()
    res["ignored_names"] = ignored
    res["inner_buffer_value"] = float(holder.buffer.data.mean())

    # 4. PerRankState: rank 0 receives every rank's state; each rank loads its own back.
    _, lf, _ = _setup(DigitsCNN, rank, buffer_size=8)
    lf.buffer.data.fill_(float(10 + rank))
    state = jdist.PerRankState(lf).state_dict()
    objs = _gather(state["states"] if rank == 0 else None)
    full = objs[0]
    res["per_rank_values"] = [float(s["buffer.data"].mean()) for s in full]
    lf.buffer.data.zero_()
    jdist.PerRankState(lf).load_state_dict({"format": state["format"], "world_size": 2, "states": full})
    res["per_rank_restored"] = float(lf.buffer.data.mean())

    # 4b. BatchNorm statistics each rank recomputed on its own shard (jem train's update_bn after
    #     a joint run), averaged over the ranks so that rank 0's checkpoint holds all the data's.
    torch.manual_seed(0)  # the same network on both ranks, as after training
    bn_jm = jem.wrap(TinyCNN())
    torch.optim.swa_utils.update_bn([torch.full((8, 1, 8, 8), float(rank)) + torch.rand(8, 1, 8, 8)], bn_jm)
    bn = next(m for m in bn_jm.modules() if isinstance(m, torch.nn.BatchNorm2d))
    own = bn.running_mean.clone()
    res["bn_layers_averaged"] = jdist.average_batchnorm_statistics(bn_jm)
    res["bn_mean_own_and_averaged"] = [_gather(float(own.mean())), float(bn.running_mean.mean())]

    # 5. FSDP2 (fully_shard) on CPU/gloo: trains with JEMLoss, ranks in sync, close to DDP.
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 (imported only to learn whether this torch has FSDP2)
    except ImportError:
        res["fsdp"] = "unavailable"
    else:
        finals = {}
        for kind in ("ddp", "fsdp2"):
            jm, loss_fn, g = _setup(DigitsCNN, rank)
            model = jdist.wrap_ddp(jm) if kind == "ddp" else jm
            if kind == "fsdp2":
                jdist.fully_shard_jem(jm)
            opt = torch.optim.SGD(jm.parameters(), lr=0.1)
            for _ in range(2):
                x, y = _batch(g)
                out = loss_fn(model, x, y)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in jm.parameters()]
            finals[kind] = torch.cat([p.flatten() for p in params])
        res["fsdp_sharded"] = all(type(p).__name__ == "DTensor" for p in jm.parameters())
        res["fsdp_vs_ddp_maxdiff"] = float((finals["fsdp2"] - finals["ddp"]).abs().max())

    # 6. timm's task API under DDP: JEMTask.prepare_distributed, then a few steps.
    from jem_plugin.integrations.timm_task import JEMTask

    jm, loss_fn, g = _setup(DigitsCNN, rank)
    task = JEMTask(jm, loss_fn=loss_fn, verbose=False).prepare_distributed()
    opt = torch.optim.SGD(task.get_trainable_module().parameters(), lr=0.1)
    for _ in range(2):
        x, y = _batch(g)
        result = task(x, y)
        opt.zero_grad()
        result["loss"].backward()
        opt.step()
    res["timm_task_ddp"] = type(task.get_trainable_module()).__name__
    res["timm_task_in_sync"] = jdist.params_in_sync(task.jem)

    # 7. Lightning's DDP strategy inside these torchrun processes: each rank's buffer is saved
    #    (gathered into rank 0's checkpoint) and each rank gets its own back.
    if importlib.util.find_spec("lightning") is None:
        res["lightning"] = "unavailable"
    else:
        import lightning.pytorch as pl
        from torch.utils.data import DataLoader, TensorDataset

        from jem_plugin.integrations.lightning import JEMLightningModule

        torch.manual_seed(0)
        module = JEMLightningModule(
            TinyCNN(),
            sampler=jem.SGLD(steps=2, generator=jdist.rank_generator(0)),
            buffer=jem.ReplayBuffer(16, (1, 8, 8)),
            val_scores=("grad_norm",),
            lr=1e-2,
            wrap_options={"data_range": (-1.0, 1.0), "input_size": (1, 8, 8)},
        )
        data = TensorDataset(*_batch(torch.Generator().manual_seed(0), 32))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=1,
            val_check_interval=2,
            enable_checkpointing=False,
            default_root_dir=out_dir,
        )
        trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
        ckpt = str(Path(out_dir, "lightning.ckpt"))
        trainer.save_checkpoint(ckpt)
        dist.barrier()
        restored = JEMLightningModule.load_from_checkpoint(
            ckpt, model=TinyCNN(), sampler=jem.SGLD(steps=2), buffer=jem.ReplayBuffer(16, (1, 8, 8))
        )
        res["lightning_in_sync"] = jdist.params_in_sync(module.model)
        res["lightning_buffer_sums"] = _gather(_checksum(module.jem_loss.buffer.data))
        res["lightning_restored_own"] = bool(torch.equal(restored.jem_loss.buffer.data, module.jem_loss.buffer.data))
        res["lightning_val_grad_norm"] = float(trainer.callback_metrics["val/grad_norm"])

    # 8. Accelerate across the same processes: save_state/load_state keep each rank's buffer.
    if importlib.util.find_spec("accelerate") is None:
        res["accelerate"] = "unavailable"
    else:
        import accelerate

        from jem_plugin.integrations.accelerate import register_jem_state

        accelerator = accelerate.Accelerator(cpu=True)
        jm, loss_fn, g = _setup(TinyCNN, rank, buffer_size=16)
        opt = torch.optim.Adam(jm.parameters(), lr=1e-3)
        prepared, opt = accelerator.prepare(jm, opt)
        register_jem_state(accelerator, loss_fn)
        with accelerator.accumulate(prepared):
            x, y = _batch(g, 4)
            out = loss_fn(prepared, x, y)
            accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad()
        accelerator.save_state(str(Path(out_dir, "accelerate")))
        # save_state writes custom objects from the main process and returns without a barrier:
        # a rank that loads right away can look before rank 0's files exist (seen in CI).
        accelerator.wait_for_everyone()
        saved = loss_fn.buffer.data.clone()
        loss_fn.buffer.data.zero_()
        accelerator.load_state(str(Path(out_dir, "accelerate")))
        res["accelerate_wrapper"] = type(prepared).__name__
        res["accelerate_restored_own"] = bool(torch.equal(loss_fn.buffer.data, saved))
        res["accelerate_buffer_sums"] = _gather(_checksum(saved))

    Path(out_dir, f"results-rank{rank}.json").write_text(json.dumps(res))

    # 9. The example: interrupted after step 3 (the test resumes it in new processes), and
    #    uninterrupted, as the reference.
    sys.path.insert(0, str(EXAMPLE.parent))
    import train_ddp

    stopped = train_ddp.main([*SMOKE, "--out", str(Path(out_dir, "interrupted")), "--stop-after", "3"])
    summary = train_ddp.main([*SMOKE, "--out", str(Path(out_dir, "uninterrupted"))])
    Path(out_dir, f"example-rank{rank}.json").write_text(
        json.dumps({"stopped": stopped, "in_sync": summary["in_sync"], "step": summary["step"]})
    )
    jdist.cleanup()


# =============================================================================== tests
@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    _torchrun([__file__, str(out)])
    results = [json.loads(Path(out, f"results-rank{r}.json").read_text()) for r in range(2)]
    return out, results


@pytest.mark.slow
def test_ranks_stay_in_sync_and_buffers_are_per_rank(worker_results):
    _, (r0, r1) = worker_results
    assert r0["world_size"] == r1["world_size"] == 2
    for r in (r0, r1):
        assert r["ddp_in_sync"], "parameters differ across ranks after DDP JEM steps"
        assert r["ddp_params_moved"] and r["ddp_loss_finite"]
        assert r["ddp_module_mode_restored"], "sampling left the model in eval mode"
    a, b = r0["ddp_buffer_sums"]
    assert a != b, "both ranks hold the same replay buffer: seed the sampler per rank"


@pytest.mark.slow
def test_no_sync_accumulation_reduces_only_on_the_last_micro_batch(worker_results):
    _, (r0, _) = worker_results
    first, final = r0["nosync_grads_differ"], r0["sync_grads"]
    assert first[0] != first[1], "gradients were all-reduced inside no_sync()"
    assert final[0] == final[1], "gradients were not all-reduced on the synced micro-batch"


@pytest.mark.slow
def test_replay_buffer_inside_ddp_module_is_not_broadcast(worker_results):
    _, (r0, r1) = worker_results
    assert r0["ignored_names"] == ["buffer.data", "buffer.labels", "buffer.initialized", "buffer._colours"]
    assert r0["inner_buffer_value"] == 1.0
    assert r1["inner_buffer_value"] == 2.0, "DDP replaced rank 1's replay buffer with rank 0's"


@pytest.mark.slow
def test_per_rank_state_gathers_and_restores_each_rank(worker_results):
    _, (r0, r1) = worker_results
    assert r0["per_rank_values"] == [10.0, 11.0]
    assert (r0["per_rank_restored"], r1["per_rank_restored"]) == (10.0, 11.0)


@pytest.mark.slow
def test_batchnorm_statistics_recomputed_per_shard_are_averaged_over_ranks(worker_results):
    _, (r0, r1) = worker_results
    assert r0["bn_layers_averaged"] == r1["bn_layers_averaged"] >= 1
    (own0, own1), averaged = r0["bn_mean_own_and_averaged"]
    assert abs(own1 - own0) > 1e-3, "the two ranks' shards should give different statistics"
    assert averaged == pytest.approx((own0 + own1) / 2, abs=1e-6)
    assert r1["bn_mean_own_and_averaged"][1] == pytest.approx(averaged, abs=1e-6)


@pytest.mark.slow
def test_fsdp2_trains_a_jem_on_cpu(worker_results):
    _, (r0, r1) = worker_results
    if r0.get("fsdp") == "unavailable":
        pytest.skip("torch.distributed.fsdp.fully_shard is not in this torch")
    assert r0["fsdp_sharded"] and r1["fsdp_sharded"]
    # Same data, samples and SGD steps as DDP (whose ranks stay in sync); only the reduction
    # order differs.
    assert r0["fsdp_vs_ddp_maxdiff"] < 1e-5 and r1["fsdp_vs_ddp_maxdiff"] < 1e-5


@pytest.mark.slow
def test_timm_task_prepare_distributed_trains_in_sync(worker_results):
    _, (r0, r1) = worker_results
    assert r0["timm_task_ddp"] == "DistributedJEM"
    assert r0["timm_task_in_sync"] and r1["timm_task_in_sync"]


@pytest.mark.slow
def test_lightning_ddp_saves_and_restores_every_ranks_buffer(worker_results):
    _, (r0, r1) = worker_results
    if r0.get("lightning") == "unavailable":
        pytest.skip("lightning is not installed")
    assert r0["lightning_in_sync"] and r1["lightning_in_sync"]
    a, b = r0["lightning_buffer_sums"]
    assert a != b, "Lightning's DDP gave both ranks the same replay buffer"
    assert r0["lightning_restored_own"] and r1["lightning_restored_own"], "a rank resumed with another rank's chains"
    assert math.isfinite(r0["lightning_val_grad_norm"])  # a gradient score, computed in validation


@pytest.mark.slow
def test_accelerate_saves_and_restores_every_ranks_buffer(worker_results):
    _, (r0, r1) = worker_results
    if r0.get("accelerate") == "unavailable":
        pytest.skip("accelerate is not installed")
    assert r0["accelerate_wrapper"] == "DistributedDataParallel"
    a, b = r0["accelerate_buffer_sums"]
    assert a != b
    assert r0["accelerate_restored_own"] and r1["accelerate_restored_own"]


def _flat(obj, prefix=""):
    out = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
        else:
            out.update(_flat(v, f"{prefix}{k}."))
    return out


@pytest.mark.slow
def test_example_resumes_bit_for_bit_after_a_restart(worker_results):
    out, _ = worker_results
    for r in range(2):
        done = json.loads(Path(out, f"example-rank{r}.json").read_text())
        assert done == {"stopped": {"step": 3, "stopped": True}, "in_sync": True, "step": 8}
    run = out / "interrupted"
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    # Stopped after step 3: the last complete checkpoint is step 2 (step 3's work is replayed).
    assert ckpts == ["ckpt-000000002.pt", "ckpt-000000002.rank0.pt", "ckpt-000000002.rank1.pt"]
    second = _torchrun([str(EXAMPLE), *SMOKE, "--out", str(run)])
    assert "resumed at step 2" in second.stdout
    ref = out / "uninterrupted" / "checkpoints"
    for name in ("ckpt-000000008.pt", "ckpt-000000008.rank0.pt", "ckpt-000000008.rank1.pt"):
        a = _flat(torch.load(ref / name, weights_only=True)["objects"])
        b = _flat(torch.load(run / "checkpoints" / name, weights_only=True)["objects"])
        assert a.keys() == b.keys() and a
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"{name}: resumed run differs from the uninterrupted one in {diff[:5]}"
    # The shared file holds the bare model (no DDP "module." prefix): it loads in one process.
    import jem_plugin as jem
    from jem_plugin import distributed as jdist
    from jem_plugin.app.nets import DigitsCNN
    from jem_plugin.checkpoint import load_checkpoint
    from jem_plugin.errors import CheckpointError

    jm = jem.wrap(DigitsCNN(width=8), data_range=(-1.0, 1.0), input_size=(1, 8, 8))
    extra = load_checkpoint(run / "checkpoints" / "ckpt-000000008.pt", rng=False, model=jm)
    assert extra["world_size"] == 2 and extra["step"] == 8
    # Resuming a 2-process run with 1 process is a clear error, not a silent mix-up of buffers.
    loss_fn = jem.JEMLoss(jem.SGLD(steps=5), jem.ReplayBuffer(256, (1, 8, 8)))
    with pytest.raises(CheckpointError, match="nproc_per_node=2"):
        jdist.DistributedCheckpointer(run / "checkpoints").resume(model=jm, per_rank={"loss": loss_fn})
    # Each rank's buffer was saved, and they differ.
    r0 = _flat(torch.load(run / "checkpoints" / "ckpt-000000008.rank0.pt", weights_only=True)["objects"])
    r1 = _flat(torch.load(run / "checkpoints" / "ckpt-000000008.rank1.pt", weights_only=True)["objects"])
    assert not torch.equal(r0["loss.buffer.data"], r1["loss.buffer.data"])


# =============================================================================== single process
def test_helpers_without_a_process_group(tmp_path):
    """The same script runs under plain ``python``: helpers degrade to one process."""
    import jem_plugin as jem
    from jem_plugin import distributed as jdist
    from jem_plugin.app.nets import DigitsCNN
    from jem_plugin.errors import CheckpointError, JEMError

    info = jdist.init_distributed()
    assert (info.rank, info.world_size, info.distributed) == (0, 1, False)
    assert jdist.rank_seed(0, 0) != jdist.rank_seed(0, 1) != jdist.rank_seed(1, 1)
    with pytest.raises(JEMError, match="torchrun"):
        jdist.wrap_ddp(DigitsCNN())
    jm = jem.wrap(DigitsCNN(width=4), data_range=(-1.0, 1.0), input_size=(1, 8, 8))
    loss_fn = jem.JEMLoss(jem.SGLD(steps=2), jem.ReplayBuffer(16, (1, 8, 8)))
    loss_fn(jm, torch.rand(4, 1, 8, 8) * 2 - 1, torch.arange(4))
    ckpt = jdist.DistributedCheckpointer(tmp_path, every=1, keep=1)
    ckpt.save(1, model=jm, per_rank={"loss": loss_fn})
    ckpt.save(2, model=jm, per_rank={"loss": loss_fn})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000002.pt", "ckpt-000000002.rank0.pt"]
    saved = loss_fn.buffer.data.clone()
    loss_fn(jm, torch.rand(4, 1, 8, 8) * 2 - 1, torch.arange(4))
    assert ckpt.resume(model=jm, per_rank={"loss": loss_fn})["step"] == 2
    assert torch.equal(loss_fn.buffer.data, saved)
    # A per-rank state from 2 processes cannot be loaded by 1: a clear error, not a silent mix-up.
    with pytest.raises(CheckpointError, match="same number of processes"):
        jdist.select_rank_state({"format": jdist.PER_RANK_FORMAT, "world_size": 2, "states": [{}, {}]})
    # A checkpoint whose rank file is gone is skipped, falling back to nothing here.
    (tmp_path / "ckpt-000000002.rank0.pt").unlink()
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert ckpt.resume(model=jm, per_rank={"loss": loss_fn}) == {}


if __name__ == "__main__":  # the torchrun children
    _worker(sys.argv[1])


def test_cleanup_frees_garbage_before_it_leaves_the_process_group(monkeypatch):
    """A DDP wrapper lives in reference cycles; freed during interpreter shutdown, after the group
    is gone, its gloo work can abort a finished run (pytorch/pytorch#179291). cleanup() collects
    such garbage while the group still exists."""
    import gc
    import weakref

    import torch.distributed as dist

    from jem_plugin.distributed import _group

    class Cyclic:
        pass

    obj = Cyclic()
    obj.me = obj  # only the cyclic collector frees it
    alive = weakref.ref(obj)
    del obj
    seen = []
    gc.disable()
    try:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append(alive() is None))
        _group.cleanup()
    finally:
        gc.enable()
    assert seen == [True]
