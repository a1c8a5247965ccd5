"""Stopping a role server stops what it started, also when the server died alone."""

from __future__ import annotations

import os
import sys
import time

import pytest

from meshrl.config import build_config
from meshrl.launcher.local import LocalLauncher, RoleProcess
from meshrl.launcher.server_processes import leftover_pids

pytestmark = pytest.mark.timeout(60)

# A "server" that starts a child in its own session (as torchrun starts ranks) and writes the
# child's pid to a file.
SERVER = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "open(sys.argv[1], 'w').write(str(c.pid)); time.sleep(120)"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited child of a dead parent is reaped by init; until then it is a zombie.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _kill_if_alive(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, 9)


def _start(launcher: LocalLauncher, tmp_path) -> tuple[RoleProcess, int]:
    pid_file = tmp_path / "child.pid"
    proc = RoleProcess(
        "actor", [sys.executable, "-c", SERVER, str(pid_file)], "127.0.0.1:1", tmp_path / "a.log"
    )
    launcher._spawn(proc)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the server never started its child"
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds leftovers through /proc")
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_children_of_a_server_killed_alone_are_stopped(tmp_path, start_method):
    launcher = LocalLauncher(build_config({}, [f"launcher.start_method={start_method}"]), tmp_path)
    proc, child = _start(launcher, tmp_path)
    try:
        # A forked server's /proc environ is its fork server's: it is stopped by its pid.
        # What it starts by exec (torchrun ranks, spawned scorers) carries its instance id.
        server = {proc.popen.pid} if start_method == "spawn" else set()
        assert set(leftover_pids(proc.instance_id)) == server | {child}
        proc.popen.kill()  # the OOM killer takes the server only; its child runs on
        proc.popen.wait()
        assert _alive(child)
        launcher.stop()  # used to return at once: the server was already gone
        assert _gone_within(child, 10)
    finally:
        _kill_if_alive(child)


def test_stop_of_a_live_server_stops_its_children(tmp_path):
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    proc, child = _start(launcher, tmp_path)
    try:
        launcher.stop()
        assert proc.popen.poll() is not None
        assert _gone_within(child, 10)
    finally:
        _kill_if_alive(child)


# A "server" that notes when its SIGTERM came, then takes a while to shut down.
SLOW_TO_STOP = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    open(sys.argv[1], 'w').write(repr(time.time())); time.sleep(1.0); sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "open(sys.argv[1] + '.up', 'w').write('up')\n"
    "time.sleep(120)\n"
)


def test_the_servers_of_a_run_are_stopped_side_by_side(tmp_path):
    """Before, each got its SIGTERM only once the one before it had exited: a run's five
    servers took five shutdowns in turn after its last step."""
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    marks = [tmp_path / f"term{i}" for i in range(3)]
    for i, mark in enumerate(marks):
        command = [sys.executable, "-c", SLOW_TO_STOP, str(mark)]
        launcher._spawn(RoleProcess(f"s{i}", command, "127.0.0.1:1", tmp_path / f"s{i}.log"))
    deadline = time.monotonic() + 30
    while not all(m.with_name(m.name + ".up").exists() for m in marks):
        assert time.monotonic() < deadline, "the servers never started"
        time.sleep(0.05)
    launcher.stop()
    termed = sorted(float(m.read_text()) for m in marks)
    # every one was told to stop before the first of them (1 s after its signal) had
    # exited; one after the other, the last would have been told 2 s after the first
    assert termed[-1] - termed[0] < 1.5, termed
    assert all(not p.alive() for p in launcher.processes.values())
