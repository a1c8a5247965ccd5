"""Stopping a role server with every process it started, even after it died alone.

A launcher starts each server in a session of its own, so one signal to the process group
reaches its torchrun ranks and scorer workers too. When the server itself is already gone
(the OOM killer or a segfault took it alone), those processes are still running, holding
memory, GPUs and the server's port; its group id may be handed to an unrelated process once
that group is empty, so they are found by the instance id every process of the server
inherits (``MESHRL_INSTANCE_ID``), never by a recycled number.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from meshrl.rpc.server import INSTANCE_ENV

if TYPE_CHECKING:
    from meshrl.launcher.fork_server import ForkedServer

_PROC = Path("/proc")


def stop_server(
    popen: subprocess.Popen | ForkedServer, instance_id: str, grace_s: float = 5.0
) -> None:
    """SIGTERM to the server's process group, SIGKILL after ``grace_s``; then SIGKILL any
    process left that was started with ``instance_id``."""
    stop_servers([(popen, instance_id)], grace_s)


def stop_servers(
    servers: list[tuple[subprocess.Popen | ForkedServer, str]], grace_s: float = 5.0
) -> None:
    """:func:`stop_server` for several servers at once: every one gets its SIGTERM first,
    and they shut down side by side within one ``grace_s``. One after the other, a run's
    five servers took five shutdowns in turn (about 1.5 s each on two cores) after its
    last step."""
    running = [popen for popen, _ in servers if popen.poll() is None]
    for popen in running:
        _signal_group(popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
    for popen in running:
        _signal_group(popen.pid, signal.SIGKILL)  # also any torchrun child left behind
        popen.wait()
    for pid in leftover_pids(*(instance_id for _, instance_id in servers)):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def leftover_pids(*instance_ids: str) -> list[int]:
    """Running processes started with one of ``instance_ids`` in their environment (Linux
    /proc; none found elsewhere)."""
    return pids_with_env(INSTANCE_ENV, *instance_ids)


def pids_with_env(name: str, *values: str) -> list[int]:
    """Running processes (not this one) whose environment sets ``name`` to one of
    ``values``: what they inherited from whoever started them (Linux /proc; none found
    elsewhere)."""
    markers = {f"{name}={v}".encode() for v in values if v}
    if not markers or not _PROC.is_dir():
        return []
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for a zombie
        except OSError:  # gone meanwhile, or another user's
            continue
        if markers.intersection(environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)
