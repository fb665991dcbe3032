"""Typed gRPC clients of the control plane: the driver's client of a partition owner and an
operator's client of the driver.

Every call carries the job's bearer token and ``RequestHeader`` and has a deadline (the
method's ``timeout_s`` or the client's default); see :mod:`zero_ray.control.client_channel` for how a
failure surfaces (a handler's as :class:`~zero_ray.errors.RemoteFailure` with its structured
``detail``).

Example::

    client = OwnerClient(ClientConfig(address="10.0.0.5:41003", credentials=creds))
    result = client.step(StepArgs(step=7, piece=Piece(batch_key="0:7"), global_samples=256, generation=0),
                         timeout_s=600)
    client.close()
"""

from __future__ import annotations

from zero_ray.control import json_fields as plain
from zero_ray.control._generated import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    owner_pb2,
    owner_pb2_grpc,
    relay_pb2,
    relay_pb2_grpc,
)
from zero_ray.control.client_channel import BaseClient, ClientConfig, Pending, Stream, check_timeout
from zero_ray.control.handlers import (
    CheckpointResult,
    EvaluateArgs,
    EvaluateResult,
    Flight,
    Heartbeat,
    JobStatus,
    LoadResult,
    MetricsEvent,
    OwnerStats,
    OwnerStatus,
    Plain,
    HostRelaysArgs,
    HostRelaysResult,
    RelayCallArgs,
    RelayEvaluateArgs,
    RelayStepArgs,
    ResizeResult,
    SavePhase,
    SaveResult,
    SetupResult,
    StepArgs,
    StepResult,
    SubtreeEvaluation,
    SubtreeReplies,
    SubtreeStep,
)
from zero_ray.control.conversion import to_message, to_record
from zero_ray.control.relay_wire import evaluation_from_wire, from_wire, replies_from_wire
from zero_ray.core.reply_combine import CombinedEvaluation, CombinedReplies, CombinedStep
from zero_ray.errors import ConfigError

__all__ = ["ClientConfig", "CoordinatorClient", "OwnerClient", "RelayClient", "Stream"]


