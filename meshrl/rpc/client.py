"""Client side: channels with the shared options, waiting for health, calls with deadlines."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.rpc.options import GRPC_OPTIONS


class ServiceUnavailable(RuntimeError):
    """A role server did not answer (dead, not started, or not ready) in time."""


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def health_status(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


def wait_for_health(
    address: str, service: str = "", timeout_s: float = 60.0, alive: callable | None = None
) -> None:
    """Polls the health service until `service` is SERVING.

    `alive` (optional) is checked between polls, so a server process that died during
    start-up fails fast instead of after the whole timeout.
    """
    deadline = time.monotonic() + timeout_s
    channel = open_channel(address)
    last_error = "no answer"
    try:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise ServiceUnavailable(f"{service or 'server'} at {address} exited during start-up")
            try:
                if health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = "NOT_SERVING"
            except grpc.RpcError as e:
                last_error = e.code().name
            time.sleep(0.2)
    finally:
        channel.close()
    raise ServiceUnavailable(
        f"{service or 'server'} at {address} not healthy after {timeout_s:.0f}s ({last_error})"
    )
