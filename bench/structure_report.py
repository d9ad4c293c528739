#!/usr/bin/env python3
"""The structure figures of a checkout (not a speed benchmark): upward imports against the layer rule of
tests/test_layers.py, import cycles between modules, files over 800 and 600 lines, the largest classes and
those over 400 lines, README lines before the set-up commands.

    python3 bench/structure_report.py CHECKOUT     # another version: git archive <commit> | tar x -C DIR
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_layers import ALLOWED, floor, imports, module_name  # noqa: E402  (the rule in one place)


def daemon_modules(root: Path) -> dict[str, Path]:
    pkg = root / "daemon" / "hmad"
    return {module_name(p, pkg, "hmad"): p for p in pkg.rglob("*.py")}


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {n for n in imports(p, m) if n in mods} for m, p in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other (strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    mods = daemon_modules(root)
    edges = import_graph(mods)
    up = [
        f"{m} -> {n}"
        for m, ns in edges.items()
        for n in ns
        if floor(m) != "process" and floor(n) not in ALLOWED[floor(m)]
    ]
    files = [p for p in (root / "daemon").rglob("*.py")]
    files += [p for p in (root / "client").rglob("*.py") if "build" not in p.parts]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in files), reverse=True)
    classes = sorted(
        (node.end_lineno - node.lineno + 1, node.name, str(p.relative_to(root)))
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
    )[::-1]
    readme = (root / "README.md").read_text().splitlines()
    setup = next(i for i, line in enumerate(readme) if line.startswith("## Set-up"))
    print(f"upward imports: {len(up)}", *up, sep="\n  ")
    print(f"import cycles: {cycles(edges)}")
    print(f"files over 800 lines: {[f'{n} {f}' for n, f in sizes if n > 800]}")
    print(f"files over 600 lines: {[f'{n} {f}' for n, f in sizes if n > 600]}")
    print(f"largest classes: {classes[:3]}")
    print(f"classes over 400 lines: {[c for c in classes if c[0] > 400]}")
    print(f"README: {len(readme)} lines, {setup} before set-up")


if __name__ == "__main__":
    main()
