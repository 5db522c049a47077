"""Layout figures of the package (issue 12): modules, lines per module, import edges, import cycles.

Usage: python benchmarks/layout_stats.py [REPO_ROOT]   (TYPE_CHECKING-only imports are not counted)
"""

import ast
import pathlib
import statistics
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
mods = {}
for base, pkg in ((root / "jem_plugin", "jem_plugin"), (root / "adapters", "jem_adapters")):
    for f in base.rglob("*.py"):
        rel = f.relative_to(base).with_suffix("")
        parts = [pkg] + list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f


def resolve(modname, is_pkg, level, target):
    base = modname.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def targets_of(node, name, is_pkg):
    t = []
    if isinstance(node, ast.ImportFrom):
        mod = resolve(name, is_pkg, node.level, node.module) if node.level else node.module
        if mod:
            t.append(mod)
            t += [f"{mod}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
        t += [a.name for a in node.names]
    return t


edges, top_edges = set(), set()
for name, f in mods.items():
    tree = ast.parse(f.read_text())
    is_pkg = f.name == "__init__.py"
    toplevel = {id(n) for n in tree.body} | {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}
    tc = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            tc |= {id(m) for m in ast.walk(n)}
    for node in ast.walk(tree):
        if id(node) in tc:
            continue
        for t in targets_of(node, name, is_pkg):
            if t in mods and t != name:
                edges.add((name, t))
                if id(node) in toplevel:
                    top_edges.add((name, t))


def sccs(es):
    adj = {}
    for a, b in es:
        adj.setdefault(a, set()).add(b)
    index, low, stack, on, out, i = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(adj):
        if v not in index:
            visit(v)
    return out


# a package importing its own submodules (re-exports) is not a cycle we care about
no_pkg = {(a, b) for a, b in edges if not b.startswith(a + ".") and not a.startswith(b + ".")}
lines = {n: len(f.read_text().splitlines()) for n, f in mods.items()}
print(
    f"modules {len(mods)}, lines {sum(lines.values())}, median {statistics.median(lines.values()):.0f} lines, largest {max(lines.items(), key=lambda kv: kv[1])}, over 500: {sorted(n for n, count in lines.items() if count > 500)}"
)
skip = ("._checks", ".errors")
rest = [e for e in edges if not e[1].endswith(skip)]
print(f"import edges {len(edges)} (module level {len(top_edges)}); without edges into _checks/errors: {len(rest)}")
print("cycles (any import, package re-exports excluded):", sccs(no_pkg))
core = [
    n
    for n in mods
    if n.startswith("jem_plugin")
    and not n.startswith(("jem_plugin.app", "jem_plugin.builtins", "jem_plugin.integrations"))
]
up = sorted(
    (a, b)
    for a, b in edges
    if a in core
    and (b.startswith("jem_plugin.app") or b.startswith("jem_plugin.builtins") or b.startswith("jem_adapters"))
)
print("core -> app/builtins/adapters edges:", up)
