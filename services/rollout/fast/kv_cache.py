"""A static KV cache: two flat buffers taken once, viewed per generate call as
``(layers, slots, kv_heads, slot_len, head_dim)``.

Each sequence owns one *slot* of ``slot_len`` positions; prompt keys/values go to
positions ``0..P-1`` and every decode step writes one more. The buffers are sized from a
share of the GPU's memory (vLLM's ``gpu_memory_utilization``) on CUDA, or grown to what a
call needs on CPU. Since the buffers never move between ``release()`` and ``resume()``,
CUDA graphs captured over a view stay valid; after a release they must be captured again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class KVView(NamedTuple):
    """The cache as one call sees it."""

    k: torch.Tensor  # (layers, slots, kv_heads, slot_len, head_dim)
    v: torch.Tensor  # same
    slots: int
    slot_len: int


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Keys + values of one position over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def numel_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim


class StaticKVCache:
    """Owns the buffers; ``view(slot_len, want)`` lays out as many slots as fit (<= want)."""

    def __init__(self, shape: KVShape, device: torch.device, capacity_tokens: int | None = None):
        """``capacity_tokens`` fixes the size (allocated now); None grows on demand (CPU)."""
        self.shape = shape
        self.device = device
        self.capacity_tokens = capacity_tokens
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._released = False
        if capacity_tokens is not None:
            self._allocate(capacity_tokens)

    @property
    def nbytes(self) -> int:
        if self._k is None:
            return 0
        return 2 * self._k.numel() * self._k.element_size()

    @property
    def tokens(self) -> int:
        """Positions the buffers hold now."""
        return 0 if self._k is None else self._k.numel() // self.shape.numel_per_token

    def view(self, slot_len: int, want_slots: int) -> KVView:
        """The buffers as ``min(want_slots, fit)`` slots of ``slot_len`` positions.

        Raises:
            RuntimeError: released, or not even one slot fits.
        """
        if self._released:
            raise RuntimeError("the KV cache is released")
        if self.capacity_tokens is None and self.tokens < slot_len * want_slots:
            self._allocate(slot_len * want_slots)
        slots = min(want_slots, self.tokens // slot_len)
        if slots < 1:
            raise RuntimeError(
                f"the KV cache holds {self.tokens} positions, less than one slot of {slot_len}"
            )
        s = self.shape
        # Same base pointer and strides for every `slots` of one slot_len: a CUDA graph
        # captured over rows [0, bs) of one view serves every later view with that slot_len.
        rows = self.tokens // slot_len
        n = s.layers * rows * s.kv_heads * slot_len * s.head_dim
        shape = (s.layers, rows, s.kv_heads, slot_len, s.head_dim)
        assert self._k is not None and self._v is not None  # slots >= 1: allocated
        return KVView(self._k[:n].view(shape), self._v[:n].view(shape), slots, slot_len)

    def release(self) -> None:
        """Frees the buffers (the caller empties the allocator's cache)."""
        self._k = self._v = None
        self._released = True

    def resume(self) -> None:
        """Takes the buffers again, at the same capacity."""
        self._released = False
        if self.capacity_tokens is not None and self._k is None:
            self._allocate(self.capacity_tokens)

    def _allocate(self, tokens: int) -> None:
        self._k = self._v = None  # drop the old buffers before taking the new ones
        numel = tokens * self.shape.numel_per_token
        # Zeros, not empty: masked positions are multiplied by a zero weight, and 0 * NaN
        # from never-written memory would poison the whole attention row.
        self._k = torch.zeros(numel, dtype=self.shape.dtype, device=self.device)
        self._v = torch.zeros(numel, dtype=self.shape.dtype, device=self.device)


def cuda_capacity_tokens(
    shape: KVShape,
    device: torch.device,
    gpu_memory_utilization: float,
    reserve_bytes: int,
    max_tokens: int,
) -> int:
    """Positions that fit in ``gpu_memory_utilization`` of the GPU, after what this process
    already holds (the weights) and ``reserve_bytes`` for activations; at most ``max_tokens``.
    """
    _, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    budget = int(gpu_memory_utilization * total) - held - reserve_bytes
    tokens = min(max_tokens, budget // shape.bytes_per_token)
    if tokens < 1:
        raise RuntimeError(
            f"gpu_memory_utilization={gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"no room for a KV cache (weights hold {held / 2**30:.1f} GiB, activations need "
            f"{reserve_bytes / 2**30:.1f} GiB)"
        )
    return tokens
