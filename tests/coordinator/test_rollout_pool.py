"""RolloutPool: requests to the least-loaded replica, joined in prompt order, seeded by their
place in the batch; a replica that goes down leaves and its requests go to the others."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from services.coordinator.generation.rollout_pool import (
    REQUEST_SEED_STRIDE,
    RolloutPool,
    prompts_per_request,
)
from services.rollout.types import GenerationResult, SamplingParams


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "stand-in"


def call_error(code: grpc.StatusCode, address: str = "x:1") -> RoleCallError:
    return RoleCallError("rollout", address, "Generate", _RpcError(code))


class StandIn:
    """A replica that takes ``per_prompt_s`` a prompt and answers prompt p of a request with
    [p, seed + row]: what it samples depends on the request's seed and the row in it only.
    One request at a time, as a real replica's engine lock has it."""

    def __init__(self, address: str, per_prompt_s: float = 0.0, version: int = 3):
        self.address = address
        self.per_prompt_s = per_prompt_s
        self.version = version
        self.requests: list[list[int]] = []  # the first token of each prompt served
        self.fail_on: dict[int, grpc.StatusCode] = {}  # call index -> the error it raises
        self._engine = threading.Lock()

    def generate(self, prompts: Ragged, sampling: SamplingParams) -> GenerationResult:
        call = len(self.requests)
        self.requests.append([row[0] for row in prompts.tolist()])
        if call in self.fail_on:
            raise call_error(self.fail_on[call], self.address)
        with self._engine:
            time.sleep(self.per_prompt_s * len(prompts))
        seed = sampling.seed or 0
        rows = [[row[0], seed + r] for r, row in enumerate(prompts.tolist())]
        return GenerationResult(
            responses=Ragged.from_lists(rows),
            logprobs=Ragged.from_lists([[0.0, 0.0] for _ in rows], dtype=torch.float32),
            finish_reasons=["length"] * len(rows),
            weight_version=self.version,
        )


def pool_of(*replicas: StandIn, per_request: int | None = 2) -> RolloutPool:
    return RolloutPool(
        {f"rollout{i}": r for i, r in enumerate(replicas)}, len(replicas), per_request
    )


def batch(b: int) -> Ragged:
    return Ragged.from_lists([[p, 1] for p in range(b)])


SAMPLING = SamplingParams(max_tokens=2, n=1, seed=41)


def test_a_fast_replica_takes_more_requests_and_the_order_is_kept():
    fast, slow = StandIn("fast:1", 0.002), StandIn("slow:1", 0.05)
    pool = pool_of(fast, slow)
    out = pool.generate(batch(24), SAMPLING)  # 12 requests of 2 prompts
    assert [row[0] for row in out.responses.tolist()] == list(range(24))  # joined in order
    # the slow one holds a request 0.1 s; the fast one serves its 2 in flight in 0.008 s
    assert len(fast.requests) >= 8 > len(slow.requests) >= 1, (fast.requests, slow.requests)
    served = sorted(p for r in (fast, slow) for req in r.requests for p in req)
    assert served == list(range(24))  # every prompt once
    metrics = pool.metrics()
    assert metrics["rollout/replicas"] == 2 and metrics["rollout/resent_requests"] == 0
    assert metrics["rollout/replica/0/requests"] == len(fast.requests)
    assert metrics["rollout/replica/0/tokens_per_s"] > metrics["rollout/replica/1/tokens_per_s"]
    assert pool.metrics()["rollout/replica/0/requests"] == 0  # read once per step


def test_each_replica_holds_at_most_two_requests_and_the_least_loaded_gets_the_next():
    replicas = [StandIn(f"r{i}:1", 0.01) for i in range(3)]
    pool = pool_of(*replicas)
    pool.generate(batch(12), SAMPLING)  # 6 requests: 2 each, in flight at once
    assert [len(r.requests) for r in replicas] == [2, 2, 2]
    assert replicas[0].requests[0] == [0, 1] and replicas[1].requests[0] == [2, 3]


def test_what_is_sampled_does_not_depend_on_the_replica_that_served_it():
    """Request j is seeded seed + j * stride wherever it runs: one replica, or three of
    different speeds, give the same responses."""
    alone = pool_of(StandIn("a:1")).generate(batch(10), SAMPLING)
    spread = pool_of(StandIn("b:1", 0.02), StandIn("c:1"), StandIn("d:1", 0.005)).generate(
        batch(10), SAMPLING
    )
    assert alone.responses.tolist() == spread.responses.tolist()
    # prompt 4 is row 0 of request 2 (2 prompts a request)
    assert alone.responses.tolist()[4] == [4, 41 + 2 * REQUEST_SEED_STRIDE]
    assert SAMPLING.seed == 41  # the caller's params untouched


