"""Sender side of a sync: fill each flat bucket as full parameters stream in, broadcast it.

Staging buffers rotate (``WeightGroup.pipeline_depth`` of them), so bucket k+1 is gathered,
cast and packed while earlier buckets are on the wire and the next one is already queued
behind them; a parameter that fills a bucket alone and already has the wire dtype is broadcast
as it is, without the copy.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterator

import torch

from meshrl.weight_sync import delta as delta_sync
from meshrl.weight_sync.group import PendingBroadcast, WeightGroup, WeightGroupError
from meshrl.weight_sync.receiver import sync_header
from meshrl.weight_sync.types import BucketPlan, ParamSlot, WeightManifest

TEST_DELAY_ENV = "MESHRL_TEST_SYNC_DELAY_S"
"""Test hook: seconds to sleep before each bucket after the first, so that a test can kill
a peer while a sync is surely in flight. Unset (the default) in any real run."""


def send_weights(
    group: WeightGroup | None,
    named_full_params: Iterator[tuple[str, torch.Tensor]],
    manifest: WeightManifest,
    stats: dict[str, int] | None = None,
) -> tuple[int, float]:
    """Broadcasts a header (the version and the base version), then the manifest's buckets,
    from group rank 0; returns (bytes sent, seconds).

    With ``manifest.delta`` each bucket goes as the delta protocol has it (a meta tensor,
    then only the changed elements, or the dense bucket where that is not larger; see
    ``meshrl.weight_sync.delta``), against the copy kept on ``group.delta_state``;
    ``stats`` (if given) then receives ``changed`` and ``elements``.

    ``named_full_params`` must yield the manifest's parameters in manifest order (full,
    un-sharded tensors, any dtype: they are cast to the bucket's). On FSDP ranks other than
    0, ``group`` is None: they only drive the iterator, whose gathers are collectives of the
    trainer's world.

    The iterator is always drained, even after a failed broadcast: the other FSDP ranks
    are still gathering parameters, and stopping here would leave them blocked forever.

    Raises:
        WeightGroupError: a broadcast failed (a receiver died or timed out).
        ValueError: the parameters do not match the manifest, or the manifest was planned
            for another group.
    """
    start = time.perf_counter()
    failure: Exception | None = None
    member = group  # None: this rank only drives the gathers
    if group is not None and manifest.group_id and manifest.group_id != group.group_id:
        failure = ValueError(f"manifest is for group {manifest.group_id}, not {group.group_id}")
        member = None
    params = iter(named_full_params)
    delay_s = float(os.environ.get(TEST_DELAY_ENV) or 0)
    depth = member.pipeline_depth if member is not None else 1
    in_flight: deque[PendingBroadcast] = deque()
    state = None
    if member is not None and manifest.delta:
        state = member.delta_state = member.delta_state or delta_sync.DeltaState()
        if manifest.base_version != state.base_for(manifest) and manifest.base_version >= 0:
            failure = ValueError(
                f"manifest goes from version {manifest.base_version}, the copy kept here "
                f"holds {state.base_for(manifest)}"
            )
            member = state = None
        else:
            state.begin(manifest)  # version None until every bucket has left
    sent, changed = 0, 0
    try:
        if member is not None:
            try:  # the receivers wait for this before they touch their models
                header = sync_header(manifest.version, member.device, manifest.base_version)
                in_flight.append(member.broadcast_async(header, src=0))
            except WeightGroupError as e:
                failure = e
        for k, bucket in enumerate(manifest.buckets):
            # Bucket k's staging slot last held bucket k - depth: that one must have left.
            while failure is None and len(in_flight) >= depth:
                failure = _settle(in_flight.popleft())
            flat = _fill(member if failure is None else None, bucket, params, slot=k % depth)
            if flat is None or member is None:  # flat is None whenever member is
                continue
            if delay_s and k:
                time.sleep(delay_s)
            wire = [flat]
            if state is not None:  # the kept copy takes the bucket: its slot is free again
                kept = state.buffer(k, bucket, member.device)
                enc = delta_sync.encode(bucket, flat, kept, full=manifest.base_version < 0)
                wire = [enc.meta] + ([enc.payload] if enc.payload.numel() else [])
                changed += enc.changed
            try:
                for tensor in wire:
                    in_flight.append(member.broadcast_async(tensor, src=0))
                    sent += tensor.numel() * tensor.element_size()
            except WeightGroupError as e:
                failure = e
        while failure is None and in_flight:
            failure = _settle(in_flight.popleft())
    finally:
        while in_flight:  # leaving on an error: let the wire finish with the buffers
            _settle(in_flight.popleft())
        if member is not None:
            member.release_staging()  # CUDA: no device memory held between syncs
    for _ in params:  # keep the other ranks' gathers in step
        pass
    if failure is not None:
        raise failure
    elements = sum(b.numel for b in manifest.buckets)
    if stats is not None:
        stats["changed"] = changed if state is not None else elements
        stats["elements"] = elements
    if member is None:
        return 0, time.perf_counter() - start
    if state is None:
        return manifest.nbytes, time.perf_counter() - start
    state.version = manifest.version  # what every kept bucket now holds
    return sent, time.perf_counter() - start


def _settle(pending: PendingBroadcast | None) -> WeightGroupError | None:
    """Waits for a broadcast in flight; returns its error instead of raising it."""
    if pending is None:
        return None
    try:
        pending.wait()
    except WeightGroupError as e:
        return e
    return None


def take_param(params: Iterator[tuple[str, torch.Tensor]], slot: ParamSlot) -> torch.Tensor:
    """The stream's next parameter, which must be the one the manifest puts in ``slot``
    (the actor's parameter order is the manifest's, for every transport)."""
    name, tensor = next(params, (None, None))
    if name != slot.name or tensor is None or tensor.numel() != slot.numel:
        raise ValueError(
            f"parameter stream gives {name!r}, the manifest expects {slot.name!r} "
            f"({slot.numel} elements)"
        )
    return tensor


def _fill(
    group: WeightGroup | None,
    bucket: BucketPlan,
    params: Iterator[tuple[str, torch.Tensor]],
    slot: int,
) -> torch.Tensor | None:
    """Takes the bucket's parameters from the stream and packs them (``group`` None: only
    drains them). Returns the flat tensor to broadcast, (``bucket.numel``,).

    The bucket's tensors are taken first and packed by one multi-tensor copy (which also
    casts): a copy per parameter cost more host time than the GPU needs to move them, and
    the broadcasts waited on the host (about 290 copies for a 0.5B model). So a bucket's
    full parameters are held at once: at most ``bucket_size_mb`` in the wire dtype, twice
    that from float32 masters.
    """
    if group is None:  # drive the gathers only; hold nothing
        for p in bucket.params:
            take_param(params, p)
        return None
    tensors = [take_param(params, p) for p in bucket.params]
    if len(tensors) == 1 and _sendable_as_is(tensors[0], bucket, group.device):
        return tensors[0].view(-1)
    flat = group.staging(slot, bucket.numel, bucket.dtype)
    places = [
        flat[p.offset : p.offset + p.numel].view(t.shape)
        for p, t in zip(bucket.params, tensors, strict=True)
    ]
    torch._foreach_copy_(places, tensors)  # casts to the wire dtype where they differ
    return flat


def _sendable_as_is(tensor: torch.Tensor, bucket: BucketPlan, device: torch.device) -> bool:
    # Broadcasting from rank 0 only reads the tensor, and the actor does not train while
    # a sync runs, so its own storage can go on the wire.
    return tensor.dtype == bucket.dtype and tensor.device == device and tensor.is_contiguous()
