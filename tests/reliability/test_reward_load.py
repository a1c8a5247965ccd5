"""A bounded version of benchmarks/reward/load.py: 16 concurrent clients for 5 s against a real
reward server process; every call answered, every score right, no error."""

from __future__ import annotations

import pytest

from benchmarks.reward.load import RewardServerProcess, run_load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_sixteen_clients_five_seconds_no_errors(tmp_path):
    with RewardServerProcess(2, tmp_path / "server.log") as server:
        summary = run_load(
            server.address, clients=16, seconds=5.0, items_per_call=8, procs=1, warmup_s=3.0
        )
        assert server.proc.poll() is None, "the server must outlive the load"
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["requests"] >= 16  # every client got answers
    assert summary["items_scored"] == 8 * summary["requests"]
    assert summary["latency_ms"]["p99"] < 30_000  # far below the call deadline
