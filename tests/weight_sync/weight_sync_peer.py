"""The rollout side of the weight-sync tests, run in a spawned process."""

from __future__ import annotations

from meshrl.api.v1 import common_pb2


def receive_to_file(spec_bytes: bytes, manifest_bytes: bytes, out_path: str) -> None:
    """Joins the group described by `spec_bytes`, receives a manifest's buckets, saves them;
    the order they arrived in is the file's metadata "order" (a JSON list of names)."""
    import json

    import torch
    from safetensors.torch import save_file

    from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest, receive_weights

    torch.set_num_threads(1)
    spec = GroupSpec.from_proto(common_pb2.WeightGroupSpec.FromString(spec_bytes))
    manifest = WeightManifest.from_proto(common_pb2.WeightManifest.FromString(manifest_bytes))
    group = WeightGroup.join(spec)
    try:
        received = {name: t.clone() for name, t in receive_weights(group, manifest)}
    finally:
        group.close()
    save_file(received, out_path, metadata={"order": json.dumps(list(received))})


def join_then_exit(spec_bytes: bytes) -> None:
    """Joins the group and dies without receiving anything (a crashed rollout)."""
    from meshrl.weight_sync import GroupSpec, WeightGroup

    spec = GroupSpec.from_proto(common_pb2.WeightGroupSpec.FromString(spec_bytes))
    WeightGroup.join(spec)
