from meshrl.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_SUCCEEDED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_REJECTED: _ClassVar[RunState]
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_SUCCEEDED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_REJECTED: RunState

class StartRunRequest(_message.Message):
    __slots__ = ("config_yaml", "overrides")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, config_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "state", "step", "total_steps", "message", "run_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    step: int
    total_steps: int
    message: str
    run_dir: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., message: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("status", "metrics", "log_line")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOG_LINE_FIELD_NUMBER: _ClassVar[int]
    status: RunStatus
    metrics: _containers.ScalarMap[str, float]
    log_line: str
    def __init__(self, status: _Optional[_Union[RunStatus, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., log_line: _Optional[str] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ...) -> None: ...

class RolloutReplicaRequest(_message.Message):
    __slots__ = ("run_id", "address")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    address: str
    def __init__(self, run_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...
