"""The state of sequences decoded together: KV cache, masks, positions and outputs so far.

Rows are the sequences still in the model's batch; ``seq_ids`` maps each row to its slot
in the output buffers. When at most half the rows are still alive the batch is compacted
(rows dropped from the cache too), so finished sequences stop costing compute.

Layout: prompts are left-padded to a common width P and generated tokens follow at columns
P, P+1, ... of the attention mask, so one decode step appends the same column for all rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshrl.ragged import Ragged
from services.rollout.types import FinishReason

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class DecodeBatch:
    cache: DynamicCache
    """The model's KV cache (a transformers DynamicCache), one batch row per ``rows``."""
    prompt_ids: torch.Tensor
    """(rows, P) int64 the left-padded prompts (a weight swap may recompute the cache)."""
    attention_mask: torch.Tensor
    """(rows, P + max_tokens) int64: 1 at real prompt tokens and at generated tokens so far."""
    positions: torch.Tensor
    """(rows,) int64 position id of ``last_tokens`` (the next token fed to the model)."""
    last_tokens: torch.Tensor
    """(rows,) int64 the tokens sampled last, fed at the next decode step."""
    seq_ids: torch.Tensor
    """(rows,) int64 output slot of each row."""
    alive: torch.Tensor
    """(rows,) bool: still generating."""
    tokens: torch.Tensor
    """(num_seqs, max_tokens) int64 output tokens; valid up to ``lengths``."""
    logprobs: torch.Tensor
    """(num_seqs, max_tokens) float32 log-probs of the output tokens."""
    lengths: torch.Tensor
    """(num_seqs,) int64 tokens generated per sequence."""
    stopped: torch.Tensor
    """(num_seqs,) bool: ended by an EOS/stop token (else by max_tokens)."""
    prompt_width: int
    step: int = 0
    """Tokens generated so far by every live row."""

    @staticmethod
    def start(
        cache, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_tokens: int
    ) -> DecodeBatch:
        """A batch right after prefill; prompt_ids and prompt_mask (rows, P) are the
        left-padded prompts."""
        rows, width = prompt_mask.shape
        device = prompt_mask.device
        mask = torch.zeros(rows, width + max_tokens, dtype=torch.int64, device=device)
        mask[:, :width] = prompt_mask
        return DecodeBatch(
            cache=cache,
            prompt_ids=prompt_ids,
            attention_mask=mask,
            positions=prompt_mask.sum(dim=1) - 1,  # the last prompt token's; append moves it on
            last_tokens=torch.zeros(rows, dtype=torch.int64, device=device),
            seq_ids=torch.arange(rows, device=device),
            alive=torch.ones(rows, dtype=torch.bool, device=device),
            tokens=torch.zeros(rows, max_tokens, dtype=torch.int64, device=device),
            logprobs=torch.zeros(rows, max_tokens, dtype=torch.float32, device=device),
            lengths=torch.zeros(rows, dtype=torch.int64, device=device),
            stopped=torch.zeros(rows, dtype=torch.bool, device=device),
            prompt_width=width,
        )

    @property
    def max_tokens(self) -> int:
        return self.tokens.shape[1]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs of the next decode step: tokens (rows, 1), mask (rows, P + step), positions (rows, 1)."""
        width = self.prompt_width + self.step
        return self.last_tokens[:, None], self.attention_mask[:, :width], self.positions[:, None]

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: torch.Tensor) -> int:
        """Records one sampled token per row; returns how many rows are still alive.

        tokens (rows,) int64, logprobs (rows,) float32, stop_ids (s,) int64. Rows already
        finished sample too (they are still in the batch) but nothing of theirs is kept.
        """
        self.tokens[self.seq_ids, self.step] = tokens
        self.logprobs[self.seq_ids, self.step] = logprobs
        self.lengths[self.seq_ids] += self.alive.long()
        hit_stop = torch.isin(tokens, stop_ids) & self.alive
        self.stopped[self.seq_ids] |= hit_stop
        self.alive &= ~hit_stop
        self.step += 1
        if self.step == self.max_tokens:
            self.alive.zero_()
        # The token just sampled is fed next: it gets a mask column and the next position.
        self.attention_mask[:, self.prompt_width + self.step - 1] = 1
        self.last_tokens = tokens
        self.positions += 1
        return int(self.alive.sum())  # the one device-to-host sync of a step

    def compact(self) -> None:
        """Drops finished rows from the model batch (and its KV cache)."""
        keep = self.alive.nonzero().squeeze(1)  # (alive,)
        self.cache.batch_select_indices(keep)
        self.prompt_ids = self.prompt_ids[keep]
        self.attention_mask = self.attention_mask[keep]
        self.positions = self.positions[keep]
        self.last_tokens = self.last_tokens[keep]
        self.seq_ids = self.seq_ids[keep]
        self.alive = self.alive[keep]

    def results(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[FinishReason]]:
        """Per sequence: its tokens (len,) int64, log-probs (len,) float32, finish reason."""
        lengths = self.lengths.tolist()
        tokens = self.tokens.cpu()
        logprobs = self.logprobs.cpu()
        reasons: list[FinishReason] = ["stop" if s else "length" for s in self.stopped.tolist()]
        return (
            [tokens[i, :n] for i, n in enumerate(lengths)],
            [logprobs[i, :n] for i, n in enumerate(lengths)],
            reasons,
        )


def left_pad(
    rows: Ragged, pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids (b, P) int64 and mask (b, P) int64 of ragged prompts."""
    right, mask = rows.to_padded(pad_value=pad_id)  # (b, P) right-padded
    lengths = rows.lengths  # (b,)
    width = right.shape[1]
    # Row i shifts right by P - len_i: gather column (j - shift) mod P.
    shift = (width - lengths)[:, None]  # (b, 1)
    cols = (torch.arange(width)[None, :] - shift) % max(width, 1)  # (b, P)
    ids = right.gather(1, cols).to(torch.int64)
    mask = mask.gather(1, cols).to(torch.int64)
    return ids.to(device), mask.to(device)