class OwnerClient(BaseClient):
    """The driver's client of one partition owner (``zero_ray.v1.PartitionOwner``)."""

    _SERVICE = "PartitionOwner"

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._stub = owner_pb2_grpc.PartitionOwnerStub(self._channel)

    def __enter__(self) -> OwnerClient:
        return self

    def step(self, args: StepArgs, *, timeout_s: float | None = None) -> StepResult:
        """Run one step on the owner; ``timeout_s`` should cover the step's compute."""
        request = to_message(args, owner_pb2.StepRequest, header=self._header())
        return to_record(self._unary("Step", self._stub.Step, request, timeout_s), StepResult)

    def step_async(self, args: StepArgs, *, timeout_s: float | None = None) -> Pending[StepResult]:
        """``step`` without a thread waiting for it: the reply arrives as a ``Pending``."""
        request = to_message(args, owner_pb2.StepRequest, header=self._header())
        return self._unary_future("Step", self._stub.Step, request, timeout_s, lambda r: to_record(r, StepResult))

    def evaluate(self, args: EvaluateArgs, *, timeout_s: float | None = None) -> EvaluateResult:
        """The owner's loss on its piece, forward only."""
        request = to_message(args, owner_pb2.EvaluateRequest, header=self._header())
        return to_record(self._unary("Evaluate", self._stub.Evaluate, request, timeout_s), EvaluateResult)

    def save(self, path: str, step: int, *, phase: SavePhase = SavePhase.BOTH,
             timeout_s: float | None = None) -> SaveResult:
        """Have the owner write its shard of the state at ``step`` under ``path``."""
        request = owner_pb2.SaveRequest(header=self._header(), path=path, step=step, phase=phase.value)
        return to_record(self._unary("Save", self._stub.Save, request, timeout_s), SaveResult)

    def load(self, path: str, step: int, *, timeout_s: float | None = None) -> LoadResult:
        """Have the owner restore its shard of the state at ``step`` from ``path``."""
        reply = self._unary("Load", self._stub.Load,
                            owner_pb2.LoadRequest(header=self._header(), path=path, step=step), timeout_s)
        return to_record(reply, LoadResult)

    def abort(self, reason: str, generation: int, *, timeout_s: float | None = None) -> bool:
        """Make the owner abandon its step of ``generation``; whether there was one."""
        reply = self._unary("Abort", self._stub.Abort,
                            owner_pb2.AbortRequest(header=self._header(), reason=reason, generation=generation),
                            timeout_s)
        return reply.aborted

    def stats(self, *, timeout_s: float | None = None) -> OwnerStats:
        """The owner's memory and traffic counters."""
        reply = self._unary("Stats", self._stub.Stats, owner_pb2.StatsRequest(header=self._header()), timeout_s)
        return to_record(reply, OwnerStats)

    def setup(self, *, timeout_s: float | None = None) -> SetupResult:
        """Have the owner join its group and build its model state (call every owner at once)."""
        reply = self._unary("Setup", self._stub.Setup, owner_pb2.SetupRequest(header=self._header()), timeout_s)
        return to_record(reply, SetupResult)

    def reform(self, generation: int, *, timeout_s: float | None = None) -> bool:
        """Re-form the group as ``generation`` (every owner at once); whether the state is intact."""
        reply = self._unary("Reform", self._stub.Reform,
                            owner_pb2.ReformRequest(header=self._header(), generation=generation), timeout_s)
        return reply.consistent

    def set_peers(self, backup: int, ward: int, *, timeout_s: float | None = None) -> None:
        """The owner sends its snapshots to rank ``backup`` and keeps rank ``ward``'s."""
        self._unary("SetPeers", self._stub.SetPeers,
                    owner_pb2.SetPeersRequest(header=self._header(), backup=backup, ward=ward), timeout_s)

    def snapshots(self, committed_step: int, *, layout_complete: bool = False,
                  timeout_s: float | None = None) -> Plain:
        """The committed peer snapshots the owner holds, by rank, once every owner finished
        driver step ``committed_step`` (-1: none); ``layout_complete``: the last resize's or
        restore's transfers all ended, so its layout's copies count where unconfirmed."""
        reply = self._unary("Snapshots", self._stub.Snapshots,
                            owner_pb2.SnapshotsRequest(header=self._header(), committed_step=committed_step,
                                                       layout_complete=layout_complete),
                            timeout_s)
        return plain.loads(reply.snapshots_json)

    def resize_info(self, *, timeout_s: float | None = None) -> Plain:
        """The owner's part of a resize's description."""
        reply = self._unary("ResizeInfo", self._stub.ResizeInfo,
                            owner_pb2.ResizeInfoRequest(header=self._header()), timeout_s)
        return plain.loads(reply.description_json)

    def reshard(self, *, old_world: int, new_world: int, generation: int, description: Plain,
                timeout_s: float | None = None) -> int:
        """Move the owner's state from ``old_world`` to ``new_world`` owners (every owner at once,
        with the merged ``description``); bytes sent."""
        request = owner_pb2.ReshardRequest(header=self._header(), old_world=old_world, new_world=new_world,
                                           generation=generation, description_json=plain.dumps(description))
        return self._unary("Reshard", self._stub.Reshard, request, timeout_s).bytes_sent

    def rebuild(self, *, position: int, world_size: int, generation: int, restore: Plain | None,
                timeout_s: float | None = None) -> int:
        """Take ``position`` of a rebuilt pool (``restore``: the snapshot transfer, or None for
        fresh state); bytes sent."""
        request = owner_pb2.RebuildRequest(header=self._header(), position=position, world_size=world_size,
                                           generation=generation,
                                           restore_json=plain.dumps(restore) if restore is not None else b"")
        return self._unary("Rebuild", self._stub.Rebuild, request, timeout_s).bytes_sent

    def status(self, *, timeout_s: float | None = None) -> OwnerStatus:
        """Where the owner stands."""
        r = self._unary("Status", self._stub.Status, owner_pb2.OwnerStatusRequest(header=self._header()), timeout_s)
        return to_record(r, OwnerStatus)

    def flight(self, *, timeout_s: float | None = None) -> Flight:
        """The owner's flight record: its phase and recent collectives."""
        r = self._unary("Flight", self._stub.Flight, owner_pb2.FlightRequest(header=self._header()), timeout_s)
        return to_record(r, Flight)

    def close_owner(self, *, timeout_s: float | None = None) -> None:
        """Have the owner leave its group and stop serving (it is ended next). Not
        :meth:`close`, which closes this client's channel."""
        self._unary("Close", self._stub.Close, owner_pb2.CloseRequest(header=self._header()), timeout_s)

    def heartbeats(self, interval_s: float, *, stall_s: float | None = None,
                   timeout_s: float | None = None) -> Stream[Heartbeat]:
        """Heartbeats every ``interval_s`` until closed. Iteration raises ControlError
        when none arrives within ``stall_s`` (default ``3 * interval_s + 1``) or the
        server ends the stream; ``timeout_s`` optionally bounds the stream's lifetime."""
        check_timeout("interval_s", interval_s)
        request = owner_pb2.HealthRequest(header=self._header(), interval_ms=max(1, round(interval_s * 1000)))

        def convert(beat: owner_pb2.Heartbeat) -> Heartbeat:
            return to_record(beat, Heartbeat)

        return self._stream("Health", self._stub.Health, request, convert,
                            stall_s=3.0 * interval_s + 1.0 if stall_s is None else stall_s,
                            timeout_s=timeout_s, end_is_error=True)


