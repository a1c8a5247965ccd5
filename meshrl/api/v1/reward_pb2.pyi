from meshrl.api.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("data_source", "response", "ground_truth", "prompt", "extra_info_json")
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    data_source: str
    response: str
    ground_truth: str
    prompt: str
    extra_info_json: str
    def __init__(self, data_source: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., prompt: _Optional[str] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "timeout_s")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    timeout_s: float
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("score", "ok", "reason", "extra", "pred")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCORE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    PRED_FIELD_NUMBER: _ClassVar[int]
    score: float
    ok: bool
    reason: str
    extra: _containers.ScalarMap[str, float]
    pred: str
    def __init__(self, score: _Optional[float] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ..., extra: _Optional[_Mapping[str, float]] = ..., pred: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ListScorersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListScorersResponse(_message.Message):
    __slots__ = ("data_sources",)
    DATA_SOURCES_FIELD_NUMBER: _ClassVar[int]
    data_sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, data_sources: _Optional[_Iterable[str]] = ...) -> None: ...
