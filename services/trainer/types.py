"""The trainer service's typed values: what its roles take in (protos are converted to
these once, in ``convert.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.ragged import Ragged


@dataclass(frozen=True)
class SequenceBatch:
    """B prompt+response pairs; ``responses.values[k]`` is the k-th response token overall."""

    prompts: Ragged
    responses: Ragged
    loss_mask: Ragged | None = None
    """1 on the response tokens the model sampled, 0 on those it did not (a multi-turn
    rollout's observations): the losses and their token counts leave the 0s out. None:
    every response token is the model's."""

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.responses):
            raise ValueError(
                f"{len(self.prompts)} prompts but {len(self.responses)} responses; "
                "each prompt needs exactly one response"
            )
        if self.loss_mask is not None and not torch.equal(
            self.loss_mask.offsets, self.responses.offsets
        ):
            raise ValueError(
                f"loss_mask has {self.loss_mask.values.numel()} values for "
                f"{self.responses.values.numel()} response tokens, laid out otherwise"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def response_lengths(self) -> torch.Tensor:
        """(b,) int64."""
        return self.responses.lengths

    @property
    def num_response_tokens(self) -> int:
        return self.responses.values.numel()

    @property
    def loss_lengths(self) -> torch.Tensor:
        """(b,) int64 response tokens of each row the losses count (the model's own)."""
        if self.loss_mask is None:
            return self.response_lengths
        lengths = self.loss_mask.lengths
        row_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        counted = (self.loss_mask.values != 0).long()
        return torch.zeros(len(lengths), dtype=torch.int64).index_add_(0, row_of_token, counted)

    def padded_loss_mask(self, width: int) -> torch.Tensor:
        """(b, width) bool: a real response token that the losses count."""
        real = self.responses.to_padded(width=width)[1]
        if self.loss_mask is None:
            return real
        counted = self.loss_mask.to_padded(pad_value=0, width=width)[0].bool()
        return real & counted

    def select(self, rows: torch.Tensor) -> SequenceBatch:
        mask = self.loss_mask.select(rows) if self.loss_mask is not None else None
        return SequenceBatch(self.prompts.select(rows), self.responses.select(rows), mask)

    def check_token_ids(self, vocab_size: int) -> None:
        """Prompt and response ids inside the model's vocabulary (Ragged.check_token_ids)."""
        self.prompts.check_token_ids("prompts", vocab_size)
        self.responses.check_token_ids("responses", vocab_size)
