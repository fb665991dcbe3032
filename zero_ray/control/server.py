"""gRPC servers for the control plane: a partition owner's and the driver's.

A :class:`ControlServer` serves handlers (see :mod:`zero_ray.control.handlers`)
on its own thread pool, so that a call such as ``Abort`` is served while another
thread is blocked in a long ``Step``. Every call first passes the token and
header checks of :mod:`zero_ray.control.auth`. Only small control messages
travel here (tensors move through Ray and the collectives), hence the small
default message limit.

Example::

    server = ControlServer(ServerConfig(host=node_ip, credentials=creds))
    server.add_owner(handler)
    address = server.start()   # "HOST:PORT", for the driver to dial
    ...
    server.stop()
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from zero_ray.control._generated import coordinator_pb2, coordinator_pb2_grpc, owner_pb2, owner_pb2_grpc
from zero_ray.control.auth import (
    SUPPORTED_PROTOCOL_VERSIONS,
    Credentials,
    HeaderInterceptor,
    TokenInterceptor,
    read_pem,
)
from zero_ray.control.handlers import (
    CheckpointResult,
    CoordinatorHandler,
    Heartbeat,
    JobStatus,
    LoadResult,
    MetricsEvent,
    OwnerHandler,
    OwnerStats,
    ResizeResult,
    SavePhase,
    SaveResult,
    EvaluateArgs,
    LossTotals,
    Piece,
    StepArgs,
    StepResult,
)
from zero_ray.errors import CollectiveError, ConfigError, ControlError, OwnerError, ZeroRayError

_log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# gRPC's own ceiling for a message length (a signed 32-bit int).
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
# Status details travel in HTTP/2 trailers, whose total size the peer limits (8 KiB by default).
_MAX_DETAILS_CHARS = 4000
_MIN_INTERVAL_MS, _MAX_INTERVAL_MS = 10, 60_000
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets as gRPC targets need."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a :class:`ControlServer` listens.

    ``host`` is the node's own IP (``ray.util.get_node_ip_address()`` on a cluster,
    ``127.0.0.1`` on one machine); wildcards are refused so that the control plane
    is never offered on every interface by accident. ``port`` 0 lets the OS pick.
    ``threads`` bounds concurrent calls; at most ``max_streams`` of them may be
    long-lived streams (Health, Metrics), which leaves threads for ``Step`` and
    ``Abort`` however many monitors connect. TLS is on when ``tls_cert`` and
    ``tls_key`` are given; ``tls_client_ca`` additionally requires client
    certificates signed by that CA (mTLS). ``protocol_versions`` are the header
    versions accepted; ``grace_s`` is how long :meth:`ControlServer.stop` lets calls
    in flight finish.
    """

    host: str
    credentials: Credentials
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    threads: int = 8
    max_streams: int = 4
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    protocol_versions: frozenset[int] = SUPPORTED_PROTOCOL_VERSIONS
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        host = self.host.strip("[]")
        if host in _WILDCARD_HOSTS:
            raise ConfigError(f"host={self.host!r} would listen on every interface; pass the node's own IP "
                              "(ray.util.get_node_ip_address()) or 127.0.0.1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if not 1024 <= self.max_message_bytes <= _GRPC_MAX_MESSAGE_BYTES:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes} must be in "
                              f"[1024, {_GRPC_MAX_MESSAGE_BYTES}]")
        if self.threads < 2:
            raise ConfigError(f"threads={self.threads} must be >= 2, so that Abort is served while Step runs")
        if not 0 <= self.max_streams <= self.threads - 2:
            raise ConfigError(f"max_streams={self.max_streams} must be in [0, threads - 2 = {self.threads - 2}], "
                              "leaving a thread each for Step and Abort")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r}: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(f"tls_client_ca={self.tls_client_ca!r} (mTLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r} is not a file")
        if not self.protocol_versions:
            raise ConfigError(f"protocol_versions={set(self.protocol_versions)} must not be empty")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError(f"grace_s={self.grace_s} must be a finite number >= 0")

    @property
    def bind_host(self) -> str:
        """The host without IPv6 brackets."""
        return self.host.strip("[]")

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS."""
        return self.tls_cert is not None


def _status_for(exc: BaseException) -> grpc.StatusCode:
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


def _details(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_DETAILS_CHARS else text[: _MAX_DETAILS_CHARS - 15] + " ... (truncated)"


def _serve(context: grpc.ServicerContext, method: str, call: Callable[[], R], build: Callable[[R], T]) -> T:
    """Run a handler method and build its reply, turning exceptions into statuses."""
    try:
        result = call()
    except Exception as exc:  # a handler's failure is the caller's answer, not the server's crash
        code = _status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            _log.exception("%s: handler failed", method)
        else:
            _log.info("%s: handler raised %s", method, _details(exc))
        context.abort(code, f"{method}: {_details(exc)}")
        raise  # unreachable: abort raises; keeps type checkers honest
    try:
        return build(result)
    except Exception as exc:  # e.g. a negative count for a uint64 field: the handler's bug
        _log.exception("%s: handler returned an unusable value %r", method, result)
        context.abort(grpc.StatusCode.INTERNAL, f"{method}: the handler returned a value that does not fit "
                                                f"the reply: {_details(exc)}")
        raise


class _Streams:
    """Admission and shutdown of long-lived server streams.

    Each open stream holds a pool thread for its lifetime, so they are capped
    below the pool size. Each gets an event set when the call ends (the client
    cancelled, the deadline passed) or the server stops, which the stream waits
    on between messages instead of sleeping.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._open: set[threading.Event] = set()
        self._closed = False

    @contextmanager
    def open(self, context: grpc.ServicerContext, method: str) -> Iterator[threading.Event]:
        """Admit a stream or abort the call; yields its "finished" event."""
        finished = threading.Event()
        with self._lock:
            refusal = (
                (grpc.StatusCode.UNAVAILABLE, f"{method}: the server is shutting down") if self._closed else
                (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {self._limit} streams are open already "
                                                     f"(max_streams={self._limit}); close one first")
                if len(self._open) >= self._limit else None
            )
            if refusal is None:
                self._open.add(finished)
        if refusal is not None:
            context.abort(*refusal)
        if not context.add_callback(finished.set):  # the call has ended already
            finished.set()
        try:
            yield finished
        finally:
            with self._lock:
                self._open.discard(finished)

    def close(self) -> None:
        """End every open stream and refuse new ones."""
        with self._lock:
            self._closed = True
            for finished in self._open:
                finished.set()


