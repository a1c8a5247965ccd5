"""Trainer protos -> the typed values the roles take, with the checks a request must pass
(one float per response token, a checkpoint path)."""

from __future__ import annotations

import torch

from meshrl.api.v1 import common_pb2, trainer_pb2
from meshrl.ragged import Ragged
from meshrl.wire import ragged_from_proto, tensor_from_proto
from services.trainer.types import SequenceBatch


def batch_from_proto(msg: common_pb2.SequenceBatch) -> SequenceBatch:
    responses = ragged_from_proto(msg.responses)
    loss_mask = None
    if msg.loss_mask.dtype:  # a multi-turn rollout's: observations are not the model's
        values = tensor_from_proto(msg.loss_mask).reshape(-1)
        if values.numel() != responses.values.numel():
            raise ValueError(
                f"loss_mask has {values.numel()} values for {responses.values.numel()} "
                "response tokens"
            )
        loss_mask = responses.with_values(values.to(torch.uint8))
    batch = SequenceBatch(ragged_from_proto(msg.prompts), responses, loss_mask)
    if len(batch) == 0:
        raise ValueError("the batch holds no sequences")
    return batch


def per_token(batch: SequenceBatch, msg: common_pb2.Tensor, name: str) -> Ragged | None:
    """A float per response token, laid out like the responses; None if the field is empty."""
    if not msg.dtype:
        return None
    values = tensor_from_proto(msg).float().reshape(-1)
    if values.numel() != batch.num_response_tokens:
        raise ValueError(
            f"{name} has {values.numel()} values for {batch.num_response_tokens} response tokens"
        )
    return batch.responses.with_values(values)


def required_per_token(batch: SequenceBatch, msg: common_pb2.Tensor, name: str) -> Ragged:
    """As :func:`per_token`, for a field the update cannot run without."""
    values = per_token(batch, msg, name)
    if values is None:
        raise ValueError(f"{name} is missing: it needs one float per response token")
    return values


def checkpoint_path(req: trainer_pb2.CheckpointRequest) -> str:
    if not req.path:
        raise ValueError("checkpoint path is empty")
    return req.path
