"""benchmarks/architecture/: the coordinator's shape and the same-run check read what they
claim to read."""

from __future__ import annotations

import json

from benchmarks.architecture.coordinator_shape import shape
from benchmarks.architecture.import_graph import ROOT, longest_chain
from benchmarks.architecture.same_run import differences


def test_a_value_that_changed_is_found_and_the_clocks_are_not(tmp_path):
    step = {"step": 1, "critic/score/mean": 0.5, "timing_s/gen": 1.0, "perf/mfu/actor": 0.1}
    before, after = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    before.write_text(json.dumps(step) + "\n")
    after.write_text(json.dumps({**step, "timing_s/gen": 2.0, "perf/mfu/actor": 0.2}) + "\n")
    assert differences(before, after) == []
    after.write_text(json.dumps({**step, "critic/score/mean": 0.75}) + "\n")
    assert differences(before, after) == ["step 1: critic/score/mean 0.5 before, 0.75 after"]


def test_the_longest_chain_follows_imports_within_the_package():
    edges = {"p.a": {"p.b", "q.x"}, "p.b": {"p.c"}, "p.c": set(), "q.x": set()}
    assert longest_chain(edges, "p") == ["p.a", "p.b", "p.c"]
    assert longest_chain(edges, "p", start="p.b") == ["p.b", "p.c"]


def test_the_step_is_measured_where_it_is():
    figures = shape(ROOT)
    assert figures["ppo_step_run_parameters"] == 3  # records, step, source
    assert figures["above_step"][-1] == "services.coordinator.step.ppo_step"
    assert figures["import_depth"] == len(figures["longest_chain"]) <= 8
