"""`make mutation`: mutmut over the PPO math and its plumbing, then a kill-rate report.

    python .ci/mutation.py run [NAME ...]      # mutmut run over MUTANTS (or these, again)
    python .ci/mutation.py report              # kill rate per module, and every survivor

mutmut's settings (files, test selection, process isolation) are in pyproject.toml's
[tool.mutmut]; docs/testing.md records the last report and the reason for each survivor.

Two things mutmut does not do by itself, done here:
- It skips every decorated function, and the advantage estimators, the token rewards and
  the truncated IS weights are ``@torch.no_grad()`` functions. The trampoline mutmut puts
  in front of a function keeps its decorators, so allowing that one decorator is safe;
  ``run`` does.
- It mutates whole files; the trainer's files are restricted to the functions that
  assemble the losses, the coordinator's to the step (PPOStep's phases, the batch sources,
  the stages) and the advantages (MUTANTS).
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

# mutmut's names: module.x_function or module.xǁClassǁmethod, then __mutmut_<n>.
MUTANTS = [
    "meshrl.algorithms.*",  # the registered estimators and losses, PolicyLossSettings too
    # the trainer's loss assembly
    "services.trainer.actor.xǁActorRoleǁupdate_policy__mutmut_*",
    "services.trainer.actor.xǁActorRoleǁ_targets__mutmut_*",
    "services.trainer.actor.xǁActorRoleǁ_micro_loss__mutmut_*",
    "services.trainer.actor.x_widen__mutmut_*",
    "services.trainer.critic.xǁValueLossSettingsǁfrom_config__mutmut_*",
    "services.trainer.critic.xǁCriticRoleǁupdate_value__mutmut_*",
    # the coordinator's step: its advantage plumbing, every phase of PPOStep, the batch
    # sources and the stages passed between the phases
    "services.coordinator.step.advantage.*",
    "services.coordinator.step.ppo_step.xǁPPOStepǁ*",
    "services.coordinator.step.batch_source.xǁBatchSourceǁ*",  # the defaults (not StepPhases)
    "services.coordinator.step.batch_sources.xǁSynchronousBatchesǁ*",
    "services.coordinator.step.batch_sources.xǁOneStepOffBatchesǁ*",
    "services.coordinator.step.batch_sources.xǁFullyAsyncBatchesǁ*",
    "services.coordinator.step.stages.*",
    "services.coordinator.generation.generated.xǁGeneratedBatchǁselect_groups__mutmut_*",
    "services.coordinator.generation.generated.xǁGeneratedBatchǁconcat__mutmut_*",
    # the weight-sync receiver
    "meshrl.weight_sync.receiver.*",
]

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code), for the report. A test
# process the mutant crashed (SIGABRT from gloo, SIGSEGV) failed: counted as killed.
KILLED = {1, 3, -6, -11}
SURVIVED = {0}
NOT_RUN = {None, 2}


def _allow_no_grad_decorator() -> None:
    import libcst as cst
    from mutmut.mutation import file_mutation

    skip = file_mutation.MutationVisitor._skip_node_and_children

    def no_grad_only(node: cst.CSTNode) -> bool:
        return (
            isinstance(node, cst.FunctionDef)
            and len(node.decorators) == 1
            and cst.Module([]).code_for_node(node.decorators[0].decorator) == "torch.no_grad()"
        )

    def patched(self, node: cst.CSTNode) -> bool:
        if no_grad_only(node):
            return skip(self, node.with_changes(decorators=[]))
        return skip(self, node)

    file_mutation.MutationVisitor._skip_node_and_children = patched


def run(names: list[str]) -> None:
    """Without ``names``: the mutants of MUTANTS that have no result yet (a run resumes
    where it stopped). With ``names`` (mutmut's names or patterns): those, run again even
    if they have a result, as ``mutmut run NAME`` does (after a test was added)."""
    _allow_no_grad_decorator()
    import mutmut.__main__ as mutmut_main

    if not names:
        # mutmut runs every mutant named on its command line again, results or not; a
        # filter applied where it lists the mutants keeps the results it already has.
        collect = mutmut_main.collect_source_file_mutation_data

        def only_ours(*, mutant_names):
            return collect(mutant_names=MUTANTS)

        mutmut_main.collect_source_file_mutation_data = only_ours
    sys.argv = ["mutmut", "run", *names]
    mutmut_main.cli()


def _function_source(lines: list[str], name: str) -> list[str]:
    """The lines of ``def name(`` in a mutated file, from its parameters on."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {name}("))
    indent = len(lines[start]) - len(lines[start].lstrip())
    depth, end = 0, start  # the signature may take several lines
    for end in range(start, len(lines)):
        depth += lines[end].count("(") - lines[end].count(")")
        if depth == 0 and lines[end].rstrip().endswith(":"):
            break
    # the signature (defaults are mutated too) without the name, then the body
    body = [lines[start].split("(", 1)[1], *lines[start + 1 : end + 1]]
    for line in lines[end + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return body


def mutant_diff(name: str) -> tuple[str, str]:
    """(original line(s), mutated line(s)) of a mutant, from the files mutmut wrote."""
    module, _, function = name.rpartition(".")
    path = Path("mutants", *module.split(".")).with_suffix(".py")
    lines = path.read_text().splitlines()
    orig = _function_source(lines, function.rsplit("__mutmut_", 1)[0] + "__mutmut_orig")
    mutated = _function_source(lines, function)
    removed = [a.strip() for a in orig if a not in mutated]
    added = [b.strip() for b in mutated if b not in orig]
    return " ⏎ ".join(removed), " ⏎ ".join(added)


def classify(before: str, after: str) -> str:
    """A survivor's class, from its diff; "" when it needs a look."""
    import re

    if " ⏎ " in before or " ⏎ " in after:  # several lines: needs a look
        return ""
    if "-1" in before and before.replace("-1", "+1") == after:
        return "axis"
    if "record_function(" in before:
        return "label"
    if "strict=True" in before:
        return "zip-strict"
    if "device" in before and (
        "device=None" in after or "device" not in after or ".to(None)" in after
    ):
        return "device"
    if "dtype" in before and (
        "dtype=None" in after or "dtype" not in after or ".to(None)" in after
    ):
        return "dtype"
    if ".to(" in before and ".to(None)" in after:
        return "dtype"
    if re.search(r"raise \w+\(|ValueError\(|f\"", before) and re.search(
        r"XX|\(None\)|[A-Z]{4,}", after
    ):
        return "message"
    return ""


def _selected(name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in MUTANTS)


def report() -> None:
    """Markdown: a row per module, then every survivor with its reason (docs/testing.md)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from mutation_reasons import AUTO, MANUAL

    by_module: dict[str, Counter] = defaultdict(Counter)
    rows = []
    for meta in sorted(Path("mutants").rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        for name, code in sorted(codes.items()):
            if not _selected(name):
                continue
            c = by_module[name.split(".x", 1)[0]]
            c["total"] += 1
            if code in NOT_RUN:
                c["not run"] += 1
            elif code in KILLED:
                c["killed"] += 1
            elif code in SURVIVED:
                before, after = mutant_diff(name)
                reason = MANUAL.get(name) or AUTO.get(classify(before, after), "")
                equivalent = reason.startswith(("equivalent", "dtype"))
                c["equivalent" if equivalent else "survived"] += 1
                rows.append((name, before, after, reason or "NEEDS A REASON"))
            else:
                c["other"] += 1  # timeouts: none in the recorded run
    print("| module | mutants | run | killed | equivalent | survived, not equivalent "
          "| killed of the non-equivalent |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    total: Counter = Counter()
    for module, c in [*sorted(by_module.items()), ("all", None)]:
        c = total if c is None else c
        run = c["total"] - c["not run"]
        denom = c["killed"] + c["survived"]
        rate = f"{c['killed'] / denom:.1%}" if denom else "–"
        label = module if module == "all" else f"`{module}`"
        print(f"| {label} | {c['total']} | {run} | {c['killed']} | {c['equivalent']} "
              f"| {c['survived']} | {rate} |")  # fmt: skip
        if module != "all":
            total.update(c)
    print()
    print("| survivor | original | mutant | reason |")
    print("|---|---|---|---|")
    for name, before, after, reason in rows:
        cell = lambda code: "`" + code.replace("|", "\\|") + "`" if code else ""  # noqa: E731
        short = name.replace("__mutmut_", " #")
        print(f"| `{short}` | {cell(before)} | {cell(after)} | {reason} |")


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["run"]
    {"run": lambda: run(rest), "report": report}[command]()
