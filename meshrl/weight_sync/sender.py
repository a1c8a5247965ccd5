"""Sender side of a sync: fill each flat bucket as full parameters stream in, broadcast it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from meshrl.weight_sync.group import WeightGroup, WeightGroupError
from meshrl.weight_sync.types import WeightManifest


def send_weights(
    group: WeightGroup | None,
    named_full_params: Iterator[tuple[str, torch.Tensor]],
    manifest: WeightManifest,
) -> tuple[int, float]:
    """Broadcasts the manifest's buckets from group rank 0; returns (bytes sent, seconds).

    ``named_full_params`` must yield the manifest's parameters in manifest order (full,
    un-sharded tensors). On FSDP ranks other than 0, ``group`` is None: they only drive the
    iterator, whose gathers are collectives of the trainer's world.

    The iterator is always drained, even after a failed broadcast: the other FSDP ranks
    are still gathering parameters, and stopping here would leave them blocked forever.

    Raises:
        WeightGroupError: a broadcast failed (a receiver died or timed out).
        ValueError: the parameters do not match the manifest, or the manifest was planned
            for another group.
    """
    start = time.perf_counter()
    sent = 0
    failure: Exception | None = None
    if group is not None and manifest.group_id and manifest.group_id != group.group_id:
        failure = ValueError(f"manifest is for group {manifest.group_id}, not {group.group_id}")
    params = iter(named_full_params)
    for bucket in manifest.buckets:
        flat = None
        if group is not None and failure is None:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=group.device)
        for slot in bucket.params:
            name, tensor = next(params, (None, None))
            if name != slot.name or tensor.numel() != slot.numel:
                raise ValueError(
                    f"parameter stream gives {name!r}, the manifest expects {slot.name!r} "
                    f"({slot.numel} elements)"
                )
            if flat is not None:
                flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        if flat is not None:
            try:
                group.broadcast(flat, src=0)
                sent += bucket.nbytes
            except WeightGroupError as e:
                failure = e
    for _ in params:  # keep the other ranks' gathers in step
        pass
    if failure is not None:
        raise failure
    return sent, time.perf_counter() - start
