"""Prompt+response pairs: from ragged token ids to the padded tensors a model reads, and
from per-position model outputs back to per-response-token values.

Each row is its prompt followed by its response, right-padded to the longest row. With a
causal model, right padding leaves every real token's output exactly as in an unpadded
forward: padding only ever comes *after* the tokens that could attend to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.ragged import Ragged
from services.trainer.types import SequenceBatch


@dataclass(frozen=True)
class PackedSequences:
    """Model inputs of a (micro-)batch and where its response tokens are predicted.

    Response token j of row i is predicted by the output at position
    ``prompt_len[i] + j - 1`` (the token before it): ``predictor_index[i, j]``.
    """

    input_ids: torch.Tensor  # (b, t) int64, right-padded
    attention_mask: torch.Tensor  # (b, t) int64, 1 on real tokens
    position_ids: torch.Tensor  # (b, t) int64
    response_ids: torch.Tensor  # (b, r) int64, 0 on padding
    response_mask: torch.Tensor  # (b, r) bool
    predictor_index: torch.Tensor  # (b, r) int64 positions in t; 0 on padding
    first_predictor: int  # no output before this position is ever needed

    @property
    def outputs_needed(self) -> int:
        """How many trailing positions' outputs cover every response token."""
        return self.input_ids.shape[1] - self.first_predictor

    @property
    def logits_to_keep(self) -> int:
        return self.outputs_needed

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }

    def kept_labels(self) -> torch.Tensor:
        """(b, k) the token each of the last ``k = outputs_needed`` positions predicts;
        the last position predicts nothing (label 0)."""
        ids = self.input_ids
        k = self.outputs_needed
        return torch.cat([ids[:, ids.shape[1] - k + 1 :], ids.new_zeros(ids.shape[0], 1)], dim=1)

    def at_responses(self, outputs: torch.Tensor) -> torch.Tensor:
        """See :func:`at_response_positions`."""
        return at_response_positions(outputs, self)

    def to(self, device: torch.device) -> PackedSequences:
        return PackedSequences(
            to_device(self.input_ids, device),
            to_device(self.attention_mask, device),
            to_device(self.position_ids, device),
            to_device(self.response_ids, device),
            to_device(self.response_mask, device),
            to_device(self.predictor_index, device),
            self.first_predictor,
        )


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; from the host to a GPU through pinned memory, without
    waiting. A copy from pageable memory first waits for all the work queued on the GPU,
    so the host could not queue the next micro-batch while the GPU runs the previous one.
    (PyTorch keeps the pinned block until the copy has run.)"""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pack_sequences(
    batch: SequenceBatch, response_width: int | None = None, pad_id: int = 0
) -> PackedSequences:
    """Concatenates each prompt with its response and right-pads the rows.

    ``response_width`` widens the response tensors to a fixed ``r`` (default: the longest
    response), so micro-batches of one batch line up column for column.
    """
    prompt_lens = batch.prompts.lengths  # (b,)
    if len(batch) == 0:
        raise ValueError("empty batch")
    if bool((prompt_lens < 1).any()):
        raise ValueError(
            "every prompt needs at least one token (the first response token's context)"
        )
    rows = [
        torch.cat([batch.prompts.row(i), batch.responses.row(i)]).to(torch.int64)
        for i in range(len(batch))
    ]
    input_ids, real = Ragged.from_tensors(rows).to_padded(pad_value=pad_id)  # (b, t)
    response_ids, response_mask = batch.responses.to_padded(pad_value=0, width=response_width)
    r = response_ids.shape[1]
    predictor = prompt_lens.unsqueeze(1) - 1 + torch.arange(r).unsqueeze(0)  # (b, r)
    predictor = torch.where(response_mask, predictor, torch.zeros_like(predictor))
    t = input_ids.shape[1]
    return PackedSequences(
        input_ids=input_ids,
        attention_mask=real.to(torch.int64),
        position_ids=torch.arange(t).unsqueeze(0).expand(len(batch), t).contiguous(),
        response_ids=response_ids.to(torch.int64),
        response_mask=response_mask,
        predictor_index=predictor,
        first_predictor=int(prompt_lens.min()) - 1,
    )


def at_response_positions(outputs: torch.Tensor, packed: PackedSequences) -> torch.Tensor:
    """Picks, for every response token, the output at the position that predicts it.

    Args:
        outputs: ``(b, k, ...)`` outputs of the last ``k = packed.outputs_needed`` positions
            (e.g. logits from ``logits_to_keep=k``), or of all ``t`` positions.

    Returns:
        ``(b, r, ...)``; entries under a false ``response_mask`` are meaningless.
    """
    offset = packed.input_ids.shape[1] - outputs.shape[1]  # positions not in `outputs`
    if offset > packed.first_predictor:
        raise ValueError(f"outputs start at position {offset}, past {packed.first_predictor}")
    index = (packed.predictor_index - offset).clamp(min=0)  # (b, r)
    rows = torch.arange(outputs.shape[0], device=outputs.device).unsqueeze(1)  # (b, 1)
    return outputs[rows, index]


def ragged_to_padded(values: Ragged, width: int) -> torch.Tensor:
    """Flat per-token values (aligned with responses.ids) as ``(b, width)``, 0 on padding."""
    padded, _ = values.to_padded(pad_value=0.0, width=width)
    return padded
