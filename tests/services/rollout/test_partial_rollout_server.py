"""Partial rollouts through a real rollout server process: a weight sync over gloo lands
while a Generate runs; the responses that span it carry, token by token, the version and the
log-prob of the weights that sampled them (``partial_rollout_checks.py`` says what equals
what). Without partial rollouts the sync waits for the Generate, as it always did.

Greedy decoding of the tiny random model runs some responses to the 900 tokens allowed
(seconds on a CPU), so the sync, sent once the server logs that Generate started, lands
mid-way without a test hook.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from partial_rollout_checks import (
    full_forward_logprobs,
    keep_logprobs,
    response_rows,
    split_point,
)
from rollout_server_process import Server, sync_weights, wait_for_log

from meshrl.api.v1 import common_pb2, rollout_pb2
from meshrl.config import build_config, config_to_yaml
from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights
from meshrl.wire import ragged_to_proto
from services.rollout.convert import generation_from_proto
from services.rollout.native.engine import NativeEngine
from services.rollout.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9]]
MAX_TOKENS = 900


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Plain engines on the weights served first (version 0) and synced mid-call (1)."""
    root = tmp_path_factory.mktemp("models")
    dirs = [make_tiny_model_dir(root / name, seed=seed, max_positions=1024) for name, seed in
            [("a", 0), ("b", 1)]]  # fmt: skip
    return NativeEngine(str(dirs[0])), NativeEngine(str(dirs[1]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("logs") / "rollout.log")
    try:
        yield srv
    finally:
        srv.stop()


def _initialize(server, model_dir: str, **rollout) -> None:
    """Loads version 0 afresh, with the rollout settings given."""
    tree = {
        "actor_rollout_ref": {"model": {"path": model_dir}, "rollout": rollout},
        "data": {"max_prompt_length": 16, "max_response_length": MAX_TOKENS},
    }
    request = common_pb2.InitializeRequest(config_yaml=config_to_yaml(build_config(tree)))
    server.stub.Initialize(request, timeout=120)


def _generate_across_a_sync(server, new_model):
    """A greedy Generate with a sync to version 1 sent once it has started; returns the
    result and when (monotonic) the Generate's reply and the sync's came."""
    started = len(re.findall(r"rpc Generate #\d+ started", server.log_path.read_text()))
    request = rollout_pb2.GenerateRequest(
        prompts=ragged_to_proto(Ragged.from_lists(PROMPTS)),
        sampling=rollout_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=1),
    )
    call = server.stub.Generate.future(request, timeout=180)
    replied: list[float] = []
    call.add_done_callback(lambda _: replied.append(time.monotonic()))
    wait_for_log(server, f"rpc Generate #{started + 1} started")
    assert sync_weights(server, new_model, version=1).version == 1
    synced_at = time.monotonic()
    result = generation_from_proto(call.result())
    return result, replied[0], synced_at


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_response_spanning_a_sync_has_each_tokens_version_and_logprob(server, engines, kv):
    old, new = engines
    _initialize(server, old.model_path, partial_rollout=True, partial_rollout_kv=kv)
    result, replied_at, synced_at = _generate_across_a_sync(server, new.runner.model)
    assert synced_at < replied_at  # the sync did not wait for the generation
    assert result.weight_version == 1 and result.token_versions is not None
    spans = 0
    for i, (response, versions, lps) in enumerate(response_rows(result)):
        k = split_point(versions, 0, 1)  # one switch, 0 -> 1, at a token boundary
        lps = torch.tensor(lps)
        if k:  # greedy: log-probs at temperature 1
            want = full_forward_logprobs(old, PROMPTS[i], response, 1.0)[:k]
            torch.testing.assert_close(lps[:k], want, atol=1e-5, rtol=0)
        if 0 < k < len(response):
            spans += 1
            if kv == "keep":
                want = keep_logprobs(old, new, PROMPTS[i], response, k, 1.0)
            else:
                want = full_forward_logprobs(new, PROMPTS[i], response, 1.0)[k:]
            torch.testing.assert_close(lps[k:], want, atol=1e-5, rtol=0)
    assert spans, "no response spans the sync: it landed before or after the generation"
    assert "swapped in mid-generation" in server.log_path.read_text()


def test_without_partial_rollouts_the_sync_waits_for_the_generation(server, engines):
    old, new = engines
    _initialize(server, old.model_path, partial_rollout=False)
    result, replied_at, synced_at = _generate_across_a_sync(server, new.runner.model)
    assert replied_at < synced_at  # the sync waited for the generation
    assert result.weight_version == 0 and result.token_versions is None
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = old.generate(Ragged.from_lists(PROMPTS), greedy)
    assert result.responses.tolist() == want.responses.tolist()


class _DeltaActor:
    """Plays the actor of one group kept across syncs, with delta syncs (as the publisher)."""

    def __init__(self, server):
        self.server = server
        store, spec = WeightGroup.open("127.0.0.1", timeout_s=30, world_size=2)
        peer = GroupSpec(**{**spec.__dict__, "rank": 1})
        joined = server.stub.JoinWeightGroup.future(
            common_pb2.JoinWeightGroupRequest(spec=peer.to_proto()), timeout=60
        )
        self.group = WeightGroup.join(spec, store)
        assert joined.result().group_id == spec.group_id

    def sync(self, model, version: int) -> tuple[common_pb2.WeightSyncResult, WeightManifest]:
        named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        buckets = plan_buckets(named, torch.float32, 32 * 1024)
        manifest = WeightManifest(version, buckets, self.group.group_id, delta=True)
        if self.group.delta_state is not None:
            manifest.base_version = self.group.delta_state.base_for(manifest)
        result = self.server.stub.ReceiveWeights.future(manifest.to_proto(), timeout=60)
        send_weights(self.group, ((n, p.detach()) for n, p in model.named_parameters()), manifest)
        return result.result(), manifest


def test_a_delta_sync_lands_mid_generation_at_a_token_boundary(server, engines):
    """Partial rollouts with delta syncs: a full sync of the served weights (version 1),
    then a delta to the other model's (version 2) sent while a Generate runs; the tokens
    after the switch have the log-probs of the new weights."""
    old, new = engines
    _initialize(server, old.model_path, partial_rollout=True, partial_rollout_kv="recompute")
    actor = _DeltaActor(server)
    try:
        first, manifest = actor.sync(old.runner.model, version=1)
        assert first.version == 1 and manifest.base_version == -1
        started = len(re.findall(r"rpc Generate #\d+ started", server.log_path.read_text()))
        request = rollout_pb2.GenerateRequest(
            prompts=ragged_to_proto(Ragged.from_lists(PROMPTS)),
            sampling=rollout_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=1),
        )
        call = server.stub.Generate.future(request, timeout=180)
        wait_for_log(server, f"rpc Generate #{started + 1} started")
        second, manifest = actor.sync(new.runner.model, version=2)
        assert second.version == 2 and manifest.base_version == 1
        result = generation_from_proto(call.result())
    finally:
        actor.group.close()
    assert result.token_versions is not None
    spans = 0
    for i, (response, versions, lps) in enumerate(response_rows(result)):
        k = split_point(versions, 1, 2)
        if 0 < k < len(response):
            spans += 1
            want = full_forward_logprobs(new, PROMPTS[i], response, 1.0)[k:]
            torch.testing.assert_close(torch.tensor(lps[k:]), want, atol=1e-5, rtol=0)
    assert spans, "no response spans the sync: it landed before or after the generation"
