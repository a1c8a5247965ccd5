"""The layers of the tree, read from the source (every import statement, lazy ones in
functions included): ``meshrl/`` is a library that imports nothing from ``services/`` or the
application layer; ``services/`` imports nothing from the application layer; and no module
reaches itself again through imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("meshrl", "services", "meshrl_app")
GENERATED = "_pb2"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if GENERATED not in p.name
    }


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def test_the_library_imports_no_service_and_no_application_module():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.split(".")[0] == "meshrl"
        for target in targets
        if target.split(".")[0] in ("services", "meshrl_app")
    )
    assert not wrong, "\n".join(wrong)


def test_services_import_nothing_of_the_application_layer():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _graph().items()
        if module.startswith("services")
        for target in targets
        if target.startswith("meshrl_app")
    )
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_lazy_ones_included():
    graph = _graph()
    # A package's __init__ re-exporting its modules is not a circle of behaviour.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_circle_and_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = ROOT / "meshrl" / "launcher" / "factory.py"  # imports its launchers lazily
    assert "meshrl.launcher.local" in _imports(source, "meshrl.launcher.factory", set(_modules()))
