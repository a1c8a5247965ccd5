"""The trainer's torch.distributed world: start-up, and who this rank is.

A trainer endpoint is one process per rank. Under ``torchrun`` the environment names the
world; started plainly, the process forms a world of one on a private TCP store, so the
same FSDP code path runs in both cases.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_distributed() -> None:
    """Joins (or forms) the default process group; a no-op if it already exists."""
    if dist.is_initialized():
        return
    # gloo moves CPU tensors (and the command channel); NCCL the CUDA ones when there are GPUs.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
        return
    # Port 0: the store picks a free port itself, so two servers never race for one.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


@dataclass(frozen=True)
class World:
    """This rank's place in the trainer world, and the device its model lives on.

    A role's batch is split over ``world_size`` ranks (``rank`` is this one's place): all the
    role's ranks, or, when a backend splits each layer over several ranks (Megatron's tensor
    parallelism), its data-parallel ranks only (:meth:`data_parallel`), whose reductions run
    over ``group``; each of them then stands for ``model_parallel`` devices."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    group: dist.ProcessGroup | None = None  # None: the default group (all ranks)
    model_parallel: int = 1

    @staticmethod
    def current(device_type: str = "cpu") -> World:
        """The world of the default process group; ``device_type`` from ``trainer.device``."""
        rank, size = dist.get_rank(), dist.get_world_size()
        if device_type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        else:
            device = torch.device("cpu")
        return World(rank, size, device, init_device_mesh(device.type, (size,)))

    def data_parallel(self, rank: int, size: int, group: dist.ProcessGroup) -> World:
        """The world the batch is split over when every ``self.world_size / size`` ranks
        (a model-parallel group) compute one share together: this rank's data-parallel
        ``rank`` of ``size``, reduced over ``group``."""
        if size == self.world_size:
            return self
        return dataclasses.replace(
            self, rank=rank, world_size=size, group=group,
            model_parallel=self.world_size // size,
        )  # fmt: skip

    @property
    def devices(self) -> int:
        """The role's devices (every rank of every model-parallel group)."""
        return self.world_size * self.model_parallel

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks of the batch (a no-op on one); returns ``tensor``.
        Model-parallel ranks of one share computed the same sum: it is counted once."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor
