"""The calls a server is running now, and whether it still takes new ones.

A role server told to stop refuses new calls and gives those in flight gRPC's grace
period, but never waits for them beyond it: a generation, an update or a scoring pass
cannot be interrupted half-way, nor a weight-group join or send blocked on its peer. The
count tells the server whether it must leave without them (the rollout and trainer
servers' ``shut_down``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CallCount:
    """Counts calls while they run; refuses new ones once closed.

    ``refusal(name)``: the exception a call named ``name`` gets once the server is
    stopping (the server maps it to UNAVAILABLE).
    """

    def __init__(self, refusal: Callable[[str], Exception]) -> None:
        self._refusal = refusal
        self._lock = threading.Condition()  # guards the two below; notified as calls end
        self._running = 0
        self._closing = False

    @contextmanager
    def admit(self, name: str) -> Iterator[None]:
        """Counts one call while it runs; raises ``refusal(name)`` once `close` was called."""
        with self._lock:
            if self._closing:
                raise self._refusal(name)
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self._lock.notify_all()

    def close(self) -> None:
        """From now on every call is refused; those running go on."""
        with self._lock:
            self._closing = True

    @property
    def closing(self) -> bool:
        with self._lock:
            return self._closing

    @property
    def running(self) -> int:
        """Calls still running."""
        with self._lock:
            return self._running

    def wait_idle(self, timeout_s: float) -> int:
        """Waits up to `timeout_s` for the running calls to end; returns those still running."""
        with self._lock:
            self._lock.wait_for(lambda: self._running == 0, timeout_s)
            return self._running
