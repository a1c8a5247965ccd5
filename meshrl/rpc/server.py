"""Building and running a gRPC server with the standard health service.

Health is honest: the overall service ("") is SERVING once the process listens; the role's
own service name stays NOT_SERVING until its model is loaded (see `mark_ready`).
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshrl.rpc.options import SERVER_OPTIONS

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with a gRPC status code, raised by service logic to fail one call cleanly."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def rpc_method(fn: Callable) -> Callable:
    """Maps exceptions of a servicer method to gRPC status codes with a clear message.

    ValueError/KeyError -> INVALID_ARGUMENT, TimeoutError -> DEADLINE_EXCEEDED,
    anything else -> INTERNAL with the exception text (the traceback goes to the log).
    """

    @functools.wraps(fn)
    def wrapper(self, request, context: grpc.ServicerContext):
        try:
            return fn(self, request, context)
        except ServiceError as e:
            context.abort(e.code, str(e))
        except (ValueError, KeyError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"timeout: {e}")
        except Exception as e:  # noqa: BLE001 - the call fails, the server lives on
            log.error("%s failed:\n%s", fn.__name__, traceback.format_exc())
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: {type(e).__name__}: {e}")

    return wrapper


class GrpcServer:
    """A gRPC server bound to host:port with health checking; one per role process."""

    def __init__(self, service_name: str, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16):
        self.service_name = service_name
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), options=SERVER_OPTIONS
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise OSError(f"cannot bind {service_name} to {host}:{port}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot bind {service_name} to {host}:{port} (port taken?)")
        self.host = host
        self.health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def add(self, register: Callable, servicer) -> None:
        register(servicer, self.server)

    def mark_ready(self, ready: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(self.service_name, status)

    def start(self) -> None:
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on %s:%d", self.service_name, self.host, self.port)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def wait(self) -> None:
        """Blocks until SIGTERM/SIGINT, then stops gracefully."""
        done = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        self.stop()
