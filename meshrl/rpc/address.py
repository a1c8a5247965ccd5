"""Server addresses as users type them (``--coordinator``, ``--server``, environment
variables), checked before anything is dialled."""

from __future__ import annotations

import argparse

GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


def host_port(text: str) -> str:
    """An argparse type: a server address ``HOST:PORT`` (``[::1]:PORT`` for IPv6), or a
    gRPC target with its scheme (``unix:/path``). Without a port gRPC would dial 443, and a
    port that is no number would fail only when dialled."""
    if text.startswith(GRPC_SCHEMES):
        return text
    if "://" in text:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, not a URL, got {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or host.endswith(":"):
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {text!r} (no port)")
    if not host:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {text!r} (no host)")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with a port 1 to 65535, got {text!r}")
    return text
