"""Building and running a gRPC server with the standard health service.

Health is honest: the overall service ("") is SERVING once the process listens; the role's
own service name stays NOT_SERVING until its model is loaded (see `mark_ready`).

Security comes from the environment (see `meshrl.rpc.security`): TLS or mutual TLS, the
shared-token check and the API-version check apply to every call, health checks included.

With ``MESHRL_METRICS_PORT`` set (``--metrics-port``; see `meshrl.rpc.metrics_port`) the
server also serves Prometheus metrics over HTTP (`meshrl.rpc.metrics`).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from meshrl.rpc.metrics_port import metrics_port_from_env
from meshrl.rpc.options import server_options
from meshrl.rpc.parent_watch import watch_parent
from meshrl.rpc.security import SecuritySettings, server_credentials, server_interceptors

if TYPE_CHECKING:
    from meshrl.rpc.metrics import MetricsEndpoint

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


# Set by a launcher for each server it starts: the server then also reports SERVING under
# instance_health_name(it), so the launcher knows that the server answering on the port is
# the process it started, not another one (of this or another run) on a recycled port.
INSTANCE_ENV = "MESHRL_INSTANCE_ID"


def instance_health_name(instance_id: str) -> str:
    """The health service name under which the server started as ``instance_id`` serves."""
    return f"meshrl.instance.{instance_id}"


class ServerBindError(OSError):
    """A server cannot listen where it was asked to (a port in use, an address of another
    machine): a mistake of the command line, said in one line (``meshrl: ...``, exit 2)."""


class GrpcServer:
    """A gRPC server bound to host:port with health checking; one per role process."""

    def __init__(
        self,
        service_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 16,
        security: SecuritySettings | None = None,
        metrics_port: int | None = None,
        name: str = "",
    ):
        """`security` None = from the environment (MESHRL_TLS_*, MESHRL_AUTH_TOKEN_FILE);
        `metrics_port` None = from MESHRL_METRICS_PORT (unset: no metrics endpoint);
        `name`: what the server is to its user ("rollout server"), in its errors (default:
        the service name)."""
        self.service_name = service_name
        self.name = name or service_name
        security = security if security is not None else SecuritySettings.from_env()
        metrics_port = metrics_port if metrics_port is not None else metrics_port_from_env()
        interceptors = server_interceptors(security)
        executor = futures.ThreadPoolExecutor(max_workers=max_workers)
        if metrics_port is not None:
            from meshrl.rpc.metrics import MetricsInterceptor, QueueCountingExecutor

            interceptors = [MetricsInterceptor(), *interceptors]  # outermost: refusals count
            executor = QueueCountingExecutor(max_workers=max_workers)
        self.server = grpc.server(executor, options=server_options(), interceptors=interceptors)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        credentials = server_credentials(security)
        self.port = self._bind(host, port, credentials)
        self.host = host
        self.metrics = None if metrics_port is None else self._serve_metrics(host, metrics_port)
        self.security = _describe(security)
        if credentials is None and not _is_loopback(host):
            log.warning(
                "%s listens on %s without TLS: %s",
                service_name,
                host,
                "the token travels in clear text"
                if security.auth_token_file
                else "anyone who can reach the port can call it (set MESHRL_TLS_* / security.*)",
            )
        self.health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        address = f"{host}:{port}"
        # Asked of the OS first: gRPC's own failed bind writes a C-core log line
        # ("E1205 ... add_port.cc:83] Failed to add port ...") to stderr before any message
        # of ours, which the one-line error of a port in use is meant to replace.
        problem = bind_problem(host, port)
        if problem is None:
            try:
                if credentials is None:
                    bound = self.server.add_insecure_port(address)
                else:
                    bound = self.server.add_secure_port(address, credentials)
            except RuntimeError:
                bound = 0
            if bound:
                return bound
            # taken between the two binds, or refused by gRPC alone
            problem = bind_problem(host, port) or _GRPC_REFUSED
        raise ServerBindError(f"{self.name} cannot bind {address}: {problem}")

    def _serve_metrics(self, host: str, port: int) -> MetricsEndpoint:
        from meshrl.rpc.metrics import MetricsEndpoint

        try:
            return MetricsEndpoint(host, port)
        except OSError as e:
            problem = (bind_problem(host, port) if port else None) or str(e)
            raise ServerBindError(
                f"{self.service_name} cannot serve metrics on {host}:{port}: {problem}"
            ) from None

    def add(self, register: Callable, servicer) -> None:
        register(servicer, self.server)

    def mark_ready(self, ready: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(self.service_name, status)

    def start(self) -> None:
        self.server.start()
        watch_parent()  # exit with the launcher that started us, if one did
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if instance := os.environ.get(INSTANCE_ENV):
            self.health.set(instance_health_name(instance), health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "%s listening on %s:%d (%s)%s",
            self.service_name,
            self.host,
            self.port,
            self.security,
            f"; metrics on {self.metrics.url}" if self.metrics else "",
        )

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.metrics is not None:  # scraped until the calls are done
            self.metrics.close()

    def wait(self) -> None:
        """Blocks until SIGTERM/SIGINT, then stops gracefully."""
        wait_for_stop_signal()
        self.stop()


def _describe(security: SecuritySettings) -> str:
    transport = "insecure"
    if security.server_tls:
        transport = "mutual TLS" if security.require_client_cert else "TLS"
    return transport + (", token required" if security.auth_token_file else "")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_GRPC_REFUSED = "gRPC refused the address (port in use, or not an address of this machine)"


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port, asked of the OS with a plain socket
    (which says what it is); None when it could. The socket reuses addresses as gRPC's
    does, so a port left in TIME_WAIT by closed connections is free, and a listener is not."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host.strip("[]"), port))
    except (socket.gaierror, UnicodeError) as e:  # gaierror is an OSError: first
        return f"host {host!r} does not resolve ({e})"
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"port {port} is already in use (another server, or one left over from an earlier run)"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"address {host} is not an address of this machine"
        if e.errno == errno.EACCES:
            return f"no permission to bind port {port}"
        return f"{e.strerror or e}"
    return None


class StopSignal:
    """SIGTERM and SIGINT, caught from when it is made (in the main thread) until `wait`
    returns.

    A server makes it before its slow start-up (spawning workers, loading a model), so a
    Ctrl-C then is kept, instead of a KeyboardInterrupt traceback half-way through it: acted
    on once start-up ends, or at once by a server that watches `received` meanwhile (the
    reward server).
    """

    POLL_S = 0.1

    def __init__(self) -> None:
        # A plain flag, not an Event: the handler runs in the main thread between any two
        # bytecodes, and torchrun delivers each signal twice; a handler calling Event.set
        # while the first one's set held the Event's lock would hang on it for ever.
        self._received = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, *_) -> None:
        self._received = True

    @property
    def received(self) -> bool:
        """Whether a signal came (a start-up that failed then was most likely cut by it)."""
        return self._received

    def wait(self, second_exits_at_once: bool = True) -> None:
        """Blocks until a signal came (within `POLL_S`). Then, with `second_exits_at_once`,
        puts back the default actions: a second Ctrl-C or SIGTERM while the server stops
        ends it at once, as a second Ctrl-C abandons the step of `meshrl run`."""
        while not self._received:
            time.sleep(self.POLL_S)
        if second_exits_at_once:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)


def wait_for_stop_signal() -> None:
    """Blocks (in the main thread) until SIGTERM or SIGINT; later ones are ignored."""
    StopSignal().wait(second_exits_at_once=False)


START_UP_EXIT_CODE = 2
"""What a server command exits with when it cannot start as asked (`serve_exit_code`)."""


def serve_exit_code(serve: Callable[[], object], *user_errors: type[BaseException]) -> int:
    """Runs ``serve()`` for a server's ``main`` (``python -m services.<role>.server``): 0 when
    it returns; a start-up the user can fix (a port in use, an address of another machine,
    ``user_errors``) is one line ``meshrl: <message>`` on stderr and exit code 2, as
    ``meshrl serve`` and ``meshrl reward serve`` end, never a traceback."""
    caught: tuple[type[BaseException], ...] = (ServerBindError, *user_errors)
    try:
        serve()
    except caught as e:
        print(f"meshrl: {e}", file=sys.stderr, flush=True)
        return START_UP_EXIT_CODE
    return 0


def exit_at_once() -> None:
    """Exit code 0 without joining the threads of calls still running.

    For a server told to stop whose calls outlive the gRPC grace period: a generation, an
    update, a scoring pass cannot be cut short, and the interpreter would join their
    threads at exit. Their results have no caller left.
    """
    logging.shutdown()  # flushes the log handlers; os._exit skips that
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
