"""Coordinator side of actor -> rollout weight sync: arranges the group over gRPC and runs
each sync (manifest once over gRPC, then the buckets through the collective).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

from meshrl.config.schema import RunConfig
from services.coordinator.clients import RoleCallError, RolloutClient, TrainerClient

log = logging.getLogger(__name__)


def resolve_transport(cfg: RunConfig) -> str:
    """auto -> gloo on CPU; on GPUs cuda_ipc when co-located, else nccl."""
    transport = cfg.actor_rollout_ref.rollout.weight_sync.transport
    if transport != "auto":
        return transport
    return "gloo" if cfg.trainer.device == "cpu" else "cuda_ipc"


class WeightSyncer:
    """Forms the actor+rollouts group and pushes versioned weights through it."""

    def __init__(self, cfg: RunConfig, actor: TrainerClient, rollouts: list[RolloutClient]):
        sync_cfg = cfg.actor_rollout_ref.rollout.weight_sync
        self.actor = actor
        self.rollouts = rollouts
        self.transport = resolve_transport(cfg)
        self.timeout_s = sync_cfg.timeout_s
        self.bucket_bytes = sync_cfg.bucket_size_mb * 1024 * 1024
        self.dtype = cfg.actor_rollout_ref.rollout.dtype
        self.pool = ThreadPoolExecutor(max_workers=1 + len(rollouts), thread_name_prefix="sync")
        self.group_id: str | None = None

    def form_group(self) -> None:
        """Opens a rendezvous on the actor (fresh port) and has every member join it."""
        spec = self.actor.open_weight_group(self.transport, 1 + len(self.rollouts), self.timeout_s)
        joins = [self.pool.submit(self.actor.join_weight_group, spec)]
        for i, rollout in enumerate(self.rollouts):
            joins.append(self.pool.submit(rollout.join_weight_group, dataclasses.replace(spec, rank=1 + i)))
        for f in joins:
            f.result()
        self.group_id = spec.group_id
        log.info("weight-sync group %s formed (%s, %d members)", spec.group_id, self.transport, spec.world_size)

    def sync(self, version: int, retries: int = 1) -> dict[str, float]:
        """Moves the actor's weights to every rollout; re-forms the group and retries on failure."""
        for attempt in range(retries + 1):
            try:
                if self.group_id is None:
                    self.form_group()
                return self._sync_once(version)
            except RoleCallError as e:
                self.group_id = None
                if attempt == retries:
                    raise
                log.warning("weight sync v%d failed (%s); re-forming the group", version, e)
        raise AssertionError("unreachable")

    def _sync_once(self, version: int) -> dict[str, float]:
        manifest = self.actor.prepare_weights(version, self.dtype, self.bucket_bytes)
        deadline = self.timeout_s * max(1, len(manifest.buckets)) + 30
        send = self.pool.submit(self.actor.send_weights, version, deadline)
        receives = [self.pool.submit(r.receive_weights, manifest, deadline) for r in self.rollouts]
        sent = send.result()
        for f in receives:
            got = f.result()
            if got.version != version:
                raise RuntimeError(f"rollout reports weight version {got.version}, expected {version}")
        return {
            "weight_sync/bytes": float(sent.bytes),
            "weight_sync/gbps": sent.bytes / max(sent.seconds, 1e-9) / 1e9,
            "weight_sync/version": float(version),
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
