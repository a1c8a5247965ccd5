"""A gate on the rollout pool's requests: a weight sync closes it and waits for the requests
out to come back, so that no request straddles the sync (``rollout.partial_rollout=false``
in fully async mode). Requests queued behind it go out once it opens again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class DispatchGate:
    """Counts the requests out; ``closed()`` holds new ones back until its block ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = 0  # nested closers: open again when the last one ends
        self._out = 0

    @property
    def is_open(self) -> bool:
        with self._cond:
            return not self._closed

    def try_enter(self) -> bool:
        """Lets one request out, unless the gate is closed (False: hold it back)."""
        with self._cond:
            if self._closed:
                return False
            self._out += 1
            return True

    def leave(self) -> None:
        """A request let out has come back (done, failed or cancelled)."""
        with self._cond:
            self._out -= 1
            self._cond.notify_all()

    def wait_open(self, timeout: float | None = None) -> bool:
        """Blocks until the gate is open (or ``timeout``); whether it is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._closed, timeout)

    @contextmanager
    def closed(self) -> Iterator[float]:
        """Closes the gate, waits until every request out has come back, and yields the
        seconds waited; the gate opens again when the block ends."""
        start = time.perf_counter()
        with self._cond:
            self._closed += 1
            self._cond.wait_for(lambda: self._out == 0)
        try:
            yield time.perf_counter() - start
        finally:
            with self._cond:
                self._closed -= 1
                self._cond.notify_all()
