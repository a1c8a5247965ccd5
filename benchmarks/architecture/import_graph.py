"""The tree's import graph, read from the source (every import statement, lazy ones in
functions included): what ``tests/architecture/test_layering.py`` checks and
``coordinator_shape.py`` measures."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("meshrl", "services", "meshrl_app")
GENERATED = "_pb2"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {
        module_name(p, root): p
        for pkg in PACKAGES
        for p in sorted((root / pkg).rglob("*.py"))
        if GENERATED not in p.name
    }


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Modules of the tree that ``path`` imports anywhere (module level or inside a function)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports."""
    found = modules(root)
    known = set(found)
    return {name: imports_of(path, name, known) for name, path in found.items()}


def longest_chain(edges: dict[str, set[str]], within: str, start: str | None = None) -> list[str]:
    """The longest chain of modules under ``within`` each importing the next, from ``start``
    (None: from any); the graph has no circle (test_layering.py keeps it so)."""
    inside = {m for m in edges if m == within or m.startswith(within + ".")}
    memo: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in memo:
            below = [chain(d) for d in edges[m] if d in inside and not m.startswith(d + ".")]
            memo[m] = [m] + max(below, key=len, default=[])
        return memo[m]

    return max((chain(m) for m in sorted(inside) if start in (None, m)), key=len, default=[])
