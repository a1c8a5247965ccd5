"""Rollout protos <-> the typed values of ``types.py``, both directions, in one place: the
server converts requests in and results out, the client the other way round."""

from __future__ import annotations

import torch

from meshrl.api.v1 import rollout_pb2
from meshrl.wire import ragged_from_proto, ragged_to_proto, tensor_from_proto, tensor_to_proto
from services.rollout.types import GenerationResult, SamplingParams

FINISH_TO_PROTO = {
    "stop": rollout_pb2.FINISH_REASON_STOP,
    "length": rollout_pb2.FINISH_REASON_LENGTH,
}
# An older server may leave a reason unset: it reads as "unknown" rather than failing.
FINISH_FROM_PROTO: dict[int, str] = {
    **{v: k for k, v in FINISH_TO_PROTO.items()},
    rollout_pb2.FINISH_REASON_UNSPECIFIED: "unknown",
}


def sampling_from_proto(msg: rollout_pb2.SamplingParams) -> SamplingParams:
    """top_p 0 means off (1.0) and top_k 0 means off (-1): proto3 has no "unset" for them. The
    seed has presence: unset draws a fresh one each call (as vLLM), instead of every call
    without one sampling the same tokens with seed 0."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        max_tokens=msg.max_tokens,
        n=msg.n,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        logprobs=not msg.skip_logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> rollout_pb2.SamplingParams:
    msg = rollout_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        n=params.n,
        stop_token_ids=list(params.stop_token_ids),
        skip_logprobs=not params.logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def generation_to_proto(result: GenerationResult) -> rollout_pb2.GenerateResponse:
    versions = result.token_versions
    return rollout_pb2.GenerateResponse(
        responses=ragged_to_proto(result.responses),
        logprobs=tensor_to_proto(result.logprobs.values),
        finish_reasons=[FINISH_TO_PROTO[r] for r in result.finish_reasons],
        weight_version=result.weight_version,
        token_versions=tensor_to_proto(versions.values) if versions is not None else None,
    )


def generation_from_proto(msg: rollout_pb2.GenerateResponse) -> GenerationResult:
    """An empty ``token_versions`` (an older server too) reads as None: every token of
    ``weight_version``."""
    responses = ragged_from_proto(msg.responses)
    versions = None
    if msg.HasField("token_versions") and msg.token_versions.dtype:
        values = tensor_from_proto(msg.token_versions).to(torch.int64)
        if values.shape != responses.values.shape:
            raise ValueError(
                f"token_versions has {values.numel()} values for "
                f"{responses.values.numel()} response tokens"
            )
        versions = responses.with_values(values)
    return GenerationResult(
        responses=responses,
        logprobs=responses.with_values(tensor_from_proto(msg.logprobs).float()),
        finish_reasons=[FINISH_FROM_PROTO[r] for r in msg.finish_reasons],  # type: ignore[misc]
        weight_version=msg.weight_version,
        token_versions=versions,
    )