class CoordinatorClient(BaseClient):
    """An operator's client of the driver (``zero_ray.v1.Coordinator``)."""

    _SERVICE = "Coordinator"

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def __enter__(self) -> CoordinatorClient:
        return self

    def status(self, *, flight: bool = False, timeout_s: float | None = None) -> JobStatus:
        """The job's state, step, loss and per-rank health; with ``flight``, where every owner is
        now (its phase, the collective it waits in, for how long)."""
        reply = self._unary("Status", self._stub.Status,
                            coordinator_pb2.StatusRequest(header=self._header(), flight=flight), timeout_s)
        return to_record(reply, JobStatus)

    def checkpoint(self, path: str | None = None, *, timeout_s: float | None = None) -> CheckpointResult:
        """Write a checkpoint now (under ``path``, or the job's directory); returns once written."""
        reply = self._unary("Checkpoint", self._stub.Checkpoint,
                            coordinator_pb2.CheckpointRequest(header=self._header(), path=path or ""), timeout_s)
        return to_record(reply, CheckpointResult)

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
        return to_record(reply, ResizeResult)

    def metrics(self, *, timeout_s: float | None, stall_s: float | None = None) -> Stream[MetricsEvent]:
        """One event per finished step until training ends or the stream is closed.
        ``timeout_s`` must be given (None for no limit on the stream's lifetime);
        ``stall_s`` optionally bounds the wait for each event."""

        def convert(event: coordinator_pb2.MetricsEvent) -> MetricsEvent:
            return to_record(event, MetricsEvent)

        return self._stream("Metrics", self._stub.Metrics, coordinator_pb2.MetricsRequest(header=self._header()),
                            convert, stall_s=stall_s, timeout_s=timeout_s, end_is_error=False)


class RelayClient(BaseClient):
    """A client of one relay of the control tree (``zero_ray.v1.Relay``): the driver's of a top
    relay, or a relay's of a relay below it."""

    _SERVICE = "Relay"

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self._stub = relay_pb2_grpc.RelayStub(self._channel)

    def __enter__(self) -> RelayClient:
        return self

    def relay_step(self, args: RelayStepArgs, *, timeout_s: float | None = None) -> CombinedStep:
        """Run one step on every rank of the relay's subtree; their replies combined (a rank's
        failure is the reply's ``failure``). ``timeout_s`` bounds the call: at least
        ``args.timeout_s`` and the time the reply takes to come back."""
        request = to_message(args, relay_pb2.RelayStepRequest, header=self._header())
        return from_wire(to_record(self._unary("RelayStep", self._stub.RelayStep, request, timeout_s), SubtreeStep))

    def relay_step_async(self, args: RelayStepArgs, *, timeout_s: float | None = None) -> Pending[CombinedStep]:
        """``relay_step`` without a thread waiting for it: the reply arrives as a ``Pending``."""
        request = to_message(args, relay_pb2.RelayStepRequest, header=self._header())
        return self._unary_future("RelayStep", self._stub.RelayStep, request, timeout_s,
                                  lambda r: from_wire(to_record(r, SubtreeStep)))

    def relay_evaluate(self, args: RelayEvaluateArgs, *, timeout_s: float | None = None) -> CombinedEvaluation:
        """Run one evaluation on every rank of the relay's subtree; their loss totals combined
        (a rank's failure is the reply's ``failure``). ``timeout_s`` as for ``relay_step``."""
        request = to_message(args, relay_pb2.RelayEvaluateRequest, header=self._header())
        return evaluation_from_wire(to_record(self._unary("RelayEvaluate", self._stub.RelayEvaluate, request,
                                                          timeout_s), SubtreeEvaluation))

    def relay_call(self, args: RelayCallArgs, *, timeout_s: float | None = None) -> CombinedReplies:
        """Call ``args.method`` on every rank of the relay's subtree with the same request; every
        rank's reply (or failure) in rank order, unparsed."""
        request = to_message(args, relay_pb2.RelayCallRequest, header=self._header())
        return replies_from_wire(to_record(self._unary("RelayCall", self._stub.RelayCall, request, timeout_s),
                                           SubtreeReplies))

    def host_relays(self, args: HostRelaysArgs, *, timeout_s: float | None = None) -> HostRelaysResult:
        """Have the process serve ``args.relays`` from now on (in place of those before)."""
        request = to_message(args, relay_pb2.HostRelaysRequest, header=self._header())
        return to_record(self._unary("HostRelays", self._stub.HostRelays, request, timeout_s), HostRelaysResult)
