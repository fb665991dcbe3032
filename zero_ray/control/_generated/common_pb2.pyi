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
