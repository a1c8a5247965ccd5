"""Client side: channels with the shared options, waiting for health, calls with deadlines.

`open_channel` applies the process's security settings (`meshrl.rpc.security`, read from the
environment): TLS or mutual TLS, and the token and API-version metadata on every call.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.progress_ticker import ProgressTicker
from meshrl.rpc.options import channel_options
from meshrl.rpc.security import SecuritySettings, channel_credentials, client_interceptor


class ServiceUnavailable(RuntimeError):
    """A role server did not answer (dead, not started, or not ready) in time."""


# Answers that waiting will not change: give up at once with the server's message.
_PERMANENT = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)


def open_channel(address: str, security: SecuritySettings | None = None) -> grpc.Channel:
    """A channel to `address`; `security` None = from the environment (MESHRL_TLS_*, ...)."""
    settings = security if security is not None else SecuritySettings.from_env()
    credentials = channel_credentials(settings)
    if credentials is None:
        channel = grpc.insecure_channel(address, options=channel_options())
    else:
        channel = grpc.secure_channel(address, credentials, options=channel_options())
    return grpc.intercept_channel(channel, client_interceptor(settings))


def health_status(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


def unreachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether a server at ``address`` fails to answer a health check within ``timeout_s``."""
    channel = open_channel(address)
    try:
        health_status(channel, "", timeout_s)
        return False
    except grpc.RpcError:
        return True
    finally:
        channel.close()


def wait_for_health(
    address: str,
    service: str = "",
    timeout_s: float = 60.0,
    alive: Callable[[], bool] | None = None,
    security: SecuritySettings | None = None,
    progress: Callable[[str], None] | None = None,
    name: str = "",
) -> None:
    """Polls the health service until `service` is SERVING.

    `alive` (optional) is checked between polls, so a server process that died during
    start-up fails fast instead of after the whole timeout. A refusal that waiting cannot
    change (no or a wrong token, another API version) fails at once with the server's message.
    `progress` (optional) hears every `PROGRESS_EVERY_S` how the wait goes ("waiting for
    rollout0 at H:P (connection refused) ... 20 s of 120 s"); `name` is whom it waits for
    (default: the service).
    """
    who = f"{name or service or 'server'} at {address}"
    deadline = time.monotonic() + timeout_s
    channel = open_channel(address, security)
    last_error = "no answer"

    def how_it_goes(elapsed_s: float) -> str:
        return f"waiting for {who} ({last_error}) ... {elapsed_s:.0f} s of {timeout_s:.0f} s"

    ticker = ProgressTicker(how_it_goes, progress) if progress else contextlib.nullcontext()
    try:
        with ticker:
            while time.monotonic() < deadline:
                if alive is not None and not alive():
                    raise ServiceUnavailable(f"{who} exited during start-up")
                try:
                    if health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last_error = "not serving yet"
                except grpc.RpcError as e:
                    if e.code() in _PERMANENT:
                        raise ServiceUnavailable(
                            f"{who} refused the health check: {e.code().name}: {e.details()}"
                        ) from None
                    last_error = why_no_answer(e)
                time.sleep(0.2)
    finally:
        channel.close()
    raise ServiceUnavailable(f"{who} not healthy after {timeout_s:.0f}s ({last_error})")


def why_no_answer(e: grpc.RpcError) -> str:
    """A health check's failure in a few words: "connection refused" (nothing listens
    there), "no answer" (its deadline passed), else its code and gRPC's details."""
    details = e.details() or ""
    if "connection refused" in details.lower():
        return "connection refused"
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer"
    return f"{e.code().name}: {details}"
