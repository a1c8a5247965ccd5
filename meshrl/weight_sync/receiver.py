"""Receiver side of a sync: one broadcast per bucket, parameters as views into it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from meshrl.weight_sync.group import WeightGroup
from meshrl.weight_sync.types import WeightManifest


def receive_weights(
    group: WeightGroup, manifest: WeightManifest, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, tensor of the parameter's shape) in manifest order.

    Each tensor is a view into its bucket's buffer (dtype of the bucket): copy it into
    the model (``param.copy_(t)``) before the buffer is dropped; nothing is copied twice.
    ``device`` defaults to the group's device for NCCL (buckets must live on the GPU).

    Raises:
        WeightGroupError: a broadcast failed (the sender died or timed out).
    """
    if manifest.group_id and manifest.group_id != group.group_id:
        raise ValueError(f"manifest is for group {manifest.group_id}, not {group.group_id}")
    if group.device.type == "cuda":
        device = group.device
    for bucket in manifest.buckets:
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
        group.broadcast(flat, src=0)
        for slot in bucket.params:
            yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
