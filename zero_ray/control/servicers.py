"""protobuf <-> plain translation on the server side: the servicers a :class:`ControlServer`
registers for an :class:`OwnerHandler`, a :class:`CoordinatorHandler` and a relay's
:class:`~zero_ray.control.relay_host.RelayHost`.

Every method runs its handler through :func:`zero_ray.control.failure_status.serve`, so that a failure
ends the call with a status and a FailureDetail; ``*_json`` fields are read and written with
:mod:`zero_ray.control.json_fields`; records are converted by :mod:`zero_ray.control.conversion`, by field name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from zero_ray.control import json_fields as plain
from zero_ray.control._generated import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    owner_pb2,
    owner_pb2_grpc,
    relay_pb2,
    relay_pb2_grpc,
)
from zero_ray.control.handlers import (
    CoordinatorHandler,
    EvaluateArgs,
    FailureContext,
    OwnerHandler,
    HostRelaysArgs,
    RelayCallArgs,
    RelayEvaluateArgs,
    RelayStepArgs,
    SavePhase,
    StepArgs,
)
from zero_ray.control.conversion import to_message, to_record
from zero_ray.control.failure_status import abort_call, handler_failed, reply_failed
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.relay_watch import WatchFeed
from zero_ray.control.relay_wire import evaluation_to_wire, replies_to_wire, to_wire
from zero_ray.control.stream_admission import Streams

T = TypeVar("T")

_MIN_INTERVAL_MS, _MAX_INTERVAL_MS = 10, 60_000


def _interval_s(interval_ms: int, context: grpc.ServicerContext, method: str) -> float:
    if not _MIN_INTERVAL_MS <= interval_ms <= _MAX_INTERVAL_MS:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{method}: interval_ms={interval_ms} must be in [{_MIN_INTERVAL_MS}, {_MAX_INTERVAL_MS}]")
    return interval_ms / 1000.0


def _stall_s(stall_ms: int, interval_s: float, context: grpc.ServicerContext, method: str) -> float:
    if not interval_s * 1000 < stall_ms <= 24 * 3600 * 1000:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{method}: stall_ms={stall_ms} must be above interval_ms={round(interval_s * 1000)} "
                      "(a child beating every interval would be counted stalled) and at most a day")
    return stall_ms / 1000.0


def _same(value: T) -> T:
    return value


class _Serving:
    """What both servicers share: the handler, the stream admission, running a handler method."""

    _SERVICE = ""

    def __init__(self, handler: Any, streams: Streams) -> None:
        self._handler = handler
        self._streams = streams

    def _failure_context(self) -> FailureContext:
        return FailureContext()

    def _serve(self, context: grpc.ServicerContext, method: str, call: Callable[[], Any],
               build: Callable[[Any], T]) -> T:
        """Run a handler method and build its reply; an exception in either ends the call with a
        status and FailureDetail, built by control/failure_status.py only when there is one."""
        try:
            result = call()
        except Exception as exc:  # a handler's failure is the caller's answer, not the server's crash
            failed = handler_failed(f"{self._SERVICE}.{method}", exc, self._failure_context)
        else:
            try:
                return build(result)
            except Exception as exc:  # e.g. a negative count for a uint64 field: the handler's bug
                failed = reply_failed(f"{self._SERVICE}.{method}", exc, result, self._failure_context)
        # After the except clause: the exception and the frames it holds are freed first.
        abort_call(context, failed)


class OwnerServicer(_Serving, owner_pb2_grpc.PartitionOwnerServicer):
    """protobuf <-> plain translation for an :class:`OwnerHandler`."""

    _SERVICE = "PartitionOwner"
    _handler: OwnerHandler

    def _failure_context(self) -> FailureContext:
        return self._handler.failure_context()

    def Setup(self, request: owner_pb2.SetupRequest, context: grpc.ServicerContext) -> owner_pb2.SetupReply:
        return self._serve(context, "Setup", self._handler.setup, lambda r: to_message(r, owner_pb2.SetupReply))

    def Step(self, request: owner_pb2.StepRequest, context: grpc.ServicerContext) -> owner_pb2.StepReply:
        args = self._serve(context, "Step", lambda: to_record(request, StepArgs), _same)
        return self._serve(context, "Step", lambda: self._handler.step(args),
                           lambda r: to_message(r, owner_pb2.StepReply))

    def Evaluate(self, request: owner_pb2.EvaluateRequest,
                 context: grpc.ServicerContext) -> owner_pb2.EvaluateReply:
        args = self._serve(context, "Evaluate", lambda: to_record(request, EvaluateArgs), _same)
        return self._serve(context, "Evaluate", lambda: self._handler.evaluate(args),
                           lambda r: to_message(r, owner_pb2.EvaluateReply))

    def Save(self, request: owner_pb2.SaveRequest, context: grpc.ServicerContext) -> owner_pb2.SaveReply:
        phase = self._serve(context, "Save", lambda: SavePhase(request.phase), _same)
        return self._serve(context, "Save", lambda: self._handler.save(request.path, request.step, phase),
                           lambda r: to_message(r, owner_pb2.SaveReply))

    def Load(self, request: owner_pb2.LoadRequest, context: grpc.ServicerContext) -> owner_pb2.LoadReply:
        return self._serve(context, "Load", lambda: self._handler.load(request.path, request.step),
                           lambda r: to_message(r, owner_pb2.LoadReply))

    def Abort(self, request: owner_pb2.AbortRequest, context: grpc.ServicerContext) -> owner_pb2.AbortReply:
        return self._serve(context, "Abort", lambda: self._handler.abort(request.reason, request.generation),
                           lambda aborted: owner_pb2.AbortReply(aborted=bool(aborted)))

    def Health(self, request: owner_pb2.HealthRequest, context: grpc.ServicerContext) -> Iterator[owner_pb2.Heartbeat]:
        method = "PartitionOwner.Health"
        interval = _interval_s(request.interval_ms, context, method)
        with self._streams.open(context, method) as finished:
            while True:  # the first heartbeat at once, so that a new monitor knows the owner is alive
                yield self._serve(context, "Health", self._handler.heartbeat,
                                  lambda beat: to_message(beat, owner_pb2.Heartbeat))
                if finished.wait(interval):
                    return

    def Stats(self, request: owner_pb2.StatsRequest, context: grpc.ServicerContext) -> owner_pb2.StatsReply:
        return self._serve(context, "Stats", self._handler.stats, lambda r: to_message(r, owner_pb2.StatsReply))

    def Reform(self, request: owner_pb2.ReformRequest, context: grpc.ServicerContext) -> owner_pb2.ReformReply:
        return self._serve(context, "Reform", lambda: self._handler.reform(request.generation),
                           lambda consistent: owner_pb2.ReformReply(consistent=bool(consistent)))

    def SetPeers(self, request: owner_pb2.SetPeersRequest,
                 context: grpc.ServicerContext) -> owner_pb2.SetPeersReply:
        return self._serve(context, "SetPeers", lambda: self._handler.set_peers(request.backup, request.ward),
                           lambda _: owner_pb2.SetPeersReply())

    def Snapshots(self, request: owner_pb2.SnapshotsRequest,
                  context: grpc.ServicerContext) -> owner_pb2.SnapshotsReply:
        return self._serve(context, "Snapshots", lambda: self._handler.snapshots(request.committed_step,
                                                                                 request.layout_complete),
                           lambda held: owner_pb2.SnapshotsReply(snapshots_json=plain.dumps(held)))

    def ResizeInfo(self, request: owner_pb2.ResizeInfoRequest,
                   context: grpc.ServicerContext) -> owner_pb2.ResizeInfoReply:
        return self._serve(context, "ResizeInfo", self._handler.resize_info,
                           lambda info: owner_pb2.ResizeInfoReply(description_json=plain.dumps(info)))

    def Reshard(self, request: owner_pb2.ReshardRequest, context: grpc.ServicerContext) -> owner_pb2.TransferReply:
        description = self._serve(context, "Reshard", lambda: plain.loads(request.description_json), _same)
        return self._serve(context, "Reshard", lambda: self._handler.reshard(
            old_world=request.old_world, new_world=request.new_world, generation=request.generation,
            description=description), lambda sent: owner_pb2.TransferReply(bytes_sent=sent))

    def Rebuild(self, request: owner_pb2.RebuildRequest, context: grpc.ServicerContext) -> owner_pb2.TransferReply:
        # An empty field is "no restore": fresh state, a checkpoint being loaded next.
        restore = self._serve(context, "Rebuild",
                              lambda: plain.loads(request.restore_json) if request.restore_json else None, _same)
        return self._serve(context, "Rebuild", lambda: self._handler.rebuild(
            position=request.position, world_size=request.world_size, generation=request.generation,
            restore=restore), lambda sent: owner_pb2.TransferReply(bytes_sent=sent))

    def Status(self, request: owner_pb2.OwnerStatusRequest,
               context: grpc.ServicerContext) -> owner_pb2.OwnerStatusReply:
        return self._serve(context, "Status", self._handler.status,
                           lambda r: to_message(r, owner_pb2.OwnerStatusReply))

    def Close(self, request: owner_pb2.CloseRequest, context: grpc.ServicerContext) -> owner_pb2.CloseReply:
        return self._serve(context, "Close", self._handler.close, lambda _: owner_pb2.CloseReply())

    def Flight(self, request: owner_pb2.FlightRequest, context: grpc.ServicerContext) -> owner_pb2.FlightReply:
        return self._serve(context, "Flight", self._handler.flight, lambda r: to_message(r, owner_pb2.FlightReply))


class CoordinatorServicer(_Serving, coordinator_pb2_grpc.CoordinatorServicer):
    """protobuf <-> plain translation for a :class:`CoordinatorHandler`."""

    _SERVICE = "Coordinator"
    _handler: CoordinatorHandler

    def Status(self, request: coordinator_pb2.StatusRequest,
               context: grpc.ServicerContext) -> coordinator_pb2.StatusReply:
        return self._serve(context, "Status", lambda: self._handler.status(request.flight),
                           lambda r: to_message(r, coordinator_pb2.StatusReply))

    def Checkpoint(self, request: coordinator_pb2.CheckpointRequest,
                   context: grpc.ServicerContext) -> coordinator_pb2.CheckpointReply:
        # proto3 has no "unset" string; empty means the job's configured directory.
        return self._serve(context, "Checkpoint", lambda: self._handler.checkpoint(request.path or None),
                           lambda r: to_message(r, coordinator_pb2.CheckpointReply))

    def Stop(self, request: coordinator_pb2.StopRequest, context: grpc.ServicerContext) -> coordinator_pb2.StopReply:
        return self._serve(context, "Stop", lambda: self._handler.stop(request.reason),
                           lambda state: coordinator_pb2.StopReply(state=state))

    def Resize(self, request: coordinator_pb2.ResizeRequest,
               context: grpc.ServicerContext) -> coordinator_pb2.ResizeReply:
        if request.world_size < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Coordinator.Resize: world_size={request.world_size} must be >= 1")
        return self._serve(context, "Resize", lambda: self._handler.resize(request.world_size),
                           lambda r: to_message(r, coordinator_pb2.ResizeReply))

    def Metrics(self, request: coordinator_pb2.MetricsRequest,
                context: grpc.ServicerContext) -> Iterator[coordinator_pb2.MetricsEvent]:
        method = "Coordinator.Metrics"
        with self._streams.open(context, method) as finished:
            events = self._serve(context, "Metrics", lambda: iter(self._handler.metrics(finished)), _same)
            try:
                while not finished.is_set():
                    event = self._serve(context, "Metrics", lambda: next(events, None), _same)
                    if event is None:  # the handler ended the stream: training is over
                        return
                    yield self._serve(context, "Metrics", lambda: event,
                                      lambda e: to_message(e, coordinator_pb2.MetricsEvent))
            finally:
                close = getattr(events, "close", None)
                if close is not None:  # run the handler generator's cleanup now, not at garbage collection
                    close()


class RelayServicer(_Serving, relay_pb2_grpc.RelayServicer):
    """protobuf <-> plain translation for the relays a process serves (:class:`RelayHost`):
    the combined reply is converted to its wire record here (:mod:`zero_ray.control.relay_wire`);
    a Watch stream is a :class:`WatchFeed` over the named hop's children, for as long as the
    caller reads it."""

    _SERVICE = "Relay"
    _handler: RelayHost

    def _failure_context(self) -> FailureContext:
        return self._handler.failure_context()

    def RelayStep(self, request: relay_pb2.RelayStepRequest, context: grpc.ServicerContext) -> relay_pb2.RelayStepReply:
        args = self._serve(context, "RelayStep", lambda: to_record(request, RelayStepArgs), _same)
        return self._serve(context, "RelayStep", lambda: self._handler.relay_step(args),
                           lambda r: to_message(to_wire(r), relay_pb2.RelayStepReply))

    def RelayEvaluate(self, request: relay_pb2.RelayEvaluateRequest,
                      context: grpc.ServicerContext) -> relay_pb2.RelayEvaluateReply:
        args = self._serve(context, "RelayEvaluate", lambda: to_record(request, RelayEvaluateArgs), _same)
        return self._serve(context, "RelayEvaluate", lambda: self._handler.relay_evaluate(args),
                           lambda r: to_message(evaluation_to_wire(r), relay_pb2.RelayEvaluateReply))

    def RelayCall(self, request: relay_pb2.RelayCallRequest, context: grpc.ServicerContext) -> relay_pb2.RelayCallReply:
        args = self._serve(context, "RelayCall", lambda: to_record(request, RelayCallArgs), _same)
        return self._serve(context, "RelayCall", lambda: self._handler.relay_call(args),
                           lambda r: to_message(replies_to_wire(r), relay_pb2.RelayCallReply))

    def HostRelays(self, request: relay_pb2.HostRelaysRequest,
                   context: grpc.ServicerContext) -> relay_pb2.HostRelaysReply:
        args = self._serve(context, "HostRelays", lambda: to_record(request, HostRelaysArgs), _same)
        return self._serve(context, "HostRelays", lambda: self._handler.host_relays(args),
                           lambda r: to_message(r, relay_pb2.HostRelaysReply))

    def Watch(self, request: relay_pb2.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[relay_pb2.SubtreeBeats]:
        method = "Relay.Watch"
        interval = _interval_s(request.interval_ms, context, method)
        stall = _stall_s(request.stall_ms, interval, context, method)
        with self._streams.open(context, method) as finished:
            feed = self._serve(context, "Watch", lambda: WatchFeed(self._handler.hop(request.relay).children,
                                                                   interval_s=interval, stall_s=stall), _same)
            try:
                context.add_callback(feed.wake)  # the caller's cancel ends the wait between messages
                while True:
                    message = feed.next(finished)
                    if message is None:
                        return
                    yield message
            finally:
                feed.close()
