"""JEM training on the bundled digits with DistributedDataParallel (DDP), resumable.

    torchrun --nproc_per_node=2 examples/train_ddp.py --smoke     # seconds, CPU (gloo)
    torchrun --nproc_per_node=2 examples/train_ddp.py             # the full run
    python examples/train_ddp.py --smoke                          # one process works too

Stop it at any time (Ctrl-C, SIGKILL, a preempted job) and run the same command again: it
resumes from the newest checkpoint in ``--out`` with the model, the optimizer and every rank's
replay buffer, sampler generator and RNG states, and continues as if it had never stopped.

What is specific to DDP (everything else is the single-process recipe):

1. ``jdist.init_distributed()`` joins torchrun's process group (gloo on CPU, NCCL on GPU).
2. ``jdist.wrap_ddp(jm)``: the JEM in DDP. ``loss_fn(ddp_jm, x, y)`` samples on the bare module
   and sends the concatenated [data; samples] batch through DDP once.
3. One replay buffer per rank, seeded per rank (``jdist.rank_generator``); a ``DistributedSampler``
   gives each rank its own share of the data.
4. ``jdist.maybe_no_sync`` for gradient accumulation; ``jdist.DistributedCheckpointer`` saves the
   shared state once and each rank's buffer in its own file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler

import jem_plugin as jem
from jem_plugin import distributed as jdist
from jem_plugin.app.data import load_digits
from jem_plugin.app.nets import DigitsCNN
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.checkpoint import save_checkpoint
from jem_plugin.losses import JEMLoss
from jem_plugin.sampling import SGLD
from jem_plugin.viz import save_samples


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/train_ddp", help="run directory (checkpoints, model, samples)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps in total")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--width", type=int, default=32, help="channels of the digits CNN")
    p.add_argument("--sgld-steps", type=int, default=20)
    p.add_argument("--step-size", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--buffer-size", type=int, default=10000, help="per rank")
    p.add_argument("--px-weight", type=float, default=1.0, help="weight of the p(x) term (0: plain classifier)")
    p.add_argument("--l2-weight", type=float, default=0.1, help="energy L2 regulariser (stability)")
    p.add_argument("--ckpt-every", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="exit after this many steps of this launch without a final save (to try resuming)",
    )
    p.add_argument("--smoke", action="store_true", help="a few seconds: tiny model, 5 SGLD steps, 8 steps")
    args = p.parse_args(argv)
    if args.smoke:
        args.width, args.sgld_steps, args.buffer_size, args.batch_size = 8, 5, 256, 32
        args.max_steps = args.max_steps or 8
        args.ckpt_every, args.log_every = min(args.ckpt_every, 4), 2
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    info = jdist.init_distributed()
    dev = info.device
    out = Path(args.out)

    # Same initial weights on every rank (DDP also broadcasts rank 0's at construction) ...
    torch.manual_seed(args.seed)
    jm = jem.wrap(DigitsCNN(width=args.width), data_range=(-1.0, 1.0), input_size=(1, 8, 8)).to(dev)
    model = jdist.wrap_ddp(jm) if info.distributed else jm
    # ... and from here on each rank draws its own data noise and chains.
    torch.manual_seed(jdist.rank_seed(args.seed))
    sampler = SGLD(
        steps=args.sgld_steps,
        step_size=args.step_size,
        noise=args.noise,
        generator=jdist.rank_generator(args.seed, device=dev),
    )
    buffer = ReplayBuffer(args.buffer_size, (1, 8, 8), reinit_freq=0.05, device=dev)
    loss_fn = JEMLoss(sampler, buffer, px_weight=args.px_weight, l2_weight=args.l2_weight)
    opt = torch.optim.Adam(jm.parameters(), lr=args.lr)

    train = load_digits("train", seed=args.seed)
    data_sampler = DistributedSampler(
        train, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=args.seed, drop_last=True
    )
    # The loader's own generator: iterating it must not consume the global RNG (exact resume).
    loader = DataLoader(
        train,
        batch_size=args.batch_size,
        sampler=data_sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    steps_per_epoch = len(loader) // args.accum
    if steps_per_epoch < 1:
        raise SystemExit(f"--accum {args.accum} exceeds the {len(loader)} batches per epoch")
    total = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total = min(total, args.max_steps)

    ckpt = jdist.DistributedCheckpointer(out / "checkpoints", every=args.ckpt_every, keep=2)
    per_rank = {"loss": loss_fn}  # the replay buffer, the sampler and its generator
    state = {} if args.fresh else ckpt.resume(model=jm, optimizer=opt, per_rank=per_rank)
    step = start = int(state.get("step", 0))
    if info.is_main:
        print(
            f"world_size={info.world_size} device={dev} steps={total} "
            + (f"resumed at step {step}" if step else "fresh start"),
            flush=True,
        )

    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    stopped = False
    while step < total and not stopped:
        epoch, offset = divmod(step, steps_per_epoch)
        data_sampler.set_epoch(epoch)
        batches = itertools.islice(
            jdist.skip_batches(loader, offset * args.accum), (steps_per_epoch - offset) * args.accum
        )
        model.train()
        for i, (x, y) in enumerate(batches):
            sync = (i + 1) % args.accum == 0
            with jdist.maybe_no_sync(model, sync):  # all-reduce only on the last micro-batch
                out_ = loss_fn(model, x.to(dev), y.to(dev))
                (out_.loss / args.accum).backward()
            if not sync:
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            metrics = out_.metrics
            if info.is_main and (step % args.log_every == 0 or step == total):
                print(
                    f"step {step}/{total} loss {metrics['loss']:.4f} acc {metrics['acc']:.3f} "
                    f"E(data) {metrics['energy_data']:.3f} E(sample) {metrics.get('energy_sample', 0):.3f}",
                    flush=True,
                )
            ckpt.maybe_save(step, model=jm, optimizer=opt, per_rank=per_rank)
            if args.stop_after is not None and step - start >= args.stop_after:
                stopped = True  # simulated interruption: no final save
            if stopped or step >= total:
                break
    if stopped:
        return {"step": step, "stopped": True}

    if ckpt.latest() is None or ckpt.checkpoints()[-1][0] != step:
        ckpt.save(step, model=jm, optimizer=opt, per_rank=per_rank)
    summary = {
        "step": step,
        "world_size": info.world_size,
        "seconds": time.perf_counter() - t0,
        "in_sync": jdist.params_in_sync(model),
        "train": metrics,
    }
    if bool(buffer.initialized):  # each rank's own chains
        save_samples(buffer.samples(64), out / f"samples-rank{info.rank}.png", domain=jm.domain)
    if info.is_main:
        jm.eval()
        test = load_digits("test", seed=args.seed)
        with torch.no_grad():
            x, y = test.tensors
            summary["test_accuracy"] = float((jm(x.to(dev)).argmax(1).cpu() == y).float().mean())
        save_checkpoint(out / "model.pt", rng=False, model=jm.model)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary), flush=True)
    jdist.barrier()
    return summary


if __name__ == "__main__":
    try:
        main()
    finally:
        jdist.cleanup()