def _interval_s(interval_ms: int, context: grpc.ServicerContext, method: str) -> float:
    if not _MIN_INTERVAL_MS <= interval_ms <= _MAX_INTERVAL_MS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{method}: interval_ms={interval_ms} must be in [{_MIN_INTERVAL_MS}, {_MAX_INTERVAL_MS}]")
    return interval_ms / 1000.0


def _piece(message: owner_pb2.Piece) -> Piece:
    return Piece(batch_key=message.batch_key, dataset=message.dataset, indices=tuple(message.indices))


def _totals(totals: LossTotals) -> owner_pb2.LossTotals:
    return owner_pb2.LossTotals(loss_sum=totals.loss_sum, samples=totals.samples, count=totals.count,
                                counted=totals.counted, items=totals.items)


def _step_reply(result: StepResult) -> owner_pb2.StepReply:
    return owner_pb2.StepReply(totals=_totals(result.totals), grad_norm=result.grad_norm,
                               skipped=result.skipped, loss_scale=result.loss_scale,
                               compute_seconds=result.compute_seconds, bytes_sent=dict(result.bytes_sent),
                               rank=result.rank, lr=result.lr, refused=result.refused,
                               nonfinite_loss_ranks=list(result.nonfinite_loss_ranks),
                               nonfinite_grad_ranks=list(result.nonfinite_grad_ranks))