def test_an_unset_seed_stays_unset_on_every_request():
    seeds = []

    class Recorder(StandIn):
        def generate(self, prompts, sampling):
            seeds.append(sampling.seed)
            return super().generate(prompts, sampling)

    pool_of(Recorder("a:1"), Recorder("b:1")).generate(batch(4), SamplingParams())
    assert seeds == [None, None]


def test_a_replica_that_goes_down_leaves_and_its_requests_are_sent_again():
    steady, dying, other = StandIn("s:1", 0.005), StandIn("d:1", 0.005), StandIn("o:1", 0.005)
    dying.fail_on = {1: grpc.StatusCode.UNAVAILABLE, 2: grpc.StatusCode.UNAVAILABLE}
    pool = pool_of(steady, dying, other)
    out = pool.generate(batch(20), SAMPLING)
    assert [row[0] for row in out.responses.tolist()] == list(range(20))  # no prompt lost
    # the same responses as a pool where nothing failed: the re-sent requests kept their seeds
    clean = pool_of(StandIn("a:1")).generate(batch(20), SAMPLING)
    assert out.responses.tolist() == clean.responses.tolist()
    assert len(dying.requests) == 2  # its second call failed, and it took no more
    assert pool.take_departed() == ["rollout1"] and pool.take_departed() == []
    assert pool.names == ["rollout0", "rollout2"]
    metrics = pool.metrics()
    assert metrics["rollout/replicas"] == 2 and metrics["rollout/resent_requests"] == 1


def test_the_generation_fails_only_when_no_replica_is_left():
    a, b = StandIn("a:1"), StandIn("b:1")
    a.fail_on = {0: grpc.StatusCode.UNAVAILABLE}
    b.fail_on = {0: grpc.StatusCode.UNAVAILABLE}
    pool = pool_of(a, b)
    with pytest.raises(RoleCallError, match="UNAVAILABLE"):
        pool.generate(batch(4), SAMPLING)
    assert sorted(pool.take_departed()) == ["rollout0", "rollout1"] and len(pool) == 0


def test_a_call_refused_for_its_request_fails_the_generation_and_the_replica_stays():
    a, b = StandIn("a:1"), StandIn("b:1")
    a.fail_on = {0: grpc.StatusCode.INVALID_ARGUMENT}
    pool = pool_of(a, b)
    with pytest.raises(RoleCallError, match="INVALID_ARGUMENT"):
        pool.generate(batch(4), SAMPLING)
    assert pool.take_departed() == [] and len(pool) == 2


def test_replicas_serving_different_weight_versions_are_refused():
    pool = pool_of(StandIn("a:1", version=3), StandIn("b:1", version=2))
    with pytest.raises(RuntimeError, match="different weight versions"):
        pool.generate(batch(4), SAMPLING)


def test_a_removed_replica_takes_no_new_request_and_an_added_one_does():
    a, b, c = StandIn("a:1"), StandIn("b:1"), StandIn("c:1")
    pool = pool_of(a, b)
    pool.remove("rollout1")
    pool.add("rollout2", c)
    pool.generate(batch(8), SAMPLING)
    assert b.requests == [] and c.requests and a.requests
    assert pool.metrics()["rollout/replicas"] == 2


def test_request_size_defaults_to_the_batch_for_one_replica_and_a_quarter_share_for_more():
    assert prompts_per_request(None, 64, 1) == 64
    assert prompts_per_request(None, 64, 2) == 8  # 4 requests a replica
    assert prompts_per_request(None, 10, 3) == 1
    assert prompts_per_request(5, 64, 3) == 5
    assert prompts_per_request(None, 0, 1) == 1
    out = pool_of(StandIn("a:1"), per_request=None).generate(Ragged.from_lists([]), SAMPLING)
    assert len(out.responses) == 0


def test_validation_waits_are_said_as_validation_not_as_the_steps_generate():
    """A validation's Generate requests run in the pool's threads with the caller's purpose:
    a long one is said `rollout Generate for validation at step 2 (10 s)`. Before, the
    progress line named it `rollout Generate (10 s)`, as if the step generated."""
    from meshrl.rpc.calls_in_flight import CALL_PURPOSE, CallsInFlight, calls_for

    seen: list[str] = []
    calls = CallsInFlight()

    class Tracked(StandIn):
        def generate(self, prompts, sampling):
            seen.append(CALL_PURPOSE.get())
            with calls.track("rollout", self.address, "Generate"):
                time.sleep(0.05)
                seen.append(calls.long_calls_line(0.01) or "")
                return super().generate(prompts, sampling)

    pool = pool_of(Tracked("r:1"), per_request=4)
    with calls_for("validation at step 2"):
        pool.generate(batch(4), SAMPLING)
    assert seen[0] == "validation at step 2"
    assert seen[1].startswith("still waiting: rollout Generate for validation at step 2 ("), seen
    seen.clear()
    pool.generate(batch(4), SAMPLING)  # the step's own
    assert seen[0] == "" and seen[1].startswith("still waiting: rollout Generate ("), seen
