"""A LoRA actor served by 2 FSDP ranks (torchrun) against one on 1 rank, over gRPC: frozen
base weights and trained adapters in the same shard units give the same update, and the
weights streamed out of the sharded model are the merged ones, under Hugging Face names."""

from concurrent.futures import ThreadPoolExecutor

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

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
]
BATCH = make_batch(9, seed=21)  # the last mini-batch has one row: rank 1 pads


def test_two_rank_lora_update_equals_one_rank_and_streams_merged_weights(
    tiny_model_dir, world, tmp_path
):
    cfg = trainer_config(tiny_model_dir, LORA)
    with initialized_actors(tmp_path, [("one_rank", 1, cfg), ("two_ranks", 2, cfg)]) as servers:
        one, two = servers
        logprobs = common_pb2.LogProbsRequest(batch=batch_to_proto(BATCH))
        old = tensor_from_proto(one.stub.ComputeLogProbs(logprobs, timeout=120).logprobs)
        update = trainer_pb2.PolicyUpdateRequest(
            batch=batch_to_proto(BATCH),
            old_logprobs=tensor_to_proto(old),
            advantages=tensor_to_proto(torch.linspace(-1.0, 1.0, old.numel())),
            global_step=1,
        )
        with ThreadPoolExecutor(2) as pool:
            m1, m2 = pool.map(
                lambda s: dict(s.stub.UpdatePolicy(update, timeout=120).metrics), servers
            )
        for key in m1:
            if not key.startswith("perf/"):  # timings differ between runs
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-5), key
        after = [
            tensor_from_proto(s.stub.ComputeLogProbs(logprobs, timeout=120).logprobs)
            for s in servers
        ]
        torch.testing.assert_close(after[1], after[0], atol=1e-4, rtol=0)
        assert (after[0] - old).abs().max() > 1e-3
        # The base model (the reference, adapters off) from the sharded actor: every rank
        # switches its adapters off for the call, and they are back on after it.
        base_request = common_pb2.LogProbsRequest(batch=batch_to_proto(BATCH), base_model=True)
        base = [
            tensor_from_proto(s.stub.ComputeLogProbs(base_request, timeout=120).logprobs)
            for s in servers
        ]
        torch.testing.assert_close(base[1], base[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(base[0], old, atol=1e-5, rtol=0)  # B was 0 before the update
        back_on = tensor_from_proto(two.stub.ComputeLogProbs(logprobs, timeout=120).logprobs)
        torch.testing.assert_close(back_on, after[1], atol=1e-6, rtol=0)

        # The 2-rank actor streams its weights to this process (playing rollout).
        stub = two.stub
        spec = stub.OpenWeightGroup(
            common_pb2.WeightGroupSpec(transport="gloo", world_size=2, timeout_s=30), timeout=10
        )
        thread, box = join_in_background(GroupSpec.from_proto(spec), rank=1)
        stub.JoinWeightGroup(common_pb2.JoinWeightGroupRequest(spec=spec), timeout=60)
        thread.join(60)
        assert "group" in box, box.get("error")
        manifest = WeightManifest.from_proto(
            stub.PrepareWeights(
                trainer_pb2.PrepareWeightsRequest(version=1, dtype="float32"), timeout=30
            )
        )
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(
                lambda: stub.SendWeights(trainer_pb2.SendWeightsRequest(version=1), timeout=120)
            )
            received = {name: t.clone() for name, t in receive_weights(box["group"], manifest)}
            sending.result()
        box["group"].close()

        # The 1-rank actor's checkpoint, loaded here, merges to the same weights.
        path = str(tmp_path / "one_rank_ckpt")
        one.stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=path), timeout=120)
    single = ActorRole.build(cfg, world)
    single.load(path, with_optimizer=False)
    merged = dict(single.iter_full_params())
    assert list(received) == list(merged)
    assert not any("lora" in name or "base_layer" in name for name in received)
    worst = max((received[n] - t).abs().max().item() for n, t in merged.items())
    assert worst < 1e-5, worst
