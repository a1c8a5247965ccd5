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


def receive_deltas_to_file(spec_bytes: bytes, manifests: list[bytes], out_path: str) -> None:
    """Joins the group, receives one sync per manifest (a full one, then deltas) into
    bf16 tensors of its own, as a rollout engine holds them, and saves those."""
    import torch
    from safetensors.torch import save_file

    from meshrl.weight_sync import GroupSpec, WeightGroup, WeightManifest
    from meshrl.weight_sync.receiver import WeightReceiver

    torch.set_num_threads(1)
    spec = GroupSpec.from_proto(common_pb2.WeightGroupSpec.FromString(spec_bytes))
    group = WeightGroup.join(spec)
    held: dict[str, torch.Tensor] = {}
    try:
        for raw in manifests:
            manifest = WeightManifest.from_proto(common_pb2.WeightManifest.FromString(raw))
            if not held:
                held = {
                    s.name: torch.zeros(s.shape, dtype=b.dtype)
                    for b in manifest.buckets
                    for s in b.params
                }
            for name, tensor in WeightReceiver(group, manifest, held):
                held[name].copy_(tensor)  # the pair is the target itself: copies nothing
    finally:
        group.close()
    save_file(held, out_path)
