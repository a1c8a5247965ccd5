"""A Megatron actor on 2 data-parallel ranks (torchrun, gloo; tensor and pipeline size 1)
against one on 1 rank, over gRPC: the same log-probs, and the same update (DDP averages the
gradients as FSDP2 reduces them)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from trainer_helpers import batch_to_proto, initialized_actors, make_batch, trainer_config

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.wire import tensor_from_proto, tensor_to_proto

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# 9 rows in mini-batches of 4: the last has one row, so rank 1 runs a weight-0 micro-batch.
BATCH = make_batch(9, seed=21)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    cfg = trainer_config(tiny_model_dir, ["actor_rollout_ref.actor.strategy=megatron",
                                          "actor_rollout_ref.actor.ppo_epochs=2"])  # fmt: skip
    logs = tmp_path_factory.mktemp("megatron_actors")
    with initialized_actors(logs, [("one_rank", 1, cfg), ("two_ranks", 2, cfg)]) as pair:
        yield pair


def test_two_data_parallel_ranks_score_and_update_as_one(servers):
    one, two = servers
    request = common_pb2.LogProbsRequest(batch=batch_to_proto(BATCH))
    lp1, lp2 = (tensor_from_proto(s.stub.ComputeLogProbs(request, timeout=120).logprobs)
                for s in servers)  # fmt: skip
    torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=0)
    update = trainer_pb2.PolicyUpdateRequest(
        batch=batch_to_proto(BATCH),
        old_logprobs=tensor_to_proto(lp1),
        advantages=tensor_to_proto(torch.linspace(-1.0, 1.0, lp1.numel())),
        global_step=1,
    )
    with ThreadPoolExecutor(2) as pool:
        m1, m2 = pool.map(lambda s: dict(s.stub.UpdatePolicy(update, timeout=120).metrics), servers)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    after1, after2 = (tensor_from_proto(s.stub.ComputeLogProbs(request, timeout=120).logprobs)
                      for s in servers)  # fmt: skip
    assert (after1 - lp1).abs().max() > 1e-4  # the update moved the weights
    torch.testing.assert_close(after2, after1, atol=1e-5, rtol=0)
