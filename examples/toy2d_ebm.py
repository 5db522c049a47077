"""A 2D mixture of Gaussians learned as a JEM: density and samples beside the truth.

An 8-component Gaussian mixture; each component is a class. A small MLP is trained with
cross-entropy plus JEM's generative term, so the same network gives p(y|x) and an
(unnormalised) density exp(logsumexp f(x)). The script plots the true density, the learned
density and SGLD samples side by side.

    python examples/toy2d_ebm.py --out runs/toy2d          # about 2 minutes on one CPU core
    python examples/toy2d_ebm.py --smoke                   # a few seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

import jem_plugin as jem
from jem_plugin.app.data import toy2d, toy2d_logpdf
from jem_plugin.app.nets import ToyMLP
from jem_plugin.viz import plot_density_2d


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="8gaussians")
    p.add_argument("--iters", type=int, default=1500)
    p.add_argument("--out", default="runs/toy2d")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny budget (seconds), for tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.iters = 30
    torch.manual_seed(args.seed)

    x_all, y_all = toy2d(args.dataset, n=20000, seed=args.seed)
    lim = 4.0
    jm = jem.wrap(ToyMLP(num_classes=int(y_all.max()) + 1), data_range=(-lim, lim), input_size=(2,))
    # 2D needs small Langevin steps relative to the domain: step a = s^2 / 2 (proper Langevin).
    sampler = jem.SGLD(steps=20, step_size=0.01, noise=0.1)
    buffer = jem.ReplayBuffer(10000, (2,), reinit_freq=0.05)
    loss_fn = jem.JEMLoss(sampler, buffer, data_noise=0.01, l2_weight=0.1)
    opt = torch.optim.Adam(jm.parameters(), lr=1e-3)

    bar = tqdm(range(args.iters), desc="toy2d JEM", disable=args.smoke)
    for it in bar:
        idx = torch.randint(0, len(x_all), (256,))
        out = loss_fn(jm, x_all[idx], y_all[idx])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        if it % 50 == 0:
            bar.set_postfix(acc=f"{out.metrics['acc']:.2f}", gap=f"{out.metrics['energy_gap']:.2f}")

    jm.eval()
    samples = jem.SGLD(steps=200, step_size=0.01, noise=0.1).sample(jm, n=1000)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = plot_density_2d(
        out_dir / "toy2d_density.png",
        true=lambda x: toy2d_logpdf(args.dataset, x),
        learned=jm.log_px,
        samples=samples,
        data=x_all[:2000],
        lim=lim,
        title=f"{args.dataset}: JEM density and samples",
    )
    with torch.no_grad():
        acc = float((jm(x_all[:2000]).argmax(1) == y_all[:2000]).float().mean())
    print(f"accuracy {acc:.3f}; plot: {path}")
    return {"accuracy": acc, "plot": str(path)}


if __name__ == "__main__":
    main()
