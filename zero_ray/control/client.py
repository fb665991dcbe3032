"""Typed gRPC clients of the control plane.

Every call carries the job's bearer token and ``RequestHeader`` and has a
deadline (the method's ``timeout_s`` or the client's default). gRPC failures
surface as :class:`~zero_ray.errors.ControlError` (:class:`~zero_ray.errors.AuthError`
for a refused token), naming the method, the address and the status; the
``grpc.RpcError`` stays reachable as ``__cause__``.

Example::

    client = OwnerClient(ClientConfig(address="10.0.0.5:41003", credentials=creds))
    result = client.step(StepArgs(step=7, piece=Piece(batch_key="0:7"), global_samples=256, generation=0),
                         timeout_s=600)
    client.close()
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

from zero_ray.control._generated import common_pb2, coordinator_pb2, coordinator_pb2_grpc, owner_pb2, owner_pb2_grpc
from zero_ray.control.auth import PROTOCOL_VERSION, Credentials, bearer_metadata, read_pem
from zero_ray.control.handlers import (
    CheckpointResult,
    Heartbeat,
    JobStatus,
    LoadResult,
    MetricsEvent,
    OwnerStats,
    RankStatus,
    ResizeResult,
    SavePhase,
    SaveResult,
    EvaluateArgs,
    EvaluateResult,
    LossTotals,
    Piece,
    StepArgs,
    StepResult,
)
from zero_ray.errors import AuthError, ConfigError, ControlError

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


def _check_timeout(name: str, value: float) -> float:
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
        _check_timeout("timeout_s", self.timeout_s)
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


def _channel(config: ClientConfig) -> grpc.Channel:
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Node addresses are cluster-internal: an http_proxy in the environment must not capture them.
        ("grpc.enable_http_proxy", 0),
    ]
    if config.tls_ca is None:
        return grpc.insecure_channel(config.address, options=options)
    if config.tls_server_name is not None:
        options.append(("grpc.ssl_target_name_override", config.tls_server_name))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read_pem(config.tls_ca),
        private_key=read_pem(config.tls_key) if config.tls_key is not None else None,
        certificate_chain=read_pem(config.tls_cert) if config.tls_cert is not None else None,
    )
    return grpc.secure_channel(config.address, credentials, options=options)


def _convert_error(where: str, err: grpc.RpcError, timeout_s: float | None) -> ControlError:
    code = err.code() if isinstance(err, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (err.details() if isinstance(err, grpc.Call) else str(err)) or "no details"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return AuthError(f"{where} was refused ({code.name}): {details}")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        limit = f"its deadline of {timeout_s:g}s" if timeout_s is not None else "its deadline"
        return ControlError(f"{where} did not finish within {limit} (DEADLINE_EXCEEDED: {details})")
    if code is grpc.StatusCode.UNAVAILABLE:
        return ControlError(f"{where} failed: the server is unreachable (UNAVAILABLE: {details})")
    return ControlError(f"{where} failed with {code.name}: {details}")


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
            # A weak reference, so that a stream dropped without close() is still collected
            # (gRPC cancels a collected call) and its watchdog then ends.
            threading.Thread(target=Stream._watch, args=(weakref.ref(self), self._done, stall_s),
                             name="zero-ray-stream-watchdog", daemon=True).start()

    @staticmethod
    def _watch(ref: weakref.ref[Stream[Any]], done: threading.Event, stall_s: float) -> None:
        # One thread per stream polling a timestamp: cheaper than a timer per message.
        poll = max(stall_s / 4.0, 0.01)
        while not done.wait(poll):
            stream = ref()
            if stream is None:
                return
            since = stream._waiting_since
            if since is not None and time.monotonic() - since > stall_s:
                stream._stalled = True
                stream._call.cancel()
                return
            del stream  # hold no strong reference while waiting

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
            raise _convert_error(self._where, err, self._timeout_s) from err
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


class _Client:
    """Channel, credentials, header, deadlines and error conversion."""

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
        return common_pb2.RequestHeader(job_id=self._config.credentials.job_id,
                                        protocol_version=self._config.protocol_version)

    def _where(self, method: str) -> str:
        return f"{self._SERVICE}.{method} to {self._config.address}"

    def _unary(self, method: str, rpc: Callable[..., T], request: Any, timeout_s: float | None) -> T:
        timeout = _check_timeout("timeout_s", self._config.timeout_s if timeout_s is None else timeout_s)
        try:
            return rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise _convert_error(self._where(method), err, timeout) from err

    def _stream(self, method: str, rpc: Callable[..., Any], request: Any, convert: Callable[[Any], T], *,
                stall_s: float | None, timeout_s: float | None, end_is_error: bool) -> Stream[T]:
        if timeout_s is not None:
            _check_timeout("timeout_s", timeout_s)
        if stall_s is not None:
            _check_timeout("stall_s", stall_s)
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


def _piece(piece: Piece) -> owner_pb2.Piece:
    return owner_pb2.Piece(batch_key=piece.batch_key, dataset=piece.dataset, indices=list(piece.indices))


def _totals(message: owner_pb2.LossTotals) -> LossTotals:
    return LossTotals(loss_sum=message.loss_sum, samples=message.samples, count=message.count,
                      counted=message.counted, items=message.items)


class OwnerClient(_Client):
    """The driver's client of one partition owner (``zero_ray.v1.PartitionOwner``)."""

    _SERVICE = "PartitionOwner"

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._stub = owner_pb2_grpc.PartitionOwnerStub(self._channel)

    def __enter__(self) -> OwnerClient:
        return self

    def step(self, args: StepArgs, *, timeout_s: float | None = None) -> StepResult:
        """Run one step on the owner; ``timeout_s`` should cover the step's compute."""
        request = owner_pb2.StepRequest(header=self._header(), step=args.step, piece=_piece(args.piece),
                                        global_samples=args.global_samples, generation=args.generation,
                                        samples_seen=args.samples_seen)
        reply = self._unary("Step", self._stub.Step, request, timeout_s)
        return StepResult(totals=_totals(reply.totals), grad_norm=reply.grad_norm,
                          skipped=reply.skipped, loss_scale=reply.loss_scale, compute_seconds=reply.compute_seconds,
                          rank=reply.rank, bytes_sent=dict(reply.bytes_sent), lr=reply.lr,
                          nonfinite_loss_ranks=tuple(reply.nonfinite_loss_ranks),
                          nonfinite_grad_ranks=tuple(reply.nonfinite_grad_ranks), refused=reply.refused)

    def evaluate(self, args: EvaluateArgs, *, timeout_s: float | None = None) -> EvaluateResult:
        """The owner's loss on its piece, forward only."""
        request = owner_pb2.EvaluateRequest(header=self._header(), piece=_piece(args.piece),
                                            generation=args.generation)
        reply = self._unary("Evaluate", self._stub.Evaluate, request, timeout_s)
        return EvaluateResult(totals=_totals(reply.totals), rank=reply.rank)

    def save(self, path: str, step: int, *, phase: SavePhase = SavePhase.BOTH,
             timeout_s: float | None = None) -> SaveResult:
        """Have the owner write its shard of the state at ``step`` under ``path``."""
        request = owner_pb2.SaveRequest(header=self._header(), path=path, step=step, phase=phase.value)
        reply = self._unary("Save", self._stub.Save, request, timeout_s)
        return SaveResult(path=reply.path, step=reply.step, bytes_written=reply.bytes_written,
                          record_json=reply.record_json)

    def load(self, path: str, step: int, *, timeout_s: float | None = None) -> LoadResult:
        """Have the owner restore its shard of the state at ``step`` from ``path``."""
        reply = self._unary("Load", self._stub.Load,
                            owner_pb2.LoadRequest(header=self._header(), path=path, step=step), timeout_s)
        return LoadResult(step=reply.step, bytes_read=reply.bytes_read)

    def abort(self, reason: str, generation: int, *, timeout_s: float | None = None) -> bool:
        """Make the owner abandon its step of ``generation``; whether there was one."""
        reply = self._unary("Abort", self._stub.Abort,
                            owner_pb2.AbortRequest(header=self._header(), reason=reason, generation=generation),
                            timeout_s)
        return reply.aborted

    def stats(self, *, timeout_s: float | None = None) -> OwnerStats:
        """The owner's memory and traffic counters."""
        reply = self._unary("Stats", self._stub.Stats, owner_pb2.StatsRequest(header=self._header()), timeout_s)
        return OwnerStats(step=reply.step, rank=reply.rank, world_size=reply.world_size, stage=reply.stage,
                          memory_bytes=dict(reply.memory_bytes), bytes_sent=dict(reply.bytes_sent))

    def heartbeats(self, interval_s: float, *, stall_s: float | None = None,
                   timeout_s: float | None = None) -> Stream[Heartbeat]:
        """Heartbeats every ``interval_s`` until closed. Iteration raises ControlError
        when none arrives within ``stall_s`` (default ``3 * interval_s + 1``) or the
        server ends the stream; ``timeout_s`` optionally bounds the stream's lifetime."""
        _check_timeout("interval_s", interval_s)
        request = owner_pb2.HealthRequest(header=self._header(), interval_ms=max(1, round(interval_s * 1000)))

        def convert(beat: owner_pb2.Heartbeat) -> Heartbeat:
            return Heartbeat(rank=beat.rank, step=beat.step, state=beat.state, timestamp=beat.timestamp,
                             rss_bytes=beat.rss_bytes)

        return self._stream("Health", self._stub.Health, request, convert,
                            stall_s=3.0 * interval_s + 1.0 if stall_s is None else stall_s,
                            timeout_s=timeout_s, end_is_error=True)


