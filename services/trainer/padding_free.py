"""Padding-free model inputs: a micro-batch's prompt+response sequences concatenated into
one ``(1, T)`` row, with no padding token anywhere.

``position_ids`` restart at 0 with every sequence, so rotary embeddings see each sequence
as if it were alone, and ``cu_seq_lens`` keep attention inside each sequence (see
``varlen_attention.py``). Only the positions that predict a response token reach the LM
head (``logits_to_keep`` as a tensor of positions); their outputs are then laid out
``(b, r)`` exactly as :class:`~services.trainer.sequences.PackedSequences` lays them out,
so everything after the forward (losses, scoring) is shared by both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.sequences import PackedSequences, pack_sequences, to_device
from services.trainer.types import SequenceBatch


@dataclass(frozen=True)
class FlatSequences:
    """b sequences in one row of T tokens; response token j of row i is predicted at row
    position ``starts[i] + prompt_len[i] + j - 1``."""

    input_ids: torch.Tensor  # (1, T) int64
    position_ids: torch.Tensor  # (1, T) int64, 0 at each sequence's first token
    cu_seq_lens: torch.Tensor  # (b + 1,) int32 offsets of the sequences in the row
    max_length: int  # longest sequence
    response_ids: torch.Tensor  # (b, r) int64, 0 on padding
    response_mask: torch.Tensor  # (b, r) bool
    predictor_index: torch.Tensor  # (n,) int64 row positions predicting the n response tokens
    response_slot: torch.Tensor  # (b, r) int64 index into predictor_index; 0 on padding

    @property
    def attention_mask(self) -> None:
        """No mask: sequence boundaries travel as ``cu_seq_lens``."""
        return None

    @property
    def logits_to_keep(self) -> torch.Tensor:
        """The positions whose outputs are needed: one per response token, in order."""
        return self.predictor_index

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward (those of transformers' varlen path)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }

    def kept_labels(self) -> torch.Tensor:
        """(1, n) the token each kept position predicts: the response tokens, in order."""
        return self.response_ids[self.response_mask].unsqueeze(0)

    def at_responses(self, outputs: torch.Tensor) -> torch.Tensor:
        """``(1, n, ...)`` outputs of the kept positions, or ``(1, T, ...)`` of every
        position, -> ``(b, r, ...)``; entries under a false ``response_mask`` are
        meaningless. (n < T always: a sequence's last token predicts nothing.)"""
        flat = outputs[0]
        if flat.shape[0] == self.input_ids.shape[1]:
            flat = flat[self.predictor_index]  # (n, ...)
        if flat.shape[0] == 0:
            # Every response is empty (n = 0): the slots (all 0, all masked) need one row
            # to point at. A zero row joined to the outputs keeps the graph behind them.
            flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat[self.response_slot]

    def to(self, device: torch.device) -> FlatSequences:
        return FlatSequences(
            to_device(self.input_ids, device),
            to_device(self.position_ids, device),
            to_device(self.cu_seq_lens, device),
            self.max_length,
            to_device(self.response_ids, device),
            to_device(self.response_mask, device),
            to_device(self.predictor_index, device),
            to_device(self.response_slot, device),
        )


def flatten_sequences(batch: SequenceBatch, response_width: int | None = None) -> FlatSequences:
    """Concatenates every prompt and response of ``batch`` into one padding-free row.

    ``response_width`` widens the ``(b, r)`` response tensors as in ``pack_sequences``.
    """
    if len(batch) == 0:
        raise ValueError("empty batch")
    prompt_lens = batch.prompts.lengths  # (b,)
    if bool((prompt_lens < 1).any()):
        raise ValueError(
            "every prompt needs at least one token (the first response token's context)"
        )
    response_lens = batch.responses.lengths
    seq_lens = prompt_lens + response_lens  # (b,)
    ids = []
    for i in range(len(batch)):
        ids += [batch.prompts.row(i), batch.responses.row(i)]
    input_ids = torch.cat(ids).to(torch.int64).unsqueeze(0)  # (1, T)
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # (b,) first position of each sequence
    seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), seq_lens)  # (T,)
    position_ids = torch.arange(input_ids.shape[1]) - starts[seq_of_token]  # (T,)
    response_ids, response_mask = batch.responses.to_padded(pad_value=0, width=response_width)
    r = response_ids.shape[1]
    predictor = (starts + prompt_lens - 1).unsqueeze(1) + torch.arange(r).unsqueeze(0)  # (b, r)
    slot = torch.cumsum(response_mask.flatten(), 0).view_as(response_mask) - 1  # (b, r)
    return FlatSequences(
        input_ids=input_ids,
        position_ids=position_ids.unsqueeze(0),
        cu_seq_lens=torch.cat([seq_lens.new_zeros(1), torch.cumsum(seq_lens, 0)]).to(torch.int32),
        max_length=int(seq_lens.max()),
        response_ids=response_ids.to(torch.int64),
        response_mask=response_mask,
        predictor_index=predictor[response_mask],
        response_slot=torch.where(response_mask, slot, torch.zeros_like(slot)),
    )


ModelBatch = PackedSequences | FlatSequences
"""A micro-batch's model inputs in either layout."""


def pack_micro_batch(
    batch: SequenceBatch, padding_free: bool, response_width: int | None = None
) -> ModelBatch:
    """One padding-free row (``use_remove_padding``), else right-padded rows."""
    if padding_free:
        return flatten_sequences(batch, response_width)
    return pack_sequences(batch, response_width)
