"""Host-side bookkeeping of the slots: who waits, who runs where, how far they can be.

The device holds the real state (``slots.py``); the host only keeps upper bounds it can
compute without asking the device: a slot's position grows by at most one a step, and a
sequence ends by length exactly ``max_tokens - 1`` steps after its prefill. These bounds
choose the rows and attended width of each step and when to look at ``done`` next.
"""

from __future__ import annotations

from collections import deque


class Scheduler:
    def __init__(
        self,
        prompt_lengths: list[int],
        n: int,
        slots: int,
        max_tokens: int,
        refill_fraction: float = 0.125,
    ):
        """Sequence k is sample ``k % n`` of prompt ``k // n``; ``slots`` run at once."""
        self.prompt_lengths = prompt_lengths
        self.n = n
        self.slots = slots
        self.max_tokens = max_tokens
        self.refill_at = max(1, int(refill_fraction * slots))
        self.waiting: deque[int] = deque(range(len(prompt_lengths) * n))
        self.slot_seq = [-1] * slots  # the sequence in each slot, -1 when free
        self.step = 0  # decode steps run so far
        self.start_pos = [0] * slots  # position of the first generated token (= prompt length)
        self.admitted_at = [0] * slots  # `step` when the slot was prefilled
        self.active: list[int] = []  # busy slots, ascending (kept, not recomputed per step)
        self._lead = 0
        self._oldest = 0

    @property
    def free(self) -> list[int]:
        return [s for s, q in enumerate(self.slot_seq) if q < 0]

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.active

    def admit(self) -> list[tuple[int, int]]:
        """(sequence, slot) pairs to prefill now: once enough slots are free (a prefill of
        a few sequences costs nearly as much as of many), or when nothing else runs."""
        free = self.free
        if not self.waiting or not free:
            return []
        if len(free) < min(self.refill_at, len(self.waiting)) and self.active:
            return []
        pairs = []
        for slot in free[: len(self.waiting)]:
            seq = self.waiting.popleft()
            self.slot_seq[slot] = seq
            self.start_pos[slot] = self.prompt_lengths[seq // self.n]
            self.admitted_at[slot] = self.step
            pairs.append((seq, slot))
        self._sync_active()
        return pairs

    def steps_until_check(self, check_every: int) -> int:
        """Steps to run before reading ``done``: at most ``check_every``, and never past the
        step where some sequence ends by length (so its slot is refilled at once)."""
        if not self.active:
            return 0
        return max(0, min(check_every, self.max_tokens - 1 - (self.step - self._oldest)))

    def advance(self) -> None:
        """One decode step ran."""
        self.step += 1

    def rows_needed(self) -> int:
        active = self.active
        return active[-1] + 1 if active else 0

    def width_needed(self) -> int:
        """Positions the next step must attend over (the furthest fed token's, plus one)."""
        return (self._lead + self.step + 1) if self.active else 1

    def release(self, *slots: int) -> list[int]:
        """Frees finished slots; returns their sequences. (One update of the running set
        for all of them: per slot, freeing a full batch cost ~5 ms of host time.)"""
        seqs = []
        for slot in slots:
            seqs.append(self.slot_seq[slot])
            self.slot_seq[slot] = -1
        self._sync_active()
        return seqs

    def compaction(self) -> tuple[list[int], list[int]]:
        """(src, dst) slot moves that pack the running sequences into the lowest slots, once
        no sequence waits (then the tail of a call runs on ever fewer rows)."""
        if self.waiting:
            return [], []
        active = self.active
        count = len(active)
        src = [s for s in active if s >= count]
        dst = [s for s in range(count) if self.slot_seq[s] < 0]
        return src, dst

    def move(self, src: list[int], dst: list[int]) -> None:
        for a, b in zip(src, dst, strict=True):
            self.slot_seq[b], self.slot_seq[a] = self.slot_seq[a], -1
            self.start_pos[b] = self.start_pos[a]
            self.admitted_at[b] = self.admitted_at[a]
        self._sync_active()

    def _sync_active(self) -> None:
        self.active = [s for s, q in enumerate(self.slot_seq) if q >= 0]
        # Cached so a step costs O(1) on the host: the furthest position is max over the
        # slots of start_pos - admitted_at (plus step); the first to end is the oldest.
        self._lead = max((self.start_pos[s] - self.admitted_at[s] for s in self.active), default=0)
        self._oldest = min((self.admitted_at[s] for s in self.active), default=0)
