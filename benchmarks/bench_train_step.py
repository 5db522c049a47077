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

``--cuts`` (issue 45, deliverable 3: a cheaper iteration) times something else: ``jem train``'s
choice (:data:`CHOICE`) and each candidate cut (:data:`CUTS`, recipe settings changed on top of
it) against cross-entropy, each a whole iteration of :func:`benchmarks.bench_generative.train_step`
(what the generalisation matrix and the long row train with: augmentation, the clean batch for the
p(x) term, optimiser, schedule) on 32x32 textures at 150 per class, batch 64, one thread,
interleaved rounds, in CPU seconds (``time.process_time``: on a shared machine wall time counts the
others' work), ratios paired per round. Writes ``train_step_cuts.{json,md}``.

    OMP_NUM_THREADS=1 nice -n 19 python -m benchmarks.bench_train_step --cuts [--repeats 10]
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, make_model, uniform_batch
from jem_plugin.app.default_recipe import default_choice

NAME = "train_step"
TARGET_PARTS = 1.05

CUTS_NAME = "train_step_cuts"
#: the cost target: a whole iteration of jem train's choice at most this many CE iterations
TARGET_CE = 3.0
#: jem train's choice at 150 images per class (the same settings with and without BatchNorm)
CHOICE: dict[str, Any] = dict(default_choice(150, batchnorm=True).settings)
#: candidate cuts: recipe settings (flat names, as ``Recipe.replace`` takes them) changed on top of
#: :data:`CHOICE`. ``shared``: the p(x) term's data energies come from the classification forward
#: (the augmented, noisy batch), not from a second pass over the clean batch (160 -> 96 images in
#: the loss's forward and backward). ``steps5``: 5 SGLD steps instead of 10 from the informative init.
#: ``chains16``: 16 chains per iteration instead of 32 (the buffer, sized for 40 draws per slot,
#: halves with them).
CUTS: dict[str, dict[str, Any]] = {
    "shared": {"px_clean_data": False},
    "steps5": {"sgld_steps": 5},
    "steps5_shared": {"sgld_steps": 5, "px_clean_data": False},
    "chains16_shared": {"n_samples": 16, "px_clean_data": False},
    "steps5_chains16": {"sgld_steps": 5, "n_samples": 16},
    "steps5_chains16_shared": {"sgld_steps": 5, "n_samples": 16, "px_clean_data": False},
    # steps5_shared with each slot drawn twice as often (half the slots): its chains get the steps
    # that 10 steps at 40 draws gave them, at steps5_shared's cost (the buffer's size costs nothing
    # per iteration); for the quality check, left out of the timed contenders
    "steps5_shared_visits80": {"sgld_steps": 5, "px_clean_data": False, "buffer_visits": 80},
}
#: the cuts timed by :func:`run_cuts` (the others cost what one of these costs)
TIMED_CUTS = tuple(name for name in CUTS if name != "steps5_shared_visits80")


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


# ---------------------------------------------------------------------------- cheaper iterations
def cut_contenders(
    net: str,
    channels_last: bool = True,
    iterations: int = 3000,
    cuts: Sequence[str] | None = None,
    tiny: bool = False,
) -> dict[str, Contender]:
    """``ce``, ``choice`` and each of :data:`CUTS` (or those named in ``cuts``) on ``net``: one whole
    training iteration each, on its own model, optimiser and buffer (sized for a run of
    ``iterations``, as the long row's), cycling through the same batches. With ``channels_last``: ``ce_cl`` and ``choice_cl``, the same
    with the model's weights in channels-last memory format (not a recipe setting: a model's).
    ``tiny``: the generalisation matrix's tiny textures (a smoke test's: one batch of the 60 images
    its pool holds) instead of its 150-per-class row."""
    from benchmarks import bench_generalisation as GB
    from benchmarks import bench_generative as G

    S = GB.setting(GB.dataset("textures", tiny), net, GB.per_class_for("textures", "150", tiny), 0)
    lr = GB.NETWORK_LR.get(net)
    order = torch.randperm(len(S["x"]), generator=torch.Generator().manual_seed(0))
    batch = min(GB.BATCH, len(order))
    batches = [(S["x"][i], S["y"][i]) for i in order.split(batch) if len(i) == batch]

    def contender(settings: dict[str, Any] | None, cl: bool = False) -> Contender:
        run = "baseline" if settings is None else "generative"
        overrides = {**({"lr": lr} if lr else {}), **(settings or {})}
        ctx = G.start_run(S, run, iterations, batch_size=GB.BATCH, overrides=overrides or None, fit_init="train")
        if cl:
            ctx["model"].to(memory_format=torch.channels_last)
        feed = itertools.cycle(batches)

        def step() -> None:
            x, y = next(feed)
            G.train_step(ctx, x, y)

        return Contender(step)

    out = {"ce": contender(None), "choice": contender(CHOICE)}
    out.update({name: contender({**CHOICE, **CUTS[name]}) for name in (TIMED_CUTS if cuts is None else cuts)})
    if channels_last:
        out["ce_cl"], out["choice_cl"] = contender(None, cl=True), contender(CHOICE, cl=True)
    return out


def run_cuts(
    quick: bool = False,
    repeats: int | None = None,
    networks: Sequence[str] | None = None,
    channels_last: bool = True,
    cuts: Sequence[str] | None = None,
    warmup: int | None = None,
    tiny: bool = False,
    **_: Any,
) -> dict[str, Any]:
    """Every contender of :func:`cut_contenders` per network, interleaved, in CPU seconds; the
    load average before and after (the machine is shared: read the ratios, not the times).
    ``warmup``: untimed rounds first (default 2; quick 1); ``tiny``: :func:`cut_contenders`'."""
    networks = list(networks or ["resnet10t", "convnext_atto"])
    repeats = repeats or (2 if quick else 10)
    result: dict[str, Any] = {
        "choice": CHOICE,
        "cuts": CUTS,
        "repeats": repeats,
        "clock": "process_time (CPU seconds)",
        "target_ce": TARGET_CE,
        "networks": {},
    }
    for net in networks:
        load_before = os.getloadavg()
        times = common.interleaved(
            cut_contenders(net, channels_last, 40 if quick else 3000, cuts, tiny),
            repeats=repeats,
            warmup=(1 if quick else 2) if warmup is None else warmup,
            clock=time.process_time,
        )
        stats = common.ratios(times, "ce")
        if "ce_cl" in stats:  # channels-last against its own cross-entropy step
            stats["choice_cl"]["ratio_vs_ce_cl"] = common.paired_ratio(times["choice_cl"], times["ce_cl"])
        result["networks"][net] = {
            "time": stats,
            "samples_s": times,
            "load_before": load_before,
            "load_after": os.getloadavg(),
        }
    return result


def cuts_to_markdown(res: dict[str, Any]) -> str:
    choice = ", ".join(f"{k}={v}" for k, v in res["choice"].items())
    lines = [
        f"One whole training iteration (bench_generative.train_step: 32x32 textures, batch 64, one thread) of "
        f"jem train's choice (generative, {choice}) and of each cut (recipe settings on top of it) against a "
        f"cross-entropy iteration; {res['repeats']} interleaved rounds, {res['clock']}; ratio = paired median of "
        f"t / t_ce. Target: at most {res['target_ce']:g}x.",
        "",
    ]
    rows = []
    for net, entry in res["networks"].items():
        for name, s in entry["time"].items():
            settings = res["cuts"].get(name)
            what = ", ".join(f"{k}={v}" for k, v in settings.items()) if settings else ""
            ratio = common.fmt_ratio(s["ratio"])
            if "ratio_vs_ce_cl" in s:
                ratio += f" ({s['ratio_vs_ce_cl']:.2f}x ce_cl)"
            meets = "" if name.startswith("ce") else ("yes" if s["ratio"] <= res["target_ce"] else "no")
            rows.append([net, name, what, common.fmt_ms(s["median_s"]), f"{s['spread']:.1%}", ratio, meets])
    lines.append(
        common.md_table(["network", "iteration", "settings", "median CPU ms", "spread", "x CE", "<= target"], rows)
    )
    lines.append("")
    for net, entry in res["networks"].items():
        b, a = entry["load_before"], entry["load_after"]
        lines.append(f"- {net}: load average {b[0]:.1f} / {b[1]:.1f} before, {a[0]:.1f} / {a[1]:.1f} after (1 / 5 min)")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--cuts" in sys.argv[1:]:
        sys.argv.remove("--cuts")

        def _cuts_extra(p):
            p.add_argument("--networks", nargs="*", default=None)
            p.add_argument("--no-channels-last", dest="channels_last", action="store_false")

        common.standalone_main(CUTS_NAME, run_cuts, cuts_to_markdown, extra_args=_cuts_extra)
        sys.exit()

    def _extra(p):
        p.add_argument("--models", nargs="*", default=None, choices=list(common.MODELS))

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
