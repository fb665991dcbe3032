from zero_ray.control._generated import common_pb2 as _common_pb2
from zero_ray.control._generated import owner_pb2 as _owner_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("header", "interval_ms", "stall_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    STALL_MS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    interval_ms: int
    stall_ms: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., interval_ms: _Optional[int] = ..., stall_ms: _Optional[int] = ...) -> None: ...

class RankLoss(_message.Message):
    __slots__ = ("rank", "reason", "unwatched")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNWATCHED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    unwatched: bool
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ..., unwatched: _Optional[bool] = ...) -> None: ...

class SubtreeBeats(_message.Message):
    __slots__ = ("beats", "lost")
    BEATS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    beats: _containers.RepeatedCompositeFieldContainer[_owner_pb2.Heartbeat]
    lost: _containers.RepeatedCompositeFieldContainer[RankLoss]
    def __init__(self, beats: _Optional[_Iterable[_Union[_owner_pb2.Heartbeat, _Mapping]]] = ..., lost: _Optional[_Iterable[_Union[RankLoss, _Mapping]]] = ...) -> None: ...

class RankStep(_message.Message):
    __slots__ = ("rank", "args")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    args: _owner_pb2.StepRequest
    def __init__(self, rank: _Optional[int] = ..., args: _Optional[_Union[_owner_pb2.StepRequest, _Mapping]] = ...) -> None: ...

class RelayStepRequest(_message.Message):
    __slots__ = ("header", "steps", "timeout_s")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    steps: _containers.RepeatedCompositeFieldContainer[RankStep]
    timeout_s: float
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[RankStep, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ExactSumValue(_message.Message):
    __slots__ = ("units", "pos_inf", "neg_inf", "nan")
    UNITS_FIELD_NUMBER: _ClassVar[int]
    POS_INF_FIELD_NUMBER: _ClassVar[int]
    NEG_INF_FIELD_NUMBER: _ClassVar[int]
    NAN_FIELD_NUMBER: _ClassVar[int]
    units: bytes
    pos_inf: bool
    neg_inf: bool
    nan: bool
    def __init__(self, units: _Optional[bytes] = ..., pos_inf: _Optional[bool] = ..., neg_inf: _Optional[bool] = ..., nan: _Optional[bool] = ...) -> None: ...

class SubtreeTotals(_message.Message):
    __slots__ = ("loss_sum", "samples", "count", "items", "counted", "counted_rank")
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    COUNTED_RANK_FIELD_NUMBER: _ClassVar[int]
    loss_sum: ExactSumValue
    samples: int
    count: ExactSumValue
    items: ExactSumValue
    counted: bool
    counted_rank: int
    def __init__(self, loss_sum: _Optional[_Union[ExactSumValue, _Mapping]] = ..., samples: _Optional[int] = ..., count: _Optional[_Union[ExactSumValue, _Mapping]] = ..., items: _Optional[_Union[ExactSumValue, _Mapping]] = ..., counted: _Optional[bool] = ..., counted_rank: _Optional[int] = ...) -> None: ...

class StepAgreed(_message.Message):
    __slots__ = ("grad_norm", "lr", "skipped", "loss_scale", "refused", "rank")
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    grad_norm: float
    lr: float
    skipped: bool
    loss_scale: float
    refused: bool
    rank: int
    def __init__(self, grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., skipped: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., refused: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class RankSpan(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class FailedRank(_message.Message):
    __slots__ = ("rank", "node", "detail", "at")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    detail: _common_pb2.FailureDetail
    at: float
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., detail: _Optional[_Union[_common_pb2.FailureDetail, _Mapping]] = ..., at: _Optional[float] = ...) -> None: ...

class RelayStepReply(_message.Message):
    __slots__ = ("ranks", "totals", "agreed", "compute_seconds", "data_seconds", "data_seconds_sum", "bytes_sent", "nonfinite_loss_ranks", "nonfinite_grad_ranks", "failure")
    class BytesSentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_LOSS_RANKS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_GRAD_RANKS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpan]
    totals: SubtreeTotals
    agreed: StepAgreed
    compute_seconds: float
    data_seconds: float
    data_seconds_sum: ExactSumValue
    bytes_sent: _containers.ScalarMap[str, int]
    nonfinite_loss_ranks: _containers.RepeatedScalarFieldContainer[int]
    nonfinite_grad_ranks: _containers.RepeatedScalarFieldContainer[int]
    failure: FailedRank
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankSpan, _Mapping]]] = ..., totals: _Optional[_Union[SubtreeTotals, _Mapping]] = ..., agreed: _Optional[_Union[StepAgreed, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., data_seconds: _Optional[float] = ..., data_seconds_sum: _Optional[_Union[ExactSumValue, _Mapping]] = ..., bytes_sent: _Optional[_Mapping[str, int]] = ..., nonfinite_loss_ranks: _Optional[_Iterable[int]] = ..., nonfinite_grad_ranks: _Optional[_Iterable[int]] = ..., failure: _Optional[_Union[FailedRank, _Mapping]] = ...) -> None: ...
