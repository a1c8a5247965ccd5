"""Typed views of the weight-sync messages of `common.proto` (converted once, here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.api.v1 import common_pb2
from meshrl.wire import dtype_from_name, dtype_name

TRANSPORTS = ("gloo", "nccl", "cuda_ipc")


@dataclass
class GroupSpec:
    """Where and how a weight-sync group forms; actor rank 0 is rank 0 of the group."""

    transport: str = "gloo"
    """"gloo" (CPU tensors), "nccl" (CUDA tensors) or "cuda_ipc" (one shared GPU)."""
    master_addr: str = ""
    """Host of the group's TCP store (the actor's)."""
    master_port: int = 0
    """Port of the TCP store; fresh for every formation of the group."""
    world_size: int = 2
    """1 + number of rollout replicas."""
    rank: int = 0
    """This member's rank in the group."""
    timeout_s: float = 120.0
    """Deadline of the rendezvous and of every collective of the group."""
    group_id: str = ""
    """Unique per formation: tells a stale group from the current one."""

    @staticmethod
    def from_proto(msg: common_pb2.WeightGroupSpec) -> GroupSpec:
        return GroupSpec(
            transport=msg.transport or "gloo",
            master_addr=msg.master_addr,
            master_port=int(msg.master_port),
            world_size=int(msg.world_size),
            rank=int(msg.rank),
            timeout_s=float(msg.timeout_s) if msg.timeout_s > 0 else 120.0,
            group_id=msg.group_id,
        )

    def to_proto(self) -> common_pb2.WeightGroupSpec:
        return common_pb2.WeightGroupSpec(
            transport=self.transport,
            master_addr=self.master_addr,
            master_port=self.master_port,
            world_size=self.world_size,
            rank=self.rank,
            timeout_s=self.timeout_s,
            group_id=self.group_id,
        )


@dataclass
class ParamSlot:
    """One parameter's place inside a flat bucket: ``flat[offset : offset + numel]``."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass
class BucketPlan:
    """A flat buffer of ``numel`` elements of ``dtype`` that one broadcast moves."""

    params: list[ParamSlot]
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class WeightManifest:
    """What one sync moves, in broadcast order; agreed over gRPC before the buckets travel."""

    version: int
    buckets: list[BucketPlan]
    group_id: str = ""
    ipc_handles: bytes = field(default=b"", repr=False)
    """cuda_ipc only: the serialized handle table (JSON, never pickle)."""
    delta: bool = False
    """The delta protocol (meshrl.weight_sync.delta): per bucket a meta tensor (kind,
    changed elements, checksums of the result) then a dense or sparse payload."""
    base_version: int = -1
    """With ``delta``: the version the receivers must hold, which the sync goes from; -1:
    a full sync (every bucket dense, its checksums checked all the same)."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def param_names(self) -> list[str]:
        return [slot.name for b in self.buckets for slot in b.params]

    @staticmethod
    def from_proto(msg: common_pb2.WeightManifest) -> WeightManifest:
        buckets = [
            BucketPlan(
                params=[
                    ParamSlot(p.name, tuple(int(d) for d in p.shape), int(p.offset), int(p.numel))
                    for p in b.params
                ],
                numel=int(b.numel),
                dtype=dtype_from_name(b.dtype),
            )
            for b in msg.buckets
        ]
        return WeightManifest(
            int(msg.version),
            buckets,
            msg.group_id,
            bytes(msg.ipc_handles),
            delta=msg.delta,
            base_version=int(msg.base_version) if msg.delta else -1,
        )

    def to_proto(self) -> common_pb2.WeightManifest:
        return common_pb2.WeightManifest(
            version=self.version,
            group_id=self.group_id,
            ipc_handles=self.ipc_handles,
            delta=self.delta,
            base_version=self.base_version,
            buckets=[
                common_pb2.Bucket(
                    numel=b.numel,
                    dtype=dtype_name(b.dtype),
                    params=[
                        common_pb2.ParamSlot(
                            name=s.name, shape=list(s.shape), offset=s.offset, numel=s.numel
                        )
                        for s in b.params
                    ],
                )
                for b in self.buckets
            ],
        )