class CoordinatorClient(_Client):
    """An operator's client of the driver (``zero_ray.v1.Coordinator``)."""

    _SERVICE = "Coordinator"

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def __enter__(self) -> CoordinatorClient:
        return self

    def status(self, *, timeout_s: float | None = None) -> JobStatus:
        """The job's state, step, loss and per-rank health."""
        reply = self._unary("Status", self._stub.Status, coordinator_pb2.StatusRequest(header=self._header()),
                            timeout_s)
        ranks = tuple(RankStatus(rank=r.rank, node=r.node, healthy=r.healthy, state=r.state,
                                 last_heartbeat=r.last_heartbeat, memory=dict(r.memory)) for r in reply.ranks)
        return JobStatus(world_size=reply.world_size, stage=reply.stage, step=reply.step, last_loss=reply.last_loss,
                         state=reply.state, ranks=ranks, events=tuple(reply.events))

    def checkpoint(self, path: str | None = None, *, timeout_s: float | None = None) -> CheckpointResult:
        """Write a checkpoint now (under ``path``, or the job's directory); returns once written."""
        reply = self._unary("Checkpoint", self._stub.Checkpoint,
                            coordinator_pb2.CheckpointRequest(header=self._header(), path=path or ""), timeout_s)
        return CheckpointResult(path=reply.path, step=reply.step)

    def stop(self, reason: str = "", *, timeout_s: float | None = None) -> str:
        """Ask the job to stop after the current step; returns its state afterwards."""
        reply = self._unary("Stop", self._stub.Stop, coordinator_pb2.StopRequest(header=self._header(), reason=reason),
                            timeout_s)
        return reply.state

    def resize(self, world_size: int, *, timeout_s: float | None = None) -> ResizeResult:
        """Ask the job to continue with ``world_size`` owners."""
        if world_size < 1:
            raise ConfigError(f"{world_size=} must be >= 1")
        reply = self._unary("Resize", self._stub.Resize,
                            coordinator_pb2.ResizeRequest(header=self._header(), world_size=world_size), timeout_s)
        return ResizeResult(previous_world_size=reply.previous_world_size, world_size=reply.world_size)

    def metrics(self, *, timeout_s: float | None, stall_s: float | None = None) -> Stream[MetricsEvent]:
        """One event per finished step until training ends or the stream is closed.
        ``timeout_s`` must be given (None for no limit on the stream's lifetime);
        ``stall_s`` optionally bounds the wait for each event."""

        def convert(event: coordinator_pb2.MetricsEvent) -> MetricsEvent:
            return MetricsEvent(step=event.step, loss=event.loss, step_seconds=event.step_seconds,
                                tokens_per_second=event.tokens_per_second, values=dict(event.values))

        return self._stream("Metrics", self._stub.Metrics, coordinator_pb2.MetricsRequest(header=self._header()),
                            convert, stall_s=stall_s, timeout_s=timeout_s, end_is_error=False)
