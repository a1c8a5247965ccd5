"""One-rank trainer servers as real processes: preconditions, health, the critic's RPCs."""

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from trainer_helpers import TrainerProcess, batch_to_proto, make_batch, trainer_config

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.rpc.client import health_status
from meshrl.wire import tensor_from_proto, tensor_to_proto
from services.trainer.server import SERVICE_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def critic_server(tmp_path_factory):
    server = TrainerProcess("critic", 1, tmp_path_factory.mktemp("critic") / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_critic_server_lifecycle(critic_server, tiny_model_dir):
    stub = critic_server.stub
    batch = make_batch(4, seed=11)  # one mini-batch: the loss is measured before any step
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert (info.service, info.role, info.ready, info.world_size) == ("trainer", "critic", False, 1)
    assert info.weight_version == -1
    assert (
        health_status(critic_server.channel, SERVICE_NAME)
        == health_pb2.HealthCheckResponse.NOT_SERVING
    )

    # A role's RPC on another role, and any model RPC before Initialize.
    code, details = _code(lambda: stub.ComputeLogProbs(common_pb2.LogProbsRequest(), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "ComputeLogProbs is served by role actor or ref; this server is critic" in details
    code, details = _code(lambda: stub.ComputeValues(batch_to_proto(batch), timeout=10))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "before Initialize" in details

    bad = trainer_config(tiny_model_dir, ["actor_rollout_ref.model.path=/no/such/model"])
    code, details = _code(lambda: critic_server.initialize(bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "/no/such/model" in details
    assert not stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10).ready

    response = critic_server.initialize(trainer_config(tiny_model_dir))
    assert response.info.ready and response.info.num_parameters > 0
    assert response.info.model_path == str(tiny_model_dir)
    assert (
        health_status(critic_server.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    )

    values = tensor_from_proto(stub.ComputeValues(batch_to_proto(batch), timeout=60).values)
    assert values.shape == (batch.num_response_tokens,)
    assert torch.count_nonzero(values) == 0
    request = trainer_pb2.ValueUpdateRequest(
        batch=batch_to_proto(batch),
        old_values=tensor_to_proto(values),
        returns=tensor_to_proto(torch.ones_like(values)),
        global_step=1,
    )
    metrics = dict(stub.UpdateValue(request, timeout=60).metrics)
    assert {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
    } <= set(metrics)
    assert metrics["critic/vf_loss"] == pytest.approx(0.5)  # 0.5 * (0 - 1)^2
    after = tensor_from_proto(stub.ComputeValues(batch_to_proto(batch), timeout=60).values)
    assert after.mean() > 0

    # Bad input is the caller's fault; the server lives on.
    request.returns.CopyFrom(tensor_to_proto(torch.ones(3)))
    code, details = _code(lambda: stub.UpdateValue(request, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "returns has 3 values" in details
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    # one update applied; a critic sends no weights, so it holds no weight version
    assert (info.update_count, info.weight_version) == (1, -1)


def test_weight_rpcs_belong_to_the_actor(critic_server):
    code, details = _code(
        lambda: critic_server.stub.OpenWeightGroup(common_pb2.WeightGroupSpec(), timeout=10)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "served by role actor" in details
