"""The ``cuda_ipc`` transport: actor and rollout share one GPU, where NCCL refuses two ranks.

The actor keeps a small ring of flat bucket buffers on the GPU and exports their CUDA IPC
handles once, in the manifest (``WeightManifest.ipc_handles``, JSON: no pickle crosses the
process boundary). A rollout opens the handles (mapping the actor's memory into its own
address space) and copies each bucket straight into its weights. The group's TCP store
carries the handshake of every bucket:

    actor    wait until every rollout acked the bucket that last used this ring buffer
             -> fill the buffer (cast to the sync dtype) -> synchronize -> set ``ready``
    rollout  wait for ``ready`` -> copy the parameters out -> synchronize -> set ``ack``

so the actor never overwrites a buffer a rollout is still reading. Every wait has the
group's timeout; a dead peer surfaces as :class:`WeightGroupError`, like the collectives.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from meshrl.weight_sync.group import WeightGroupError
from meshrl.weight_sync.sender import take_param
from meshrl.weight_sync.store import connect_store, open_store
from meshrl.weight_sync.types import GroupSpec, WeightManifest
from meshrl.wire import dtype_from_name, dtype_name

log = logging.getLogger(__name__)

RING_BUFFERS = 2  # the actor fills one bucket while the rollouts copy the previous one


def export_handle(tensor: torch.Tensor) -> dict:
    """A JSON-able description of a CUDA tensor that another process can open."""
    _, args = reduce_tensor(tensor)
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": dtype_name(dtype),
        "device": device,
        "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "handle": _b64(handle),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_handle": _b64(ref_handle),
        "ref_offset": ref_offset,
        "event_handle": _b64(event_handle),
        "event_sync": bool(event_sync),
    }


def open_handle(desc: dict, device: torch.device | None = None) -> torch.Tensor:
    """Maps an exported tensor into this process (same GPU required)."""
    index = device.index if device is not None and device.index is not None else desc["device"]
    here = str(torch.cuda.get_device_properties(index).uuid)
    if here != desc["gpu_uuid"]:
        raise WeightGroupError(
            f"cuda_ipc needs the actor's GPU ({desc['gpu_uuid']}) but this process has "
            f"cuda:{index} ({here}); use nccl across GPUs"
        )
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(desc["size"]),
        tuple(desc["stride"]),
        desc["offset"],
        torch.UntypedStorage,
        dtype_from_name(desc["dtype"]),
        index,
        _unb64(desc["handle"]),
        desc["storage_bytes"],
        desc["storage_offset"],
        False,
        _unb64(desc["ref_handle"]),
        desc["ref_offset"],
        _unb64(desc["event_handle"]),
        desc["event_sync"],
    )


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


class IpcGroup:
    """One member of a cuda_ipc group: rank 0 is the actor, ranks 1.. the rollouts."""

    def __init__(self, spec: GroupSpec, store: dist.Store, device: torch.device):
        self.spec = spec
        self.device = device
        # kept alive: a master store dies with its last reference
        self._root: dist.Store | None = store
        self._store = dist.PrefixStore(f"cuda_ipc/{spec.group_id}/", store)
        self._ring: list[torch.Tensor] = []  # actor: exported buffers; rollout: opened ones
        self._ring_key = ""

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.spec.timeout_s)

    @staticmethod
    def open(
        host: str, timeout_s: float = 120.0, world_size: int = 2
    ) -> tuple[dist.TCPStore, GroupSpec]:
        """Actor side: a store on a fresh port; returns it and the spec for the members."""
        return open_store(host, timeout_s, world_size, "cuda_ipc")

    @staticmethod
    def join(spec: GroupSpec, store: dist.Store | None = None) -> IpcGroup:
        """Joins as ``spec.rank``; returns once every member joined (or raises on timeout)."""
        try:
            store = connect_store(spec, store)
            group = IpcGroup(spec, store, torch.device("cuda", torch.cuda.current_device()))
            group._store.set(f"joined/{spec.rank}", "1")
            group._wait([f"joined/{r}" for r in range(spec.world_size)], "join")
        except WeightGroupError:
            raise
        except Exception as e:  # noqa: BLE001 - store errors come in many types
            raise WeightGroupError(
                f"cuda_ipc group {spec.group_id}: rank {spec.rank} could not join "
                f"{spec.master_addr}:{spec.master_port}: {type(e).__name__}: {e}"
            ) from e
        return group

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self._store.wait(keys, self.timeout)
        except Exception as e:  # noqa: BLE001
            raise WeightGroupError(
                f"cuda_ipc group {self.group_id}: rank {self.rank} waited {self.spec.timeout_s:g}s "
                f"for {what} ({keys[0]}...): {type(e).__name__}: {e}"
            ) from e

    # --- actor side ---

    def export_ring(self, manifest: WeightManifest) -> bytes:
        """(Re)allocates the ring for the manifest's largest bucket; returns the handle
        table (JSON bytes) to put in ``manifest.ipc_handles``."""
        largest = max((b.nbytes for b in manifest.buckets), default=0)
        if not self._ring or self._ring[0].numel() < largest:
            self._ring = [
                torch.empty(largest, dtype=torch.uint8, device=self.device)
                for _ in range(RING_BUFFERS)
            ]
            self._ring_key = uuid.uuid4().hex  # new buffers: rollouts must open them again
        table = {"ring": [export_handle(t) for t in self._ring], "id": self._ring_key}
        return json.dumps(table).encode()

    def send(
        self, named_full_params: Iterator[tuple[str, torch.Tensor]], manifest: WeightManifest
    ) -> tuple[int, float]:
        """Streams the manifest's buckets through the ring; returns (bytes, seconds) once
        every rollout acknowledged every bucket. Drains the iterator even on failure."""
        start = time.perf_counter()
        params = iter(named_full_params)
        receivers = range(1, self.spec.world_size)
        v = manifest.version
        failure: Exception | None = None
        sent = 0
        try:
            for i, bucket in enumerate(manifest.buckets):
                if i >= len(self._ring):  # the buffer's previous bucket must be read first
                    self._wait([f"{v}/ack/{i - len(self._ring)}/{r}" for r in receivers], "ack")
                flat = self._ring[i % len(self._ring)][: bucket.nbytes].view(bucket.dtype)
                for slot in bucket.params:
                    tensor = take_param(params, slot)
                    flat[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
                torch.cuda.current_stream(self.device).synchronize()  # filled before announced
                self._store.set(f"{v}/ready/{i}", "1")
                sent += bucket.nbytes
            last = range(max(0, len(manifest.buckets) - len(self._ring)), len(manifest.buckets))
            self._wait([f"{v}/ack/{i}/{r}" for i in last for r in receivers], "ack")
        except Exception as e:  # noqa: BLE001
            failure = e
        for _ in params:  # other FSDP ranks are still gathering: keep them in step
            pass
        if failure is not None:
            raise failure
        return sent, time.perf_counter() - start

    # --- rollout side ---

    def receive(self, manifest: WeightManifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, view into the actor's buffer); the consumer copies each tensor
        before asking for the next. A bucket is acknowledged once all of its tensors
        were taken and the copies finished on the device."""
        if manifest.group_id and manifest.group_id != self.group_id:
            raise ValueError(f"manifest is for group {manifest.group_id}, not {self.group_id}")
        self._open_ring(manifest.ipc_handles)
        v = manifest.version
        for i, bucket in enumerate(manifest.buckets):
            self._wait([f"{v}/ready/{i}"], "ready")
            flat = self._ring[i % len(self._ring)][: bucket.nbytes].view(bucket.dtype)
            for slot in bucket.params:
                yield slot.name, flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            torch.cuda.current_stream(self.device).synchronize()  # copies done: buffer free
            self._store.set(f"{v}/ack/{i}/{self.rank}", "1")

    def _open_ring(self, table_bytes: bytes) -> None:
        if not table_bytes:
            raise ValueError("cuda_ipc manifest without ipc_handles")
        table = json.loads(table_bytes)
        if table["id"] != self._ring_key:
            self._ring = [open_handle(d, self.device) for d in table["ring"]]
            self._ring_key = table["id"]

    def close(self) -> None:
        self._ring = []
        self._store = None  # type: ignore[assignment]  # released: unusable after close
        self._root = None


def send_weights_ipc(group: IpcGroup | None, named_full_params, manifest: WeightManifest):
    """``send_weights`` for cuda_ipc: rank 0 streams; other FSDP ranks only drain."""
    if group is None:
        for _ in named_full_params:
            pass
        return 0, 0.0
    return group.send(named_full_params, manifest)
