from meshrl.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "n", "seed", "stop_token_ids", "skip_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    n: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., skip_logprobs: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    prompts: _common_pb2.TokenBatch
    sampling: SamplingParams
    def __init__(self, prompts: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("responses", "logprobs", "finish_reasons", "weight_version", "token_versions")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    responses: _common_pb2.TokenBatch
    logprobs: _common_pb2.Tensor
    finish_reasons: _containers.RepeatedScalarFieldContainer[FinishReason]
    weight_version: int
    token_versions: _common_pb2.Tensor
    def __init__(self, responses: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finish_reasons: _Optional[_Iterable[_Union[FinishReason, str]]] = ..., weight_version: _Optional[int] = ..., token_versions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class MemoryStateRequest(_message.Message):
    __slots__ = ("release",)
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    release: bool
    def __init__(self, release: _Optional[bool] = ...) -> None: ...

class MemoryStateResponse(_message.Message):
    __slots__ = ("kv_cache_bytes",)
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_cache_bytes: int
    def __init__(self, kv_cache_bytes: _Optional[int] = ...) -> None: ...
