"""A log line as a server's long call starts and as it ends, and a test hook that holds a call
open so that a fault test can kill the server while it is surely inside that call.

Each role server wraps its long handlers (Generate, Score, UpdatePolicy, ComputeValues, ...)
in ``CallMarkers.call``, which logs at INFO:

    rpc Generate #4 started (pid 1234)
    rpc Generate #4 finished in 0.31 s (pid 1234)      # or "failed in ...", on an exception

``#k`` counts that method's calls in this process, from 1. After a crash the server's log
(``<run>/logs/<role>.log`` under the local launcher) says which call it died in: a "started"
with no "finished" or "failed" of the same ``#k`` and pid.

Test hook ``MESHRL_TEST_SLOW_RPC`` (read once, when the server builds its ``CallMarkers``):
``[role.]Method=seconds[@k]``, comma separated, e.g. ``ref.ComputeLogProbs=20@4`` holds the
ref server's 4th ComputeLogProbs call for 20 s after its "started" line, before any work.
Without ``role.`` it applies to every server of the run; without ``@k``, to every call of the
method. ``tests/e2e/test_faults.py`` uses it to make each kill land inside a given call.
Unset in any real run: then nothing is parsed and no call waits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

TEST_SLOW_ENV = "MESHRL_TEST_SLOW_RPC"


@dataclass(frozen=True)
class SlowCall:
    """One entry of MESHRL_TEST_SLOW_RPC."""

    method: str
    seconds: float
    role: str | None = None  # None: any server
    call: int | None = None  # the method's k-th call in the process (from 1); None: every call

    def matches(self, role: str, method: str, k: int) -> bool:
        return method == self.method and self.role in (None, role) and self.call in (None, k)


def parse_slow_calls(spec: str) -> list[SlowCall]:
    """``"ref.ComputeLogProbs=20@4,Generate=1"`` -> SlowCall entries; ValueError naming the
    entry when one is malformed (a typo must not silently turn the hook off)."""
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            target, value = entry.split("=")
            seconds, _, call = value.partition("@")
            role, _, method = target.rpartition(".")
            out.append(SlowCall(method, float(seconds), role or None, int(call) if call else None))
        except ValueError:
            raise ValueError(
                f"{TEST_SLOW_ENV}: bad entry {entry!r}; expected [role.]Method=seconds[@k]"
            ) from None
    return out


class CallMarkers:
    """Start/finish log lines of one server's long calls (see the module docstring)."""

    def __init__(self, role: str, spec: str | None = None):
        """`role`: the server's role name (rollout, actor, critic, ref, reward); `spec`: the
        test hook's value, None = read MESHRL_TEST_SLOW_RPC."""
        self.role = role
        spec = os.environ.get(TEST_SLOW_ENV, "") if spec is None else spec
        self.slow = parse_slow_calls(spec) if spec else []
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # handlers run on several gRPC threads

    def hold_s(self, method: str, k: int) -> float:
        return sum(s.seconds for s in self.slow if s.matches(self.role, method, k))

    @contextmanager
    def call(self, method: str) -> Iterator[None]:
        with self._lock:
            self._counts[method] += 1
            k = self._counts[method]
        pid = os.getpid()
        log.info("rpc %s #%d started (pid %d)", method, k, pid)
        start = time.perf_counter()
        outcome = "failed"
        try:
            if self.slow and (hold := self.hold_s(method, k)):
                log.info("rpc %s #%d held %.1f s (test hook %s)", method, k, hold, TEST_SLOW_ENV)
                time.sleep(hold)
            yield
            outcome = "finished"
        finally:
            seconds = time.perf_counter() - start
            log.info("rpc %s #%d %s in %.2f s (pid %d)", method, k, outcome, seconds, pid)
