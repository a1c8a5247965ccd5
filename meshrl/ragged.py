"""Ragged batches: variable-length rows stored as one flat tensor plus offsets.

This is how token batches and per-token values travel (flat ids + offsets, no padding on
the wire) and the one place that converts them to and from padded (b, t) tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ragged:
    """Rows of different lengths: row i is ``values[offsets[i]:offsets[i+1]]``.

    values: (total,) any dtype. offsets: (n + 1,) int64, offsets[0] == 0, non-decreasing.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.numel() < 1 or int(self.offsets[0]) != 0:
            raise ValueError("offsets must be 1-D and start at 0")
        if int(self.offsets[-1]) != self.values.numel():
            raise ValueError(
                f"offsets end at {int(self.offsets[-1])} but there are {self.values.numel()} values"
            )
        if self.offsets.numel() > 1 and bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")

    @staticmethod
    def from_lists(rows: Sequence[Sequence[int | float]], dtype=torch.int32) -> Ragged:
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        flat = [x for r in rows for x in r]
        return Ragged(torch.tensor(flat, dtype=dtype), offsets)

    @staticmethod
    def from_tensors(rows: Sequence[torch.Tensor]) -> Ragged:
        lengths = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        values = torch.cat([r.reshape(-1) for r in rows]) if rows else torch.zeros(0)
        return Ragged(values, offsets)

    @staticmethod
    def from_padded(padded: torch.Tensor, lengths: torch.Tensor) -> Ragged:
        """padded (b, t), lengths (b,): keeps the first lengths[i] entries of row i."""
        mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)  # (b, t)
        offsets = torch.zeros(padded.shape[0] + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths.to(torch.int64), 0)
        return Ragged(padded[mask], offsets)

    @staticmethod
    def concat(parts: Sequence[Ragged]) -> Ragged:
        """The rows of ``parts``, one after another (all of one dtype)."""
        if not parts:
            raise ValueError("concat of no Ragged batches")
        values = torch.cat([p.values for p in parts])
        lengths = torch.cat([p.lengths for p in parts])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        return Ragged(values, offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """(n,) int64 row lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def row(self, i: int) -> torch.Tensor:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def tolist(self) -> list[list]:
        flat = self.values.tolist()
        bounds = self.offsets.tolist()
        return [flat[bounds[i] : bounds[i + 1]] for i in range(len(self))]

    def to_padded(self, pad_value=0, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded (b, t) tensor and its (b, t) bool mask; t = max length unless given."""
        lengths = self.lengths
        t = int(lengths.max()) if width is None and len(self) else (width or 0)
        mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # (b, t)
        out = torch.full((len(self), t), pad_value, dtype=self.values.dtype)
        out[mask] = self.values
        return out, mask

    def select(self, indices: Sequence[int] | torch.Tensor) -> Ragged:
        """The rows at ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.int64).tolist()
        return (
            Ragged.from_tensors([self.row(i) for i in idx])
            if idx
            else Ragged(self.values[:0], torch.zeros(1, dtype=torch.int64))
        )

    def with_values(self, values: torch.Tensor) -> Ragged:
        """Same layout, other per-element values (e.g. log-probs aligned with token ids)."""
        return Ragged(values, self.offsets)

    def check_token_ids(self, field: str, vocab_size: int) -> None:
        """Raises ValueError naming the row and id of the first token id outside
        ``[0, vocab_size)``: checked before a forward, where the embedding lookup would fail
        with an unnamed IndexError (on a GPU, a device-side assert that ruins the process)."""
        bad = (self.values < 0) | (self.values >= vocab_size)
        if self.values.numel() and bool(bad.any()):
            flat = int(bad.nonzero()[0])
            row = int(torch.searchsorted(self.offsets, flat, right=True)) - 1
            raise ValueError(
                f"{field}[{row}] holds token id {int(self.values[flat])}, outside the model's "
                f"vocabulary [0, {vocab_size})"
            )
