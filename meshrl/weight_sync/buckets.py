"""Packing parameters into flat buckets: few large collectives instead of one per tensor."""

from __future__ import annotations

import math

import torch

from meshrl.weight_sync.types import BucketPlan, ParamSlot


def plan_buckets(
    named_shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int
) -> list[BucketPlan]:
    """Packs parameters, in order, into buckets of at most ``bucket_bytes``.

    A bucket closes when the next parameter would overflow it; a parameter larger than
    ``bucket_bytes`` gets a bucket of its own (it is never split, so a receiver can take a
    view of each parameter inside one bucket).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    itemsize = dtype.itemsize
    buckets: list[BucketPlan] = []
    slots: list[ParamSlot] = []
    used = 0  # elements in the open bucket
    for name, shape in named_shapes:
        numel = math.prod(shape)
        if slots and (used + numel) * itemsize > bucket_bytes:
            buckets.append(BucketPlan(slots, used, dtype))
            slots, used = [], 0
        slots.append(ParamSlot(name, tuple(shape), used, numel))
        used += numel
    if slots:
        buckets.append(BucketPlan(slots, used, dtype))
    return buckets
