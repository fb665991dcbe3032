from zero_ray.control._generated import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SavePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_PHASE_UNSPECIFIED: _ClassVar[SavePhase]
    SAVE_PHASE_SNAPSHOT: _ClassVar[SavePhase]
    SAVE_PHASE_AWAIT: _ClassVar[SavePhase]
SAVE_PHASE_UNSPECIFIED: SavePhase
SAVE_PHASE_SNAPSHOT: SavePhase
SAVE_PHASE_AWAIT: SavePhase

class Piece(_message.Message):
    __slots__ = ("batch_key", "dataset", "indices")
    BATCH_KEY_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    batch_key: str
    dataset: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_key: _Optional[str] = ..., dataset: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("header", "step", "piece", "global_samples", "generation", "samples_seen", "ahead")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SEEN_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    step: int
    piece: Piece
    global_samples: int
    generation: int
    samples_seen: int
    ahead: bool
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., step: _Optional[int] = ..., piece: _Optional[_Union[Piece, _Mapping]] = ..., global_samples: _Optional[int] = ..., generation: _Optional[int] = ..., samples_seen: _Optional[int] = ..., ahead: _Optional[bool] = ...) -> None: ...

class LossTotals(_message.Message):
    __slots__ = ("loss_sum", "samples", "count", "counted", "items")
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    loss_sum: float
    samples: int
    count: float
    counted: bool
    items: float
    def __init__(self, loss_sum: _Optional[float] = ..., samples: _Optional[int] = ..., count: _Optional[float] = ..., counted: _Optional[bool] = ..., items: _Optional[float] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("totals", "grad_norm", "skipped", "loss_scale", "compute_seconds", "bytes_sent", "rank", "lr", "nonfinite_loss_ranks", "nonfinite_grad_ranks", "refused", "data_seconds")
    class BytesSentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_LOSS_RANKS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_GRAD_RANKS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    totals: LossTotals
    grad_norm: float
    skipped: bool
    loss_scale: float
    compute_seconds: float
    bytes_sent: _containers.ScalarMap[str, int]
    rank: int
    lr: float
    nonfinite_loss_ranks: _containers.RepeatedScalarFieldContainer[int]
    nonfinite_grad_ranks: _containers.RepeatedScalarFieldContainer[int]
    refused: bool
    data_seconds: float
    def __init__(self, totals: _Optional[_Union[LossTotals, _Mapping]] = ..., grad_norm: _Optional[float] = ..., skipped: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., bytes_sent: _Optional[_Mapping[str, int]] = ..., rank: _Optional[int] = ..., lr: _Optional[float] = ..., nonfinite_loss_ranks: _Optional[_Iterable[int]] = ..., nonfinite_grad_ranks: _Optional[_Iterable[int]] = ..., refused: _Optional[bool] = ..., data_seconds: _Optional[float] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("header", "piece", "generation")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    piece: Piece
    generation: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., piece: _Optional[_Union[Piece, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class EvaluateReply(_message.Message):
    __slots__ = ("totals", "rank")
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    totals: LossTotals
    rank: int
    def __init__(self, totals: _Optional[_Union[LossTotals, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("header", "path", "step", "phase")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    path: str
    step: int
    phase: SavePhase
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., path: _Optional[str] = ..., step: _Optional[int] = ..., phase: _Optional[_Union[SavePhase, str]] = ...) -> None: ...

class SaveReply(_message.Message):
    __slots__ = ("path", "step", "bytes_written", "record_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    bytes_written: int
    record_json: str
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., bytes_written: _Optional[int] = ..., record_json: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("header", "path", "step")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    path: str
    step: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("step", "bytes_read")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    step: int
    bytes_read: int
    def __init__(self, step: _Optional[int] = ..., bytes_read: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("header", "reason", "generation")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    reason: str
    generation: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("header", "interval_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    interval_ms: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("rank", "step", "state", "timestamp", "rss_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    state: str
    timestamp: float
    rss_bytes: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., state: _Optional[str] = ..., timestamp: _Optional[float] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("memory_bytes", "bytes_sent", "step", "rank", "world_size", "stage", "inside_node_bytes", "cross_node_bytes")
    class MemoryBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BytesSentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INSIDE_NODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CROSS_NODE_BYTES_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: _containers.ScalarMap[str, int]
    bytes_sent: _containers.ScalarMap[str, int]
    step: int
    rank: int
    world_size: int
    stage: int
    inside_node_bytes: int
    cross_node_bytes: int
    def __init__(self, memory_bytes: _Optional[_Mapping[str, int]] = ..., bytes_sent: _Optional[_Mapping[str, int]] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., stage: _Optional[int] = ..., inside_node_bytes: _Optional[int] = ..., cross_node_bytes: _Optional[int] = ...) -> None: ...

class SetupRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class ParamInfo(_message.Message):
    __slots__ = ("name", "shape", "trainable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    trainable: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., trainable: _Optional[bool] = ...) -> None: ...

class ModelLayout(_message.Message):
    __slots__ = ("numel", "padded_numel", "buckets", "params")
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PADDED_NUMEL_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    numel: int
    padded_numel: int
    buckets: int
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    def __init__(self, numel: _Optional[int] = ..., padded_numel: _Optional[int] = ..., buckets: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ...) -> None: ...

class SetupReply(_message.Message):
    __slots__ = ("rank", "layout")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    layout: ModelLayout
    def __init__(self, rank: _Optional[int] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ...) -> None: ...

class ReformRequest(_message.Message):
    __slots__ = ("header", "generation")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    generation: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class ReformReply(_message.Message):
    __slots__ = ("consistent",)
    CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    consistent: bool
    def __init__(self, consistent: _Optional[bool] = ...) -> None: ...

class SetPeersRequest(_message.Message):
    __slots__ = ("header", "backup", "ward")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    WARD_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    backup: int
    ward: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., backup: _Optional[int] = ..., ward: _Optional[int] = ...) -> None: ...

class SetPeersReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotsRequest(_message.Message):
    __slots__ = ("header", "committed_step", "layout_complete")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    committed_step: int
    layout_complete: bool
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., committed_step: _Optional[int] = ..., layout_complete: _Optional[bool] = ...) -> None: ...

class SnapshotsReply(_message.Message):
    __slots__ = ("snapshots_json",)
    SNAPSHOTS_JSON_FIELD_NUMBER: _ClassVar[int]
    snapshots_json: bytes
    def __init__(self, snapshots_json: _Optional[bytes] = ...) -> None: ...

class ResizeInfoRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class ResizeInfoReply(_message.Message):
    __slots__ = ("description_json",)
    DESCRIPTION_JSON_FIELD_NUMBER: _ClassVar[int]
    description_json: bytes
    def __init__(self, description_json: _Optional[bytes] = ...) -> None: ...

class ReshardRequest(_message.Message):
    __slots__ = ("header", "old_world", "new_world", "generation", "description_json")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OLD_WORLD_FIELD_NUMBER: _ClassVar[int]
    NEW_WORLD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_JSON_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    old_world: int
    new_world: int
    generation: int
    description_json: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., old_world: _Optional[int] = ..., new_world: _Optional[int] = ..., generation: _Optional[int] = ..., description_json: _Optional[bytes] = ...) -> None: ...

class RebuildRequest(_message.Message):
    __slots__ = ("header", "position", "world_size", "generation", "restore_json")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTORE_JSON_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    position: int
    world_size: int
    generation: int
    restore_json: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., position: _Optional[int] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., restore_json: _Optional[bytes] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("bytes_sent",)
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    bytes_sent: int
    def __init__(self, bytes_sent: _Optional[int] = ...) -> None: ...

class OwnerStatusRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class OwnerStatusReply(_message.Message):
    __slots__ = ("rank", "world_size", "generation", "step", "phase", "samples_seen", "busy", "detached", "node_id", "host", "ip", "pid", "control_address", "layout", "standby")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SEEN_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    generation: int
    step: int
    phase: str
    samples_seen: int
    busy: bool
    detached: bool
    node_id: str
    host: str
    ip: str
    pid: int
    control_address: str
    layout: ModelLayout
    standby: bool
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., phase: _Optional[str] = ..., samples_seen: _Optional[int] = ..., busy: _Optional[bool] = ..., detached: _Optional[bool] = ..., node_id: _Optional[str] = ..., host: _Optional[str] = ..., ip: _Optional[str] = ..., pid: _Optional[int] = ..., control_address: _Optional[str] = ..., layout: _Optional[_Union[ModelLayout, _Mapping]] = ..., standby: _Optional[bool] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlightRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class CollectiveEvent(_message.Message):
    __slots__ = ("op", "group", "seq", "nbytes", "started", "ended")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    seq: int
    nbytes: int
    started: float
    ended: float
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., nbytes: _Optional[int] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ...) -> None: ...

class FlightReply(_message.Message):
    __slots__ = ("rank", "phase", "phase_since", "now", "current", "recent")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SINCE_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    phase: str
    phase_since: float
    now: float
    current: CollectiveEvent
    recent: _containers.RepeatedCompositeFieldContainer[CollectiveEvent]
    def __init__(self, rank: _Optional[int] = ..., phase: _Optional[str] = ..., phase_since: _Optional[float] = ..., now: _Optional[float] = ..., current: _Optional[_Union[CollectiveEvent, _Mapping]] = ..., recent: _Optional[_Iterable[_Union[CollectiveEvent, _Mapping]]] = ...) -> None: ...
