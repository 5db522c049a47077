"""A tiny JEM training run that checkpoints and resumes (driven by tests/test_checkpoint.py).

    python tests/_resume_script.py OUT_DIR --iters 30 --every 5 [--sleep 0.05]

Trains a small CNN on digits-like 8x8 data with JEMLoss (3 SGLD steps, replay buffer), saving a
checkpoint every ``--every`` iterations through :class:`jem_plugin.checkpoint.Checkpointer`, and
resuming from the newest one on start. Batches and data noise come from the *global* torch RNG,
so an exact resume depends on the RNG state in the checkpoint. On completion it writes
``OUT_DIR/final.pt`` with the model parameters and the replay buffer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn

torch.set_num_threads(1)

import jem_plugin as jem
from jem_plugin.buffer import ReplayBuffer
from jem_plugin.checkpoint import Checkpointer
from jem_plugin.losses import JEMLoss
from jem_plugin.sampling import SGLD


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Digits-like data: 10 random 8x8 prototypes in [-1, 1] plus noise (no sklearn import: fast start)."""
    g = torch.Generator().manual_seed(123)
    protos = torch.rand(10, 1, 8, 8, generator=g) * 2 - 1
    y = torch.arange(512) % 10
    x = (protos[y] + 0.3 * torch.randn(512, 1, 8, 8, generator=g)).clamp(-1, 1)
    return x, y


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    x_all, y_all = digits()
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.SiLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.SiLU(),
        nn.Flatten(),
        nn.Linear(8 * 16, 10),
    )
    jm = jem.wrap(net, num_classes=10, data_range=(-1.0, 1.0))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loss_fn = JEMLoss(SGLD(steps=3), ReplayBuffer(capacity=256, sample_shape=(1, 8, 8)), l2_weight=0.1)
    ckpt = Checkpointer(args.out, every=args.every, keep=2)

    start = ckpt.resume(model=jm, optimizer=opt, loss=loss_fn).get("step", 0)
    print(f"start {start}", flush=True)
    for step in range(start, args.iters):
        idx = torch.randint(0, x_all.shape[0], (32,))
        out = loss_fn(jm, x_all[idx], y_all[idx])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        ckpt.maybe_save(step + 1, model=jm, optimizer=opt, loss=loss_fn)
        if args.sleep:
            time.sleep(args.sleep)
    torch.save(
        {
            "params": {k: v.clone() for k, v in net.state_dict().items()},
            "buffer": loss_fn.buffer.data.clone(),
            "rng": torch.get_rng_state(),
        },
        os.path.join(args.out, "final.pt"),
    )
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
