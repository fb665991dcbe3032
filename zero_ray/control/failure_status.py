"""How a handler's failure becomes a gRPC status, and how a client reads it back.

A failed call ends with a status code (from the exception's type, the table in
:mod:`zero_ray.control.handlers`), a short human-readable message, and the structured
``FailureDetail`` (protos/zero_ray/v1/common.proto) serialized into the binary trailing-metadata
entry ``zero-ray-failure-bin``. Clients rebuild the error from that message's fields; the status
text is for people and logs and is never parsed.

Why a trailer of our own rather than gRPC's rich error model (``grpc-status-details-bin``
holding a ``google.rpc.Status`` with ``Any`` details, grpcio-status): the detail is one message
of this project's protos, so a trailer holding it needs no further dependency (grpcio-status and
googleapis-common-protos), no ``Any`` packing and no type-URL lookup, and any gRPC client in any
language reads it with the generated ``FailureDetail`` alone. What a status can carry is bounded
by the peer's header-list limit (8 KiB by default, trailers included; binary values are
base64-encoded on the wire), so the detail is kept under ``MAX_DETAIL_BYTES`` serialized: the
message and cause are cut at the end, the traceback at its beginning (its last frames matter).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc

from zero_ray.control._generated import common_pb2
from zero_ray.control.handlers import FailureContext
from zero_ray.errors import CollectiveError, FailureDetail, OwnerError, ZeroRayError

_log = logging.getLogger(__name__)


FAILURE_TRAILER = "zero-ray-failure-bin"  # gRPC requires the "-bin" suffix for binary values
MAX_DETAIL_BYTES = 4096  # serialized; about 5.5 KiB base64-encoded, under the default 8 KiB limit
# In UTF-8 bytes, leaving the traceback at least 2 KiB of the detail.
_MAX_MESSAGE_BYTES = 1500
_MAX_CAUSE_BYTES = 400
_MAX_STATUS_CHARS = 1000  # the human-readable status message, also in the trailers
_MAX_TRACE_LINE_CHARS = 300


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status code for a handler's exception."""
    # Order matters: ConfigError is a ZeroRayError too, CollectiveTimeout a TimeoutError.
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, FileNotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (CollectiveError, OwnerError)):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(exc, ZeroRayError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 16] + " ... (truncated)"


def _cut_bytes(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes (cut at the end, never inside a character)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 16].decode(errors="ignore") + " ... (truncated)"


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return "" if cause is None else _cut_bytes(f"{type(cause).__name__}: {cause}", _MAX_CAUSE_BYTES)


def failure_detail(exc: BaseException, *, operation: str, context: FailureContext) -> common_pb2.FailureDetail:
    """``exc`` (being handled: its traceback is read) as a FailureDetail of at most
    ``MAX_DETAIL_BYTES`` serialized."""
    detail = common_pb2.FailureDetail(type=type(exc).__name__, phase=context.phase, operation=operation,
                                      message=_cut_bytes(str(exc), _MAX_MESSAGE_BYTES), cause=_cause(exc))
    if context.rank is not None:
        detail.rank = context.rank
    budget = MAX_DETAIL_BYTES - detail.ByteSize() - 8  # the field's tag and length
    # Lines cut short: the exception's own line repeats the message, which is sent already.
    lines = "".join(traceback.format_exception(exc)).splitlines()
    trace = "\n".join(_cut(line, _MAX_TRACE_LINE_CHARS) for line in lines).encode()
    if len(trace) > budget:
        marker = b"... (earlier frames cut)\n"
        # Keep the end; cutting inside a multi-byte character is undone by errors="ignore".
        trace = marker + trace[len(trace) - max(0, budget - len(marker)):]
    detail.remote_traceback = trace.decode(errors="ignore")
    return detail


@dataclass(frozen=True)
class Failed:
    """A handler's failure, as sent: plain values only."""

    code: grpc.StatusCode
    message: str
    detail: common_pb2.FailureDetail


def _failed(method: str, exc: BaseException, failure: FailureContext) -> Failed:
    """``exc`` (being handled) as its status code, a short message and its FailureDetail."""
    code = status_code(exc)
    if code is grpc.StatusCode.INTERNAL:
        _log.exception("%s: handler failed", method)
    else:
        _log.info("%s: handler raised %s: %s", method, type(exc).__name__, _cut(str(exc), _MAX_STATUS_CHARS))
    detail = failure_detail(exc, operation=method, context=failure)
    return Failed(code, _cut(f"{method}: {type(exc).__name__}: {exc}", _MAX_STATUS_CHARS), detail)


def abort_call(context: grpc.ServicerContext, failed: Failed) -> NoReturn:
    # Called after the except clause: the exception, its traceback and the frames it holds (a
    # half-built model after a MemoryError) are freed before the detail is serialized.
    try:
        context.set_trailing_metadata(((FAILURE_TRAILER, failed.detail.SerializeToString()),))
    except Exception:  # still out of memory: the status alone, which names the type and message
        _log.exception("could not serialize the FailureDetail; sending the status alone")
    context.abort(failed.code, failed.message)
    raise AssertionError("unreachable: context.abort raises")


def handler_failed(method: str, exc: BaseException, failure: Callable[[], FailureContext]) -> Failed:
    """A handler's ``exc`` (being handled) as it is to be sent (``failure()`` gives the rank and
    phase, asked now, after the failure). The servicer runs the call itself and asks this only
    on a failure, then ends the call with ``abort_call`` outside its except clause."""
    return _failed(method, exc, _context(failure))


def reply_failed(method: str, exc: BaseException, result: object,
                 failure: Callable[[], FailureContext]) -> Failed:
    """The handler's ``result`` did not fit its reply message (e.g. a negative count for a
    uint64 field: the handler's bug): ``exc`` as it is to be sent."""
    _log.error("%s: the handler returned a value that does not fit the reply: %r", method, result)
    return _failed(method, exc, _context(failure))


def _context(failure: Callable[[], FailureContext]) -> FailureContext:
    try:
        return failure()
    except Exception:  # the failure itself must still be reported
        _log.exception("failure_context() failed")
        return FailureContext()


def detail_of(err: grpc.RpcError) -> FailureDetail | None:
    """The FailureDetail a failed call carried, or None (a refusal before any handler ran, a
    transport failure, or a server that sends none)."""
    # A grpc.aio call's error (no grpc.Call) carries its trailers too.
    trailers = err.trailing_metadata() if isinstance(err, (grpc.Call, grpc.aio.AioRpcError)) else None
    for key, value in trailers or ():
        if key == FAILURE_TRAILER and isinstance(value, bytes):
            try:
                m = common_pb2.FailureDetail.FromString(value)
            except Exception:  # a malformed trailer: the status alone then  # noqa: BLE001
                _log.warning("ignoring a malformed %s trailer (%d bytes)", FAILURE_TRAILER, len(value))
                return None
            return FailureDetail(type=m.type, message=m.message, rank=m.rank if m.HasField("rank") else None,
                                 phase=m.phase, cause=m.cause, remote_traceback=m.remote_traceback,
                                 operation=m.operation)
    return None
