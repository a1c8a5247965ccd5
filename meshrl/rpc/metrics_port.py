"""Where a server's Prometheus endpoint listens: ``--metrics-port`` on the command line of
every server, ``MESHRL_METRICS_PORT`` in its environment.

Off unless one of them is given: a scrape endpoint is an open HTTP port, and every server
of a local run would otherwise need a port of its own. Light on purpose (argparse and os
only): the `meshrl` parser is built from it without importing grpc or prometheus_client.
"""

from __future__ import annotations

import argparse
import os

METRICS_PORT_ENV = "MESHRL_METRICS_PORT"
"""The port of the server's /metrics endpoint; unset or empty: no endpoint; 0: any free port
(logged)."""


def parse_metrics_port(text: str) -> int:
    """A port number 0 to 65535 (0: any free one), else ValueError naming what was given."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise ValueError(f"must be a port number 0 to 65535 (0 = any free port), got {text!r}")
    return int(text)


def metrics_port_from_env() -> int | None:
    """The port ``MESHRL_METRICS_PORT`` asks for; None when it is unset or empty."""
    text = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_metrics_port(text)
    except ValueError as e:
        raise ValueError(f"{METRICS_PORT_ENV}: {e}") from None


def _port_argument(text: str) -> int:
    try:
        return parse_metrics_port(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_metrics_port_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        metavar="PORT",
        type=_port_argument,
        default=None,
        help=f"serve Prometheus metrics on http://HOST:PORT/metrics (0 = any free port; "
        f"default: ${METRICS_PORT_ENV}, unset = no endpoint)",
    )


def use_metrics_port(args: argparse.Namespace) -> None:
    """``--metrics-port`` as ``MESHRL_METRICS_PORT`` of this process, where the server reads
    it (``GrpcServer``): one setting, whichever way it was given. Processes the server
    starts inherit it; of those only a trainer's rank 0 serves."""
    if getattr(args, "metrics_port", None) is not None:
        os.environ[METRICS_PORT_ENV] = str(args.metrics_port)
