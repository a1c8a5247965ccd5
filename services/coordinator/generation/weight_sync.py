"""Coordinator side of actor -> rollout weight sync: arranges the group over gRPC and runs
each sync (manifest once over gRPC, then the buckets through the collective).

The actor is the source of truth for the group: a manifest that names another group than
the one formed here means the actor lost it (a failed sync, a restart), and the group is
formed again, on a fresh port, before any bucket moves. See docs/weight_sync.md.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from meshrl.config.schema import RunConfig
from meshrl.rpc.role_client import RoleCallError
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from services.rollout.client import RolloutClient
from services.trainer.client import TrainerClient

log = logging.getLogger(__name__)

# What a sync's RPCs may take beyond the collectives' own timeouts (gRPC, load, reset).
_RPC_SLACK_S = 30.0


def resolve_transport(cfg: RunConfig) -> str:
    """auto -> gloo on CPU; on GPUs cuda_ipc when actor and rollout share their GPUs
    (``launcher.role_gpus`` names the same ones, or neither is placed), else nccl."""
    transport = cfg.actor_rollout_ref.rollout.weight_sync.transport
    if transport != "auto":
        return transport
    if cfg.trainer.device == "cpu":
        return "gloo"
    placed = cfg.launcher.role_gpus
    if placed.get("rollout") != placed.get("actor"):
        return "nccl"
    return "cuda_ipc"


class WeightSyncer:
    """Forms the actor+rollouts group and pushes versioned weights through it.

    ``bucket_bytes`` overrides ``weight_sync.bucket_size_mb`` (tests and benchmarks use
    buckets smaller than a megabyte).
    """

    def __init__(
        self,
        cfg: RunConfig,
        actor: TrainerClient,
        rollouts: list[RolloutClient],
        bucket_bytes: int | None = None,
    ):
        sync_cfg = cfg.actor_rollout_ref.rollout.weight_sync
        self.actor = actor
        self.rollouts = list(rollouts)  # its own: the run's list changes between steps
        self.transport = resolve_transport(cfg)
        self.timeout_s = sync_cfg.timeout_s
        self.bucket_bytes = bucket_bytes or sync_cfg.bucket_bytes(cfg.trainer.device)
        self.dtype = cfg.actor_rollout_ref.rollout.dtype
        self.delta = sync_cfg.delta and self.transport != "cuda_ipc"
        self._full_requested = False
        self._last_version: int | None = None  # of the last sync that succeeded
        self.pool = ThreadPoolExecutor(max_workers=1 + len(rollouts), thread_name_prefix="sync")
        self.spec: GroupSpec | None = None
        """The group formed last (rank 0's spec); None: form one before the next sync."""

    def set_rollouts(self, rollouts: list[RolloutClient]) -> None:
        """The rollout replicas to sync from now on; another membership than the group's
        (a replica that went down, one that joined) forms a new group at the next sync."""
        if rollouts == self.rollouts:
            return
        self.rollouts = list(rollouts)
        self.spec = None  # the actor's manifest then names another group: formed again
        # every member's join blocks until all joined: a thread for each
        self.pool.shutdown(wait=False)
        self.pool = ThreadPoolExecutor(max_workers=1 + len(rollouts), thread_name_prefix="sync")

    @property
    def group_id(self) -> str | None:
        return self.spec.group_id if self.spec is not None else None

    def form_group(self) -> GroupSpec:
        """Opens a rendezvous on the actor (fresh port) and has every member join it.

        Raises:
            RoleCallError: a member could not join within the timeout (the first failure;
                every join has ended when it is raised).
        """
        self.spec = None
        spec = self.actor.open_weight_group(self.transport, 1 + len(self.rollouts), self.timeout_s)
        joins = [self.pool.submit(self.actor.join_weight_group, spec)]
        for i, rollout in enumerate(self.rollouts):
            member = dataclasses.replace(spec, rank=1 + i)
            joins.append(self.pool.submit(rollout.join_weight_group, member))
        _all(joins)
        self.spec = spec
        log.info(
            "weight-sync group %s formed (%s, port %d, %d members)",
            spec.group_id, self.transport, spec.master_port, spec.world_size,
        )  # fmt: skip
        return spec

    def request_full(self) -> None:
        """Makes the next sync a full one (with ``weight_sync.delta``); after that, deltas."""
        self._full_requested = True

    def sync(self, version: int, retries: int = 1, full: bool = False) -> dict[str, float]:
        """Moves the actor's weights to every rollout; re-forms the group and retries on failure.

        With ``weight_sync.delta``, only what changed since the group's last sync moves,
        unless ``full`` (or :meth:`request_full`) or ``version`` does not follow the last
        synced one (a version gap); a failed delta sync (a receiver that refused it:
        another base, a checksum that differs) is retried in a new group, which makes it a
        full one.

        Raises:
            RoleCallError: the last attempt failed (the first failing call of it).
        """
        gap = self._last_version is not None and version != self._last_version + 1
        full = full or self._full_requested or gap
        for attempt in range(retries + 1):
            try:
                metrics = self._sync_once(version, full)
                self._full_requested = False
                self._last_version = version
                return metrics
            except RoleCallError as e:
                self.spec = None
                # A dead member would only make the new group wait out its join timeout:
                # leave it to the caller to restart it first.
                if attempt == retries or not self._members_answer():
                    raise
                log.warning("weight sync v%d failed (%s); re-forming the group", version, e)
        raise AssertionError("unreachable")

    def _members_answer(self) -> bool:
        """Whether the actor and every rollout answer GetInfo (each within 10 s)."""
        probes = [self.pool.submit(c.info) for c in (self.actor, *self.rollouts)]
        dead = [f.exception() for f in probes if f.exception() is not None]
        for e in dead:
            log.warning("weight sync: a member does not answer: %s", e)
        return not dead

    def _sync_once(self, version: int, full: bool = False) -> dict[str, float]:
        manifest = self._prepare(version, full)
        if manifest.group_id != self.group_id:
            # The actor holds no group or another one (it failed a sync, or restarted).
            self.form_group()
            manifest = self._prepare(version, full)
        # Each bucket's collective has its own timeout; the RPCs' deadline only backs them up.
        deadline = self.timeout_s * max(1, len(manifest.buckets)) + _RPC_SLACK_S
        send = self.pool.submit(self.actor.send_weights, version, deadline)
        receives = [self.pool.submit(r.receive_weights, manifest, deadline) for r in self.rollouts]
        sent, *received = _all([send, *receives])
        for rollout, got in zip(self.rollouts, received, strict=True):
            if got.version != version:
                raise RuntimeError(
                    f"rollout at {rollout.address} reports weight version {got.version}, "
                    f"expected {version}"
                )
        metrics = {
            "weight_sync/bytes": float(sent.bytes),
            "weight_sync/gbps": sent.bytes / max(sent.seconds, 1e-9) / 1e9,
            "weight_sync/seconds": float(sent.seconds),
            "weight_sync/version": float(version),
        }
        if manifest.delta:
            metrics["weight_sync/delta"] = float(sent.delta)
            metrics["weight_sync/changed_fraction"] = sent.changed / max(sent.elements, 1)
        return metrics

    def _prepare(self, version: int, full: bool = False) -> WeightManifest:
        if not self.delta:
            return self.actor.prepare_weights(version, self.dtype, self.bucket_bytes)
        return self.actor.prepare_weights(
            version, self.dtype, self.bucket_bytes, delta=True, full=full
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _all(futures: list[Future]) -> list:
    """Every future's result, in order; raises the first failure, but only once all have
    ended, so that no member is still inside a call when the group is formed again."""
    errors = [f.exception() for f in futures]  # waits for each (every call has a deadline)
    failed = [e for e in errors if e is not None]
    for e in failed[1:]:
        log.warning("weight sync: also failed: %s", e)
    if failed:
        raise failed[0]
    return [f.result() for f in futures]
