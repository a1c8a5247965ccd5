"""The rollout server's Prometheus endpoint, as a user starts it: `meshrl serve rollout
--metrics-port PORT` in a process of its own, scraped over HTTP before Initialize, after
Generate calls and after a weight sync."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshrl.api.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.ports import free_port
from meshrl.ragged import Ragged
from meshrl.rpc.client import open_channel, wait_for_health
from meshrl.testing.tiny_model import make_tiny_model_dir
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights
from meshrl.wire import ragged_from_proto, ragged_to_proto
from services.rollout.convert import FINISH_FROM_PROTO
from services.rollout.native.engine import NativeEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[1, 4, 5, 6], [1, 7], [1, 8, 9]]
ROLLOUT = "meshrl.api.v1.RolloutService"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rollout_metrics")
    port, metrics_port = free_port(), free_port()
    log = open(folder / "rollout.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrl_app.cli", "serve", "rollout"]
        + ["--port", str(port), "--metrics-port", str(metrics_port)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for_health(address, "", timeout_s=60, alive=lambda: proc.poll() is None)
        channel = open_channel(address)
        yield (
            rollout_pb2_grpc.RolloutServiceStub(channel),
            f"http://127.0.0.1:{metrics_port}/metrics",
            make_tiny_model_dir(folder / "model", seed=0),
            folder / "rollout.log",
        )
        channel.close()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _sync(stub, model, version: int) -> None:
    """Plays the actor over gloo, as tests/services/rollout/test_rollout_server.py does."""
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=30, world_size=2)
    peer = GroupSpec(**{**spec.__dict__, "rank": 1})
    joined = stub.JoinWeightGroup.future(
        common_pb2.JoinWeightGroupRequest(spec=peer.to_proto()), timeout=60
    )
    group = WeightGroup.join(spec, store)
    joined.result()
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    manifest = WeightManifest(version, plan_buckets(named, torch.float32, 32 * 1024), spec.group_id)
    result = stub.ReceiveWeights.future(manifest.to_proto(), timeout=60)
    send_weights(group, ((n, p.detach()) for n, p in model.named_parameters()), manifest)
    try:
        result.result()
    finally:
        group.close()


def test_tokens_weight_version_and_calls_are_scraped(server):
    stub, url, model_dir, log_path = server
    assert value(scrape(url), "meshrl_rollout_weight_version") == -1  # before Initialize
    assert f"metrics on {url}" in log_path.read_text()  # said where to scrape

    cfg = {"actor_rollout_ref": {"model": {"path": str(model_dir)}}}
    stub.Initialize(
        common_pb2.InitializeRequest(config_yaml=config_to_yaml(build_config(cfg))), timeout=120
    )
    assert value(scrape(url), "meshrl_rollout_weight_version") == 0

    before = scrape(url)
    replies = [
        stub.Generate(
            rollout_pb2.GenerateRequest(
                prompts=ragged_to_proto(Ragged.from_lists(PROMPTS)),
                sampling=rollout_pb2.SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3),
            ),
            timeout=60,
        )
        for _ in range(2)
    ]
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    generated = sum(ragged_from_proto(r.responses).values.numel() for r in replies)
    assert moved("meshrl_rollout_generated_tokens_total") == generated > 0
    assert moved("meshrl_rollout_prompt_tokens_total") == 2 * sum(map(len, PROMPTS))
    reasons = [FINISH_FROM_PROTO[r] for reply in replies for r in reply.finish_reasons]
    for reason in set(reasons):
        assert moved("meshrl_rollout_generated_sequences_total", finish_reason=reason) == (
            reasons.count(reason)
        )
    assert len(reasons) == 2 * 2 * len(PROMPTS)

    unary = {"grpc_service": ROLLOUT, "grpc_method": "Generate", "grpc_type": "unary"}
    assert moved("grpc_server_handled_total", **unary, grpc_code="OK") == 2
    assert moved("grpc_server_handling_seconds_count", **unary) == 2
    assert value(after, "process_resident_memory_bytes") > 50 * 2**20  # torch and a model

    _sync(stub, NativeEngine(str(model_dir)).runner.model, version=7)
    assert value(scrape(url), "meshrl_rollout_weight_version") == 7
