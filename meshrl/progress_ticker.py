"""A wait that says how it goes: a line every few seconds for as long as it lasts.

Waits that can run long (servers starting, models loading, an external server not yet up,
the demo's warm start) would otherwise be silent: on a loaded machine a user saw gaps of 7
to 18 s before a run's first step and 725 s of nothing during a warm start, and could not
tell a slow start from a hung one.

    with ProgressTicker(lambda s: f"waiting for rollout0 ({s:.0f} s)", log.info):
        wait_for_it()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
"""How often a wait says how it goes: no wait is silent for longer."""


class ProgressTicker:
    """Calls ``say(describe(elapsed_s))`` every ``every_s`` seconds (default
    ``PROGRESS_EVERY_S``, read when made) from a daemon thread while the ``with`` block
    runs. ``describe`` returning None or "" says nothing that time (a describer that keeps
    its own marks polls with a short ``every_s``); one that raises is logged and skipped,
    never ends the wait."""

    def __init__(
        self,
        describe: Callable[[float], str | None],
        say: Callable[[str], None],
        every_s: float | None = None,
    ):
        self.describe = describe
        self.say = say
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="progress", daemon=True)

    def __enter__(self) -> ProgressTicker:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _tick(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                line = self.describe(time.monotonic() - self._start)
            except Exception:  # noqa: BLE001 - a progress line never ends the wait
                log.debug("progress line failed", exc_info=True)
                continue
            if line and not self._done.is_set():
                self.say(line)
