"""Prometheus metrics of a server process, served at ``http://HOST:PORT/metrics``.

Every server built on ``GrpcServer`` (rollout, the trainer roles, reward, the coordinator
service) has the same ones when its endpoint is on (``meshrl.rpc.metrics_port``):

- per RPC, labelled ``grpc_service`` / ``grpc_method`` as go-grpc-prometheus names them, so
  existing Grafana dashboards read them: ``grpc_server_started_total``,
  ``grpc_server_handled_total`` (also by ``grpc_code``: errors are the codes other than OK),
  ``grpc_server_handling_seconds`` (a histogram from 1 ms to 10 min: a Generate or an
  update takes minutes), and ``meshrl_rpc_in_flight`` (calls being handled now);
- ``meshrl_rpc_queued``: calls received that wait for a server thread;
- the process: prometheus_client's ``process_resident_memory_bytes``, CPU seconds, open
  files; and on a process that uses CUDA, ``meshrl_gpu_memory_allocated_bytes`` /
  ``meshrl_gpu_memory_reserved_bytes`` (torch's allocator) and
  ``meshrl_gpu_memory_used_bytes`` (the whole device, every process), per visible device.

A service adds its own beside them (the rollout's tokens generated and weight version:
``services/rollout/metrics.py``). The metrics live in prometheus_client's default registry,
one per process: a process has one server.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LABELS = ("grpc_service", "grpc_method")

RPC_STARTED = Counter(
    "grpc_server_started_total", "RPCs started on the server.", [*_LABELS, "grpc_type"]
)
RPC_HANDLED = Counter(
    "grpc_server_handled_total",
    "RPCs completed on the server, by status code.",
    [*_LABELS, "grpc_type", "grpc_code"],
)
RPC_SECONDS = Histogram(
    "grpc_server_handling_seconds",
    "Time from an RPC's start to its end on the server (its whole stream, if it streams).",
    [*_LABELS, "grpc_type"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
RPC_IN_FLIGHT = Gauge("meshrl_rpc_in_flight", "RPCs being handled now.", list(_LABELS))
RPC_QUEUED = Gauge(
    "meshrl_rpc_queued", "RPCs received that wait for a free server thread (all methods)."
)


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    streams = (handler.request_streaming, handler.response_streaming)
    return {
        (False, False): "unary",
        (False, True): "server_stream",
        (True, False): "client_stream",
        (True, True): "bidi_stream",
    }[streams]


@contextlib.contextmanager
def _observed(labels: tuple[str, str, str], context: grpc.ServicerContext) -> Iterator[None]:
    service, method, kind = labels
    RPC_STARTED.labels(service, method, kind).inc()
    in_flight = RPC_IN_FLIGHT.labels(service, method)
    in_flight.inc()
    start = time.perf_counter()
    code = "UNKNOWN"  # what gRPC answers for a handler that raised
    try:
        yield
        code = "OK"
    except GeneratorExit:  # a stream whose client left: gRPC ended it
        code = "CANCELLED"
        raise
    finally:
        in_flight.dec()
        RPC_SECONDS.labels(service, method, kind).observe(time.perf_counter() - start)
        # The code the handler set or aborted with wins over what the ending says. A
        # handler that returned after its client left (a stream ends so when the client
        # cancels it) has no one to answer: gRPC has ended the call as cancelled.
        status = context.code() if code != "CANCELLED" else None
        if status is None and code == "OK" and not context.is_active():
            code = "CANCELLED"
        RPC_HANDLED.labels(service, method, kind, status.name if status else code).inc()


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every call of the server, health checks and refused calls
    included: it is the outermost interceptor, so a call the token check refuses counts
    as UNAUTHENTICATED."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED itself
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (service, method, _rpc_type(handler))
        if handler.response_streaming:
            field = "stream_stream" if handler.request_streaming else "unary_stream"
            return handler._replace(**{field: _streaming(getattr(handler, field), labels)})
        field = "stream_unary" if handler.request_streaming else "unary_unary"
        return handler._replace(**{field: _unary(getattr(handler, field), labels)})


def _unary(behaviour: Callable, labels: tuple[str, str, str]) -> Callable:
    def observed(request: Any, context: grpc.ServicerContext) -> Any:
        with _observed(labels, context):
            return behaviour(request, context)

    return observed


def _streaming(behaviour: Callable, labels: tuple[str, str, str]) -> Callable:
    def observed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        with _observed(labels, context):
            yield from behaviour(request, context)

    return observed


class QueueCountingExecutor(futures.ThreadPoolExecutor):
    """The server's thread pool, keeping ``meshrl_rpc_queued``: gRPC hands it each call,
    which waits in its queue while every thread is busy."""

    def submit(self, fn, /, *args, **kwargs):
        def run() -> Any:
            RPC_QUEUED.dec()
            return fn(*args, **kwargs)

        RPC_QUEUED.inc()
        try:
            return super().submit(run)
        except BaseException:  # shut down: the call never queued
            RPC_QUEUED.dec()
            raise


class GpuMemoryCollector(Collector):
    """GPU memory of a process that uses CUDA, read at each scrape. torch is not imported
    for it (the coordinator and the reward server without a model never load it), nor is
    CUDA started: a process that has not touched the GPU reports nothing."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        allocated = GaugeMetricFamily(
            "meshrl_gpu_memory_allocated_bytes",
            "GPU memory held by tensors of this process (torch's allocator).",
            labels=["device"],
        )
        reserved = GaugeMetricFamily(
            "meshrl_gpu_memory_reserved_bytes",
            "GPU memory reserved by torch's caching allocator in this process.",
            labels=["device"],
        )
        used = GaugeMetricFamily(
            "meshrl_gpu_memory_used_bytes",
            "GPU memory in use on the device, by every process.",
            labels=["device"],
        )
        for index in range(torch.cuda.device_count()):
            device = str(index)
            allocated.add_metric([device], torch.cuda.memory_allocated(index))
            reserved.add_metric([device], torch.cuda.memory_reserved(index))
            free, total = torch.cuda.mem_get_info(index)
            used.add_metric([device], total - free)
        yield from (allocated, reserved, used)


_gpu_collector_lock = threading.Lock()
_gpu_collector: GpuMemoryCollector | None = None


def _register_gpu_collector() -> None:
    global _gpu_collector
    with _gpu_collector_lock:
        if _gpu_collector is None:
            _gpu_collector = GpuMemoryCollector()
            REGISTRY.register(_gpu_collector)


class MetricsEndpoint:
    """The HTTP server of ``/metrics`` (a daemon thread of prometheus_client)."""

    def __init__(self, host: str, port: int):
        """Listens at once (OSError when it cannot)."""
        _register_gpu_collector()
        self._server, self._thread = start_http_server(port, addr=host.strip("[]"))
        self.port: int = self._server.server_port
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