def _heartbeat(beat: Heartbeat) -> owner_pb2.Heartbeat:
    return owner_pb2.Heartbeat(rank=beat.rank, step=beat.step, state=beat.state, timestamp=beat.timestamp,
                               rss_bytes=beat.rss_bytes)


def _stats_reply(stats: OwnerStats) -> owner_pb2.StatsReply:
    return owner_pb2.StatsReply(memory_bytes=dict(stats.memory_bytes), bytes_sent=dict(stats.bytes_sent),
                                step=stats.step, rank=stats.rank, world_size=stats.world_size, stage=stats.stage)


def _status_reply(status: JobStatus) -> coordinator_pb2.StatusReply:
    ranks = [coordinator_pb2.RankStatus(rank=r.rank, node=r.node, healthy=r.healthy, state=r.state,
                                        memory=dict(r.memory), last_heartbeat=r.last_heartbeat)
             for r in status.ranks]
    return coordinator_pb2.StatusReply(world_size=status.world_size, stage=status.stage, step=status.step,
                                       last_loss=status.last_loss, state=status.state, ranks=ranks,
                                       events=list(status.events))


def _metrics_event(event: MetricsEvent) -> coordinator_pb2.MetricsEvent:
    return coordinator_pb2.MetricsEvent(step=event.step, loss=event.loss, step_seconds=event.step_seconds,
                                        tokens_per_second=event.tokens_per_second, values=dict(event.values))


class _OwnerServicer(owner_pb2_grpc.PartitionOwnerServicer):
    """protobuf <-> plain translation for an :class:`OwnerHandler`."""

    def __init__(self, handler: OwnerHandler, streams: _Streams) -> None:
        self._handler = handler
        self._streams = streams

    def Step(self, request: owner_pb2.StepRequest, context: grpc.ServicerContext) -> owner_pb2.StepReply:
        method = "PartitionOwner.Step"
        args = _serve(context, method, lambda: StepArgs(
            step=request.step, piece=_piece(request.piece), global_samples=request.global_samples,
            generation=request.generation, samples_seen=request.samples_seen), lambda a: a)
        return _serve(context, method, lambda: self._handler.step(args), _step_reply)

    def Evaluate(self, request: owner_pb2.EvaluateRequest,
                 context: grpc.ServicerContext) -> owner_pb2.EvaluateReply:
        method = "PartitionOwner.Evaluate"
        args = _serve(context, method, lambda: EvaluateArgs(piece=_piece(request.piece),
                                                            generation=request.generation), lambda a: a)
        return _serve(context, method, lambda: self._handler.evaluate(args),
                      lambda r: owner_pb2.EvaluateReply(totals=_totals(r.totals), rank=r.rank))

    def Save(self, request: owner_pb2.SaveRequest, context: grpc.ServicerContext) -> owner_pb2.SaveReply:
        def build(r: SaveResult) -> owner_pb2.SaveReply:
            return owner_pb2.SaveReply(path=r.path, step=r.step, bytes_written=r.bytes_written,
                                       record_json=r.record_json)

        method = "PartitionOwner.Save"
        phase = _serve(context, method, lambda: SavePhase(request.phase), lambda p: p)
        return _serve(context, method, lambda: self._handler.save(request.path, request.step, phase), build)

    def Load(self, request: owner_pb2.LoadRequest, context: grpc.ServicerContext) -> owner_pb2.LoadReply:
        def build(r: LoadResult) -> owner_pb2.LoadReply:
            return owner_pb2.LoadReply(step=r.step, bytes_read=r.bytes_read)

        return _serve(context, "PartitionOwner.Load", lambda: self._handler.load(request.path, request.step), build)

    def Abort(self, request: owner_pb2.AbortRequest, context: grpc.ServicerContext) -> owner_pb2.AbortReply:
        return _serve(context, "PartitionOwner.Abort",
                      lambda: self._handler.abort(request.reason, request.generation),
                      lambda aborted: owner_pb2.AbortReply(aborted=bool(aborted)))

    def Health(self, request: owner_pb2.HealthRequest, context: grpc.ServicerContext) -> Iterator[owner_pb2.Heartbeat]:
        method = "PartitionOwner.Health"
        interval = _interval_s(request.interval_ms, context, method)
        with self._streams.open(context, method) as finished:
            while True:  # the first heartbeat at once, so that a new monitor knows the owner is alive
                yield _serve(context, method, self._handler.heartbeat, _heartbeat)
                if finished.wait(interval):
                    return

    def Stats(self, request: owner_pb2.StatsRequest, context: grpc.ServicerContext) -> owner_pb2.StatsReply:
        return _serve(context, "PartitionOwner.Stats", self._handler.stats, _stats_reply)


