"""The calls this process's role clients are waiting on, and a line about the long ones.

A run waits on its role servers most of the time: Initialize while models load, the first
weight sync, Generate of step 1. `RoleClient` records each call here; a run's progress
ticker (`long_calls_line`) names those that have gone on for another ``every_s`` seconds,
so a slow call is said every ``every_s`` while it lasts and a fast run prints nothing more.

A call made under :func:`calls_for` (validation's) is said with what it is for: ``rollout
Generate for validation at step 2 (10 s)``, not as the step's own Generate.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

CALL_PURPOSE: contextvars.ContextVar[str] = contextvars.ContextVar("call_purpose", default="")
"""What the calls made in this context are for ("validation at step 2"); "" for the
step's own. A thread pool that makes calls for its caller runs them in the caller's
context (``contextvars.copy_context().run``), so the purpose goes with them."""


@contextmanager
def calls_for(purpose: str) -> Iterator[None]:
    """The calls made inside (and in pools that copy this context) are said as for
    ``purpose``."""
    token = CALL_PURPOSE.set(purpose)
    try:
        yield
    finally:
        CALL_PURPOSE.reset(token)


@dataclass
class Call:
    server: str
    """Whom it waits on, as its client names it: rollout, actor, critic, ref, reward."""
    address: str
    method: str
    started: float
    """time.monotonic() at its start."""
    said: int = 0
    """How many times a progress line named it."""
    purpose: str = ""
    """What it is for (CALL_PURPOSE when it started); "" for a step's own call."""


class CallsInFlight:
    """Thread-safe register of the calls under way (one per process: `CALLS_IN_FLIGHT`)."""

    def __init__(self) -> None:
        self._calls: dict[int, Call] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @contextmanager
    def track(self, server: str, address: str, method: str) -> Iterator[None]:
        key = next(self._ids)
        with self._lock:
            self._calls[key] = Call(
                server, address, method, time.monotonic(), purpose=CALL_PURPOSE.get()
            )
        try:
            yield
        finally:
            with self._lock:
                del self._calls[key]

    def methods(self) -> list[tuple[str, str]]:
        """(server, method) of every call under way."""
        with self._lock:
            return [(c.server, c.method) for c in self._calls.values()]

    def long_calls_line(
        self, every_s: float, addresses: Collection[str] | None = None
    ) -> str | None:
        """``"still waiting: actor Initialize (10 s), critic Initialize (10 s)"``: the calls
        (to ``addresses``, None = any) that have run another ``every_s`` seconds since a
        line last named them; None when none has. Each such call is marked as said."""
        now = time.monotonic()
        due = []
        with self._lock:
            for call in self._calls.values():
                age = now - call.started
                if (addresses is None or call.address in addresses) and age >= every_s * (
                    call.said + 1
                ):
                    call.said = int(age // every_s)
                    due.append((call, age))
        if not due:
            return None
        due.sort(key=lambda c: (-c[1], c[0].server))
        return "still waiting: " + ", ".join(
            f"{call.server} {call.method}{' for ' + call.purpose if call.purpose else ''} "
            f"({age:.0f} s)"
            for call, age in due
        )


CALLS_IN_FLIGHT = CallsInFlight()
