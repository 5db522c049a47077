"""What the benefit ledger measured, said in ``jem train``'s one line.

``benchmarks/bench_ledger.py --report`` writes :data:`LEDGER_EVIDENCE` (shipped with the package):
per data set, network kind and recipe, the differences to a cross-entropy baseline whose 95% interval
excludes 0, how many benefits were measured, the iterations and seeds, and the cost. ``jem train``
says what was measured for the user's kind of network and recipe, and no more: a benefit whose
interval holds 0 is not named as one, and a run longer than the ledger's is told so. The table
changes only with a release (the ledger's report is committed); it never changes what a run does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .default_recipe import read_table

LEDGER_EVIDENCE = Path(__file__).with_name("ledger_evidence.json")
#: the docs page with the ledger's tables and intervals
LEDGER_PAGE = "docs/what-jem-buys.md"
#: the seeds an entry needs before jem train quotes it (the decision rule's)
MIN_SEEDS = 3


def _fmt(entry: dict[str, Any]) -> str:
    unit = " points" if entry["unit"] == "points" else ""
    scale = 100 if entry["unit"] == "points" else 1
    fmt = "{:+.1f}" if entry["unit"] == "points" else "{:+.3f}"
    d, lo, hi = (fmt.format(scale * entry[k]) for k in ("diff", "lo", "hi"))
    return f"{entry['label']} {d}{unit} [{lo}, {hi}]"


def ledger_line(
    kind: str, recipe: str, settings: dict[str, float], iterations: int, table: dict[str, Any] | None = None
) -> str | None:
    """One line on what the ledger measured for ``recipe`` with ``settings`` on a network of
    ``kind`` (:func:`default_recipe.kind_name`: ``"BN"``, ``"other"`` or ``"none"``)
    against a cross-entropy baseline, for a run of ``iterations``; None where it measured nothing
    of the kind.

    >>> t = {"entries": [dict(kind="BN", recipe="fast", settings={}, dataset="textures", net="resnet10t",
    ...     iteration=1512, seeds=3, measured=20, cost_ratio=5.3, called=[dict(label="raw ECE", unit="points",
    ...     diff=-0.021, lo=-0.03, hi=-0.012, better=True)])]}
    >>> print(ledger_line("BN", "fast", {}, 1000, t))
    the benefit ledger (docs/what-jem-buys.md) measured this recipe on textures with resnet10t at 1,512 iterations, 3 seeds, against cross-entropy: better on raw ECE -2.1 points [-3.0, -1.2]; no difference on the other 19 benefits; 5.3x its CPU cost per iteration
    """
    table = read_table(LEDGER_EVIDENCE) if table is None else table
    entries = [e for e in table.get("entries", []) if e.get("kind") == kind]
    if not entries:
        return None
    same = [e for e in entries if e["recipe"] == recipe and dict(e.get("settings") or {}) == dict(settings)]
    seeded = [e for e in same if e["seeds"] >= MIN_SEEDS]
    if not seeded:
        where = f"on {entries[0]['dataset']} with {entries[0]['net']}"
        return (
            f"the benefit ledger ({LEDGER_PAGE}) has not measured this recipe with {MIN_SEEDS} seeds {where} yet; "
            "what JEM buys you here is unmeasured"
        )
    e = max(seeded, key=lambda e: e["iteration"])
    better = [c for c in e["called"] if c["better"]]
    worse = [c for c in e["called"] if not c["better"]]
    parts = []
    if better:
        parts.append("better on " + ", ".join(_fmt(c) for c in better))
    if worse:
        parts.append("worse on " + ", ".join(_fmt(c) for c in worse))
    rest = e["measured"] - len(e["called"])
    parts.append(f"no difference on the other {rest} benefits" if e["called"] else f"no difference on any of {rest}")
    if e.get("cost_ratio"):
        parts.append(f"{e['cost_ratio']:.1f}x its CPU cost per iteration")
    line = (
        f"the benefit ledger ({LEDGER_PAGE}) measured this recipe on {e['dataset']} with {e['net']} at "
        f"{e['iteration']:,} iterations, {e['seeds']} seeds, against cross-entropy: " + "; ".join(parts)
    )
    if iterations > e["iteration"]:
        line += f"; this run has {iterations:,} iterations, past what was measured"
    return line
