"""SGLD sampling speed and memory: jem-plugin against the floor, the reference loop and torchebm.

Contenders, all on the same model (eval mode), energy ``-logsumexp f(x)``, batch (64) and number
of steps (20), step size 1, noise 0.01:

- ``floor``: the bare loop (:func:`benchmarks.common.floor_chain`), parameters frozen outside
  the timed region: the least work possible.
- ``jem_plugin``: ``SGLD(steps).sample(jm, n, buffer=ReplayBuffer(10000, ...))`` with the
  library's defaults: everything a user gets (buffer draw and write-back, reinitialisation,
  clamp to the domain, mode handling and parameter freezing, hook check, divergence check).
- ``reference``: the reference JEM ``sample_q`` with its CPU replay buffer
  (:class:`benchmarks.contenders.ReferenceJEM`).
- ``torchebm``: ``LangevinDynamics.sample(x=x0, n_steps=steps)`` from a fixed start (it has no
  replay buffer).

Also checked in the same run: our chain equals the floor's chain bit for bit for the same
generator (``clamp=False``, same start), and torchebm's chain is the same chain up to rounding.
"""

from __future__ import annotations

from typing import Any

import torch

if __package__ in (None, ""):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.common import Contender, floor_chain, frozen, make_model, uniform_batch

NAME = "sampler"
TARGET_RATIO = 1.02


def chain_agreement(model_name: str = "digits_cnn", batch: int = 8, steps: int = 5, seed: int = 123) -> dict[str, Any]:
    """Max |difference| of the final chains of ours, torchebm and the floor from the same start and
    the same generator seed (ours with ``clamp=False``: the floor does not clamp)."""
    from jem_plugin.sampling import SGLD

    model, jm, shape = make_model(model_name)
    x0 = uniform_batch(batch, shape, seed=seed + 1)
    with frozen(model):
        ref = floor_chain(model, x0, steps, generator=torch.Generator().manual_seed(seed))
    ours = SGLD(
        steps=steps, step_size=1.0, noise=0.01, clamp=False, generator=torch.Generator().manual_seed(seed)
    ).sample(jm, x_init=x0)
    out = {
        "model": model_name,
        "batch": batch,
        "steps": steps,
        "ours_equal_floor": bool(torch.equal(ours, ref)),
        "ours_max_abs_diff": float((ours - ref).abs().max()),
    }
    try:
        sampler, _ = common_torchebm(model)
        te = sampler.sample(x=x0, n_steps=steps, generator=torch.Generator().manual_seed(seed))
        out["torchebm_max_abs_diff"] = float((te - ref).abs().max())
    except ImportError:
        out["torchebm_max_abs_diff"] = None
    return out


def fixed_overhead(model_name: str, batch: int, buffer_size: int, calls: int = 200) -> dict[str, float]:
    """What jem-plugin adds per chain, measured directly: ``SGLD(steps=0).sample(jm, n, buffer=...)``
    (buffer draw, reinit, write-back, mode handling, parameter freezing: everything but the steps)."""
    import statistics
    import time

    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.sampling import SGLD

    model, jm, shape = make_model(model_name)
    buffer = ReplayBuffer(buffer_size, shape, reinit_freq=0.05)
    buffer.initialize(jm.domain)
    sampler = SGLD(steps=0)
    sampler.sample(jm, n=batch, buffer=buffer)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        sampler.sample(jm, n=batch, buffer=buffer)
        ts.append(time.perf_counter() - t0)
    return {"fixed_overhead_us": statistics.median(ts) * 1e6}


def common_torchebm(model):
    from benchmarks.contenders import torchebm_sampler

    return torchebm_sampler(model, step_size=1.0, noise=0.01)


