"""Free loopback ports for role servers and rendezvous.

A port is picked here and bound a moment later by another process, so something else may
take it in between. The usual thief is the OS itself: any process that binds port 0 or
opens a connection (torchrun's rendezvous, gloo, a gRPC client) gets a port from the
ephemeral range. So ports are drawn from *below* that range, where the OS never hands
ports out on its own, and checked free by a bind. Callers still handle the rare loss
(LocalLauncher starts a server that lost its port again on a new one).
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000
"""Below: well-known services (databases, dev servers) and Ray's default worker ports
(10002-19999), which Ray hands out on its own."""
ATTEMPTS = 64

# Seeded from the OS, not from `random.seed` a test or a run may have set: two processes
# seeded alike would draw the same ports.
_draw = random.SystemRandom()


def ephemeral_range() -> tuple[int, int] | None:
    """The OS's (low, high) ephemeral ports, None where it cannot be read (not Linux)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _binds(host: str, port: int) -> bool:
    """False when the port is taken; any other failure (an unknown host) is raised."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago and that the OS will not give to a port-0 bind
    meanwhile (drawn below the ephemeral range); the server binds it right after."""
    ephemeral = ephemeral_range()
    if ephemeral is not None and ephemeral[0] - LOWEST_PORT >= 1000:
        for _ in range(ATTEMPTS):
            port = _draw.randrange(LOWEST_PORT, ephemeral[0])
            if _binds(host, port):
                return port
    # Elsewhere (or a range that leaves no room below it): the OS's pick.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
