"""One training iteration with PGD negatives (DAT) against jem train's default and cross-entropy.

Side by side in one run (interleaved rounds, paired ratios to the cross-entropy step), on one
model at 32x32, batch 64, in train mode, Adam:

- ``ce``: one cross-entropy forward/backward/step.
- ``default``: ``jem train``'s choice for 150 images per class on this network
  (``jem_plugin.app.default_recipe.default_choice``), built by ``Recipe.build``: loss, backward, step.
- ``fast``: the ``fast`` recipe (5 SGLD steps on 32 chains).
- ``dat_{k}``: ``dat_setup(steps=k)``: ``fast``'s pieces with ``k`` PGD steps on 32 fresh
  negatives and the logistic contrast in place of SGLD and the p(x) term.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/check_pgd_negatives_cost.py --model resnet10t
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, make_model, uniform_batch


def build_contenders(model_name: str, batch: int, dat_steps: tuple[int, ...], per_class: int) -> dict[str, Contender]:
    from benchmarks.contenders import plain_ce_step
    from jem_plugin.app.default_recipe import default_choice
    from jem_plugin.builtins.pgd_negatives import dat_setup
    from jem_plugin.recipes import get_recipe

    model, jm, shape = make_model(model_name)
    model.train()
    gen = torch.Generator().manual_seed(0)
    x = uniform_batch(batch, shape)
    y = torch.randint(0, 10, (batch,), generator=gen)
    x_fit = uniform_batch(640, shape, seed=2)  # what the per-class Gaussian init is fitted on
    y_fit = torch.arange(640) % 10
    iters = 3000
    batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    choice = default_choice(per_class, batchnorm=batchnorm)

    def step_of(setup):
        def step():
            out = setup.loss(jm, x, y)
            setup.optimizer.zero_grad()
            out.loss.backward()
            setup.optimizer.step()

        return step

    contenders: dict[str, Contender] = {}
    opt_ce = torch.optim.Adam(model.parameters(), lr=3e-4)
    contenders["ce"] = Contender(lambda: plain_ce_step(model, opt_ce, x, y))
    default = get_recipe(choice.recipe).replace(**choice.settings)
    contenders["default"] = Contender(step_of(default.build(jm, (x_fit, y_fit), total_iters=iters, batch_size=batch)))
    contenders["fast"] = Contender(step_of(get_recipe("fast").build(jm, (x_fit, y_fit), total_iters=iters)))
    for k in dat_steps:
        setup = dat_setup(jm, (x_fit, y_fit), steps=k, total_iters=iters, batch_size=batch)
        contenders[f"dat_{k}"] = Contender(step_of(setup))
    print(f"default = {choice.recipe} {choice.settings}", file=sys.stderr)
    return contenders


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet10t", choices=list(common.MODELS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, nargs="*", default=[5, 10, 20])
    p.add_argument("--per-class", type=int, default=150)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}", file=sys.stderr)
    contenders = build_contenders(args.model, args.batch, tuple(args.steps), args.per_class)
    times = common.interleaved(contenders, repeats=args.repeats, warmup=1)
    stats = common.ratios(times, "ce")
    print(f"load after: {os.getloadavg()}", file=sys.stderr)
    rows = [
        [name, common.fmt_ms(s["median_s"]), f"{s['spread']:.1%}", common.fmt_ratio(s["ratio"])]
        for name, s in stats.items()
    ]
    print(
        f"{args.model}, batch {args.batch}, {args.repeats} interleaved rounds, torch threads {torch.get_num_threads()}"
    )
    print(common.md_table(["step", "median ms", "spread", "x cross-entropy step"], rows))


if __name__ == "__main__":
    main()
