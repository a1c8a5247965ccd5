"""The registry of estimators and policy losses (meshrl/algorithms/registry.py): every entry
loads, is in the ledger and has a test; the config allows exactly its names; loading the
config imports no torch; what the entries declare reaches the start-up checks."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from meshrl.algorithms.registry import (
    ESTIMATORS,
    POLICY_LOSSES,
    advantage_estimator,
    describe,
    policy_loss,
)
from meshrl.config import build_config
from meshrl.config.sections import AlgorithmConfig, PolicyLossConfig

REPO = Path(__file__).resolve().parents[2]
ENTRIES = [*ESTIMATORS.values(), *POLICY_LOSSES.values()]
IDS = [e.name for e in ENTRIES]


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_every_entry_loads_a_function_of_inputs_and_settings(entry):
    function = entry.load()
    assert callable(function)
    assert len(inspect.signature(function).parameters) == 2, entry.function
    assert entry.function.startswith("meshrl.algorithms."), "the math lives in the library"


def test_the_config_allows_exactly_the_registered_names_and_describes_each():
    fields = [
        (AlgorithmConfig.model_fields["adv_estimator"], ESTIMATORS),
        (PolicyLossConfig.model_fields["loss_mode"], POLICY_LOSSES),
    ]
    for field, entries in fields:
        assert typing.get_args(field.annotation) == tuple(entries)
        assert describe(entries) in (field.description or "")  # so docs/config.md has each


def test_each_entry_is_described_with_what_it_needs():
    text = describe(ESTIMATORS)
    assert "gae (needs the critic): " in text
    assert "remax (needs a greedy baseline: one more generation a step): " in text
    assert "grpo (needs groups: rollout.n ≥ 2): " in text
    assert "reinforce_plus_plus: " in text  # the token rewards alone
    losses = describe(POLICY_LOSSES)
    assert "clip_cov (needs a seeded draw): " in losses
    assert "GSPO's paper takes 3e-4 / 4e-4" in losses


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_every_entry_has_a_ledger_entry_in_docs_algorithms(entry):
    key = "adv_estimator" if entry.name in ESTIMATORS else "loss_mode"
    ledger = (REPO / "docs/algorithms.md").read_text()
    assert f"{key}={entry.name}`" in ledger, (
        f"docs/algorithms.md has no ledger entry whose Config line says `...{key}={entry.name}`"
    )


def _test_sources() -> dict[Path, str]:
    return {
        p: p.read_text()
        for p in (REPO / "tests").rglob("test_*.py")
        if p.resolve() != Path(__file__).resolve()
    }


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_every_entry_is_named_in_a_test(entry):
    # by its config value: "cispo", or a dotted override ...loss_mode=cispo
    named = re.compile(rf"""["']{entry.name}["']|={entry.name}\b""")
    assert any(named.search(text) for text in _test_sources().values()), (
        f"no test under tests/ names {entry.name!r}: add its hand-worked test"
    )


def test_unknown_names_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"^unknown adv_estimator 'nope'$"):
        advantage_estimator("nope")
    with pytest.raises(ValueError, match=r"^unknown policy_loss.loss_mode 'nope'$"):
        policy_loss("nope")


def test_loading_the_config_imports_no_torch():
    # The registry is read by the schema; its functions (and torch) load at their first call.
    code = (
        "import sys; from meshrl.config import build_config; "
        "cfg = build_config({}, ['algorithm.adv_estimator=grpo']); "
        "print(cfg.use_critic, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


@pytest.mark.parametrize("entry", ESTIMATORS.values(), ids=list(ESTIMATORS))
def test_the_critic_is_on_by_default_where_the_estimator_needs_it(entry):
    cfg = build_config({}, [f"algorithm.adv_estimator={entry.name}"])
    assert cfg.use_critic == entry.needs_critic
