"""What every typed control-plane client shares: where and how it connects
(:class:`ClientConfig`), the channel, the header and token on every call, deadlines, server
streams (:class:`Stream`) and how a failed call becomes an error.

gRPC failures surface as :class:`~zero_ray.errors.ControlError` carrying the status code's name:
:class:`~zero_ray.errors.RemoteFailure` when the handler raised (its ``detail`` is the
structured FailureDetail the server sent, see :mod:`zero_ray.control.failure_status`),
:class:`~zero_ray.errors.AuthError` for a refused token; the ``grpc.RpcError`` stays reachable
as ``__cause__``.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from zero_ray.control._generated import common_pb2
from zero_ray.control.auth import PROTOCOL_VERSION, Credentials, bearer_metadata, read_pem
from zero_ray.control.failure_status import detail_of
from zero_ray.errors import AuthError, ConfigError, ControlError, RemoteFailure

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


def check_timeout(name: str, value: float) -> float:
    """``value`` when it is a usable number of seconds, else ConfigError naming ``name``."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value} must be a finite number of seconds > 0")
    return value


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"address={address!r} must be HOST:PORT (an IPv6 host in brackets)")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"address={address!r}: put the IPv6 host in brackets, e.g. [::1]:{port}")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where and how a client connects.

    ``timeout_s`` is the deadline of every call that names none. TLS is on when
    ``tls_ca`` (the CA that signed the server's certificate) is given;
    ``tls_cert``/``tls_key`` add a client certificate (mTLS), and
    ``tls_server_name`` overrides the name checked against the server's
    certificate (for certificates issued to a name while dialling an IP).
    """

    address: str
    credentials: Credentials
    timeout_s: float = 30.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _split_address(self.address)
        check_timeout("timeout_s", self.timeout_s)
        if not 1024 <= self.max_message_bytes <= _GRPC_MAX_MESSAGE_BYTES:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes} must be in "
                              f"[1024, {_GRPC_MAX_MESSAGE_BYTES}]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r}: give both or neither")
        if self.tls_ca is None and (self.tls_cert is not None or self.tls_server_name is not None):
            raise ConfigError(f"tls_cert={self.tls_cert!r}, tls_server_name={self.tls_server_name!r} need "
                              "tls_ca (TLS is on only with a CA to check the server against)")
        if self.protocol_version < 1:
            raise ConfigError(f"protocol_version={self.protocol_version} must be >= 1")


def channel_settings(config: ClientConfig) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """The credentials (None: plaintext) and options every channel to ``config.address`` uses,
    blocking (``_channel``) or asyncio (``control/heartbeats.py``)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Node addresses are cluster-internal: an http_proxy in the environment must not capture them.
        ("grpc.enable_http_proxy", 0),
    ]
    if config.tls_ca is None:
        return None, options
    if config.tls_server_name is not None:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read_pem(config.tls_ca),
        private_key=read_pem(config.tls_key) if config.tls_key is not None else None,
        certificate_chain=read_pem(config.tls_cert) if config.tls_cert is not None else None,
    )
    return credentials, options


def header_of(config: ClientConfig) -> common_pb2.RequestHeader:
    """The header every request to a job's server carries."""
    return common_pb2.RequestHeader(job_id=config.credentials.job_id, protocol_version=config.protocol_version)


def _channel(config: ClientConfig) -> grpc.Channel:
    credentials, options = channel_settings(config)
    if credentials is None:
        return grpc.insecure_channel(config.address, options=options)
    return grpc.secure_channel(config.address, credentials, options=options)


def convert_error(where: str, err: grpc.RpcError, timeout_s: float | None) -> ControlError:
    """A failed call as a ControlError carrying its status code's name: RemoteFailure (with the
    handler's FailureDetail) when the handler raised, AuthError for a refused token. A
    ``grpc.aio`` call's error carries its status too, though it is no ``grpc.Call``."""
    status = isinstance(err, (grpc.Call, grpc.aio.AioRpcError))
    code = err.code() if status else grpc.StatusCode.UNKNOWN
    details = (err.details() if status else str(err)) or "no details"
    detail = detail_of(err)
    if detail is not None:
        return RemoteFailure(f"{where} failed with {code.name}: {detail.type}: {detail.message}", code=code.name,
                             detail=detail)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthError(f"{where} was refused ({code.name}): {details}", code=code.name)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        limit = f"its deadline of {timeout_s:g}s" if timeout_s is not None else "its deadline"
        return ControlError(f"{where} did not finish within {limit} (DEADLINE_EXCEEDED: {details})", code=code.name)
    if code is grpc.StatusCode.UNAVAILABLE:
        return ControlError(f"{where} failed: the server is unreachable (UNAVAILABLE: {details})", code=code.name)
    return ControlError(f"{where} failed with {code.name}: {details}", code=code.name)


