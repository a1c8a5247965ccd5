"""Receiver side of a sync: a header, then one broadcast per bucket, parameters as views.

Staging buffers rotate (``WeightGroup.pipeline_depth`` of them): the next buckets are
already arriving while the parameters of bucket k are copied into the model. With the
caller's own tensors (``targets``) a bucket that holds one parameter lands straight in it,
which saves the copy, and the others are copied in by one multi-tensor copy a bucket.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping

import torch

from meshrl.weight_sync import delta as delta_sync
from meshrl.weight_sync.group import PendingBroadcast, WeightGroup, WeightGroupError
from meshrl.weight_sync.types import BucketPlan, WeightManifest

log = logging.getLogger(__name__)


def sync_header(version: int, device: torch.device, base_version: int = -1) -> torch.Tensor:
    """The first broadcast of every sync, (2,) int64 on the group's device: the version the
    buckets belong to and the version a delta sync goes from (-1: none).

    A receiver waits for it before it touches its model, so a rollout keeps generating
    until its actor really sends, and a sender on another manifest is caught at once."""
    return torch.tensor([version, base_version], dtype=torch.int64, device=device)


class WeightReceiver:
    """One sync's buckets, received in manifest order.

    ``wait_for_sender()`` blocks until the header arrives (and checks it); iterating yields
    (Hugging Face name, tensor of the parameter's shape). A yielded tensor is a view into a
    staging buffer of the group's device (CPU for gloo, the GPU for NCCL) in the bucket's
    dtype: copy it into the model before asking for the next one. With ``targets`` (the
    caller's own tensors by name), a bucket holding a single parameter whose target has the
    bucket's dtype, shape and device and is contiguous is received into that target; the
    parameters of other buckets whose target has their shape and device are copied into it
    as the bucket arrives, one multi-tensor copy a bucket (casting to the target's dtype).
    Either way the pair yielded is the target itself (``param.copy_(t)`` then copies
    nothing). Targets are written from the start of iteration: iterate only while nothing
    else reads them.

    Raises (from either call):
        WeightGroupError: a broadcast failed (the sender died or timed out), or the sender
            announced another version than the manifest's.
    """

    def __init__(
        self,
        group: WeightGroup,
        manifest: WeightManifest,
        targets: Mapping[str, torch.Tensor] | None = None,
    ):
        if manifest.group_id and manifest.group_id != group.group_id:
            raise ValueError(f"manifest is for group {manifest.group_id}, not {group.group_id}")
        self.group = group
        self.manifest = manifest
        self.targets = targets or {}
        self.wrote_targets = False
        """True once a target was written: the model may hold a mix from then."""
        self._landed: set[int] = set()  # buckets posted straight into their target
        self._header_seen = False

    def wait_for_sender(self) -> None:
        if self._header_seen:
            return
        header = sync_header(-1, self.group.device)
        self.group.broadcast(header, src=0)
        self._header_seen = True
        sent = (int(header[0]), int(header[1]))  # (a host sync on CUDA: wanted here)
        if sent != (self.manifest.version, self.manifest.base_version):
            raise WeightGroupError(
                f"weight group {self.group.group_id}: the sender sends version {sent[0]}, "
                f"the manifest here is for {self.manifest.version} (base versions: "
                f"{sent[1]} sent, {self.manifest.base_version} here)"
            )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.wait_for_sender()
        if self.manifest.delta:
            yield from self._delta_pairs()
            return
        buckets, depth = self.manifest.buckets, self.group.pipeline_depth
        try:
            arriving = deque(self._post(k) for k in range(min(depth, len(buckets))))
            for k, bucket in enumerate(buckets):
                flat = arriving.popleft().wait()
                yield from self._unpack(bucket, flat, in_target=k in self._landed)
                # Resumed: bucket k's tensors are copied, its buffer takes bucket k + depth.
                if k + depth < len(buckets):
                    arriving.append(self._post(k + depth))
        finally:
            self.group.release_staging()

    def _delta_pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The delta protocol: per bucket its meta, then its payload, applied to this side's
        copy of the bucket (kept on the group between syncs) and checked against the
        sender's checksums; the pairs are views of that copy (copied into the targets).

        A receiver that does not hold the sync's base, or whose result differs, receives
        the rest of the sync without using it (the sender must not be left waiting), yields
        nothing more, and raises WeightIntegrityError."""
        group, manifest = self.group, self.manifest
        state = group.delta_state = group.delta_state or delta_sync.DeltaState()
        refused: Exception | None = None
        if manifest.base_version >= 0 and state.base_for(manifest) != manifest.base_version:
            refused = delta_sync.WeightIntegrityError(
                f"the sync goes from version {manifest.base_version}; this receiver holds "
                f"{state.base_for(manifest)}"
            )
        else:
            state.begin(manifest)
        for k, bucket in enumerate(manifest.buckets):
            meta = group.broadcast_async(delta_sync.empty_meta(bucket, group.device)).wait()
            base = None if refused is not None else state.buffer(k, bucket, group.device)
            payload = delta_sync.payload_buffer(bucket, meta, base, group.device)
            if payload.numel():
                group.broadcast_async(payload).wait()
            if base is None:
                continue  # drained only
            try:
                delta_sync.apply(bucket, meta, payload, base)
            except delta_sync.WeightIntegrityError as e:
                refused = e
                continue
            yield from self._unpack(bucket, base, in_target=False)
        if refused is not None:
            state.version = None
            state.buffers.clear()
            log.error(
                "weight group %s: delta sync v%d (from v%d) refused: %s; a full sync follows",
                group.group_id, manifest.version, manifest.base_version, refused,
            )  # fmt: skip
            raise refused
        state.version = manifest.version

    def _unpack(
        self, bucket: BucketPlan, flat: torch.Tensor, in_target: bool
    ) -> list[tuple[str, torch.Tensor]]:
        """The bucket's (name, tensor) pairs. Parameters with a target are copied into it
        here, all in one multi-tensor copy, and their pair carries the target itself: a copy
        per parameter by the consumer cost more host time than the GPU needed for them."""
        pairs = [(p.name, flat[p.offset : p.offset + p.numel].view(p.shape)) for p in bucket.params]
        if in_target:
            return pairs  # received straight into its target: nothing to copy
        copies = [(i, t) for i, (name, view) in enumerate(pairs)
                  if (t := self._copy_target(name, view)) is not None]  # fmt: skip
        if copies:
            self.wrote_targets = True
            torch._foreach_copy_([t for _, t in copies], [pairs[i][1] for i, _ in copies])
            for i, t in copies:
                pairs[i] = (pairs[i][0], t)
        return pairs

    def _copy_target(self, name: str, view: torch.Tensor) -> torch.Tensor | None:
        t = self.targets.get(name)
        if t is None or t.shape != view.shape or t.device != view.device:
            return None
        return t.detach()  # a caller's parameter may require grad: written as data

    def _post(self, k: int) -> PendingBroadcast:
        bucket = self.manifest.buckets[k]
        target = self._target(bucket)
        if target is not None:
            self.wrote_targets = True
            self._landed.add(k)
            flat = target.detach().view(-1)
        else:
            flat = self.group.staging(k % self.group.pipeline_depth, bucket.numel, bucket.dtype)
        return self.group.broadcast_async(flat, src=0)

    def _target(self, bucket: BucketPlan) -> torch.Tensor | None:
        if len(bucket.params) != 1:
            return None
        slot = bucket.params[0]
        t = self.targets.get(slot.name)
        fits = (
            t is not None
            and t.dtype == bucket.dtype
            and tuple(t.shape) == slot.shape
            and t.device == self.group.device
            and t.is_contiguous()
        )
        return t if fits else None


def receive_weights(
    group: WeightGroup,
    manifest: WeightManifest,
    device: str | torch.device | None = None,
    targets: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, tensor) in manifest order; see :class:`WeightReceiver`.

    ``device`` is where the caller's model lives; gloo and NCCL buffers stay on the group's
    device whatever it says (the copy into the model moves them): it is accepted so that
    every transport has one signature.
    """
    return iter(WeightReceiver(group, manifest, targets))
