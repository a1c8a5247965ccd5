"""Transport-level bad input against a real server process: a batch over the gRPC message
limit is refused with RESOURCE_EXHAUSTED and the server lives on; a port already taken or an
address not of this machine fails at start with a message naming it."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest

from benchmarks.reward.load import RewardServerProcess
from meshrl.api.v1 import reward_pb2, reward_pb2_grpc
from meshrl.launcher.ports import free_port
from meshrl.rpc.role_client import RoleCallError
from meshrl.rpc.security import SecuritySettings, client_interceptor
from meshrl.rpc.server import GrpcServer, ServerBindError
from services.reward.client import RewardClient
from services.reward.types import ScoreItem

pytestmark = pytest.mark.timeout(180)

LIMIT_MB = 1


@pytest.fixture(scope="module")
def small_limit_server(tmp_path_factory):
    """A reward server whose message limit is 1 MiB (MESHRL_GRPC_MAX_MESSAGE_MB)."""
    log = tmp_path_factory.mktemp("limit") / "server.log"
    with RewardServerProcess(1, log, env={"MESHRL_GRPC_MAX_MESSAGE_MB": str(LIMIT_MB)}) as s:
        yield s


def _item(response: str) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(data_source="openai/gsm8k", response=response, ground_truth="4")


@pytest.mark.slow
def test_batch_over_the_message_limit_is_resource_exhausted(small_limit_server):
    address = small_limit_server.address
    # a client allowed to send anything: the server's own limit must refuse it
    raw = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
    with grpc.intercept_channel(raw, client_interceptor(SecuritySettings())) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        big = reward_pb2.ScoreRequest(items=[_item("#### 4 " + "x" * 2_000_000)])
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(big, timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details().startswith("SERVER: Received message larger than max (")
        assert f"vs. {LIMIT_MB * 1024 * 1024})" in e.value.details()
        # the server lives on and answers the next, normal call
        ok = stub.Score(reward_pb2.ScoreRequest(items=[_item("#### 4")]), timeout=30)
        assert [r.score for r in ok.results] == [1.0]
    assert small_limit_server.proc.poll() is None


@pytest.mark.slow
def test_coordinator_error_for_an_oversized_batch_names_the_fix(small_limit_server):
    client = RewardClient(small_limit_server.address, timeout_s=30)
    try:
        with pytest.raises(RoleCallError) as e:
            client.score([ScoreItem("openai/gsm8k", "y" * 2_000_000, "1")])
    finally:
        client.close()
    message = str(e.value)
    assert message.startswith(
        f"reward at {small_limit_server.address} failed during Score: RESOURCE_EXHAUSTED: "
        "SERVER: Received message larger than max ("
    )
    assert message.endswith(
        "(a message over a gRPC size limit, 512 MiB in this process: lower "
        "data.train_batch_size (data.gen_batch_size) or rollout.n, or raise "
        "MESHRL_GRPC_MAX_MESSAGE_MB on every process of the run)"
    )


def test_port_already_taken_is_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServerBindError) as e:
            GrpcServer(
                "meshrl.api.v1.RewardService",
                "127.0.0.1",
                port,
                security=SecuritySettings(),
                name="reward server",
            )
    assert str(e.value) == (
        f"reward server cannot bind 127.0.0.1:{port}: port {port} is "
        "already in use (another server, or one left over from an earlier run)"
    )


def test_address_not_of_this_machine_is_named():
    with pytest.raises(OSError, match="address 192.0.2.1 is not an address of this machine"):
        GrpcServer("svc", "192.0.2.1", free_port(), security=SecuritySettings())  # TEST-NET-1


@pytest.mark.slow
def test_server_process_on_a_taken_port_exits_with_the_port_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.reward.server",
                "--port",
                str(port),
                "--num-workers",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != 0
    assert f"cannot bind 127.0.0.1:{port}: port {port} is already in use" in done.stderr
