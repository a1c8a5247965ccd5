from meshrl.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class EnvironmentSpec(_message.Message):
    __slots__ = ("name", "tools")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, name: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ...) -> None: ...

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("environments",)
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentSpec]
    def __init__(self, environments: _Optional[_Iterable[_Union[EnvironmentSpec, _Mapping]]] = ...) -> None: ...

class EpisodeTask(_message.Message):
    __slots__ = ("environment", "ground_truth", "extra_info_json", "seed")
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    environment: str
    ground_truth: str
    extra_info_json: str
    seed: int
    def __init__(self, environment: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[EpisodeTask]
    def __init__(self, tasks: _Optional[_Iterable[_Union[EpisodeTask, _Mapping]]] = ...) -> None: ...

class EpisodeStarted(_message.Message):
    __slots__ = ("episode_id", "tools")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, episode_id: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeStarted]
    def __init__(self, episodes: _Optional[_Iterable[_Union[EpisodeStarted, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class EpisodeAction(_message.Message):
    __slots__ = ("episode_id", "text", "tool_calls", "parse_error")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PARSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    parse_error: str
    def __init__(self, episode_id: _Optional[str] = ..., text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., parse_error: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("actions", "timeout_s")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[EpisodeAction]
    timeout_s: float
    def __init__(self, actions: _Optional[_Iterable[_Union[EpisodeAction, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _common_pb2.TokenBatch
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("episode_id", "observation", "reward", "done", "error")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    observation: Observation
    reward: float
    done: bool
    error: str
    def __init__(self, episode_id: _Optional[str] = ..., observation: _Optional[_Union[Observation, _Mapping]] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_ids",)
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    episode_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, episode_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...
