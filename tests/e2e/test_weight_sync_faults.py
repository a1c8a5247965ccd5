"""A peer killed (SIGKILL) in the middle of a weight sync, with real server processes.

The actor sleeps before every bucket after the first (the test hook
``MESHRL_TEST_SYNC_DELAY_S``) and the buckets are 8 KiB, so a sync of the tiny model takes
several seconds and the kill surely lands while buckets are moving. Each test then checks
that the survivor comes back usable within the collective timeout, restarts the dead
server, and that the coordinator's ``WeightSyncer`` forms a new group (fresh port) through
which a sync succeeds: the rollout's log-probs of fixed sequences equal the actor's.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from meshrl.config import build_config, config_to_yaml
from meshrl.launcher.local import LocalLauncher
from meshrl.ragged import Ragged
from meshrl.rpc.role_client import RoleCallError
from meshrl.weight_sync.sender import TEST_DELAY_ENV
from services.coordinator.generation.weight_sync import WeightSyncer
from services.rollout.client import RolloutClient
from services.rollout.types import SamplingParams
from services.trainer.client import TrainerClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TIMEOUT_S = 20.0  # weight_sync.timeout_s: every collective of the group
BUCKET_BYTES = 8 * 1024
DELAY_S = 0.5  # per bucket after the first: a sync of ~12 buckets takes ~6 s
KILL_AFTER_S = 1.5


def _config(tiny_model, tmp_path):
    return build_config({}, [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"trainer.default_local_dir={tmp_path}",
        f"actor_rollout_ref.rollout.weight_sync.timeout_s={TIMEOUT_S}",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=0.05", "critic.enable=false",
    ])  # fmt: skip


def _fixed_sequences():
    prompts = Ragged.from_lists([[1, 20, 21, 19, 6, 7, 14, 9, 12, 17], [1, 20, 21, 19, 5, 5, 14]])
    responses = Ragged.from_lists([[6, 9, 14, 9, 12, 17, 8, 5], [5, 5, 14, 2]])
    return prompts, responses


class Mesh:
    """One actor and one rollout server (plus the launcher's reward server), initialized."""

    def __init__(self, launcher: LocalLauncher, cfg):
        self.launcher = launcher
        self.text = config_to_yaml(cfg)
        endpoints = launcher.start()
        self.actor = TrainerClient(endpoints.actor, 60, "actor")
        self.rollout = RolloutClient(endpoints.rollout[0], 60)
        self.actor.initialize(self.text)
        self.rollout.initialize(self.text)
        self.syncer = WeightSyncer(cfg, self.actor, [self.rollout], bucket_bytes=BUCKET_BYTES)
        self.pool = ThreadPoolExecutor(2)

    def move_actor(self) -> None:
        """One PPO update, so the actor's weights differ from those on disk."""
        prompts, responses = _fixed_sequences()
        old, _ = self.actor.compute_log_probs(prompts, responses, 1.0)
        adv = responses.with_values(torch.ones_like(old.values))
        self.actor.update_policy(prompts, responses, old, adv, global_step=1)

    def start_sync(self, version: int):
        """A sync driven call by call (as WeightSyncer does), to watch each side's outcome."""
        manifest = self.actor.prepare_weights(version, "float32", BUCKET_BYTES)
        assert manifest.group_id == self.syncer.group_id
        assert len(manifest.buckets) >= 8, "the sync must be long enough to be interrupted"
        deadline = TIMEOUT_S * len(manifest.buckets) + 30
        send = self.pool.submit(self.actor.send_weights, version, deadline)
        receive = self.pool.submit(self.rollout.receive_weights, manifest, deadline)
        return send, receive

    def kill(self, name: str) -> float:
        proc = self.launcher.processes[name].popen
        os.killpg(proc.pid, signal.SIGKILL)  # the server's own session: its children too
        proc.wait()
        return time.monotonic()

    def assert_rollout_matches_actor(self, version: int) -> None:
        prompts, responses = _fixed_sequences()
        want, _ = self.actor.compute_log_probs(prompts, responses, 1.0)
        got = self.rollout.compute_log_probs(prompts, responses, 1.0)
        diff = (got.values - want.values).abs().max()
        assert diff <= 1e-4, diff
        assert self.rollout.info().weight_version == version

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.syncer.close()


@pytest.fixture
def mesh(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_DELAY_ENV, str(DELAY_S))  # the servers inherit it
    cfg = _config(tiny_model, tmp_path)
    with LocalLauncher(cfg, tmp_path) as launcher:
        mesh = Mesh(launcher, cfg)
        try:
            yield mesh
        finally:
            mesh.close()


def _failure(future, within_s: float) -> RoleCallError:
    with pytest.raises(RoleCallError) as info:
        future.result(timeout=within_s)
    return info.value


def test_rollout_killed_mid_sync_then_resynced(mesh, monkeypatch):
    first = mesh.syncer.form_group()
    mesh.move_actor()
    send, receive = mesh.start_sync(version=1)
    time.sleep(KILL_AFTER_S)
    assert not send.done(), "the sync ended before the kill: make it longer"
    killed_at = mesh.kill("rollout0")

    # The actor's SendWeights fails within the collective timeout, with UNAVAILABLE ...
    error = _failure(send, within_s=TIMEOUT_S + 10)
    assert time.monotonic() - killed_at < TIMEOUT_S
    assert error.method == "SendWeights" and error.code == grpc.StatusCode.UNAVAILABLE, error
    _failure(receive, within_s=5)  # the rollout's call died with its server
    # ... and the actor stays usable.
    prompts, responses = _fixed_sequences()
    logprobs, _ = mesh.actor.compute_log_probs(prompts, responses, 1.0)
    assert torch.isfinite(logprobs.values).all()

    # A new rollout server on the same address; the syncer forms a new group and syncs.
    monkeypatch.delenv(TEST_DELAY_ENV)
    mesh.launcher.restart("rollout0")
    mesh.rollout.initialize(mesh.text)
    metrics = mesh.syncer.sync(version=2, retries=0)
    second = mesh.syncer.spec
    assert second.group_id != first.group_id and second.master_port != first.master_port
    assert metrics["weight_sync/version"] == 2
    mesh.assert_rollout_matches_actor(version=2)


def test_actor_killed_mid_sync_then_resynced(mesh, monkeypatch):
    first = mesh.syncer.form_group()
    send, receive = mesh.start_sync(version=1)
    time.sleep(KILL_AFTER_S)
    assert not receive.done(), "the sync ended before the kill: make it longer"
    killed_at = mesh.kill("actor")

    # The rollout's ReceiveWeights returns an error within the timeout ...
    error = _failure(receive, within_s=TIMEOUT_S + 10)
    assert time.monotonic() - killed_at < TIMEOUT_S
    assert error.method == "ReceiveWeights" and error.code == grpc.StatusCode.UNAVAILABLE, error
    _failure(send, within_s=5)
    # ... marks its weights as a mix of versions (some buckets were loaded) ...
    assert mesh.rollout.info().weight_version == -1
    # ... and keeps serving Generate, stamped with that version.
    prompts, _ = _fixed_sequences()
    sampling = SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=3)
    out = mesh.rollout.generate(prompts, sampling)
    assert len(out.finish_reasons) == 4 and out.weight_version == -1

    # A new actor (weights from disk, then one update); a new group; the sync succeeds.
    monkeypatch.delenv(TEST_DELAY_ENV)
    mesh.launcher.restart("actor")
    mesh.actor.initialize(mesh.text)
    mesh.move_actor()
    mesh.syncer.sync(version=5, retries=0)
    second = mesh.syncer.spec
    assert second.group_id != first.group_id and second.master_port != first.master_port
    mesh.assert_rollout_matches_actor(version=5)
