"""Every GrpcServer's Prometheus endpoint (meshrl.rpc.metrics): scraped over HTTP from an
in-process server, before and after real calls. The registry is the process's, shared by
the servers of one test worker, so each test compares a scrape after its calls with one
before them."""

from __future__ import annotations

import os
import socket
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from meshrl.rpc.client import open_channel
from meshrl.rpc.metrics_port import METRICS_PORT_ENV, metrics_port_from_env
from meshrl.rpc.security import SecuritySettings
from meshrl.rpc.server import GrpcServer

pytestmark = pytest.mark.timeout(60)

HEALTH = "grpc.health.v1.Health"
INSECURE = SecuritySettings()


def scrape(server: GrpcServer) -> dict[tuple[str, frozenset], float]:
    """Every sample of the server's /metrics: (name, labels) -> value."""
    assert server.metrics is not None
    text = urllib.request.urlopen(server.metrics.url, timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def server():
    srv = GrpcServer("meshrl.test.Service", port=0, security=INSECURE, metrics_port=0)
    srv.start()
    channel = open_channel(f"127.0.0.1:{srv.port}", INSECURE)
    srv.health_stub = health_pb2_grpc.HealthStub(channel)
    yield srv
    channel.close()
    srv.stop(grace=0)


def check(server, service: str = "") -> None:
    server.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)


def test_calls_are_counted_by_method_and_code_and_timed(server):
    before = scrape(server)
    for _ in range(3):
        check(server)
    with pytest.raises(grpc.RpcError) as refused:
        check(server, "no.such.Service")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    after = scrape(server)

    unary = {"grpc_service": HEALTH, "grpc_method": "Check", "grpc_type": "unary"}

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("grpc_server_started_total", **unary) == 4
    assert moved("grpc_server_handled_total", **unary, grpc_code="OK") == 3
    assert moved("grpc_server_handled_total", **unary, grpc_code="NOT_FOUND") == 1
    assert moved("grpc_server_handling_seconds_count", **unary) == 4
    assert moved("grpc_server_handling_seconds_sum", **unary) > 0
    # every call lands in the last bucket; each in one of the bounded ones too
    assert moved("grpc_server_handling_seconds_bucket", **unary, le="+Inf") == 4
    assert moved("grpc_server_handling_seconds_bucket", **unary, le="600.0") == 4
    assert value(after, "meshrl_rpc_in_flight", grpc_service=HEALTH, grpc_method="Check") == 0
    assert value(after, "meshrl_rpc_queued") == 0


def test_a_call_in_flight_is_seen_and_a_stream_the_client_left_is_cancelled(server):
    before = scrape(server)
    stream = server.health_stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    watch = {"grpc_service": HEALTH, "grpc_method": "Watch"}
    assert value(scrape(server), "meshrl_rpc_in_flight", **watch) == 1
    stream.cancel()
    labels = {**watch, "grpc_type": "server_stream", "grpc_code": "CANCELLED"}
    for _ in range(100):  # the server learns of the cancellation a moment later
        after = scrape(server)
        if value(after, "grpc_server_handled_total", **labels) > value(
            before, "grpc_server_handled_total", **labels
        ):
            break
        threading.Event().wait(0.05)
    else:
        raise AssertionError("the cancelled Watch was never counted CANCELLED")
    assert value(after, "meshrl_rpc_in_flight", **watch) == 0


def test_process_memory_is_reported_and_gpu_memory_only_where_cuda_is_used(server):
    samples = scrape(server)
    assert value(samples, "process_resident_memory_bytes") > 10 * 2**20
    torch = __import__("sys").modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        assert not any(name.startswith("meshrl_gpu_memory") for name, _ in samples)


def test_calls_refused_by_the_token_check_count_as_unauthenticated(tmp_path):
    token = tmp_path / "token"
    token.write_text("the-token\n")
    srv = GrpcServer(
        "meshrl.test.Service",
        port=0,
        security=SecuritySettings(auth_token_file=str(token)),
        metrics_port=0,
    )
    srv.start()
    channel = open_channel(f"127.0.0.1:{srv.port}", INSECURE)  # no token sent
    try:
        before = scrape(srv)
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        labels = {
            "grpc_service": HEALTH,
            "grpc_method": "Check",
            "grpc_type": "unary",
            "grpc_code": "UNAUTHENTICATED",
        }
        after = scrape(srv)
        assert value(after, "grpc_server_handled_total", **labels) == (
            value(before, "grpc_server_handled_total", **labels) + 1
        )
    finally:
        channel.close()
        srv.stop(grace=0)


def test_the_endpoint_closes_with_the_server():
    srv = GrpcServer("meshrl.test.Service", port=0, security=INSECURE, metrics_port=0)
    srv.start()
    url = srv.metrics.url
    srv.stop(grace=0)
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_no_endpoint_unless_asked(monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    srv = GrpcServer("meshrl.test.Service", port=0, security=INSECURE)
    try:
        assert srv.metrics is None
    finally:
        srv.stop(grace=0)


def test_the_environment_variable_gives_the_port(monkeypatch):
    monkeypatch.setenv(METRICS_PORT_ENV, "0")
    srv = GrpcServer("meshrl.test.Service", port=0, security=INSECURE)
    try:
        assert srv.metrics is not None and srv.metrics.port > 0
    finally:
        srv.stop(grace=0)


@pytest.mark.parametrize("text", ["abc", "70000", "-1", "9100.5"])
def test_a_bad_environment_value_is_named(monkeypatch, text):
    monkeypatch.setenv(METRICS_PORT_ENV, text)
    with pytest.raises(ValueError) as bad:
        metrics_port_from_env()
    assert str(bad.value) == (
        f"{METRICS_PORT_ENV}: must be a port number 0 to 65535 (0 = any free port), got {text!r}"
    )


def test_a_metrics_port_in_use_is_one_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as failed:
            GrpcServer("meshrl.test.Service", port=0, security=INSECURE, metrics_port=port)
    assert str(failed.value) == (
        f"meshrl.test.Service cannot serve metrics on 127.0.0.1:{port}: port {port} is "
        "already in use (another server, or one left over from an earlier run)"
    )


def test_ports_of_the_environment_are_not_left_to_children():
    # Guard for the other tests of this worker: nothing here leaves the variable set.
    assert METRICS_PORT_ENV not in os.environ


@pytest.mark.gpu
def test_gpu_memory_of_a_process_that_uses_cuda(server):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda:0")  # 64 MiB
    samples = scrape(server)
    assert value(samples, "meshrl_gpu_memory_allocated_bytes", device="0") >= held.numel()
    assert value(samples, "meshrl_gpu_memory_reserved_bytes", device="0") >= held.numel()
    assert value(samples, "meshrl_gpu_memory_used_bytes", device="0") >= held.numel()
    del held
