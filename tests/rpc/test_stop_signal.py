"""StopSignal: a Ctrl-C during a server's start-up is kept, not a traceback; a second
signal while it stops ends it at once. Real processes, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)

SERVER = """
import sys, time
from meshrl.rpc.server import StopSignal

stop = StopSignal()
print("starting", flush=True)
time.sleep(float(sys.argv[1]))  # a slow start-up: spawning workers, loading a model
print("started", flush=True)
stop.wait()
print("stopping", flush=True)
time.sleep(float(sys.argv[2]))  # a slow stop
print("stopped", flush=True)
"""


def _start(startup_s: float, stop_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(startup_s), str(stop_s)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout.readline().strip() == "starting"
    return proc


def test_a_signal_during_start_up_stops_the_server_once_it_has_started():
    proc = _start(startup_s=1.5, stop_s=0)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert out.split() == ["started", "stopping", "stopped"]  # no KeyboardInterrupt


def test_a_second_signal_while_stopping_ends_the_process_at_once():
    proc = _start(startup_s=0, stop_s=30)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "stopping"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM  # the default action, not after the 30 s stop
    assert time.monotonic() - t0 < 10
    proc.stdout.close()
