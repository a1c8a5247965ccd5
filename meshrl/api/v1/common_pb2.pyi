from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("ids", "offsets")
    IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    offsets: Tensor
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("api_version", "service", "role", "model_path", "weight_version", "world_size", "num_parameters", "ready", "meshrl_version", "gpus", "update_count")
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    MESHRL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    api_version: str
    service: str
    role: str
    model_path: str
    weight_version: int
    world_size: int
    num_parameters: int
    ready: bool
    meshrl_version: str
    gpus: _containers.RepeatedScalarFieldContainer[str]
    update_count: int
    def __init__(self, api_version: _Optional[str] = ..., service: _Optional[str] = ..., role: _Optional[str] = ..., model_path: _Optional[str] = ..., weight_version: _Optional[int] = ..., world_size: _Optional[int] = ..., num_parameters: _Optional[int] = ..., ready: _Optional[bool] = ..., meshrl_version: _Optional[str] = ..., gpus: _Optional[_Iterable[str]] = ..., update_count: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("config_yaml", "run_dir")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    run_dir: str
    def __init__(self, config_yaml: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class InitializeResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ServerInfo
    def __init__(self, info: _Optional[_Union[ServerInfo, _Mapping]] = ...) -> None: ...

class SequenceBatch(_message.Message):
    __slots__ = ("prompts", "responses", "loss_mask")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompts: TokenBatch
    responses: TokenBatch
    loss_mask: Tensor
    def __init__(self, prompts: _Optional[_Union[TokenBatch, _Mapping]] = ..., responses: _Optional[_Union[TokenBatch, _Mapping]] = ..., loss_mask: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("batch", "temperature", "with_entropy", "base_model")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    WITH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    batch: SequenceBatch
    temperature: float
    with_entropy: bool
    base_model: bool
    def __init__(self, batch: _Optional[_Union[SequenceBatch, _Mapping]] = ..., temperature: _Optional[float] = ..., with_entropy: _Optional[bool] = ..., base_model: _Optional[bool] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("logprobs", "entropy", "weight_version", "update_count")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_COUNT_FIELD_NUMBER: _ClassVar[int]
    logprobs: Tensor
    entropy: Tensor
    weight_version: int
    update_count: int
    def __init__(self, logprobs: _Optional[_Union[Tensor, _Mapping]] = ..., entropy: _Optional[_Union[Tensor, _Mapping]] = ..., weight_version: _Optional[int] = ..., update_count: _Optional[int] = ...) -> None: ...

class WeightGroupSpec(_message.Message):
    __slots__ = ("transport", "master_addr", "master_port", "world_size", "rank", "timeout_s", "group_id")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    transport: str
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    timeout_s: float
    group_id: str
    def __init__(self, transport: _Optional[str] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_s: _Optional[float] = ..., group_id: _Optional[str] = ...) -> None: ...

class JoinWeightGroupRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: WeightGroupSpec
    def __init__(self, spec: _Optional[_Union[WeightGroupSpec, _Mapping]] = ...) -> None: ...

class JoinWeightGroupResponse(_message.Message):
    __slots__ = ("group_id",)
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    def __init__(self, group_id: _Optional[str] = ...) -> None: ...

class ParamSlot(_message.Message):
    __slots__ = ("name", "shape", "offset", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("params", "numel", "dtype")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    params: _containers.RepeatedCompositeFieldContainer[ParamSlot]
    numel: int
    dtype: str
    def __init__(self, params: _Optional[_Iterable[_Union[ParamSlot, _Mapping]]] = ..., numel: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "buckets", "group_id", "ipc_handles", "delta", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    group_id: str
    ipc_handles: bytes
    delta: bool
    base_version: int
    def __init__(self, version: _Optional[int] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., group_id: _Optional[str] = ..., ipc_handles: _Optional[bytes] = ..., delta: _Optional[bool] = ..., base_version: _Optional[int] = ...) -> None: ...

class WeightSyncResult(_message.Message):
    __slots__ = ("version", "seconds", "bytes", "delta", "changed", "elements")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    seconds: float
    bytes: int
    delta: bool
    changed: int
    elements: int
    def __init__(self, version: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., delta: _Optional[bool] = ..., changed: _Optional[int] = ..., elements: _Optional[int] = ...) -> None: ...