class _StallWatch:
    """One thread watching every open stream that has a stall bound, polling each one's
    timestamp. A thread per stream cost 4.6 s of the driver's 7.05 s of CPU per step at 1,024
    owners (benchmarks.control_scale: 1,024 threads each waking every 0.25 s). The poll is what
    a stall's detection may lag by: stall_s / 20, between 10 ms and 250 ms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[weakref.ref[Stream[Any]], float]] = {}
        self._thread: threading.Thread | None = None

    def add(self, stream: Stream[Any], stall_s: float) -> None:
        # A weak reference, so that a stream dropped without close() is still collected (gRPC
        # cancels a collected call) and forgotten here.
        with self._lock:
            self._streams[id(stream)] = (weakref.ref(stream), stall_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zero-ray-stream-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._streams:
                    self._thread = None  # the next add starts another
                    return
                items = list(self._streams.items())
            poll = min(min(max(stall / 20.0, 0.01), 0.25) for _, (_, stall) in items)
            time.sleep(poll)  # a timer, not synchronisation: what detection may lag by
            now, gone = time.monotonic(), []
            for key, (ref, stall) in items:
                stream = ref()
                if stream is None or stream._done.is_set():
                    gone.append(key)
                    continue
                since = stream._waiting_since
                if since is not None and now - since > stall:
                    stream._stalled = True
                    stream._call.cancel()
                    gone.append(key)
            if gone:
                with self._lock:
                    for key in gone:
                        self._streams.pop(key, None)


_WATCH = _StallWatch()


class Stream(Generic[T]):
    """An open server stream. Iterate for its messages; :meth:`close` (or leaving a
    ``with`` block) cancels the call and ends the iteration.

    ``stall_s`` bounds the wait for each message: when none arrives within it the
    call is cancelled and iteration raises :class:`ControlError`. ``end_is_error``
    is for streams that only end when their server goes away (heartbeats).
    """

    def __init__(self, call: Any, convert: Callable[[Any], T], where: str, *, stall_s: float | None,
                 timeout_s: float | None, end_is_error: bool) -> None:
        self._call = call
        self._convert = convert
        self._where = where
        self._stall_s = stall_s
        self._timeout_s = timeout_s
        self._end_is_error = end_is_error
        self._closed = False
        self._stalled = False
        self._done = threading.Event()
        # When the consumer began waiting in next(); None while it is busy elsewhere, so
        # that a slow consumer is not mistaken for a silent server.
        self._waiting_since: float | None = None
        if stall_s is not None:
            _WATCH.add(self, stall_s)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        self._waiting_since = time.monotonic()
        try:
            message = next(self._call)
        except StopIteration:
            self._done.set()
            if self._end_is_error and not self._closed:
                raise ControlError(f"{self._where} ended: the server stopped streaming (shutting down?)") from None
            raise
        except grpc.RpcError as err:
            self._done.set()
            if self._closed:
                raise StopIteration from None
            if self._stalled:
                raise ControlError(f"{self._where} sent nothing for {self._stall_s:g}s (stall_s); "
                                   "the stream was cancelled") from err
            raise convert_error(self._where, err, self._timeout_s) from err
        finally:
            self._waiting_since = None
        return self._convert(message)

    def close(self) -> None:
        """Cancel the call; iteration then stops. Idempotent."""
        self._closed = True
        self._done.set()
        self._call.cancel()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Pending(Generic[T]):
    """A unary call in flight in gRPC's future form: no thread of ours waits for it, so a
    fan-out to many owners costs one callback each instead of a pool thread each."""

    def __init__(self, future: Any, convert: Callable[[Any], T], where: str, timeout_s: float) -> None:
        self._future = future
        self._convert = convert
        self._where = where
        self._timeout_s = timeout_s

    def add_done_callback(self, fn: Callable[[Pending[T]], None]) -> None:
        """Call ``fn(self)`` once the call ends (on gRPC's thread: keep it short)."""
        self._future.add_done_callback(lambda _: fn(self))

    def done(self) -> bool:
        """Whether the call has ended (replied, failed or been cancelled)."""
        return self._future.done()

    def result(self) -> T:
        """The reply (blocking until it ends), or ControlError as a blocking call raises it."""
        try:
            return self._convert(self._future.result())
        except grpc.RpcError as err:
            raise convert_error(self._where, err, self._timeout_s) from err

    def cancel(self) -> None:
        self._future.cancel()


class BaseClient:
    """Channel, credentials, header, deadlines and error conversion of a typed client."""

    _SERVICE = ""

    def __init__(self, config: ClientConfig) -> None:
        self._config = config
        self._channel = _channel(config)
        self._metadata = bearer_metadata(config.credentials.token)

    @property
    def config(self) -> ClientConfig:
        """The configuration the client was built with."""
        return self._config

    @property
    def address(self) -> str:
        """The server's ``HOST:PORT``."""
        return self._config.address

    def _header(self) -> common_pb2.RequestHeader:
        return header_of(self._config)

    def _where(self, method: str) -> str:
        return f"{self._SERVICE}.{method} to {self._config.address}"

    def _unary(self, method: str, rpc: Callable[..., T], request: Any, timeout_s: float | None) -> T:
        timeout = check_timeout("timeout_s", self._config.timeout_s if timeout_s is None else timeout_s)
        try:
            return rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise convert_error(self._where(method), err, timeout) from err

    def _unary_future(self, method: str, rpc: Any, request: Any, timeout_s: float | None,
                      convert: Callable[[Any], T]) -> Pending[T]:
        timeout = check_timeout("timeout_s", self._config.timeout_s if timeout_s is None else timeout_s)
        return Pending(rpc.future(request, timeout=timeout, metadata=self._metadata), convert, self._where(method),
                       timeout)

    def _stream(self, method: str, rpc: Callable[..., Any], request: Any, convert: Callable[[Any], T], *,
                stall_s: float | None, timeout_s: float | None, end_is_error: bool) -> Stream[T]:
        if timeout_s is not None:
            check_timeout("timeout_s", timeout_s)
        if stall_s is not None:
            check_timeout("stall_s", stall_s)
        call = rpc(request, timeout=timeout_s, metadata=self._metadata)
        return Stream(call, convert, self._where(method), stall_s=stall_s, timeout_s=timeout_s,
                      end_is_error=end_is_error)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
