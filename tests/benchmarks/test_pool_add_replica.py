"""benchmarks/rollout/pool_add_replica.py on a few prompts: two real rollout servers, the
second added to the pool, which then serves requests too."""

from __future__ import annotations

import json

import pytest

from benchmarks.rollout import pool_add_replica

pytestmark = pytest.mark.slow


def test_the_added_replica_serves_and_the_figures_are_written(tmp_path):
    out = tmp_path / "pool.json"
    args = ["--batch", "8", "--per-request", "4", "--max-tokens", "4", "--rounds", "1"]
    result = pool_add_replica.main([*args, "--out", str(out)])
    assert json.loads(out.read_text())["speedup"] == result["speedup"] > 0
    before, after = result["one_replica"]["pool"], result["two_replicas"]["pool"]
    assert before["rollout/replicas"] == 1 and after["rollout/replicas"] == 2
    assert after["rollout/replica/0/requests"] == after["rollout/replica/1/requests"] == 1
