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
def test_children_of_a_server_killed_alone_are_stopped(tmp_path):
    launcher = LocalLauncher(build_config({}, []), tmp_path)
    proc, child = _start(launcher, tmp_path)
    try:
        assert set(leftover_pids(proc.instance_id)) == {proc.popen.pid, child}
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
