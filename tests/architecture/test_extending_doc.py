"""docs/extending.md stays true: a checklist for each kind of extension, every file and name
it gives exists, each registry's entries are the ones it lists, and the config allows exactly
each registry's names (the step a checklist asks for, kept)."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from meshrl.algorithms.registry import ESTIMATORS, POLICY_LOSSES
from meshrl.config.sections import AlgorithmConfig, MultiTurnConfig, PolicyLossConfig, RolloutConfig
from meshrl.config.sections.megatron import Strategy

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs/extending.md"
KINDS = (
    "advantage estimator",
    "policy loss",
    "rollout engine",
    "trainer backend",
    "reward scorer",
    "environment",
)


def _sections() -> dict[str, str]:
    """``## A <kind>`` heading -> its text."""
    parts = re.split(r"^## An? (.+)$", DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _module_names(path: str, name: str) -> list[str]:
    """The keys of the dict literal, or the items of the tuple literal, assigned to ``name``
    in the module at ``path``, read from its source (no import: the rollout registry's
    engines need no GPU to be listed)."""
    for node in ast.parse((REPO / path).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = node.value
            items = value.keys if isinstance(value, ast.Dict) else value.elts  # type: ignore[union-attr]
            return [ast.literal_eval(item) for item in items]
    raise AssertionError(f"{path} assigns no {name}")


ENGINES = _module_names("services/rollout/registry.py", "ENGINES")
FAMILIES = _module_names("services/reward/scorers/registry.py", "FAMILIES")
ENVIRONMENTS = _module_names("services/env/registry.py", "ENVIRONMENT_NAMES")
BACKENDS = _module_names("services/trainer/backends.py", "BACKENDS")


def test_one_checklist_for_each_kind_of_extension():
    sections = _sections()
    assert tuple(sections) == KINDS
    for kind, text in sections.items():
        assert re.search(r"^1\. ", text, flags=re.M), f"{kind}: no numbered checklist"


def test_every_file_the_page_names_exists():
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:meshrl|services|tests|docs)/[\w/.<>-]+)`", text))
    assert len(paths) > 20  # the pattern still finds them
    missing = [p for p in sorted(paths) if "<" not in p and not (REPO / p).exists()]
    assert not missing, f"docs/extending.md names files that do not exist: {missing}"


def test_every_name_of_code_the_page_gives_is_defined_where_it_says():
    # (name, file it is said to be in): a rename breaks the checklist here
    defined = {
        "ESTIMATORS": "meshrl/algorithms/registry.py",
        "POLICY_LOSSES": "meshrl/algorithms/registry.py",
        "AdvantageEstimatorEntry": "meshrl/algorithms/registry.py",
        "PolicyLossEntry": "meshrl/algorithms/registry.py",
        "EstimatorInputs": "meshrl/algorithms/estimators.py",
        "PolicyLossInputs": "meshrl/algorithms/loss_modes.py",
        "PolicyLossSettings": "meshrl/algorithms/loss_modes.py",
        "RULES": "meshrl/config/rules.py",
        "ENGINES": "services/rollout/registry.py",
        "RolloutEngine": "services/rollout/engine.py",
        "FAMILIES": "services/reward/scorers/registry.py",
        "ENVIRONMENT_NAMES": "services/env/registry.py",
        "build_environments": "services/env/registry.py",
        "Environment": "services/env/environment.py",
        "BACKENDS": "services/trainer/backends.py",
        "TrainerBackend": "services/trainer/backends.py",
        "Strategy": "meshrl/config/sections/megatron.py",
        "megatron_runs_as_asked": "meshrl/config/rules.py",
    }
    text = DOC.read_text()
    for name, path in defined.items():
        assert f"`{name}`" in text, name
        source = (REPO / path).read_text()
        assert re.search(rf"^(class|def) {name}\b|^{name}\b.*=", source, flags=re.M), (name, path)
    needs = [f.name for e in (ESTIMATORS, POLICY_LOSSES) for f in _declared(e)]
    for field in needs:
        assert f"`{field}`" in text, f"docs/extending.md does not say what {field} does"


def _declared(entries):
    """The fields an entry declares its needs with (all but its name, function, summary)."""
    entry = next(iter(entries.values()))
    skip = {"name", "function", "summary"}
    return [f for f in dataclasses.fields(entry) if f.name not in skip]


def test_the_page_lists_each_registrys_entries():
    sections = _sections()
    for kind, names in [
        ("rollout engine", ENGINES),
        ("trainer backend", BACKENDS),
        ("reward scorer", FAMILIES),
        ("environment", ENVIRONMENTS),
    ]:
        listed = re.search(r"The \w+\s+there:\s+(.+?)\.\s", sections[kind], flags=re.S)
        assert listed, kind
        assert re.findall(r"`([\w-]+)`", listed.group(1)) == names, kind


def test_the_config_allows_exactly_each_registrys_names():
    def allowed(model, key):
        return list(typing.get_args(model.model_fields[key].annotation))

    assert allowed(AlgorithmConfig, "adv_estimator") == list(ESTIMATORS)
    assert allowed(PolicyLossConfig, "loss_mode") == list(POLICY_LOSSES)
    assert allowed(RolloutConfig, "name") == ENGINES
    assert allowed(MultiTurnConfig, "environment") == ENVIRONMENTS
    assert list(typing.get_args(typing.get_args(Strategy)[0])) == BACKENDS
