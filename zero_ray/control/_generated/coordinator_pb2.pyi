from zero_ray.control._generated import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ("header", "flight")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    flight: bool
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., flight: _Optional[bool] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node", "healthy", "state", "memory", "last_heartbeat")
    class MemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    healthy: bool
    state: str
    memory: _containers.ScalarMap[str, int]
    last_heartbeat: float
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., healthy: _Optional[bool] = ..., state: _Optional[str] = ..., memory: _Optional[_Mapping[str, int]] = ..., last_heartbeat: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("world_size", "stage", "step", "last_loss", "state", "ranks", "events", "flight")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    stage: int
    step: int
    last_loss: float
    state: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    events: _containers.RepeatedScalarFieldContainer[str]
    flight: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, world_size: _Optional[int] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., last_loss: _Optional[float] = ..., state: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., events: _Optional[_Iterable[str]] = ..., flight: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("header", "path")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    path: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("header", "reason")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    reason: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class StopReply(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: str
    def __init__(self, state: _Optional[str] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("header", "world_size")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    world_size: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., world_size: _Optional[int] = ...) -> None: ...

class ResizeReply(_message.Message):
    __slots__ = ("previous_world_size", "world_size")
    PREVIOUS_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    previous_world_size: int
    world_size: int
    def __init__(self, previous_world_size: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class MetricsEvent(_message.Message):
    __slots__ = ("step", "loss", "step_seconds", "tokens_per_second", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    step_seconds: float
    tokens_per_second: float
    values: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., step_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...
