"""Killing a role server of a real run while it is surely inside one of its calls: the
server's call markers (``meshrl/rpc/call_markers.py``) log ``rpc <Method> #k started (pid P)``,
the test hook ``MESHRL_TEST_SLOW_RPC`` holds that call open, and :class:`KillInsideCall`
kill -9s the server's process group on that line. Used by ``test_faults.py`` and
``test_fault_sweep.py``."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from meshrl.launcher.local import LocalLauncher
from meshrl.rpc.call_markers import TEST_SLOW_ENV
from services.coordinator.run.run import PPORun


def started_line(method: str, k: int, pid: int) -> str:
    return f"rpc {method} #{k} started (pid {pid})"


def ended_line(method: str, k: int | str, pid: int) -> re.Pattern:
    return re.compile(rf"rpc {method} #{k} (finished|failed) in [\d.]+ s \(pid {pid}\)")


class KillInsideCall(threading.Thread):
    """Reads a role server's log and kill -9s its process group on the "started" line of the
    server's k-th call of `method`. The test hook is taken out of this process's environment
    first: the server the launcher starts in its place (its calls count from #1 again) holds
    no call, even one that reaches #k again after the run went back to a checkpoint."""

    def __init__(self, launcher: LocalLauncher, name: str, method: str, k: int):
        super().__init__(daemon=True)
        proc = launcher.processes[name]
        self.pid, self.log_path = proc.popen.pid, proc.log_path
        self.line = started_line(method, k, self.pid)
        self.killed = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.line in self.log_path.read_text(errors="replace"):
                os.environ.pop(TEST_SLOW_ENV, None)  # the restarted server is not held
                os.killpg(self.pid, signal.SIGKILL)  # the server's own session, by its id
                self.killed.set()
                return
            self.stop.wait(0.02)


@dataclass
class KilledRun:
    """A finished run whose server was killed inside a call; its servers still up."""

    launcher: LocalLauncher
    killer: KillInsideCall
    last: dict

    def pid(self, name: str) -> int:
        return self.launcher.processes[name].popen.pid

    def log(self, name: str) -> str:
        return self.launcher.processes[name].log_path.read_text(errors="replace")


@contextmanager
def killed_run(cfg, run_dir, name: str, method: str, k: int) -> Iterator[KilledRun]:
    """A whole run with a restarter, the server `name` kill -9ed inside its k-th `method`
    call; yields it once trained, its servers up until the block ends."""
    with LocalLauncher(cfg, run_dir) as launcher:
        endpoints = launcher.start()
        killer = KillInsideCall(launcher, name, method, k)
        killer.start()
        run = PPORun(cfg, endpoints, run_dir, restarter=launcher)
        try:
            run.setup()
            last = run.train()
        finally:
            run.close()
            killer.stop.set()
        yield KilledRun(launcher, killer, last)


def run_killing(cfg, run_dir, name: str, method: str, k: int):
    """:func:`killed_run` to its end: the last metrics, the killer, the server's new pid and
    the actor's log."""
    with killed_run(cfg, run_dir, name, method, k) as done:
        return done.last, done.killer, done.pid(name), done.log("actor")
