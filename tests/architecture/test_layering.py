"""The layers of the tree, read from the source (every import statement, lazy ones in
functions included): ``meshrl/`` is a library that imports nothing from ``services/`` or the
application layer; ``services/`` imports nothing from the application layer; and no module
reaches itself again through imports."""

from __future__ import annotations

from benchmarks.architecture.import_graph import ROOT, graph, imports_of, longest_chain, modules


def test_the_library_imports_no_service_and_no_application_module():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph().items()
        if module.split(".")[0] == "meshrl"
        for target in targets
        if target.split(".")[0] in ("services", "meshrl_app")
    )
    assert not wrong, "\n".join(wrong)


def test_services_import_nothing_of_the_application_layer():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph().items()
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
    edges = graph()
    # A package's __init__ re-exporting its modules is not a circle of behaviour.
    for name in edges:
        edges[name] = {t for t in edges[name] if not name.startswith(t + ".")}
    cycles = _cycles(edges)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_circle_and_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = ROOT / "meshrl" / "launcher" / "factory.py"  # imports its launchers lazily
    assert "meshrl.launcher.local" in imports_of(source, "meshrl.launcher.factory", set(modules()))


def test_the_coordinators_longest_import_chain_stays_short():
    """docs/architecture.md, "The coordinator's shape": 11 modules deep before its packages."""
    chain = longest_chain(graph(), "services.coordinator")
    assert len(chain) <= 8, " -> ".join(chain)
