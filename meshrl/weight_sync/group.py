"""A collective group for weight sync, apart from the trainer's FSDP world.

The group is built from a process-group *backend* object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) on its own TCP store, never through ``init_process_group`` or
``new_group``: the actor's ranks already own the default group, a rollout server owns
none, and a new formation after a failure must not disturb either. Each formation gets a
fresh store port and ``group_id``, so a stale member of an old group can never meet a new one.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshrl.weight_sync.store import connect_store, open_store
from meshrl.weight_sync.types import TRANSPORTS, GroupSpec

if TYPE_CHECKING:
    from meshrl.weight_sync.delta import DeltaState

log = logging.getLogger(__name__)


class WeightGroupError(RuntimeError):
    """The group could not form in time, or one of its collectives failed (peer gone)."""


class WeightGroup:
    """One member of a formed weight-sync group; ``broadcast`` moves flat buckets."""

    def __init__(self, spec: GroupSpec, store: dist.Store, backend, device: torch.device):
        self.spec = spec
        self.device = device
        # kept alive: the TCP store dies with its last reference
        self._store: dist.Store | None = store
        self._backend = backend
        self._staging: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # Staging buffers per side, so as many buckets in flight: on CPU a third keeps the
        # wire busy while a bucket is packed or unpacked; on a GPU each costs device memory.
        self.pipeline_depth = 3 if device.type == "cpu" else 2
        self.delta_state: DeltaState | None = None
        """Delta syncs: what the last sync through this formation left (each side's own
        copy); a new formation has none, so its first sync is full."""

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def rank(self) -> int:
        return self.spec.rank

    @staticmethod
    def open(
        host: str, timeout_s: float = 120.0, world_size: int = 2, transport: str = "gloo"
    ) -> tuple[dist.TCPStore, GroupSpec]:
        """Master side: starts a TCP store on a fresh port of ``host``; does not block.

        Returns the store (pass it to ``join`` and keep it alive while the group lives)
        and the filled spec (rank 0) to hand to the other members.
        """
        _check_transport(transport)
        return open_store(host, timeout_s, world_size, transport)

    @staticmethod
    def join(spec: GroupSpec, store: dist.Store | None = None) -> WeightGroup:
        """Joins the group as ``spec.rank``; blocks until every member joined or the timeout.

        ``store`` is the master's own store (rank 0); other members pass None and connect
        a client to ``spec.master_addr:spec.master_port``.

        Raises:
            WeightGroupError: the store is unreachable or not every member joined in time.
        """
        _check_transport(spec.transport)
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            store = connect_store(spec, store)
            prefixed = dist.PrefixStore(f"weight_sync/{spec.group_id}/", store)
            backend, device = _make_backend(spec, prefixed, timeout)
            group = WeightGroup(spec, store, backend, device)
            # The backend may connect lazily (NCCL does): one tiny broadcast proves that
            # every member is there before the caller relies on the group.
            group.broadcast(torch.zeros(1, device=device), src=0)
        except WeightGroupError:
            raise
        except Exception as e:  # noqa: BLE001 - store/backend errors come in many types
            raise WeightGroupError(
                f"weight group {spec.group_id} ({spec.transport}, "
                f"{spec.master_addr}:{spec.master_port}): rank {spec.rank} of {spec.world_size} "
                f"could not join within {spec.timeout_s:g}s: {type(e).__name__}: {e}"
            ) from e
        log.info("joined weight group %s as rank %d/%d", spec.group_id, spec.rank, spec.world_size)
        return group

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast of ``tensor`` from ``src``; waits at most the spec's timeout."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> PendingBroadcast:
        """Starts an in-place broadcast of ``tensor`` from ``src``; ``wait()`` on the result.

        The caller must leave ``tensor`` alone until the wait returns. Lets a sender fill the
        next bucket (and a receiver unpack the previous one) while this one travels.
        """
        if self._backend is None:
            raise WeightGroupError(f"weight group {self.group_id} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = timedelta(seconds=self.spec.timeout_s)
        try:
            work = self._backend.broadcast([tensor], opts)
        except Exception as e:  # noqa: BLE001
            raise self._failed(tensor, e) from e
        return PendingBroadcast(self, work, tensor)

    def staging(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of ``numel`` elements for bucket traffic, reused from sync to sync.

        Reuse saves the page faults of fresh host memory on every bucket; the buffers of a
        CUDA group are freed by :meth:`release_staging` after each sync instead, so that a
        rollout does not hold GPU memory between syncs.
        """
        key = (slot, dtype)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < numel:
            self._staging.pop(key, None)  # free the small one before allocating the large
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._staging[key] = buf
        return buf[:numel]

    def release_staging(self, keep_on_cpu: bool = True) -> None:
        """Drops the staging buffers (on CPU only if ``keep_on_cpu`` is False)."""
        if not (keep_on_cpu and self.device.type == "cpu"):
            self._staging.clear()

    def _failed(self, tensor: torch.Tensor, e: Exception) -> WeightGroupError:
        return WeightGroupError(
            f"weight group {self.group_id}: broadcast of {tensor.numel()} elements "
            f"failed on rank {self.rank}: {type(e).__name__}: {e}"
        )

    def close(self) -> None:
        """Releases the connections; the group cannot be used afterwards."""
        backend, self._backend = self._backend, None
        self._store = None
        self._staging.clear()
        self.delta_state = None
        if backend is not None:
            try:
                backend.shutdown()
            except Exception as e:  # noqa: BLE001 - a broken group may refuse a clean shutdown
                log.debug("weight group %s shutdown: %s", self.group_id, e)


class PendingBroadcast:
    """A broadcast in flight; ``wait`` blocks until it is done, at most the group's timeout."""

    def __init__(self, group: WeightGroup, work, tensor: torch.Tensor):
        self._group = group
        self._work = work
        self.tensor = tensor  # referenced until done: the collective writes or reads it

    def wait(self) -> torch.Tensor:
        """Returns the tensor once moved.

        Raises:
            WeightGroupError: a peer died or the timeout passed.
        """
        try:
            self._work.wait(timedelta(seconds=self._group.spec.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError or DistError
            raise self._group._failed(self.tensor, e) from e
        return self.tensor


def _check_transport(transport: str) -> None:
    if transport == "cuda_ipc":
        raise ValueError(
            "weight-sync transport 'cuda_ipc' forms an IpcGroup (meshrl.weight_sync.cuda_ipc), "
            "not a WeightGroup"
        )
    if transport not in TRANSPORTS:
        raise ValueError(
            f"unknown weight-sync transport {transport!r}; expected one of {TRANSPORTS}"
        )


def _make_backend(spec: GroupSpec, store: dist.Store, timeout: timedelta):
    if spec.transport == "nccl":
        # Not exercised on CPU machines; mirrors torch's own construction of NCCL groups.
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        backend = ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)
        return backend, torch.device("cuda", torch.cuda.current_device())
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch stubs
    opts._timeout = timeout
    opts._devices = [_gloo_device(spec.master_addr)]
    return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, opts), torch.device("cpu")


def _gloo_device(master_addr: str):
    """The local interface that reaches the master (GLOO_SOCKET_IFNAME wins if set).

    Gloo's default device resolves this machine's hostname, which in containers may name
    an address the peers cannot reach; the route to the master is what they share.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    return dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(master_addr))


def _local_address_towards(host: str) -> str:
    # A UDP "connect" sends nothing; it only asks the kernel for the route's source address.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return host