def build_contenders(
    model_name: str,
    batch: int,
    steps: int,
    buffer_size: int,
    include: tuple[str, ...] = ("floor", "jem_plugin", "reference", "torchebm"),
) -> dict:
    from benchmarks.contenders import ReferenceJEM
    from jem_plugin.buffer import ReplayBuffer
    from jem_plugin.sampling import SGLD

    model, jm, shape = make_model(model_name)
    x0 = uniform_batch(batch, shape)
    gen = torch.Generator().manual_seed(0)
    contenders: dict[str, Contender] = {}
    freezer = frozen(model)

    if "floor" in include:
        contenders["floor"] = Contender(
            lambda: floor_chain(model, x0, steps, generator=gen),
            setup=freezer.__enter__,
            teardown=lambda: freezer.__exit__(),
        )
    if "jem_plugin" in include:
        sampler = SGLD(steps=steps, step_size=1.0, noise=0.01, generator=torch.Generator().manual_seed(0))
        buffer = ReplayBuffer(buffer_size, shape, reinit_freq=0.05)
        contenders["jem_plugin"] = Contender(
            lambda: sampler.sample(jm, n=batch, buffer=buffer), prepare=lambda: buffer.initialize(jm.domain)
        )
    if "reference" in include:
        ref = ReferenceJEM(model, shape, buffer_size=buffer_size, n_steps=steps, batch_size=batch)
        # The reference leaves the model in train mode; the comparison is in eval mode.
        contenders["reference"] = Contender(ref.sample_q, teardown=model.eval)
    if "torchebm" in include:
        try:
            te, _ = common_torchebm(model)
            tgen = torch.Generator().manual_seed(0)
            contenders["torchebm"] = Contender(lambda: te.sample(x=x0, n_steps=steps, generator=tgen))
        except ImportError:
            pass
    return contenders


def run(
    quick: bool = False,
    repeats: int | None = None,
    models: list[str] | None = None,
    batch: int = 64,
    steps: int = 20,
    memory: bool = True,
    **_: Any,
) -> dict[str, Any]:
    if quick:
        models = models or ["digits_cnn"]
        repeats = repeats or 3
        batch, steps = 16, 4
        mem_steps = (2, 8)
        buffer_size = 256
    else:
        models = models or list(common.MODELS)
        repeats = repeats or 15
        mem_steps = (5, 20, 80)
        buffer_size = 10000
    result: dict[str, Any] = {
        "batch": batch,
        "steps": steps,
        "repeats": repeats,
        "agreement": chain_agreement(),
        "models": {},
    }
    for name in models:
        contenders = build_contenders(name, batch, steps, buffer_size)
        times = common.interleaved(contenders, repeats=repeats, warmup=1)
        stats = common.ratios(times, "floor")
        entry: dict[str, Any] = {"time": stats, "raw_times_s": times}
        entry.update(fixed_overhead(name, batch, buffer_size, calls=20 if quick else 200))
        entry["fixed_overhead_fraction"] = entry["fixed_overhead_us"] * 1e-6 / stats["floor"]["median_s"]
        if "jem_plugin" in times:
            # Paired per round, like the ratios to the floor: < 1 = we were faster in the typical round.
            entry["jem_vs"] = {
                o: common.paired_ratio(times["jem_plugin"], times[o]) for o in times if o not in ("jem_plugin", "floor")
            }
        if memory:
            mem: dict[str, Any] = {}
            # Quick: one implementation only, enough to keep the subprocess path alive.
            for impl in ["jem_plugin"] if quick else list(contenders):
                mem[impl] = {}
                for s in mem_steps:
                    mem[impl][str(s)] = common.probe_memory(
                        {
                            "kind": "sampler",
                            "impl": impl,
                            "model": name,
                            "batch": batch,
                            "steps": s,
                            "buffer_size": buffer_size,
                            "threads": torch.get_num_threads(),
                        }
                    )
            entry["memory"] = mem
        result["models"][name] = entry
    result["targets"] = targets(result)
    return result


def _mem_delta(m: dict, steps: str) -> float | None:
    v = m.get(steps, {})
    return v.get("delta_mb") if isinstance(v, dict) else None


def flatness(mem_impl: dict) -> float | None:
    """Peak-memory growth from the fewest to the most steps, in MB (0 = flat)."""
    keys = sorted(mem_impl, key=int)
    lo, hi = _mem_delta(mem_impl, keys[0]), _mem_delta(mem_impl, keys[-1])
    if lo is None or hi is None:
        return None
    return hi - lo


