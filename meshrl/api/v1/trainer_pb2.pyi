from meshrl.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValuesResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _common_pb2.Tensor
    def __init__(self, values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PolicyUpdateRequest(_message.Message):
    __slots__ = ("batch", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs", "global_step")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    old_logprobs: _common_pb2.Tensor
    advantages: _common_pb2.Tensor
    ref_logprobs: _common_pb2.Tensor
    rollout_logprobs: _common_pb2.Tensor
    global_step: int
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., old_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ref_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class ValueUpdateRequest(_message.Message):
    __slots__ = ("batch", "old_values", "returns", "global_step")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    batch: _common_pb2.SequenceBatch
    old_values: _common_pb2.Tensor
    returns: _common_pb2.Tensor
    global_step: int
    def __init__(self, batch: _Optional[_Union[_common_pb2.SequenceBatch, _Mapping]] = ..., old_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PrepareWeightsRequest(_message.Message):
    __slots__ = ("version", "dtype", "bucket_bytes", "delta", "full")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    version: int
    dtype: str
    bucket_bytes: int
    delta: bool
    full: bool
    def __init__(self, version: _Optional[int] = ..., dtype: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., delta: _Optional[bool] = ..., full: _Optional[bool] = ...) -> None: ...

class SendWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("path", "with_optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    with_optimizer: bool
    def __init__(self, path: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    seconds: float
    def __init__(self, path: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
