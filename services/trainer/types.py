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

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.responses):
            raise ValueError(
                f"{len(self.prompts)} prompts but {len(self.responses)} responses; "
                "each prompt needs exactly one response"
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

    def select(self, rows: torch.Tensor) -> SequenceBatch:
        return SequenceBatch(self.prompts.select(rows), self.responses.select(rows))

    def check_token_ids(self, vocab_size: int) -> None:
        """Prompt and response ids inside the model's vocabulary (Ragged.check_token_ids)."""
        self.prompts.check_token_ids("prompts", vocab_size)
        self.responses.check_token_ids("responses", vocab_size)
