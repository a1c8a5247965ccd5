"""The rollout server as a real process: `python -m services.rollout.server` on a free port."""

import signal
import subprocess
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from rollout_server_process import Server, sync_weights, wait_for_log

from meshrl.api.v1 import common_pb2, rollout_pb2
from meshrl.config import build_config, config_to_yaml
from meshrl.ragged import Ragged
from meshrl.rpc.client import health_status
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets
from meshrl.wire import ragged_from_proto, ragged_to_proto, tensor_from_proto
from services.rollout.convert import sampling_from_proto, sampling_to_proto
from services.rollout.native.engine import NativeEngine
from services.rollout.server import SERVICE_NAME
from services.rollout.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9]]


def _config_yaml(model_dir: str) -> str:
    tree = {"actor_rollout_ref": {"model": {"path": model_dir}, "rollout": {"max_num_seqs": 4}}}
    return config_to_yaml(build_config(tree))


def _generate_request(prompts, **sampling) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=ragged_to_proto(Ragged.from_lists(prompts)),
        sampling=rollout_pb2.SamplingParams(**sampling),
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(make_tiny_model_dir(root / "a", seed=0)), str(
        make_tiny_model_dir(root / "b", seed=1)
    )


def _call_error(call, request) -> grpc.RpcError:
    try:
        call(request, timeout=30)
    except grpc.RpcError as e:
        return e
    raise AssertionError(f"{call} succeeded")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    """One server process for the module. What it answers before Initialize is recorded in
    ``srv.before_init`` (so that test does not depend on test order); then it is initialized."""
    srv = Server(tmp_path_factory.mktemp("logs") / "rollout.log")
    try:
        srv.before_init = {
            "info": srv.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10),
            "health": health_status(srv.channel, SERVICE_NAME),
            "generate": _call_error(
                srv.stub.Generate, _generate_request(PROMPTS, n=1, max_tokens=4)
            ),
            "bad_config": _call_error(
                srv.stub.Initialize, common_pb2.InitializeRequest(config_yaml="trainer: {nope: 1}")
            ),
        }
        request = common_pb2.InitializeRequest(config_yaml=_config_yaml(model_dirs[0]))
        srv.init_info = srv.stub.Initialize(request, timeout=120).info
        yield srv
    finally:
        srv.stop()


def _code(call, request) -> tuple[grpc.StatusCode, str]:
    err = _call_error(call, request)
    return err.code(), err.details()


