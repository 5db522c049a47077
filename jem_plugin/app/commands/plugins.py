"""``jem plugins``: the loaded plugins and the hooks they implement."""

from __future__ import annotations

import argparse
import json

from ...plugins import list_plugins


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins and the hooks they implement")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=run, config=None)


def run(args) -> int:
    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        origin = "built-in" if r["builtin"] else f"external {r['version'] or ''}".strip()
        print(f"{r['name']:<{width}}  {origin:<10}  {', '.join(r['hooks'])}")
    return 0
