"""Token-budget, padding-free micro-batches on 2 FSDP ranks (torchrun) against fixed-row,
padded ones on 1 rank, over gRPC: same log-probs, same update."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from trainer_helpers import batch_to_proto, initialized_actors, make_batch, trainer_config

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.wire import tensor_from_proto, tensor_to_proto

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

COMMON = ["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.entropy_coeff=0.01"]
PACKED = [
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.model.use_remove_padding=true",
    # 14 tokens: one or two of these rows (4-9 tokens) per micro-batch, and the ranks'
    # shares need different counts, so one splits a micro-batch to match the other's.
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=14",
]
BATCH = make_batch(11, seed=31)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    logs = tmp_path_factory.mktemp("packed_actors")
    with initialized_actors(logs, [
        ("padded_one_rank", 1, trainer_config(tiny_model_dir, COMMON)),
        ("packed_two_ranks", 2, trainer_config(tiny_model_dir, COMMON + PACKED)),
    ]) as pair:  # fmt: skip
        yield pair


def _log_probs(server):
    request = common_pb2.LogProbsRequest(batch=batch_to_proto(BATCH), with_entropy=True)
    response = server.stub.ComputeLogProbs(request, timeout=120)
    return tensor_from_proto(response.logprobs), tensor_from_proto(response.entropy)


def test_packed_two_ranks_score_and_update_like_padded_one_rank(servers):
    padded, packed = servers
    lp1, ent1 = _log_probs(padded)
    lp2, ent2 = _log_probs(packed)
    torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent2, ent1, atol=1e-5, rtol=0)

    request = trainer_pb2.PolicyUpdateRequest(
        batch=batch_to_proto(BATCH),
        old_logprobs=tensor_to_proto(lp1),
        advantages=tensor_to_proto(torch.linspace(-1.0, 1.0, lp1.numel())),
        global_step=1,
    )
    with ThreadPoolExecutor(2) as pool:
        m1, m2 = pool.map(
            lambda s: dict(s.stub.UpdatePolicy(request, timeout=120).metrics), servers
        )
    assert set(m1) == set(m2)
    for key in m1:
        if not key.startswith("perf/"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-5), key
    after1, _ = _log_probs(padded)
    after2, _ = _log_probs(packed)
    torch.testing.assert_close(after2, after1, atol=1e-4, rtol=0)
    assert (after1 - lp1).abs().max() > 1e-3
