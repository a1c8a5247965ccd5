"""Role servers started by a launcher exit when the launcher's process is gone.

The local launcher puts each server in its own process session (so that stopping it also
stops its torchrun ranks); the price is that a `kill -9` of the coordinator would leave the
servers running, holding ports and memory. The launcher therefore names itself in
MESHRL_PARENT_PID, and every server polls that process and stops its whole session when it
disappears.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

ENV = "MESHRL_PARENT_PID"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_parent(interval_s: float = 1.0) -> threading.Thread | None:
    """Starts the watchdog when MESHRL_PARENT_PID is set; returns its thread."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    pid = int(raw)

    def loop() -> None:
        while _alive(pid):
            threading.Event().wait(interval_s)
        log.warning("launcher process %d is gone; stopping this role server", pid)
        try:
            os.killpg(os.getpgid(0), signal.SIGTERM)  # the whole session: torchrun ranks too
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=loop, name="parent-watch", daemon=True)
    thread.start()
    return thread
