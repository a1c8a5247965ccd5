"""Which GPUs a run computes on, so that per-GPU figures divide by the right count.

Each role server names the GPUs it computes on in its ``ServerInfo.gpus``, by UUID: the
same on every process that sees a GPU, whatever ``CUDA_VISIBLE_DEVICES`` numbers it as. So
roles co-located on one GPU name it alike, and the coordinator counts it once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

UUID_BYTES = 64
"""Room for one name in the trainer ranks' gather ("GPU-" + a 36-character UUID)."""


def gpu_names(device: torch.device) -> list[str]:
    """The UUID of ``device``'s GPU as a list of one; [] for a CPU device."""
    if device.type != "cuda":
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [str(torch.cuda.get_device_properties(index).uuid)]


def gathered_gpu_names(device: torch.device) -> list[str]:
    """Every trainer rank's ``gpu_names`` (rank order), gathered over the default group;
    every rank must call it. CPU ranks gather nothing: [] (no collective)."""
    if device.type != "cuda":
        return []
    own = gpu_names(device)
    if dist.get_world_size() == 1:
        return own
    # A CPU byte tensor per rank: gloo gathers it (the group's CPU backend), no NCCL call.
    encoded = own[0].encode().ljust(UUID_BYTES, b"\0")[:UUID_BYTES]
    mine = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in every]


def count_gpus(names_by_role: Iterable[Iterable[str]]) -> int:
    """Distinct GPUs over every role's names (a GPU shared by several roles counts once)."""
    return len({name for names in names_by_role for name in names})


def per_gpu_throughput(tokens: float, seconds: float, num_gpus: int) -> float:
    """verl's ``perf/throughput``: tokens of a step / (its seconds x the run's GPUs). A run on
    CPU (no GPU) divides by 1: the whole run's tokens/s."""
    return tokens / (max(seconds, 1e-9) * max(num_gpus, 1))
