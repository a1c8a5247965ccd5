"""Weight synchronisation actor -> rollout: a collective group apart from the trainer's
FSDP world, a manifest of flat buckets agreed over gRPC, and the buckets broadcast from
actor rank 0 to every rollout replica.

The actor server calls `WeightGroup.open`, `WeightGroup.join`, `plan_buckets` and
`send_weights`; a rollout server calls `WeightGroup.join` and `receive_weights` (or
`WeightReceiver`, to wait for the sender before touching its model). With a manifest of the
delta protocol (``manifest.delta``), both send only what changed since the group's last sync,
checked tensor by tensor (``meshrl.weight_sync.delta``). See docs/weight_sync.md.
"""

from meshrl.weight_sync.buckets import plan_buckets
from meshrl.weight_sync.group import WeightGroup, WeightGroupError
from meshrl.weight_sync.receiver import WeightReceiver, receive_weights
from meshrl.weight_sync.sender import send_weights
from meshrl.weight_sync.types import BucketPlan, GroupSpec, ParamSlot, WeightManifest

__all__ = [
    "BucketPlan",
    "GroupSpec",
    "ParamSlot",
    "WeightGroup",
    "WeightGroupError",
    "WeightManifest",
    "WeightReceiver",
    "plan_buckets",
    "receive_weights",
    "send_weights",
]
