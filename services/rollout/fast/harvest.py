"""Collecting finished sequences without stopping the GPU.

A check used to read ``done`` with a blocking copy: the host waited for the GPU to finish
the round, then the GPU waited for the host to queue the next one (~8% of a 256-row
generate on the H200). Here a check is read one round late and the outputs stay on the
device until the end of the call:

- :meth:`Harvest.queue_check` copies the first slots' ``done`` flags to pinned host memory
  right after a round is queued; the check is read after the next round is queued, while
  the GPU runs it.
- :meth:`Harvest.take` gathers the finished slots' tokens, log-probs, lengths and stop flags
  on the device (in stream order: before any refill overwrites the slots), and
  :meth:`Harvest.flush` copies them to the host once, at the end (or when they grow past
  ``flush_bytes``); :meth:`Harvest.result` files them by sequence with whole-tensor ops.

A finished slot keeps stepping until read (``slots.py``: its outputs do not change), so
reading late costs only that slot's extra steps. Host memory the GPU copies to or from
asynchronously is pinned and reused (:class:`PinnedRing`): pinning per call cost more
than the sync it saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.ragged import Ragged
from services.rollout.fast.slots import SlotState
from services.rollout.types import FinishReason


class PinnedRing:
    """A few host buffers for asynchronous copies, reused in turn: a buffer is handed out
    again only once the copy recorded on it has run. Plain (unpinned) memory and blocking
    copies off CUDA."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, count: int = 4):
        self.cuda = device.type == "cuda"
        self._buffers = [torch.zeros(size, dtype=dtype, pin_memory=self.cuda) for _ in range(count)]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def take(self, n: int) -> tuple[torch.Tensor, int]:
        """A free buffer's first ``n`` elements and its number (for :meth:`mark`)."""
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        if (event := self._events[i]) is not None:
            event.synchronize()  # long done, unless the ring is too small
        return self._buffers[i][:n], i

    def mark(self, i: int) -> torch.cuda.Event | None:
        """Records, after the copy just queued on buffer ``i``, when it will have run."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event
        return event


class HarvestRings:
    """The pinned buffers of an engine's harvests: ``done`` flags out, slot indices in."""

    def __init__(self, slots: int, device: torch.device):
        self.flags = PinnedRing(slots, torch.bool, device)
        self.indices = PinnedRing(slots, torch.int64, device)


@dataclass
class Check:
    """The ``done`` flags of the first slots after a round, on their way to the host."""

    holders: list[int]  # the sequence in each of those slots when queued (-1: none)
    flags: torch.Tensor  # (len(holders),) bool, host
    ready: torch.cuda.Event | None  # recorded after the copy; None: copied already

    def finished(self, slot_seq: list[int]) -> list[tuple[int, int]]:
        """(slot, sequence) of the slots that were done and still hold that sequence (a
        slot read done before, or refilled since, is left out)."""
        if self.ready is not None:
            self.ready.synchronize()
        return [
            (slot, seq)
            for slot, (seq, done) in enumerate(zip(self.holders, self.flags.tolist(), strict=True))
            if done and seq >= 0 and slot_seq[slot] == seq
        ]


class Harvest:
    """The outputs of one ``generate`` call's finished sequences."""

    def __init__(self, total: int, rings: HarvestRings, flush_bytes: int = 256 << 20):
        self.total = total
        self.flush_bytes = flush_bytes
        self._flags, self._indices = rings.flags, rings.indices
        self._parts: list[tuple[list[int], tuple[torch.Tensor, ...]]] = []  # on the device
        self._filed: list[tuple[torch.Tensor, ...]] = []  # on the host
        self._bytes = 0

    def queue_check(self, done: torch.Tensor, slot_seq: list[int]) -> Check:
        """Starts copying ``done`` of the slots up to the last one holding a sequence."""
        rows = max((s + 1 for s, q in enumerate(slot_seq) if q >= 0), default=0)
        flags, i = self._flags.take(rows)
        flags.copy_(done[:rows], non_blocking=self._flags.cuda)
        return Check(slot_seq[:rows], flags, self._flags.mark(i))

    def take(self, finished: list[tuple[int, int]], state: SlotState) -> None:
        """Gathers the (slot, sequence) pairs' outputs on the device; the slots may be
        refilled right after."""
        if not finished:
            return
        staged, i = self._indices.take(len(finished))
        staged.copy_(torch.tensor([slot for slot, _ in finished]))
        idx = staged.to(state.done.device, non_blocking=self._indices.cuda)
        self._indices.mark(i)
        part = (state.gen_len[idx], state.stopped[idx], state.tokens[idx], state.logprobs[idx])
        self._parts.append(([seq for _, seq in finished], part))
        self._bytes += sum(t.numel() * t.element_size() for t in part)
        if self._bytes > self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        """Copies what was gathered to the host (one sync)."""
        for seqs, part in self._parts:
            self._filed.append((torch.tensor(seqs, dtype=torch.int64), *(t.cpu() for t in part)))
        self._parts, self._bytes = [], 0

    def result(self) -> tuple[Ragged, Ragged, list[FinishReason]]:
        """(tokens, log-probs, finish reasons) of every sequence, in sequence order. A
        sequence never gathered has no tokens ("length").

        Filed with whole-tensor ops where the outputs are (on the GPU, unless a large call
        copied some to the host already), then copied once, compact: filing a full batch row
        by row cost ~4 ms of host time at 256 sequences, and the same ops on the host's
        tensors ~70 ms on the H200's host (CPU threads waking for each small op)."""
        if self._filed or not self._parts:
            self.flush()
            parts = self._filed
        else:
            parts = [
                (torch.tensor(seqs, dtype=torch.int64).to(part[0].device), *part)
                for seqs, part in self._parts
            ]
        if not parts:
            empty = torch.zeros(1, dtype=torch.int64)
            return (
                Ragged(torch.zeros(0, dtype=torch.int64), empty),
                Ragged(torch.zeros(0, dtype=torch.float32), empty),
                ["length"] * self.total,
            )
        seqs, gen_len, stop, tokens, logprobs = (torch.cat(t) for t in zip(*parts, strict=True))
        device = tokens.device
        lengths = torch.zeros(self.total, dtype=torch.int64, device=device)
        lengths[seqs] = gen_len.to(torch.int64)
        stopped = torch.zeros(self.total, dtype=torch.bool, device=device)
        stopped[seqs] = stop
        keep = torch.arange(tokens.shape[1], device=device)[None, :] < lengths[:, None]

        def in_sequence_order(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            """The kept values of (gathered rows, width) rows, sequence by sequence."""
            padded = rows.new_zeros(self.total, rows.shape[1])
            padded[seqs] = rows
            return padded[keep].to(dtype).cpu()

        values = in_sequence_order(tokens, torch.int64)
        lp_values = in_sequence_order(logprobs, torch.float32)
        lengths, stopped = lengths.cpu(), stopped.cpu()
        offsets = torch.zeros(self.total + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        reasons: list[FinishReason] = ["stop" if s else "length" for s in stopped.tolist()]
        self._parts, self._filed, self._bytes = [], [], 0
        return Ragged(values, offsets), Ragged(lp_values, offsets), reasons
