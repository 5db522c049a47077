"""Training-step cost: plain cross-entropy against JEM steps (5, 10, 20 SGLD steps) and the reference.

Contenders (model in train mode, Adam lr 1e-4, batch 64, one optimizer each on the same model):

- ``ce``: the baseline, one cross-entropy forward/backward/step.
- ``jem_{k}``: ``out = JEMLoss(SGLD(steps=k), ReplayBuffer(10000))(jm, x, y)``, backward, step.
- ``reference_20``: the reference JEM training step (three forwards, 20 SGLD steps, CPU buffer;
  :class:`benchmarks.contenders.ReferenceJEM`).
- ``parts_sample_20`` and ``parts_fwdbwd``: the two parts of a 20-step JEM step timed on their
  own: drawing the samples (``SGLD.sample`` with the buffer) and one forward/backward/step on the
  concatenated ``[x; x_sample]`` batch with the same loss terms. "Sum of parts" is their sum per
  round; the target is ``jem_20 <= 1.05 x`` that sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, make_model, uniform_batch

NAME = "train_step"
TARGET_PARTS = 1.05


def build_contenders(
    model_name: str, batch: int, steps_list: tuple[int, ...], buffer_size: int, ref_steps: int
) -> dict[str, Contender]:
    from benchmarks.contenders import ReferenceJEM, plain_ce_step
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.losses import JEMLoss
    from jem_plugin.sampling import SGLD

    model, jm, shape = make_model(model_name)
    model.train()
    x = uniform_batch(batch, shape)
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(0))

    def adam():
        return torch.optim.Adam(model.parameters(), lr=1e-4)

    contenders: dict[str, Contender] = {}
    opt_ce = adam()
    contenders["ce"] = Contender(lambda: plain_ce_step(model, opt_ce, x, y))

    def jem_step(loss_fn, opt):
        def step():
            out = loss_fn(jm, x, y)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            return out

        return step

    parts_sampler = parts_buffer = None
    for k in steps_list:
        sampler = SGLD(steps=k, step_size=1.0, noise=0.01)
        buffer = ReplayBuffer(buffer_size, shape, reinit_freq=0.05)
        loss_fn = JEMLoss(sampler, buffer)
        contenders[f"jem_{k}"] = Contender(jem_step(loss_fn, adam()), prepare=lambda b=buffer: b.initialize(jm.domain))
        if k == ref_steps:
            parts_sampler, parts_buffer = sampler, buffer

    ref = ReferenceJEM(model, shape, buffer_size=buffer_size, n_steps=ref_steps, batch_size=batch)
    opt_ref = adam()
    contenders[f"reference_{ref_steps}"] = Contender(lambda: ref.train_step(opt_ref, x, x, y))

    if parts_sampler is not None:
        contenders[f"parts_sample_{ref_steps}"] = Contender(
            lambda: parts_sampler.sample(jm, n=batch, buffer=parts_buffer)
        )
        x_q = parts_sampler.sample(jm, n=batch, buffer=ReplayBuffer(max(batch, 64), shape))
        opt_parts = adam()

        def fwdbwd():
            # What JEMLoss does after sampling, minus its bookkeeping: one forward on the
            # concatenated batch, CE + energy contrast, backward, step.
            logits = jm(torch.cat([x, x_q]))
            ld, lq = logits[:batch], logits[batch:]
            loss = F.cross_entropy(ld, y) - torch.logsumexp(ld, 1).mean() + torch.logsumexp(lq, 1).mean()
            opt_parts.zero_grad()
            loss.backward()
            opt_parts.step()

        contenders["parts_fwdbwd"] = Contender(fwdbwd)
    return contenders


def run(
    quick: bool = False, repeats: int | None = None, models: list[str] | None = None, batch: int = 64, **_: Any
) -> dict[str, Any]:
    if quick:
        models = models or ["digits_cnn"]
        repeats = repeats or 3
        batch, steps_list, ref_steps, buffer_size = 16, (2, 4), 4, 256
    else:
        models = models or ["digits_cnn", "test_resnet"]
        repeats = repeats or 15
        steps_list, ref_steps, buffer_size = (5, 10, 20), 20, 10000
    result: dict[str, Any] = {
        "batch": batch,
        "steps": list(steps_list),
        "ref_steps": ref_steps,
        "repeats": repeats,
        "models": {},
    }
    for name in models:
        contenders = build_contenders(name, batch, steps_list, buffer_size, ref_steps)
        times = common.interleaved(contenders, repeats=repeats, warmup=1)
        stats = common.ratios(times, "ce")
        entry: dict[str, Any] = {"time": stats}
        sk, fk, jk = f"parts_sample_{ref_steps}", "parts_fwdbwd", f"jem_{ref_steps}"
        if sk in times:
            sums = [a + b for a, b in zip(times[sk], times[fk])]
            entry["jem_vs_sum_of_parts"] = common.paired_ratio(times[jk], sums)
            entry["sum_of_parts_median_s"] = common.summarize(sums)["median_s"]
            entry["jem_vs_sum_of_parts_le_1.05"] = entry["jem_vs_sum_of_parts"] <= TARGET_PARTS
            ref = times.get(f"reference_{ref_steps}")
            if ref is not None:
                entry["jem_vs_reference"] = common.paired_ratio(times[jk], ref)
        result["models"][name] = entry
    return result


def to_markdown(res: dict) -> str:
    lines = [
        f"Training step, batch {res['batch']}, {res['repeats']} interleaved rounds, medians; ratio = "
        "paired median of t / t_ce (the plain cross-entropy step).",
        "",
    ]
    rows = []
    for name, entry in res["models"].items():
        for impl, s in entry["time"].items():
            rows.append([name, impl, common.fmt_ms(s["median_s"]), f"{s['spread']:.1%}", common.fmt_ratio(s["ratio"])])
    lines.append(common.md_table(["model", "step", "median ms", "spread", "x plain CE step"], rows))
    lines.append("")
    for name, entry in res["models"].items():
        if "jem_vs_sum_of_parts" in entry:
            k = res["ref_steps"]
            lines.append(
                f"- {name}: JEM {k}-step step / (sampling + one fwd/bwd on the concatenated batch) = "
                f"**{entry['jem_vs_sum_of_parts']:.3f}x** (target <= {TARGET_PARTS}x: "
                f"{common.target_mark(entry['jem_vs_sum_of_parts_le_1.05'])}); JEM {k}-step / reference "
                f"{k}-step = {entry.get('jem_vs_reference', float('nan')):.3f}x"
            )
    return "\n".join(lines)


if __name__ == "__main__":

    def _extra(p):
        p.add_argument("--models", nargs="*", default=None, choices=list(common.MODELS))

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