class _CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """protobuf <-> plain translation for a :class:`CoordinatorHandler`."""

    def __init__(self, handler: CoordinatorHandler, streams: _Streams) -> None:
        self._handler = handler
        self._streams = streams

    def Status(self, request: coordinator_pb2.StatusRequest,
               context: grpc.ServicerContext) -> coordinator_pb2.StatusReply:
        return _serve(context, "Coordinator.Status", self._handler.status, _status_reply)

    def Checkpoint(self, request: coordinator_pb2.CheckpointRequest,
                   context: grpc.ServicerContext) -> coordinator_pb2.CheckpointReply:
        def build(r: CheckpointResult) -> coordinator_pb2.CheckpointReply:
            return coordinator_pb2.CheckpointReply(path=r.path, step=r.step)

        # proto3 has no "unset" string; empty means the job's configured directory.
        return _serve(context, "Coordinator.Checkpoint", lambda: self._handler.checkpoint(request.path or None),
                      build)

    def Stop(self, request: coordinator_pb2.StopRequest, context: grpc.ServicerContext) -> coordinator_pb2.StopReply:
        return _serve(context, "Coordinator.Stop", lambda: self._handler.stop(request.reason),
                      lambda state: coordinator_pb2.StopReply(state=state))

    def Resize(self, request: coordinator_pb2.ResizeRequest,
               context: grpc.ServicerContext) -> coordinator_pb2.ResizeReply:
        def build(r: ResizeResult) -> coordinator_pb2.ResizeReply:
            return coordinator_pb2.ResizeReply(previous_world_size=r.previous_world_size, world_size=r.world_size)

        if request.world_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Coordinator.Resize: world_size={request.world_size} must be >= 1")
        return _serve(context, "Coordinator.Resize", lambda: self._handler.resize(request.world_size), build)

    def Metrics(self, request: coordinator_pb2.MetricsRequest,
                context: grpc.ServicerContext) -> Iterator[coordinator_pb2.MetricsEvent]:
        method = "Coordinator.Metrics"
        with self._streams.open(context, method) as finished:
            events = _serve(context, method, lambda: iter(self._handler.metrics(finished)), lambda it: it)
            try:
                while not finished.is_set():
                    event = _serve(context, method, lambda: next(events, None), lambda e: e)
                    if event is None:  # the handler ended the stream: training is over
                        return
                    yield _serve(context, method, lambda: event, _metrics_event)
            finally:
                close = getattr(events, "close", None)
                if close is not None:  # run the handler generator's cleanup now, not at garbage collection
                    close()


def _missing_methods(handler: object, protocol: type) -> list[str]:
    names = [name for name in dir(protocol) if not name.startswith("_")]
    return [name for name in names if not callable(getattr(handler, name, None))]


