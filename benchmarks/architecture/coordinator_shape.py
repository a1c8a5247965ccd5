"""The coordinator's shape, measured from the source: its longest import chain (modules each
importing the next), the PPO step's floor (the longest chain from ``step/ppo_step.py``
down) and the longest chain above it,
``PPOStep.run``'s length and parameters, and its modules and lines.

    python -m benchmarks.architecture.coordinator_shape [--ref GIT_REF] [--out DIR]

``--ref``: also measure a commit of the repository (checked out into a temporary folder),
for a before/after in one run.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.architecture.import_graph import ROOT, graph, longest_chain

COORDINATOR = "services.coordinator"


def _step_file(root: Path) -> Path:
    new = root / "services/coordinator/step/ppo_step.py"
    return new if new.exists() else root / "services/coordinator/step/ppo_step.py"


def _run_method(path: Path) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "PPOStep":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "run":
                    return item
    raise LookupError(f"PPOStep.run not found in {path}")


def shape(root: Path) -> dict:
    edges = graph(root)
    chain = longest_chain(edges, COORDINATOR)
    step_module = ".".join(_step_file(root).relative_to(root).with_suffix("").parts)
    below_step = longest_chain(edges, COORDINATOR, start=step_module)
    importers: dict[str, set[str]] = {m: set() for m in edges}
    for m, targets in edges.items():
        for target in targets:
            importers[target].add(m)
    above_step = longest_chain(importers, COORDINATOR, start=step_module)[::-1]
    run = _run_method(_step_file(root))
    files = sorted((root / "services/coordinator").rglob("*.py"))
    return {
        "import_depth": len(chain),
        "longest_chain": chain,
        "step_floor": len(below_step),  # 1: it imports no other coordinator module
        "below_step": below_step,
        "step_depth": len(above_step),  # 1: no coordinator module imports it
        "above_step": above_step,
        "ppo_step_run_lines": run.end_lineno - run.lineno + 1,  # type: ignore[operator]
        "ppo_step_run_parameters": len(run.args.args) - 1,
        "modules": len(files),
        "lines": sum(len(f.read_text().splitlines()) for f in files),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="a git ref measured beside the work tree")
    parser.add_argument("--out", type=Path, help="folder for coordinator_shape.json")
    args = parser.parse_args()
    result = {"work_tree": shape(ROOT)}
    if args.ref:
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(
                ["git", "archive", args.ref], cwd=ROOT, capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            result[args.ref] = shape(Path(tmp))
    for name, figures in result.items():
        chain = " -> ".join(m.removeprefix(COORDINATOR + ".") for m in figures["longest_chain"])
        print(
            f"{name}: import depth {figures['import_depth']} ({chain}); the step: floor "
            f"{figures['step_floor']}, {figures['step_depth'] - 1} modules above it; PPOStep.run {figures['ppo_step_run_lines']} lines, "
            f"{figures['ppo_step_run_parameters']} parameters; {figures['modules']} modules, "
            f"{figures['lines']} lines"
        )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "architecture_coordinator_shape.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