def test_uninitialized_server_is_not_ready(server):
    before = server.before_init
    info = before["info"]
    assert (info.service, info.api_version, info.ready, info.weight_version) == (
        "rollout",
        "meshrl.api.v1",
        False,
        -1,
    )
    assert before["health"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert before["generate"].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rollout not initialized: call Initialize" in before["generate"].details()
    assert before["bad_config"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trainer.nope" in before["bad_config"].details()


def test_initialize_loads_the_model_and_turns_healthy(server, model_dirs):
    info = server.init_info
    assert info.ready and info.num_parameters > 0 and info.weight_version == 0
    assert info.model_path == model_dirs[0]
    assert health_status(server.channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING


def test_generate_matches_the_engine_in_process(server, model_dirs):
    request = _generate_request(PROMPTS, temperature=0.8, top_p=0.9, max_tokens=8, n=2, seed=11)
    reply = server.stub.Generate(request, timeout=60)
    responses = ragged_from_proto(reply.responses)
    logprobs = tensor_from_proto(reply.logprobs)
    assert len(responses) == 6 and len(reply.finish_reasons) == 6
    assert logprobs.shape == responses.values.shape and logprobs.dtype == torch.float32
    assert reply.weight_version == 0
    local = NativeEngine(model_dirs[0], max_num_seqs=4).generate(
        Ragged.from_lists(PROMPTS),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, n=2, seed=11),
    )
    assert responses.tolist() == local.responses.tolist()
    reasons = {rollout_pb2.FINISH_REASON_STOP: "stop", rollout_pb2.FINISH_REASON_LENGTH: "length"}
    assert [reasons[r] for r in reply.finish_reasons] == local.finish_reasons


def test_compute_logprobs_agree_with_generate(server):
    reply = server.stub.Generate(
        _generate_request(PROMPTS, temperature=1.0, max_tokens=8, n=2, seed=3), timeout=60
    )
    prompts = Ragged.from_lists([p for p in PROMPTS for _ in range(2)])
    request = common_pb2.LogProbsRequest(
        batch=common_pb2.SequenceBatch(prompts=ragged_to_proto(prompts), responses=reply.responses),
        temperature=1.0,
        with_entropy=True,
    )
    scored = server.stub.ComputeLogProbs(request, timeout=60)
    generated = tensor_from_proto(reply.logprobs)
    torch.testing.assert_close(tensor_from_proto(scored.logprobs), generated, atol=1e-5, rtol=0)
    entropy = tensor_from_proto(scored.entropy)
    assert entropy.shape == generated.shape and bool((entropy >= 0).all())
    assert scored.weight_version == 0


def test_bad_requests_are_invalid_arguments(server):
    cases = [
        (_generate_request([[1, 99]], n=1, max_tokens=4), "prompts[0] holds token id 99"),
        (_generate_request(PROMPTS, n=0, max_tokens=4), "sampling.n must be >= 1"),
        (_generate_request(PROMPTS, n=1, max_tokens=0), "sampling.max_tokens must be >= 1"),
        (_generate_request(PROMPTS, n=1, max_tokens=4, top_p=1.5), "sampling.top_p"),
    ]
    for request, message in cases:
        code, details = _code(server.stub.Generate, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert message in details


def test_empty_prompt_batch_returns_nothing(server):
    reply = server.stub.Generate(_generate_request([], n=2, max_tokens=4), timeout=30)
    assert len(ragged_from_proto(reply.responses)) == 0 and len(reply.finish_reasons) == 0


def test_released_memory_refuses_generate_until_resumed(server):
    server.stub.SetMemoryState(rollout_pb2.MemoryStateRequest(release=True), timeout=30)
    try:
        code, details = _code(server.stub.Generate, _generate_request(PROMPTS, n=1, max_tokens=2))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "released" in details
    finally:
        server.stub.SetMemoryState(rollout_pb2.MemoryStateRequest(release=False), timeout=30)
    server.stub.Generate(_generate_request(PROMPTS, n=1, max_tokens=2), timeout=30)


def test_receive_weights_without_a_group_fails_precondition(server):
    code, details = _code(server.stub.ReceiveWeights, common_pb2.WeightManifest(version=1))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "JoinWeightGroup" in details


def test_weight_sync_over_grpc_and_gloo(server, model_dirs):
    request = _generate_request(PROMPTS, temperature=0, max_tokens=8, n=1)
    params = SamplingParams(temperature=0, max_tokens=8)
    other = NativeEngine(model_dirs[1])
    original = NativeEngine(model_dirs[0])
    result = sync_weights(server, other.runner.model, version=4)
    assert result.version == 4 and result.bytes == 4 * other.num_parameters
    reply = server.stub.Generate(request, timeout=60)
    assert reply.weight_version == 4
    expected = other.generate(Ragged.from_lists(PROMPTS), params).responses.tolist()
    assert ragged_from_proto(reply.responses).tolist() == expected
    # A second group replaces the first; the original weights come back as version 5.
    assert sync_weights(server, original.runner.model, version=5).version == 5
    reply = server.stub.Generate(request, timeout=60)
    assert reply.weight_version == 5
    expected = original.generate(Ragged.from_lists(PROMPTS), params).responses.tolist()
    assert ragged_from_proto(reply.responses).tolist() == expected
    info = server.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.weight_version == 5 and info.ready


def test_coordinator_releases_and_takes_back_the_cache(server):
    """The coordinator's side of free_cache_engine against the real server: asleep, the
    server refuses to generate; a RolloutMemory made afresh (as after a recovery) still
    wakes it."""
    from meshrl.rpc.role_client import RoleCallError
    from services.coordinator.generation.rollout_memory import RolloutMemory
    from services.rollout.client import RolloutClient

    client = RolloutClient(server.address, timeout_s=30)
    sampling = SamplingParams(temperature=1.0, max_tokens=2, n=1, seed=3)
    try:
        RolloutMemory([client], enabled=True).sleep()
        with pytest.raises(RoleCallError, match="released"):
            client.generate(Ragged.from_lists(PROMPTS), sampling)
        RolloutMemory([client], enabled=True).wake()
        assert len(client.generate(Ragged.from_lists(PROMPTS), sampling).responses) == len(PROMPTS)
    finally:
        client.set_memory_state(release=False)
        client.channel.close()


def test_an_unset_seed_is_a_fresh_one_and_zero_is_a_seed():
    """Without presence an unset seed read as 0: every call without one sampled the same."""
    assert sampling_from_proto(rollout_pb2.SamplingParams(max_tokens=4, n=1)).seed is None
    assert sampling_from_proto(rollout_pb2.SamplingParams(max_tokens=4, n=1, seed=0)).seed == 0
    assert sampling_from_proto(rollout_pb2.SamplingParams(max_tokens=4, n=1, seed=7)).seed == 7


# Ctrl-C (SIGINT) stops the standalone server in about the gRPC grace period (2 s). A call in
# flight used to hold it until the call ended: 48 s for a generation like the one below on a
# CPU, 60 s (the group's timeout) for the weight sync. The bound leaves room for a loaded
# machine.
STOP_BOUND_S = 20.0


def _ctrl_c(srv: Server) -> tuple[int | None, float]:
    """SIGINT to the server; its exit code (None: still running after STOP_BOUND_S) and the
    seconds it took to exit."""
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    try:
        rc = srv.proc.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.monotonic() - start


@pytest.fixture
def own_server(model_dirs, tmp_path):
    """A server of its own (the test stops it), initialized with the tiny model. Once it has
    answered Initialize it waits for signals: one sent just after it listens could still
    meet Python's default SIGINT handler."""
    srv = Server(tmp_path / "rollout.log")
    try:
        request = common_pb2.InitializeRequest(config_yaml=_config_yaml(model_dirs[0]))
        srv.stub.Initialize(request, timeout=120)
        yield srv
    finally:
        srv.stop()


def test_ctrl_c_stops_an_idle_server_with_exit_code_0(own_server):
    rc, seconds = _ctrl_c(own_server)
    assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, own_server.log_path.read_text())


def test_ctrl_c_does_not_wait_for_a_generation_in_flight(own_server):
    # 2048 sampled sequences of up to 200 tokens: longer than the bound on any machine.
    request = _generate_request([[1, 4, 5]] * 64, temperature=1.0, max_tokens=200, n=32)
    call = own_server.stub.Generate.future(request, timeout=300)
    wait_for_log(own_server, "rpc Generate #1 started")
    rc, seconds = _ctrl_c(own_server)
    log = own_server.log_path.read_text()
    assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, log)
    with pytest.raises(grpc.RpcError) as err:
        call.result(timeout=30)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    # the generation itself stopped, so the process could leave the normal way
    assert "generation cancelled after" in log and "exiting without waiting" not in log, log


def test_a_generation_whose_caller_left_stops_and_frees_the_engine(own_server):
    # As a run abandoned mid-step leaves it: before, the next run's calls waited behind the
    # rest of the batch (48 s on a CPU) for the engine lock.
    big = _generate_request([[1, 4, 5]] * 64, temperature=1.0, max_tokens=200, n=32)
    call = own_server.stub.Generate.future(big, timeout=300)
    wait_for_log(own_server, "rpc Generate #1 started")
    start = time.monotonic()
    call.cancel()
    small = _generate_request([[1, 4, 5]], temperature=0.0, max_tokens=4, n=1)
    reply = own_server.stub.Generate(small, timeout=60)
    seconds = time.monotonic() - start
    log = own_server.log_path.read_text()
    assert len(reply.finish_reasons) == 1
    assert seconds < STOP_BOUND_S, (seconds, log)
    assert "generation cancelled after" in log, log


def test_ctrl_c_does_not_wait_for_a_weight_sync_whose_sender_never_sends(own_server):
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=60, world_size=2)
    peer = GroupSpec(**{**spec.__dict__, "rank": 1})
    joined = own_server.stub.JoinWeightGroup.future(
        common_pb2.JoinWeightGroupRequest(spec=peer.to_proto()), timeout=60
    )
    group = WeightGroup.join(spec, store)
    try:
        assert joined.result().group_id == spec.group_id
        buckets = plan_buckets([("model.embed_tokens.weight", (22, 64))], torch.float32, 1 << 15)
        manifest = WeightManifest(1, buckets, spec.group_id)
        call = own_server.stub.ReceiveWeights.future(manifest.to_proto(), timeout=120)
        wait_for_log(own_server, "rpc ReceiveWeights #1 started")
        rc, seconds = _ctrl_c(own_server)  # the server holds the group, waiting for us
        log = own_server.log_path.read_text()
        assert rc == 0 and seconds < STOP_BOUND_S, (rc, seconds, log)
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=30)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        group.close()


def test_sampling_params_cross_the_wire_unchanged_seed_presence_included():
    for params in (
        SamplingParams(temperature=0.75, top_p=0.5, top_k=5, max_tokens=3, n=2, seed=0),
        SamplingParams(max_tokens=8, stop_token_ids=(2, 9)),
    ):
        assert sampling_from_proto(sampling_to_proto(params)) == params
