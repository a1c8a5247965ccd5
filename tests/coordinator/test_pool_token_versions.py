"""The weight version of each response token through the rollout pool into GeneratedBatch:
joined from the requests (filled from a request's weight_version where it sent none),
mixed versions accepted only in fully async mode, a response that spans a weight update
keeping its tokens' versions and behaviour log-probs; the dispatch gate around a sync."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshrl.ragged import Ragged
from services.coordinator.generation.dispatch_gate import DispatchGate
from services.coordinator.generation.rollout_pool import RolloutPool
from services.coordinator.generation.staleness import sample_lags
from services.coordinator.roles.roles import Roles
from services.coordinator.step.ppo_step import PPOStep
from services.rollout.types import GenerationResult, SamplingParams
from tests.coordinator.test_rollout_pool import StandIn, batch, pool_of
from tests.coordinator.test_run_bookkeeping import make_run

SAMPLING = SamplingParams(max_tokens=3, n=1, seed=1)


class SpanningReplica:
    """Answers each prompt [p] with 3 tokens; the first request's responses span a weight
    update after their first token (versions 3, 4, 4; behaviour log-probs -0.5, -1.0,
    -1.5, each recorded by the version that sampled it), the next are all of version 4."""

    def __init__(self) -> None:
        self.calls = 0

    def generate(self, prompts: Ragged, sampling: SamplingParams) -> GenerationResult:
        self.calls += 1
        rows = [[p[0], 7, 8] for p in prompts.tolist()]
        spans = self.calls == 1
        return GenerationResult(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists([[-0.5, -1.0, -1.5]] * len(rows), dtype=torch.float32),
            finish_reasons=["length"] * len(rows),
            weight_version=4,
            token_versions=Ragged.from_lists([[3, 4, 4]] * len(rows), dtype=torch.int64)
            if spans
            else None,
        )


def test_token_versions_are_joined_and_filled_from_each_requests_version():
    pool = RolloutPool({"rollout0": SpanningReplica()}, 1, prompts_per_request=2)
    out = pool.generate(batch(4), SAMPLING)
    assert out.token_versions is not None and out.token_versions.values.dtype == torch.int64
    assert out.token_versions.tolist() == [[3, 4, 4], [3, 4, 4], [4, 4, 4], [4, 4, 4]]
    assert torch.equal(out.token_versions.offsets, out.responses.offsets)  # aligned


def test_requests_of_other_versions_are_refused_unless_a_sync_may_land_in_the_batch():
    pool = pool_of(StandIn("a:1", 0.01, version=3), StandIn("b:1", 0.01, version=4))
    with pytest.raises(RuntimeError, match="different weight versions"):
        pool.generate(batch(4), SAMPLING)
    out = pool.generate(batch(4), SAMPLING, mixed_versions=True)
    assert out.weight_version == 4
    assert sorted({v for row in out.token_versions.tolist() for v in row}) == [3, 4]


def test_a_response_spanning_a_weight_update_keeps_its_versions_and_behaviour_logprobs(
    tmp_path,
):
    run = make_run(tmp_path, ["actor_rollout_ref.rollout.prompts_per_request=1"])
    step = PPOStep(run.cfg, Roles([SpanningReplica()], actor=None, reward=None), None, None, None)

    class Record:
        def __init__(self, i):
            self.prompt_ids, self.data_source, self.ground_truth = [i], "x", ""
            self.extra_info, self.chat = {}, None

    rollout_batch = step.generate_async([Record(0), Record(1)], step=5)
    # prompt 0's request spanned the update, prompt 1's came after it
    assert rollout_batch.versions().tolist() == [[3, 4, 4], [4, 4, 4]]
    assert rollout_batch.rollout_logprobs.tolist() == [[-0.5, -1.0, -1.5]] * 2
    # staleness from the oldest token: step 5 trains the actor of version 4
    oldest = rollout_batch.sample_versions()
    assert oldest.tolist() == [3, 4]
    assert sample_lags(oldest, actor_version=4).tolist() == [1, 0]
    # and they travel with their group through select_groups / concat
    again = type(rollout_batch).concat([rollout_batch.select_groups([1, 0])])
    assert again.versions().tolist() == [[4, 4, 4], [3, 4, 4]]


def test_the_gate_holds_new_requests_and_waits_for_those_out():
    gate = DispatchGate()
    assert gate.try_enter()  # one request out
    waited = []

    def sync():
        with gate.closed() as seconds:
            waited.append(seconds)
            assert not gate.try_enter()  # none goes out while closed

    t = threading.Thread(target=sync)
    t.start()
    time.sleep(0.1)
    assert not waited  # the sync waits for the request out
    gate.leave()
    t.join(5)
    assert waited and waited[0] >= 0.1
    assert gate.is_open and gate.try_enter()


def test_a_pool_generation_waits_at_the_closed_gate_then_goes_on():
    replica = StandIn("a:1", 0.0)
    pool = pool_of(replica)
    done = []
    with pool.gate.closed():
        t = threading.Thread(target=lambda: done.append(pool.generate(batch(4), SAMPLING)))
        t.start()
        time.sleep(0.1)
        assert replica.requests == [] and not done  # nothing sent while the sync runs
    t.join(5)
    assert len(done) == 1 and len(done[0].responses) == 4
