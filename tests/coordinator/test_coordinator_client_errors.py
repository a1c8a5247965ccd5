"""`meshrl status` / `stop` / `run --coordinator` pointed at the wrong place: an address
without a port, nothing listening, a gRPC server that is no coordinator service. Each is one
line naming the address and what to do, not gRPC's bare status."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from meshrl.launcher.ports import free_port
from meshrl_app import cli

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1", "must be HOST:PORT, got '127.0.0.1' (no port)"),  # gRPC dialled 443
        ("127.0.0.1:abc", "must be HOST:PORT with a port 1 to 65535"),  # before: exit 1
        ("127.0.0.1:70000", "must be HOST:PORT with a port 1 to 65535"),
    ],
)
@pytest.mark.parametrize("verb", [["status"], ["stop", "run-1"]])
def test_an_address_that_is_no_host_and_port_is_a_bad_argument(capsys, address, message, verb):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*verb, "--coordinator", address])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_grpc_targets_with_a_scheme_pass_as_they_are():
    from meshrl.rpc.address import host_port

    assert host_port("unix:/tmp/coordinator.sock") == "unix:/tmp/coordinator.sock"
    assert host_port("[::1]:50050") == "[::1]:50050"


def test_nothing_listening_says_how_to_start_a_coordinator(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert cli.main(["status", "--coordinator", address]) == 1
    err = capsys.readouterr().err
    assert f"meshrl: coordinator at {address}: unreachable" in err
    assert "meshrl serve coordinator" in err


def test_a_grpc_server_that_is_no_coordinator_says_so(capsys):
    # Before: `coordinator at ...: UNIMPLEMENTED: Method not found!` (a reward server, say)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert cli.main(["status", "--coordinator", f"127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert "UNIMPLEMENTED" in err
    assert "it is no meshrl coordinator service: a role or reward server?" in err


def test_the_environments_address_is_checked_as_the_flags_is(monkeypatch, capsys):
    monkeypatch.setenv("MESHRL_COORDINATOR", "10.0.0.5")  # before: dialled port 443
    assert cli.main(["status"]) == 2
    assert "meshrl: $MESHRL_COORDINATOR must be HOST:PORT, got '10.0.0.5' (no port)" in (
        capsys.readouterr().err
    )


def test_a_coordinator_that_answers_unavailable_is_not_called_unreachable():
    # the service's own answer while it shuts down: no hint to start one
    from services.coordinator.client import CoordinatorError

    e = CoordinatorError(
        "h:1", grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down: no new runs"
    )
    assert (
        str(e) == "coordinator at h:1: UNAVAILABLE: the coordinator is shutting down: no new runs"
    )


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (":50050", "(no host)"),
        ("http://h:50050", "not a URL"),
        ("h:\u0663", "with a port 1 to 65535"),  # an Arabic-Indic digit: isdigit() is true
    ],
)
def test_host_port_edge_cases(address, message):
    import argparse

    from meshrl.rpc.address import host_port

    with pytest.raises(argparse.ArgumentTypeError, match=message):
        host_port(address)
    for fine in ("localhost:50050", "0.0.0.0:50050", "my-host.example.com:1", "xds:///svc"):
        assert host_port(fine) == fine
