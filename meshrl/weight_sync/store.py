"""The TCP store a weight-sync group forms on: opened by the actor, joined by the rollouts.

Both kinds of group (`WeightGroup` for gloo/nccl, `IpcGroup` for cuda_ipc) meet the same
way: rank 0 starts a store on a fresh port, hands the filled `GroupSpec` to the others over
gRPC, and they connect a client to it. A fresh port and ``group_id`` per formation keep a
stale member of an old group from ever meeting a new one.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import torch.distributed as dist

from meshrl.weight_sync.types import GroupSpec


def open_store(
    host: str, timeout_s: float, world_size: int, transport: str
) -> tuple[dist.TCPStore, GroupSpec]:
    """Master side: starts a TCP store on a fresh port of ``host``; does not block.

    Returns the store (keep it alive while the group lives: it dies with its last
    reference) and the filled spec (rank 0) to hand to the other members.
    """
    if world_size < 2:
        raise ValueError(
            f"a weight group needs the sender and a receiver, got world_size={world_size}"
        )
    store = dist.TCPStore(
        host,
        0,
        None,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    spec = GroupSpec(
        transport=transport,
        master_addr=host,
        master_port=store.port,
        world_size=world_size,
        rank=0,
        timeout_s=timeout_s,
        group_id=uuid.uuid4().hex,
    )
    return store, spec


def connect_store(spec: GroupSpec, store: dist.Store | None = None) -> dist.Store:
    """The group's store for ``spec.rank``: the master's own ``store`` if given (rank 0),
    else a client connected to ``spec.master_addr:spec.master_port`` within the timeout."""
    if store is not None:
        return store
    return dist.TCPStore(
        spec.master_addr,
        spec.master_port,
        None,
        is_master=False,
        timeout=timedelta(seconds=spec.timeout_s),
    )
