"""The coordinator's WeightSyncer against fake role clients: when it forms a group, when it
forms a new one, and that a failed sync has every member's call ended before it raises."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import torch

from meshrl.api.v1 import common_pb2
from meshrl.config import build_config
from meshrl.rpc.role_client import RoleCallError
from meshrl.weight_sync import GroupSpec, WeightManifest, plan_buckets
from services.coordinator.generation.weight_sync import WeightSyncer

pytestmark = pytest.mark.timeout(30)


class _RpcError(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="peer gone"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _error(service: str, method: str) -> RoleCallError:
    return RoleCallError(service, "127.0.0.1:1", method, _RpcError())


class FakeActor:
    """Holds at most one group, like WeightPublisher; loses it on a failed send."""

    def __init__(self):
        self.group_id = ""
        self.opened: list[GroupSpec] = []
        self.fail_next_send = False
        self.prepared: list[tuple[bool, bool]] = []  # (delta, full) of each PrepareWeights
        self.synced_in = ""  # the group of the last sync: a delta needs the same one

    def info(self):
        return common_pb2.ServerInfo(ready=True)

    def open_weight_group(self, transport, world_size, timeout_s):
        spec = GroupSpec(transport, "127.0.0.1", 20000 + len(self.opened), world_size, 0,
                         timeout_s, uuid.uuid4().hex)  # fmt: skip
        self.opened.append(spec)
        return spec

    def join_weight_group(self, spec):
        self.group_id = spec.group_id
        return spec.group_id

    def prepare_weights(self, version, dtype, bucket_bytes, delta=False, full=False):
        self.prepared.append((delta, full))
        buckets = plan_buckets([("w", (4,))], torch.float32, bucket_bytes)
        manifest = WeightManifest(version, buckets, self.group_id, delta=delta)
        if delta and not full and self.synced_in == self.group_id:
            manifest.base_version = version - 1
        return manifest

    def send_weights(self, version, timeout_s):
        if self.fail_next_send:
            self.fail_next_send = False
            self.group_id = self.synced_in = ""  # the publisher closes its group
            raise _error("actor", "SendWeights")
        delta = self.synced_in == self.group_id and not self.prepared[-1][1]
        self.synced_in = self.group_id
        return common_pb2.WeightSyncResult(
            version=version, seconds=0.5, bytes=16, delta=delta, changed=1, elements=4
        )


class FakeRollout:
    address = "127.0.0.1:2"

    def __init__(self, receive_s: float = 0.0):
        self.receive_s = receive_s
        self.joined: list[GroupSpec] = []
        self.received_done = threading.Event()
        self.dead = False

    def info(self):
        if self.dead:
            raise _error("rollout", "GetInfo")
        return common_pb2.ServerInfo(ready=True)

    def join_weight_group(self, spec):
        self.joined.append(spec)
        return spec.group_id

    def receive_weights(self, manifest, timeout_s):
        time.sleep(self.receive_s)
        self.received_done.set()
        return common_pb2.WeightSyncResult(version=manifest.version, seconds=0.1, bytes=16)


@pytest.fixture
def cfg():
    return build_config({}, ["actor_rollout_ref.rollout.weight_sync.timeout_s=5"])


def test_first_sync_forms_the_group_and_later_ones_reuse_it(cfg):
    actor, rollouts = FakeActor(), [FakeRollout(), FakeRollout()]
    syncer = WeightSyncer(cfg, actor, rollouts, bucket_bytes=1024)
    metrics = syncer.sync(version=1)
    syncer.sync(version=2)
    assert len(actor.opened) == 1 and actor.opened[0].world_size == 3
    assert [r.joined[0].rank for r in rollouts] == [1, 2]
    assert metrics["weight_sync/version"] == 1 and metrics["weight_sync/bytes"] == 16
    syncer.close()


def test_a_group_the_actor_lost_is_formed_again_before_sending(cfg):
    actor, rollout = FakeActor(), FakeRollout()
    syncer = WeightSyncer(cfg, actor, [rollout])
    syncer.sync(version=1)
    actor.group_id = ""  # e.g. the actor restarted
    syncer.sync(version=2)
    assert len(actor.opened) == 2
    assert syncer.spec == actor.opened[1] and syncer.spec.master_port != actor.opened[0].master_port
    syncer.close()


def test_failed_sync_waits_for_every_member_then_retries_on_a_new_group(cfg):
    actor, rollout = FakeActor(), FakeRollout(receive_s=0.5)
    syncer = WeightSyncer(cfg, actor, [rollout])
    syncer.sync(version=1)
    rollout.received_done.clear()
    actor.fail_next_send = True
    with pytest.raises(RoleCallError, match="SendWeights"):
        syncer.sync(version=2, retries=0)
    assert rollout.received_done.is_set(), "the rollout's call must have ended first"
    assert syncer.spec is None
    syncer.sync(version=3)
    assert len(actor.opened) == 2

    actor.fail_next_send = True  # with a retry, the same failure is absorbed
    assert syncer.sync(version=4, retries=1)["weight_sync/version"] == 4
    assert len(actor.opened) == 3
    syncer.close()


def test_a_rollout_on_another_version_fails_the_sync(cfg):
    class Stale(FakeRollout):
        def receive_weights(self, manifest, timeout_s):
            return common_pb2.WeightSyncResult(version=manifest.version - 1)

    syncer = WeightSyncer(cfg, FakeActor(), [Stale()])
    with pytest.raises(RuntimeError, match="reports weight version 0, expected 1"):
        syncer.sync(version=1)
    syncer.close()


def test_no_retry_while_a_member_is_dead(cfg):
    actor, rollout = FakeActor(), FakeRollout()
    syncer = WeightSyncer(cfg, actor, [rollout])
    syncer.sync(version=1)
    actor.fail_next_send, rollout.dead = True, True
    with pytest.raises(RoleCallError, match="SendWeights"):
        syncer.sync(version=2, retries=1)
    assert len(actor.opened) == 1, "no group was formed with a dead member"
    syncer.close()


def test_delta_syncs_are_asked_for_and_a_full_one_on_request():
    cfg = build_config({}, ["actor_rollout_ref.rollout.weight_sync.delta=true"])
    actor, rollout = FakeActor(), FakeRollout()
    syncer = WeightSyncer(cfg, actor, [rollout])
    first = syncer.sync(version=1)
    assert first["weight_sync/delta"] == 0.0 and first["weight_sync/changed_fraction"] == 0.25
    assert syncer.sync(version=2)["weight_sync/delta"] == 1.0
    syncer.request_full()
    assert syncer.sync(version=3)["weight_sync/delta"] == 0.0
    assert syncer.sync(version=4)["weight_sync/delta"] == 1.0  # one full sync, then deltas
    assert syncer.sync(version=5, full=True)["weight_sync/delta"] == 0.0
    assert actor.prepared[-5:] == [(True, False)] * 2 + [(True, True), (True, False), (True, True)]
    assert syncer.sync(version=7)["weight_sync/delta"] == 0.0  # a version gap: full
    assert syncer.sync(version=8)["weight_sync/delta"] == 1.0
    syncer.close()


def test_cuda_ipc_never_asks_for_deltas():
    cfg = build_config({}, [
        "actor_rollout_ref.rollout.weight_sync.delta=true",
        "actor_rollout_ref.rollout.weight_sync.transport=cuda_ipc",
    ])  # fmt: skip
    actor = FakeActor()
    syncer = WeightSyncer(cfg, actor, [FakeRollout()])
    metrics = syncer.sync(version=1)
    assert "weight_sync/delta" not in metrics and actor.prepared[-1] == (False, False)
    syncer.close()
