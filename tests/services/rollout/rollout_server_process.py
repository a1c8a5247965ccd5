"""A rollout server in a process of its own, for the tests that talk to one over gRPC: start
and stop it, read its log, and play the actor of a weight sync over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshrl.api.v1 import common_pb2, rollout_pb2_grpc
from meshrl.launcher.ports import free_port
from meshrl.rpc.client import open_channel, wait_for_health
from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, plan_buckets, send_weights

REPO = Path(__file__).resolve().parents[3]


class Server:
    def __init__(self, log_path: Path):
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.rollout.server", "--port", self.address.split(":")[1]],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.channel = None
        try:
            wait_for_health(self.address, "", timeout_s=60, alive=lambda: self.proc.poll() is None)
        except Exception:
            self.stop()
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}") from None
        self.channel = open_channel(self.address)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def sync_weights(server, model, version: int) -> common_pb2.WeightSyncResult:
    """Plays the actor over gloo: a fresh group each time, as after every (re)formation."""
    store, spec = WeightGroup.open("127.0.0.1", timeout_s=30, world_size=2)
    peer = GroupSpec(**{**spec.__dict__, "rank": 1})
    joined = server.stub.JoinWeightGroup.future(
        common_pb2.JoinWeightGroupRequest(spec=peer.to_proto()), timeout=60
    )
    group = WeightGroup.join(spec, store)
    assert joined.result().group_id == spec.group_id
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    manifest = WeightManifest(version, plan_buckets(named, torch.float32, 32 * 1024), spec.group_id)
    result = server.stub.ReceiveWeights.future(manifest.to_proto(), timeout=60)
    send_weights(group, ((n, p.detach()) for n, p in model.named_parameters()), manifest)
    try:
        return result.result()
    finally:
        group.close()


def wait_for_log(srv: Server, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in srv.log_path.read_text():
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the server log:\n{srv.log_path.read_text()}")
        time.sleep(0.05)
