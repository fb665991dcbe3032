from zero_ray.control._generated import common_pb2 as _common_pb2
from zero_ray.control._generated import owner_pb2 as _owner_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchRequest(_message.Message):
    __slots__ = ("header", "interval_ms", "stall_ms", "relay")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    STALL_MS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    interval_ms: int
    stall_ms: int
    relay: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., interval_ms: _Optional[int] = ..., stall_ms: _Optional[int] = ..., relay: _Optional[int] = ...) -> None: ...

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

class RelayChildSeat(_message.Message):
    __slots__ = ("ranks", "host", "node", "address", "relay")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    host: int
    node: str
    address: str
    relay: int
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., host: _Optional[int] = ..., node: _Optional[str] = ..., address: _Optional[str] = ..., relay: _Optional[int] = ...) -> None: ...

class HostedRelay(_message.Message):
    __slots__ = ("relay", "children")
    RELAY_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    relay: int
    children: _containers.RepeatedCompositeFieldContainer[RelayChildSeat]
    def __init__(self, relay: _Optional[int] = ..., children: _Optional[_Iterable[_Union[RelayChildSeat, _Mapping]]] = ...) -> None: ...

class HostRelaysRequest(_message.Message):
    __slots__ = ("header", "relays", "margin_s")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    MARGIN_S_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    relays: _containers.RepeatedCompositeFieldContainer[HostedRelay]
    margin_s: float
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., relays: _Optional[_Iterable[_Union[HostedRelay, _Mapping]]] = ..., margin_s: _Optional[float] = ...) -> None: ...

class HostRelaysReply(_message.Message):
    __slots__ = ("relays",)
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    relays: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, relays: _Optional[_Iterable[int]] = ...) -> None: ...

class RelayStepRequest(_message.Message):
    __slots__ = ("header", "timeout_s", "relay", "step", "ranks", "counts", "indices")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    timeout_s: float
    relay: int
    step: _owner_pb2.StepRequest
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpan]
    counts: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., timeout_s: _Optional[float] = ..., relay: _Optional[int] = ..., step: _Optional[_Union[_owner_pb2.StepRequest, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankSpan, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

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

class RelayEvaluateRequest(_message.Message):
    __slots__ = ("header", "timeout_s", "relay", "evaluate", "ranks", "counts", "indices")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    timeout_s: float
    relay: int
    evaluate: _owner_pb2.EvaluateRequest
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpan]
    counts: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., timeout_s: _Optional[float] = ..., relay: _Optional[int] = ..., evaluate: _Optional[_Union[_owner_pb2.EvaluateRequest, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankSpan, _Mapping]]] = ..., counts: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class RelayEvaluateReply(_message.Message):
    __slots__ = ("ranks", "totals", "failure")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpan]
    totals: SubtreeTotals
    failure: FailedRank
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankSpan, _Mapping]]] = ..., totals: _Optional[_Union[SubtreeTotals, _Mapping]] = ..., failure: _Optional[_Union[FailedRank, _Mapping]] = ...) -> None: ...

class RelayCallRequest(_message.Message):
    __slots__ = ("header", "timeout_s", "relay", "method", "request", "ranks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    timeout_s: float
    relay: int
    method: str
    request: bytes
    ranks: _containers.RepeatedCompositeFieldContainer[RankSpan]
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., timeout_s: _Optional[float] = ..., relay: _Optional[int] = ..., method: _Optional[str] = ..., request: _Optional[bytes] = ..., ranks: _Optional[_Iterable[_Union[RankSpan, _Mapping]]] = ...) -> None: ...

class RankReply(_message.Message):
    __slots__ = ("rank", "reply", "failure")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reply: bytes
    failure: FailedRank
    def __init__(self, rank: _Optional[int] = ..., reply: _Optional[bytes] = ..., failure: _Optional[_Union[FailedRank, _Mapping]] = ...) -> None: ...

class RelayCallReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[RankReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[RankReply, _Mapping]]] = ...) -> None: ...
