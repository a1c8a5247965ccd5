"""The unprofiled host timeline (benchmarks/system/host_timeline.py) on the CPU: named ranges and
module hooks are marked in order and put back after; the wait for quiet child processes
waits for a busy child, and not for an idle one."""

import subprocess
import sys
import types
from contextlib import nullcontext

import torch

from benchmarks.system.host_timeline import Timeline, timed_ranges, wait_for_quiet_children


def test_ranges_and_hooks_are_marked_in_order_then_put_back():
    code = types.ModuleType("code_under_test")
    code.record_function = lambda name: nullcontext()
    layer = torch.nn.Linear(2, 2)

    def step():
        with code.record_function("meshrl/forward"):
            layer(torch.ones(1, 2))

    timeline = Timeline()
    with timed_ranges(timeline, [code], {"layer": layer}):
        timeline.mark("start")
        step()
        timeline.mark("end")
    rows = timeline.report()
    assert [r["point"] for r in rows] == [
        "start",
        "meshrl/forward >",
        "layer >",
        "layer <",
        "meshrl/forward <",
        "end",
    ]
    assert rows[0]["host_ms"] == 0.0
    assert all(a["host_ms"] <= b["host_ms"] for a, b in zip(rows, rows[1:], strict=False))
    # Put back: neither the range nor the hooks mark anything any more.
    step()
    assert len(timeline.names) == 6
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_waits_while_a_child_process_is_busy():
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"]
    )
    try:
        waited = wait_for_quiet_children(timeout_s=10, quiet_s=0.5)
    finally:
        busy.wait()
    assert 0.75 < waited < 10
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert idle.stdout.readline() == b"ready\n"  # past the interpreter's start-up
        assert wait_for_quiet_children(timeout_s=30, quiet_s=0.5) < 15  # not its timeout
    finally:
        idle.kill()
        idle.wait()
