"""Credentials of the control plane and the server-side checks every request passes.

Each job has one random bearer token (or reuses ``RAY_AUTH_TOKEN`` when the
cluster has one). The driver writes it, with the job id, to a token file only
its owner can read; the CLI reads that file. Servers install two interceptors,
in this order:

1. :class:`TokenInterceptor` refuses a call whose ``authorization: Bearer <token>``
   metadata is missing or wrong with ``UNAUTHENTICATED``; the handler never runs.
2. :class:`HeaderInterceptor` refuses a request whose ``header.protocol_version``
   this server does not speak or whose ``header.job_id`` is not the server's, with
   ``FAILED_PRECONDITION``. It lives here once rather than in every servicer method.

Without TLS the token crosses the network in clear text: enable TLS
(``ServerConfig.tls_*``) on networks other than the cluster's private one.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from zero_ray.errors import ConfigError

# Bumped on an incompatible change to protos/zero_ray/v1; a server may speak several.
# 2: Step carries a Piece (staged key or dataset indices) and LossTotals; Evaluate.
# 3: every control operation on a live owner is a PartitionOwner method (Setup, Reform, SetPeers,
#    Snapshots, ResizeInfo, Reshard, Rebuild, Status, Close beside Step ... Stats); a failure
#    carries a FailureDetail trailer; Step's lr moved to its reply. A version-2 client is refused.
PROTOCOL_VERSION = 3
SUPPORTED_PROTOCOL_VERSIONS: frozenset[int] = frozenset({PROTOCOL_VERSION})

TOKEN_ENV = "RAY_AUTH_TOKEN"
_AUTH_KEY = "authorization"  # gRPC metadata keys are lower case
_SCHEME = "Bearer "
_TOKEN_FILE_MODE = 0o600
# Anything shorter than this is guessable; token_urlsafe(32) gives 43 characters.
MIN_TOKEN_LENGTH = 16


def new_token(environ: Mapping[str, str] | None = None) -> str:
    """The job's bearer token: ``RAY_AUTH_TOKEN`` when set (so that one secret guards
    the cluster), else a fresh ``secrets.token_urlsafe(32)``."""
    env = os.environ if environ is None else environ
    reused = env.get(TOKEN_ENV, "").strip()
    if reused:
        if len(reused) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"{TOKEN_ENV} is {len(reused)} characters long; the control plane needs at least "
                              f"{MIN_TOKEN_LENGTH}")
        return reused
    return secrets.token_urlsafe(32)


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """What a client needs to talk to a job: its id and its bearer token."""

    job_id: str
    token: str = field(repr=False)  # never in logs or tracebacks

    def __post_init__(self) -> None:
        if not self.job_id:
            raise ConfigError(f"job_id={self.job_id!r} must not be empty")
        if len(self.token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"the token is {len(self.token)} characters long; at least {MIN_TOKEN_LENGTH} needed")


def write_token_file(path: str | os.PathLike[str], credentials: Credentials) -> Path:
    """Write ``credentials`` as JSON to ``path``, readable by the current user only.

    The file is created with mode 0600 under a temporary name and renamed over
    ``path``, so that the token is never in a file others can read, not even for
    the moment between creating and chmod-ing it, and a reader never sees half a file.
    Returns the path written.
    """
    target = Path(path)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    payload = json.dumps({"job_id": credentials.job_id, "token": credentials.token}).encode()
    # O_EXCL: refuse to write through a symlink or into a file someone else prepared.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _TOKEN_FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


def read_token_file(path: str | os.PathLike[str]) -> Credentials:
    """The credentials :func:`write_token_file` wrote. Refuses, like ssh, a file that
    group or others may read, since the token in it may be compromised."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise ConfigError(f"cannot open token file {os.fspath(path)!r}: {err.strerror}") from err
    with os.fdopen(fd, "rb") as src:
        mode = os.fstat(src.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise ConfigError(f"token file {os.fspath(path)!r} has mode {mode:#o}; others may read it. "
                              f"Fix with: chmod 600 {os.fspath(path)}")
        raw = src.read()
    try:
        data = json.loads(raw)
        return Credentials(job_id=str(data["job_id"]), token=str(data["token"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"token file {os.fspath(path)!r} is not a zero_ray token file "
                          f"(JSON with job_id and token): {err}") from err


def read_pem(path: str) -> bytes:
    """A certificate or key file's bytes, for server and client TLS credentials alike."""
    try:
        with open(path, "rb") as src:
            return src.read()
    except OSError as err:
        raise ConfigError(f"cannot read {path!r}: {err.strerror}") from err


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``; pass it as ``metadata=`` on every call. Metadata
    rather than call credentials, which gRPC only allows on TLS channels."""
    return ((_AUTH_KEY, f"{_SCHEME}{token}"),)


Behavior = Callable[[Any, grpc.ServicerContext], Any]


def _same_kind(handler: grpc.RpcMethodHandler, behavior: Behavior) -> grpc.RpcMethodHandler:
    """A method handler running ``behavior`` with the (de)serializers and streaming
    kind of ``handler``, so that a refusal looks to the client like the real method."""
    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, deserialize, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, deserialize, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(behavior, deserialize, serialize)


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler is None:  # unknown method: refuse before revealing that it does not exist
        return grpc.unary_unary_rpc_method_handler(refuse)
    return _same_kind(handler, refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses, with ``UNAUTHENTICATED``, every call without the job's bearer token."""

    def __init__(self, token: str) -> None:
        if len(token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"the token is {len(token)} characters long; at least {MIN_TOKEN_LENGTH} needed")
        self._expected = f"{_SCHEME}{token}".encode()

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        supplied = [value for key, value in handler_call_details.invocation_metadata or () if key == _AUTH_KEY]
        if not supplied:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                            f"{handler_call_details.method}: no bearer token in the {_AUTH_KEY!r} metadata")
        value = supplied[0].encode() if isinstance(supplied[0], str) else supplied[0]
        # Constant time, so that the comparison does not leak how much of a guess was right.
        if len(supplied) == 1 and hmac.compare_digest(value, self._expected):
            return handler
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"{handler_call_details.method}: wrong bearer token")


class HeaderInterceptor(grpc.ServerInterceptor):
    """Refuses, with ``FAILED_PRECONDITION``, a request whose ``RequestHeader`` names
    another job or a protocol version this server does not speak."""

    def __init__(self, job_id: str, versions: frozenset[int] = SUPPORTED_PROTOCOL_VERSIONS) -> None:
        if not job_id:
            raise ConfigError(f"{job_id=} must not be empty")
        if not versions:
            raise ConfigError(f"{versions=} must name at least one protocol version")
        self._job_id = job_id
        self._versions = versions

    def check(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        """Abort the call unless ``request.header`` is acceptable."""
        header = getattr(request, "header", None)
        if header is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request has no RequestHeader")
        # The version first: under another version the rest of the header may mean something else.
        version = header.protocol_version
        if version not in self._versions:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{method}: the client speaks protocol_version={version}, which this server does not "
                          f"(it speaks {sorted(self._versions)}); run the same zero_ray version on both sides "
                          "(upgrade the older one)")
        if header.job_id != self._job_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{method}: job_id={header.job_id!r} is not this server's job {self._job_id!r}; "
                          "the address probably belongs to another (or an earlier) job")

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        # Client-streaming methods have no single request to check; this protocol has none.
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        inner: Behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            self.check(method, request, context)
            return inner(request, context)

        return _same_kind(handler, checked)
