"""The actor's side of weight sync: the open rendezvous, the joined group, the manifest.

Opening and joining happen on rank 0 only (the other FSDP ranks are not members of the
group); preparing and sending run on every rank, because gathering each full parameter
is a collective of the FSDP world. A failed sync closes the group: the next one starts
from a fresh OpenWeightGroup on a new port.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass

import torch.distributed as dist

from meshrl.weight_sync.buckets import plan_buckets
from meshrl.weight_sync.cuda_ipc import IpcGroup, send_weights_ipc
from meshrl.weight_sync.group import WeightGroup, WeightGroupError
from meshrl.weight_sync.sender import send_weights
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from meshrl.wire import dtype_from_name
from services.trainer.actor import ActorRole

log = logging.getLogger(__name__)


class SyncStateError(RuntimeError):
    """A sync step called out of order (no group joined, no matching PrepareWeights)."""


@dataclass(frozen=True)
class SyncResult:
    version: int
    seconds: float
    bytes: int
    delta: bool = False
    """The sync went from a base version: only what changed was sent."""
    changed: int = 0
    """Elements that changed (every element in a full sync)."""
    elements: int = 0


class WeightPublisher:
    def __init__(
        self, actor: ActorRole, host: str, bucket_bytes: int, timeout_s: float, world_size: int
    ):
        self.actor = actor
        self.host = _reachable(host)
        # What an OpenWeightGroup/PrepareWeights request may leave empty (from the config).
        self.default_bucket_bytes = bucket_bytes
        self.default_timeout_s = timeout_s
        self.default_world_size = world_size
        self._store: dist.TCPStore | None = None
        self._spec: GroupSpec | None = None
        self._group: WeightGroup | IpcGroup | None = None
        self._manifest: WeightManifest | None = None
        self.sent_version = -1
        """The version of the last weights sent whole to rollout; -1: none yet."""
        self._lock = threading.Lock()  # Open/Join/Send may arrive on different RPC threads

    def open(self, request: GroupSpec) -> GroupSpec:
        """Rank 0: a fresh rendezvous; any previous group is closed first."""
        with self._lock:
            self._close()
            if request.transport == "cuda_ipc":  # same GPU: handles + a store handshake
                self._store, self._spec = IpcGroup.open(
                    self.host, request.timeout_s, request.world_size
                )
            else:
                self._store, self._spec = WeightGroup.open(
                    self.host, request.timeout_s, request.world_size, request.transport
                )
            return self._spec

    def join(self, spec: GroupSpec) -> str:
        """Rank 0: joins the opened group as its rank 0; blocks until every member joined."""
        with self._lock:
            if self._spec is None or (spec.group_id and spec.group_id != self._spec.group_id):
                raise SyncStateError(
                    f"weight group {spec.group_id or '?'} is not the one opened here "
                    f"({self._spec.group_id if self._spec else 'none'}); call OpenWeightGroup"
                )
            try:
                join = IpcGroup.join if self._spec.transport == "cuda_ipc" else WeightGroup.join
                self._group = join(self._spec, self._store)
            except WeightGroupError as e:
                log.warning("%s; closing the group", e)
                self._close()
                raise
            return self._spec.group_id

    def check_ready(self, version: int) -> None:
        """Rank 0, before SendWeights reaches the other ranks: is there a group and a plan?"""
        if self._group is None:
            raise SyncStateError("no weight group joined: call OpenWeightGroup and JoinWeightGroup")
        if self._manifest is None or self._manifest.version != version:
            planned = None if self._manifest is None else self._manifest.version
            raise SyncStateError(
                f"SendWeights(version={version}) without a matching PrepareWeights "
                f"(last prepared: {planned})"
            )
        if self._manifest.group_id != self._group.group_id:
            raise SyncStateError(
                f"the last PrepareWeights planned for group {self._manifest.group_id or 'none'}, "
                f"not the joined group {self._group.group_id}: call PrepareWeights again"
            )

    def prepare(
        self, version: int, dtype: str, bucket_bytes: int, delta: bool = False, full: bool = False
    ) -> WeightManifest:
        """Every rank: plans the buckets of the next sync from the actor's parameters.

        ``delta`` (gloo and NCCL groups; rank 0 decides): the delta protocol, going from the
        version this group's last sync left when there is one with the same buckets, else
        a full sync of the protocol (the first sync of a group, after any failure, and with
        ``full``)."""
        buckets = plan_buckets(
            self.actor.named_param_shapes(),
            dtype_from_name(dtype or "float32"),
            bucket_bytes or self.default_bucket_bytes,
        )
        group_id = self._spec.group_id if self._spec is not None else ""
        self._manifest = WeightManifest(version, buckets, group_id)
        if delta and isinstance(self._group, WeightGroup):
            self._manifest.delta = True
            state = self._group.delta_state
            if state is not None and not full:
                self._manifest.base_version = state.base_for(self._manifest)
        if isinstance(self._group, IpcGroup):  # rank 0 of a cuda_ipc group: export the ring
            self._manifest.ipc_handles = self._group.export_ring(self._manifest)
        return self._manifest

    def send(self, version: int) -> SyncResult:
        """Every rank: gathers each parameter; rank 0 broadcasts the buckets.

        Raises:
            WeightGroupError (rank 0): a receiver died or timed out; the group is closed.
        """
        if self._manifest is None or self._manifest.version != version:
            raise SyncStateError(f"SendWeights(version={version}) without PrepareWeights")
        with self._lock:
            stats: dict[str, int] = {}
            try:
                params = self.actor.iter_full_params()
                if self._manifest.ipc_handles:
                    # prepare exported the handles from this rank's IpcGroup
                    assert not isinstance(self._group, WeightGroup)
                    sent, seconds = send_weights_ipc(self._group, params, self._manifest)
                else:
                    # prepare gives the manifest of an IpcGroup its handles
                    assert not isinstance(self._group, IpcGroup)
                    sent, seconds = send_weights(self._group, params, self._manifest, stats)
            except WeightGroupError as e:
                log.warning("weight sync v%d failed: %s; closing the group", version, e)
                self._close()
                raise
        manifest = self._manifest
        delta = manifest.delta and manifest.base_version >= 0
        elements = stats.get("elements", 0)
        changed = stats.get("changed", elements)
        log.info(
            "sent weights v%d%s: %.1f MB in %.2fs%s",
            version, f" (delta from v{manifest.base_version})" if delta else "",
            sent / 1e6, seconds,
            f", {changed / elements:.2%} of the elements changed" if delta and elements else "",
        )  # fmt: skip
        self.sent_version = version
        return SyncResult(version, seconds, sent, delta, changed, elements)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._store, self._spec = None, None, None


def _reachable(host: str) -> str:
    # A server bound to every interface still needs one name the rollouts can dial.
    return socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host