class ControlServer:
    """One gRPC server on its own thread pool, serving an owner handler, a
    coordinator handler, or both. Add handlers, then :meth:`start`."""

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self._streams = _Streams(config.max_streams)
        self._executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="zero-ray-control")
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default, which would let two servers share a port silently.
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [TokenInterceptor(config.credentials.token),
                        HeaderInterceptor(config.credentials.job_id, config.protocol_versions)]
        self._server = grpc.server(self._executor, interceptors=interceptors, options=options)
        self._services: list[str] = []
        self._address: str | None = None
        self._stopped = False

    @property
    def config(self) -> ServerConfig:
        """The configuration the server was built with."""
        return self._config

    def add_owner(self, handler: OwnerHandler) -> None:
        """Serve ``zero_ray.v1.PartitionOwner`` with ``handler``."""
        self._add("PartitionOwner", handler, OwnerHandler)
        owner_pb2_grpc.add_PartitionOwnerServicer_to_server(_OwnerServicer(handler, self._streams), self._server)

    def add_coordinator(self, handler: CoordinatorHandler) -> None:
        """Serve ``zero_ray.v1.Coordinator`` with ``handler``."""
        self._add("Coordinator", handler, CoordinatorHandler)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_CoordinatorServicer(handler, self._streams),
                                                               self._server)

    def _add(self, service: str, handler: Any, protocol: type) -> None:
        if self._address is not None:
            raise ControlError(f"cannot add {service} to the server at {self._address}: it has started")
        if service in self._services:
            raise ConfigError(f"{service} is served already by this server")
        missing = _missing_methods(handler, protocol)
        if missing:
            raise ConfigError(f"{type(handler).__name__} cannot serve {service}: it lacks {missing}")
        self._services.append(service)

    def start(self) -> str:
        """Bind, start serving and return the bound address ``HOST:PORT``."""
        if self._address is not None:
            return self._address
        if not self._services:
            raise ConfigError("the server has no handler; call add_owner() or add_coordinator() first")
        config = self._config
        target = format_address(config.bind_host, config.port)
        try:
            if config.tls:
                port = self._server.add_secure_port(target, _server_credentials(config))
            else:
                port = self._server.add_insecure_port(target)
        except RuntimeError as err:  # recent grpcio raises where older ones returned 0
            raise ControlError(f"cannot listen on {target}: {err}") from err
        if port == 0:
            raise ControlError(f"cannot listen on {target}: the address is in use or not this node's")
        self._server.start()
        self._address = format_address(config.bind_host, port)
        _log.info("control server for %s listening on %s (tls=%s)", "+".join(self._services), self._address,
                  config.tls)
        return self._address

    @property
    def address(self) -> str:
        """The bound ``HOST:PORT``; only after :meth:`start`."""
        if self._address is None:
            raise ControlError("the control server has not started; call start() first")
        return self._address

    def stop(self, grace_s: float | None = None) -> None:
        """End the streams, give calls in flight ``grace_s`` (default
        ``config.grace_s``) to finish, then cancel the rest. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self._config.grace_s if grace_s is None else grace_s
        self._streams.close()
        # Bounded: a handler blocked past the grace period is cancelled, not waited for.
        self._server.stop(grace).wait(timeout=grace + 5.0)
        # wait=False: a handler thread stuck in user code must not hang shutdown.
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    assert config.tls_cert is not None and config.tls_key is not None  # checked in ServerConfig
    client_ca = read_pem(config.tls_client_ca) if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(read_pem(config.tls_key), read_pem(config.tls_cert))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def serve_owner(handler: OwnerHandler, config: ServerConfig) -> ControlServer:
    """Start a server for a partition owner's handler; its ``address`` is ready."""
    server = ControlServer(config)
    server.add_owner(handler)
    server.start()
    return server


def serve_coordinator(handler: CoordinatorHandler, config: ServerConfig) -> ControlServer:
    """Start a server for the driver's coordinator handler; its ``address`` is ready."""
    server = ControlServer(config)
    server.add_coordinator(handler)
    server.start()
    return server
