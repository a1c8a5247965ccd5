"""An actor served by 2 FSDP ranks (torchrun) against one served by 1 rank, over gRPC:
same log-probs, same update, weight sync out of the sharded model, and DCP resharding."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from trainer_helpers import (
    batch_to_proto,
    initialized_actors,
    join_in_background,
    make_batch,
    trainer_config,
)

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.weight_sync import GroupSpec, WeightManifest, receive_weights
from meshrl.wire import tensor_from_proto, tensor_to_proto
from services.trainer.actor import ActorRole

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

OVERRIDES = [
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
]
# 9 rows in mini-batches of 4: the last has one row, so rank 1 runs a padding micro-batch.
BATCH = make_batch(9, seed=21)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir, OVERRIDES)
    logs = tmp_path_factory.mktemp("actors")
    with initialized_actors(logs, [("one_rank", 1, cfg), ("two_ranks", 2, cfg)]) as pair:
        yield pair


def _log_probs(server, with_entropy=False):
    request = common_pb2.LogProbsRequest(batch=batch_to_proto(BATCH), with_entropy=with_entropy)
    response = server.stub.ComputeLogProbs(request, timeout=120)
    entropy = tensor_from_proto(response.entropy) if with_entropy else None
    return tensor_from_proto(response.logprobs), entropy


def test_two_ranks_report_their_world(servers):
    _, two = servers
    info = two.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.world_size == 2 and info.ready and info.role == "actor"


def test_log_probs_equal_one_rank(servers):
    one, two = servers
    lp1, ent1 = _log_probs(one, with_entropy=True)
    lp2, ent2 = _log_probs(two, with_entropy=True)
    assert lp1.shape == (BATCH.num_response_tokens,)
    torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent2, ent1, atol=1e-5, rtol=0)


def test_update_equals_one_rank(servers):
    one, two = servers
    old, _ = _log_probs(one)
    request = trainer_pb2.PolicyUpdateRequest(
        batch=batch_to_proto(BATCH),
        old_logprobs=tensor_to_proto(old),
        advantages=tensor_to_proto(torch.linspace(-1.0, 1.0, old.numel())),
        ref_logprobs=tensor_to_proto(old - 0.1),
        rollout_logprobs=tensor_to_proto(old + 0.05),
        global_step=1,
    )
    with ThreadPoolExecutor(2) as pool:
        m1, m2 = pool.map(
            lambda s: dict(s.stub.UpdatePolicy(request, timeout=120).metrics), servers
        )
    expected = {
        "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
        "actor/entropy", "actor/kl_loss", "actor/kl_coef", "actor/grad_norm", "actor/lr",
        "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_std",
    }  # fmt: skip
    assert expected <= set(m1)
    assert set(m1) == set(m2)
    for key in m1:
        if key.startswith("perf/"):  # timings differ between runs
            continue
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-5), key
    # Same weights afterwards: the log-probs still agree, and they moved.
    after1, _ = _log_probs(one)
    after2, _ = _log_probs(two)
    torch.testing.assert_close(after2, after1, atol=1e-4, rtol=0)
    assert (after1 - old).abs().max() > 1e-3


def test_weight_sync_after_a_failed_join_and_dcp_resharding(
    servers, world, tiny_model_dir, tmp_path
):
    one, two = servers
    stub = two.stub
    # Nobody joins: the actor's join fails within the timeout, with UNAVAILABLE.
    spec = stub.OpenWeightGroup(
        common_pb2.WeightGroupSpec(transport="gloo", world_size=2, timeout_s=2), timeout=10
    )
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.JoinWeightGroup(common_pb2.JoinWeightGroupRequest(spec=spec), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 20

    # A fresh group on a new port works; this test process plays the rollout (rank 1).
    fresh = stub.OpenWeightGroup(
        common_pb2.WeightGroupSpec(transport="gloo", world_size=2, timeout_s=30), timeout=10
    )
    assert (fresh.master_port, fresh.group_id) != (spec.master_port, spec.group_id)
    thread, box = join_in_background(GroupSpec.from_proto(fresh), rank=1)
    joined = stub.JoinWeightGroup(common_pb2.JoinWeightGroupRequest(spec=fresh), timeout=60)
    thread.join(60)
    assert joined.group_id == fresh.group_id and "group" in box, box.get("error")
    group = box["group"]

    with pytest.raises(grpc.RpcError) as info:
        stub.SendWeights(trainer_pb2.SendWeightsRequest(version=5), timeout=30)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # not prepared yet

    manifest_msg = stub.PrepareWeights(
        trainer_pb2.PrepareWeightsRequest(version=5, dtype="float32", bucket_bytes=16 * 1024),
        timeout=30,
    )
    manifest = WeightManifest.from_proto(manifest_msg)
    assert manifest.group_id == fresh.group_id and len(manifest.buckets) > 1
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(
            lambda: stub.SendWeights(trainer_pb2.SendWeightsRequest(version=5), timeout=120)
        )
        received = {name: t.clone() for name, t in receive_weights(group, manifest)}
        result = sending.result()
    group.close()
    assert (result.version, result.bytes) == (5, manifest.nbytes)
    # the actor holds weights of version 5 (the coordinator's name), after one update
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert (info.weight_version, info.update_count) == (5, 1)

    # The 2-rank checkpoint loads into one rank and holds exactly the weights just sent.
    path = str(tmp_path / "actor_ckpt")
    stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=path, with_optimizer=True), timeout=120)
    restored = ActorRole.build(trainer_config(tiny_model_dir, OVERRIDES), world)
    restored.load(path, with_optimizer=True)
    params = dict(restored.iter_full_params())
    assert list(received) == list(params)
    for name, tensor in params.items():
        assert torch.equal(received[name], tensor), name
    assert restored.update_count == 1
    assert len(restored.optimizer.state) > 0  # Adam moments came back too

    # The one-rank server's update (the same batch) reached the same weights.
    one_path = str(tmp_path / "one_rank_ckpt")
    one.stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=one_path), timeout=120)
    single = ActorRole.build(trainer_config(tiny_model_dir, OVERRIDES), world)
    single.load(one_path, with_optimizer=False)
    worst = max((t - params[n]).abs().max().item() for n, t in single.iter_full_params())
    assert worst < 1e-5, worst


def test_sigterm_stops_every_rank(servers):
    _, two = servers
    os.killpg(two.proc.pid, signal.SIGTERM)
    two.proc.wait(30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(two.proc.pid, 0)  # is anyone of the session left?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("trainer ranks still running after SIGTERM")