def targets(result: dict) -> dict[str, Any]:
    out = {}
    for name, entry in result["models"].items():
        t = entry["time"]
        ours = t.get("jem_plugin", {}).get("ratio")
        row = {"ratio": ours, "le_1.02x_floor": None if ours is None else ours <= TARGET_RATIO}
        for other, r in entry.get("jem_vs", {}).items():
            row[f"vs_{other}"] = r
            row[f"not_slower_than_{other}"] = r <= 1.0
        mem = entry.get("memory", {}).get("jem_plugin")
        if mem:
            growth = flatness(mem)
            row["memory_growth_mb"] = growth
            floor_mem = entry.get("memory", {}).get("floor")
            row["floor_memory_growth_mb"] = flatness(floor_mem) if floor_mem else None
            # "flat": growth from the fewest to the most steps within RSS noise: 5 MB or 10% of the
            # peak (the floor, which keeps nothing between steps, moves by as much). A sampler that
            # kept a graph per step would grow by the activations of every extra step: 100s of MB.
            peak = max((_mem_delta(mem, k) or 0.0) for k in mem)
            row["memory_flat"] = None if growth is None else growth <= max(5.0, 0.10 * peak)
        out[name] = row
    return out


def to_markdown(res: dict) -> str:
    lines = [
        f"SGLD sampling, batch {res['batch']}, {res['steps']} steps, {res['repeats']} interleaved rounds, "
        "medians. Ratio = median over rounds of t / t_floor (paired). Spread = IQR / median.",
        "",
    ]
    rows = []
    for name, entry in res["models"].items():
        t = entry["time"]
        mem = entry.get("memory", {})
        for impl, s in t.items():
            m = mem.get(impl, {})
            keys = sorted(m, key=int)
            mem_s = (
                " / ".join(f"{_mem_delta(m, k):.1f}" if _mem_delta(m, k) is not None else "err" for k in keys)
                if keys
                else "n/a"
            )
            rows.append(
                [
                    name,
                    impl,
                    common.fmt_ms(s["median_s"]),
                    f"{s['spread']:.1%}",
                    common.fmt_ratio(s["ratio"]),
                    common.fmt_ratio(s["ratio_of_medians"]),
                    mem_s,
                ]
            )
    steps_hdr = "/".join(
        sorted({k for e in res["models"].values() for m in e.get("memory", {}).values() for k in m}, key=int)
    )
    lines.append(
        common.md_table(
            [
                "model",
                "implementation",
                "median ms",
                "spread",
                "ratio vs floor",
                "ratio of medians",
                f"peak RSS growth MB ({steps_hdr} steps)",
            ],
            rows,
        )
    )
    lines += [
        "",
        "Fixed cost jem-plugin adds per chain (`SGLD(steps=0).sample` with the buffer: draw, reinit, "
        "write-back, mode handling), median of direct calls: "
        + "; ".join(
            f"{n}: {e['fixed_overhead_us']:.0f} us = {e['fixed_overhead_fraction']:.2%} of the floor's chain"
            for n, e in res["models"].items()
            if "fixed_overhead_us" in e
        )
        + ".",
    ]
    a = res["agreement"]
    lines += [
        "",
        f"Same chain check ({a['model']}, batch {a['batch']}, {a['steps']} steps, same generator): "
        f"jem-plugin == floor bit for bit: **{a['ours_equal_floor']}** (max |diff| "
        f"{a['ours_max_abs_diff']:.2e}); torchebm max |diff| vs floor: "
        f"{'n/a' if a['torchebm_max_abs_diff'] is None else format(a['torchebm_max_abs_diff'], '.2e')}.",
    ]
    lines += [
        "",
        "Targets: "
        + "; ".join(
            f"{n}: {common.fmt_ratio(r['ratio'])} (<= {TARGET_RATIO}x: {common.target_mark(r['le_1.02x_floor'])}"
            + "".join(
                f", vs {o} {common.fmt_ratio(r.get(f'vs_{o}'))}: {common.target_mark(r.get(f'not_slower_than_{o}'))}"
                for o in ("reference", "torchebm")
                if f"not_slower_than_{o}" in r
            )
            + (
                f", memory flat: {common.target_mark(r.get('memory_flat'))} ({r['memory_growth_mb']:+.1f} MB, floor "
                f"{r['floor_memory_growth_mb'] if r.get('floor_memory_growth_mb') is None else format(r['floor_memory_growth_mb'], '+.1f')} MB)"
                if r.get("memory_growth_mb") is not None
                else ""
            )
            + ")"
            for n, r in res["targets"].items()
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":

    def _extra(p):
        p.add_argument("--models", nargs="*", default=None, choices=list(common.MODELS))
        p.add_argument("--no-memory", dest="memory", action="store_false")

    common.standalone_main(NAME, run, to_markdown, extra_args=_extra)
