"""Call markers: a started and an ended line per call, numbered per method; the test hook holds
only the calls it names, and a malformed hook value is an error, not a silent no-op."""

import logging
import os
import threading
import time

import pytest

from meshrl.rpc import call_markers
from meshrl.rpc.call_markers import CallMarkers, SlowCall, parse_slow_calls


def test_parse_entries():
    assert parse_slow_calls("ref.ComputeLogProbs=20@4, Generate=0.5") == [
        SlowCall("ComputeLogProbs", 20.0, role="ref", call=4),
        SlowCall("Generate", 0.5),
    ]
    assert parse_slow_calls("") == []
    for bad in ("Generate", "Generate=soon", "Generate=1@x", "a=1=2"):
        with pytest.raises(ValueError, match="MESHRL_TEST_SLOW_RPC: bad entry"):
            parse_slow_calls(bad)


def test_lines_count_calls_per_method_and_name_the_outcome(caplog):
    caplog.set_level(logging.INFO, logger="meshrl.rpc.call_markers")
    markers = CallMarkers("reward", spec="")
    with markers.call("Score"):
        pass
    with pytest.raises(RuntimeError), markers.call("Score"):
        raise RuntimeError("boom")
    with markers.call("ListScorers"):
        pass
    pid = os.getpid()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"rpc Score #1 started (pid {pid})"
    assert lines[1].startswith("rpc Score #1 finished in ") and lines[1].endswith(f"(pid {pid})")
    assert lines[2] == f"rpc Score #2 started (pid {pid})"
    assert lines[3].startswith("rpc Score #2 failed in ")
    assert lines[4] == f"rpc ListScorers #1 started (pid {pid})"


def test_hook_holds_only_the_named_call_of_the_named_role(monkeypatch):
    markers = CallMarkers("ref", spec="ref.ComputeLogProbs=0.3@2,actor.UpdatePolicy=5")
    assert [markers.hold_s("ComputeLogProbs", k) for k in (1, 2, 3)] == [0.0, 0.3, 0.0]
    assert markers.hold_s("UpdatePolicy", 1) == 0.0  # another role's entry
    assert CallMarkers("critic", spec="ComputeValues=1").hold_s("ComputeValues", 7) == 1.0

    holds: list[float] = []
    monkeypatch.setattr(call_markers.time, "sleep", holds.append)
    for _ in range(3):
        with markers.call("ComputeLogProbs"):
            pass
    assert holds == [0.3]  # the second call only


def test_concurrent_calls_get_distinct_numbers(caplog):
    caplog.set_level(logging.INFO, logger="meshrl.rpc.call_markers")
    markers = CallMarkers("reward", spec="")

    def call() -> None:
        with markers.call("Score"):
            time.sleep(0.01)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = sorted(
        r.getMessage().split()[2] for r in caplog.records if "started" in r.getMessage()
    )
    assert started == sorted(f"#{k}" for k in range(1, 9))
