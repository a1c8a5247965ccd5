"""The decode step as CUDA graphs: one graph per (cache view, rows, attended width).

A decode step of a small model is hundreds of short kernels; launched one by one from
Python they take longer than they run. A captured graph launches them all at once. The
graphs read their inputs from static buffers (tokens, positions) and write logits to a
static output, so each replay only needs the inputs copied in first.

Rows are rounded up to a bucket and widths to a multiple of ``width_step``, so a run needs
few graphs; they share one memory pool. Off CUDA, or with ``enabled=False``
(``enforce_eager``), the same step runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from services.rollout.fast.decoder import StaticDecoder
from services.rollout.fast.kv_cache import KVView

log = logging.getLogger(__name__)


def row_bucket(rows: int, limit: int) -> int:
    """Rows a step runs: 1, 2, 4, 8, 16, 32, then multiples of 32; at most ``limit``."""
    bucket = 1
    while bucket < min(rows, 32):
        bucket *= 2
    if rows > 32:
        bucket = -(-rows // 32) * 32
    return min(bucket, limit)


def width_bucket(needed: int, step: int, slot_len: int) -> int:
    """Positions a step attends over: ``needed`` rounded up to ``step``, at most ``slot_len``."""
    return min(slot_len, -(-needed // step) * step)


class DecodeGraphs:
    """Runs :meth:`StaticDecoder.decode` through captured graphs (or eagerly)."""

    def __init__(self, decoder: StaticDecoder, max_rows: int, enabled: bool):
        self.decoder = decoder
        self._enabled = enabled
        self.max_rows = max_rows
        device = decoder.device
        self._tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self.capture_seconds = 0.0

    @property
    def enabled(self) -> bool:
        """Whether steps replay graphs (never off CUDA)."""
        return self._enabled and self.decoder.device.type == "cuda"

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor, kv: KVView, width: int
    ) -> torch.Tensor:
        """Logits (bs, V) of one step; tokens, positions (bs,) for slots 0..bs-1."""
        if not self.enabled:
            return self.decoder.decode(tokens, positions, kv.k, kv.v, width)
        bs = tokens.shape[0]
        self._tokens[:bs].copy_(tokens)
        self._positions[:bs].copy_(positions)
        key = (kv.k.data_ptr(), kv.slot_len, bs, width)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(kv, bs, width)
            self._graphs[key] = entry
        graph, logits = entry
        graph.replay()
        return logits

    def clear(self) -> None:
        """Drops every graph and its pool (before the KV cache is freed or moved)."""
        self._graphs.clear()
        self._pool = None

    def _capture(self, kv: KVView, bs: int, width: int):
        start = time.perf_counter()
        tokens, positions = self._tokens[:bs], self._positions[:bs]

        def step() -> torch.Tensor:
            return self.decoder.decode(tokens, positions, kv.k, kv.v, width)

        # Warm up on a side stream first (cuBLAS picks and allocates its workspaces there).
        # Each run writes the same keys/values at the same positions: capturing is harmless.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = step()
        self.capture_seconds += time.perf_counter() - start
        log.debug("captured decode graph rows=%d width=%d", bs, width)
        return graph, logits
