from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RequestHeader(_message.Message):
    __slots__ = ("job_id", "protocol_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    protocol_version: int
    def __init__(self, job_id: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class FailureDetail(_message.Message):
    __slots__ = ("type", "rank", "phase", "message", "cause", "remote_traceback", "operation")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    type: str
    rank: int
    phase: str
    message: str
    cause: str
    remote_traceback: str
    operation: str
    def __init__(self, type: _Optional[str] = ..., rank: _Optional[int] = ..., phase: _Optional[str] = ..., message: _Optional[str] = ..., cause: _Optional[str] = ..., remote_traceback: _Optional[str] = ..., operation: _Optional[str] = ...) -> None: ...
